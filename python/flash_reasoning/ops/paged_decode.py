"""``paged_decode``: decode attention of one query token per sequence over paged K/V.

Each sequence has its own block table (no sharing is exploited: that is ``tree_attention``).
On CUDA tensors the C++ core builds and runs the launches (split-K plus a log-sum-exp merge when
there are too few sequences to fill the GPU; ``csrc/ops/paged_decode.cc``, which the C ABI runs
too); on CPU tensors, the PyTorch path.
"""
from __future__ import annotations

import torch

from .. import _core, dispatch, log, runtime, torch_path
from ..runtime import Launch
from .checks import check_apart, check_compiled, check_scale, check_tensor


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
        _run_on_device(q, k_pool, v_pool, block_tables, seq_lens, out, scale)
    else:
        _check_lengths_fit(block_tables, seq_lens, k_pool.shape[1])
        _check_blocks_exist(block_tables, k_pool.shape[0])
        torch_path.paged_decode(q, k_pool, v_pool, block_tables, seq_lens, scale, out)
    return out


def _run_on_device(q, k_pool, v_pool, block_tables, seq_lens, out, sm_scale: float) -> None:
    """The C++ core's paged decode on torch's current stream, with the split workspace (fp32
    partials) from torch's caching allocator."""
    index = q.device.index
    ctx = runtime.context(index)
    shape = _shape(q, k_pool, sm_scale)
    num_seqs, max_blocks = q.shape[0], block_tables.shape[1]
    workspace_bytes = ctx.paged_decode_workspace(shape, num_seqs, max_blocks)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device) \
        if workspace_bytes else None
    if log.enabled():
        _log_launches(ctx, shape, num_seqs, max_blocks, workspace is not None)
    ctx.paged_decode(shape, num_seqs, max_blocks,
                     (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(),
                      seq_lens.data_ptr(), out.data_ptr()),
                     workspace.data_ptr() if workspace is not None else 0, workspace_bytes,
                     runtime.current_raw_stream(index))


def decode_launches(q, k_pool, v_pool, block_tables, seq_lens, out, sm_scale: float,
                    arch: str, num_sms: int, num_splits: int | None = None,
                    config: tuple[int, int, int] | None = None) -> list[Launch]:
    """The launches of one paged decode on ``arch`` with ``num_sms`` SMs, as the C++ core
    builds them (the decode kernel, then the merge if split), over these tensors and a split
    workspace from torch's allocator: for Triton's interpreter and the tuner, whose
    ``num_splits`` and ``config`` (BLOCK_N, warps, stages) force the split count and the
    decode kernel's config."""
    ctx = runtime.context(q.device.index) if q.is_cuda else runtime.host_context(arch, num_sms)
    shape = _shape(q, k_pool, sm_scale)
    num_seqs, max_blocks = q.shape[0], block_tables.shape[1]
    kernel = ""
    if config is not None:
        splits = num_splits or ctx.paged_decode_launches(shape, num_seqs, max_blocks, True)[1]
        kernel = dispatch.decode_spec(shape["dtype"], q.shape[2], splits > 1, arch, config,
                                      k_pool.shape[1]).name
    listed, splits, workspace_bytes = ctx.paged_decode_launches(
        shape, num_seqs, max_blocks, True, num_splits or 0, kernel)
    if log.enabled():
        _log_listed(listed, ctx.num_sms, arch, shape, num_seqs, max_blocks, splits,
                    num_splits is not None, config is not None)
    workspace = torch.empty(max(workspace_bytes, 16), dtype=torch.uint8, device=q.device)
    pointers = dict(zip(_core.PAGED_DECODE_POINTERS,
                        (q, k_pool, v_pool, block_tables, seq_lens, out)))
    return runtime.core_launches(listed, arch, pointers, workspace)


def _shape(q, k_pool, sm_scale: float) -> dict:
    return {"num_qo_heads": q.shape[1], "num_kv_heads": k_pool.shape[2], "head_dim": q.shape[2],
            "dtype": str(q.dtype).removeprefix("torch."), "block_size": k_pool.shape[1],
            "num_blocks": k_pool.shape[0], "sm_scale": sm_scale}


def _log_launches(ctx, shape: dict, num_seqs: int, max_blocks: int, may_split: bool) -> None:
    listed, splits, _ = ctx.paged_decode_launches(shape, num_seqs, max_blocks, may_split)
    _log_listed(listed, ctx.num_sms, ctx.arch, shape, num_seqs, max_blocks, splits, False, False)


def _log_listed(listed, num_sms: int, arch: str, shape: dict, num_seqs: int, max_blocks: int,
                splits: int, splits_given: bool, config_given: bool) -> None:
    """Debug records of a paged decode's split count and decode kernel, and why."""
    heads, kv_heads = shape["num_qo_heads"], shape["num_kv_heads"]
    tiles = kv_heads * dispatch.decode_tiles_per_kv_head(heads, kv_heads)
    log.splits_chosen(num_seqs, tiles, max_blocks * shape["block_size"], num_sms, splits,
                      splits_given)
    kernel, _, _, rule, max_tokens, programs = listed[0] if listed else (None,) * 6
    if kernel is not None:
        log.kernel_picked(kernel, rule, max_tokens, programs, num_sms, arch, config_given)


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
        check_apart(q, out)


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
