"""``paged_decode``: decode attention of one query token per sequence over paged K/V.

Each sequence has its own block table (no sharing is exploited: that is ``tree_attention``).
On CUDA tensors it runs the AOT kernels (split-K plus a log-sum-exp merge when there are too few
sequences to fill the GPU); on CPU tensors, the PyTorch path.
"""
from __future__ import annotations

import math

import torch

from .. import dispatch, log, runtime, torch_path
from ..runtime import Launch
from .checks import check_compiled, check_scale, check_tensor


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 sm_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q[i]`` over the first ``seq_lens[i]`` tokens of sequence i.

    Args:
        q: ``[num_seqs, num_qo_heads, head_dim]``, float16 or bfloat16, contiguous.
        k_pool, v_pool: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype.
        block_tables: int32 ``[num_seqs, max_blocks]``: row i lists sequence i's blocks.
        seq_lens: int32 ``[num_seqs]``, each ``<= max_blocks * block_size``.
        sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
        out: optional output, like ``q``.

    Returns ``out``. A sequence of length 0 gives zeros. On CUDA the call does not
    synchronise; lengths above the table's capacity are clamped to it there (checking would
    need a sync) and raise on CPU.
    """
    _validate(q, k_pool, v_pool, block_tables, seq_lens, out)
    scale = check_scale(sm_scale, q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    if q.is_cuda:
        device = q.device
        runtime.run(decode_launches(q, k_pool, v_pool, block_tables, seq_lens, out, scale,
                                    runtime.arch_of(device.index), runtime.num_sms(device.index)),
                    device)
    else:
        _check_lengths_fit(block_tables, seq_lens, k_pool.shape[1])
        _check_blocks_exist(block_tables, k_pool.shape[0])
        torch_path.paged_decode(q, k_pool, v_pool, block_tables, seq_lens, scale, out)
    return out


def decode_launches(q, k_pool, v_pool, block_tables, seq_lens, out, sm_scale: float,
                    arch: str, num_sms: int, num_splits: int | None = None,
                    config: tuple[int, int, int] | None = None) -> list[Launch]:
    """The launches of one paged decode: the decode kernel, then the merge if split.

    Allocates the split partials (torch's caching allocator; the plan/run form of
    ``tree_attention`` preallocates instead).
    """
    num_seqs, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    dtype = str(q.dtype).removeprefix("torch.")
    tiles = num_kv_heads * dispatch.decode_tiles_per_kv_head(num_qo_heads, num_kv_heads)
    capacity = block_tables.shape[1] * page_size  # an upper bound on every length, no sync
    given = (num_splits is not None, config is not None)  # the tuner's overrides
    if num_splits is None:
        num_splits = dispatch.num_splits(num_seqs, tiles, capacity, num_sms)
    kernel = "paged_decode_split" if num_splits > 1 else "paged_decode"
    per_program = math.ceil(capacity / num_splits)
    grid = (num_seqs, tiles, num_splits)
    programs = math.prod(grid)
    config = config or dispatch.config_for(kernel, dtype, head_dim, arch, per_program,
                                           programs=programs, num_sms=num_sms)
    if log.enabled():
        log.splits_chosen(num_seqs, tiles, capacity, num_sms, num_splits, given[0])
        log.config_chosen(kernel, config, dtype, arch, head_dim, per_program, given=given[1],
                          programs=programs, num_sms=num_sms)
    spec = dispatch.decode_spec(dtype, head_dim, num_splits > 1, arch, config, page_size)
    scalars = decode_scalars(spec, sm_scale, num_qo_heads, num_kv_heads, page_size,
                             block_tables.shape[1], per_program)
    if num_splits == 1:
        return [Launch(spec, grid, (q, k_pool, v_pool, block_tables, seq_lens, out, None, None)
                       + scalars)]
    partial_out = torch.empty(num_seqs, num_qo_heads, num_splits, head_dim,
                              dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_seqs, num_qo_heads, num_splits, dtype=torch.float32,
                              device=q.device)
    merge = Launch(dispatch.merge_spec(dtype, head_dim), (num_seqs * num_qo_heads, 1, 1),
                   (partial_out, partial_lse, out, num_splits))
    return [Launch(spec, grid, (q, k_pool, v_pool, block_tables, seq_lens, None,
                                partial_out, partial_lse) + scalars), merge]


def decode_scalars(spec, sm_scale: float, num_qo_heads: int, num_kv_heads: int, page_size: int,
                   max_blocks: int, per_program: int) -> tuple:
    """The scalar arguments of a launch of the decode kernel ``spec`` whose programs walk at
    most ``per_program`` tokens each (a split: its length, a whole multiple of the KV tile).
    A tree plan with no partials launches the same kernel (``PlanArrays.as_paged_decode``)."""
    block_n = dict(spec.constexprs)["BLOCK_N"]
    tokens_per_split = max(math.ceil(per_program / block_n) * block_n, block_n)
    return (sm_scale * math.log2(math.e), num_qo_heads, num_kv_heads, page_size, max_blocks,
            tokens_per_split)


def _validate(q, k_pool, v_pool, block_tables, seq_lens, out) -> None:
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool),
                    ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_qo_heads, head_dim], got {tuple(q.shape)}")
    check_compiled("q", q.dtype, q.shape[2])
    num_seqs, num_qo_heads, head_dim = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 4 or pool.shape[3] != head_dim:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, {head_dim}]"
                             f", got {tuple(pool.shape)}")
        check_tensor(name, pool, q.dtype, q.device, "q")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ")
    if num_qo_heads % k_pool.shape[2]:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                         f"({k_pool.shape[2]})")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], "
                         f"got {tuple(block_tables.shape)}")
    check_tensor("block_tables", block_tables, torch.int32, q.device, "q")
    if tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    check_tensor("seq_lens", seq_lens, torch.int32, q.device, "q")
    check_tensor("q", q, q.dtype, q.device, "q")
    if out is not None:
        check_tensor("out", out, q.dtype, q.device, "q")
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")


def _check_lengths_fit(block_tables, seq_lens, page_size) -> None:
    capacity = block_tables.shape[1] * page_size
    if seq_lens.numel() and (int(seq_lens.max()) > capacity or int(seq_lens.min()) < 0):
        raise ValueError(f"seq_lens must lie in [0, {capacity}] (max_blocks * block_size), "
                         f"got [{int(seq_lens.min())}, {int(seq_lens.max())}]")


def _check_blocks_exist(block_tables, num_blocks) -> None:
    """Every table entry names a block of the pool: the PyTorch path gathers whole rows (on
    CUDA the check would need a sync, and the kernels read only the entries below each
    length)."""
    if block_tables.numel() and (int(block_tables.min()) < 0 or
                                 int(block_tables.max()) >= num_blocks):
        bad = block_tables[(block_tables < 0) | (block_tables >= num_blocks)][0]
        raise ValueError(f"block_tables entries must lie in [0, {num_blocks - 1}] (the pool's "
                         f"blocks), got {int(bad)}")
