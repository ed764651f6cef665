"""Which precompiled specialization serves a call, and how the work is split.

Small pure functions (no tensors, no device queries) so they can be read, tested and tuned in
isolation. ``required_specs`` lists everything these functions can return for an arch: the AOT
grid compiles at least that, and a test checks every manifest holds it.
"""
from __future__ import annotations

import functools
import math

from .specializations import (APPEND_KV, DTYPES, MERGE_SPLITS, PAGED_DECODE, TREE_FINAL,
                              TREE_PARTIAL, Spec, make_spec)

HEAD_DIMS = (64, 128, 256)
#: Query rows per program: the GQA group padded to the smallest tensor-core tile.
BLOCK_M = 16
#: Splits merged per step of the merge kernel's loop.
MERGE_BLOCK_S = 16
APPEND_BLOCK = 1024
#: A split shorter than this costs more in partial traffic than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def decode_config(head_dim: int, arch: str) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the paged decode kernel.

    The best of ``aot.grid.DECODE_CANDIDATES`` on the H100 (docs/perf.md, 2026-11-21); sm80
    and sm89 use the same until they are measured.
    """
    del arch
    return (64, 8, 2) if head_dim == 256 else (64, 4, 3)


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not compiled; supported: {HEAD_DIMS}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use one of {tuple(DTYPES)}")


@functools.lru_cache(maxsize=None)  # a Spec per call would cost host time per launch
def decode_spec(dtype: str, head_dim: int, split: bool, arch: str,
                config: tuple[int, int, int] | None = None) -> Spec:
    """The decode kernel for a call; ``config`` (BLOCK_N, warps, stages) overrides the
    heuristic (a tuning run times each compiled candidate this way)."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    block_n, warps, stages = config or decode_config(head_dim, arch)
    return make_spec(PAGED_DECODE, dtype, warps, stages, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
                     BLOCK_N=block_n, SPLIT=int(split))


@functools.lru_cache(maxsize=None)
def merge_spec(dtype: str, head_dim: int) -> Spec:
    check_dtype(dtype)
    check_head_dim(head_dim)
    return make_spec(MERGE_SPLITS, dtype, 4, 1, HEAD_DIM=head_dim, BLOCK_S=MERGE_BLOCK_S)


@functools.lru_cache(maxsize=None)
def append_spec() -> Spec:
    return make_spec(APPEND_KV, None, 4, 1, BLOCK=APPEND_BLOCK)


#: Query-row tiles of ``tree_partial``: a node's (branch, head) rows fill tiles of one size.
TREE_BLOCK_MS = (16, 64)


def tree_block_m(flat_rows: int) -> int:
    """The ``tree_partial`` tile for a node with this many (branch, query head) rows: the
    decode tile when they fit in it, else the wide tile (fewer re-reads of the node's KV)."""
    return TREE_BLOCK_MS[0] if flat_rows <= TREE_BLOCK_MS[0] else TREE_BLOCK_MS[1]


def tree_partial_config(head_dim: int, block_m: int, arch: str) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of ``tree_partial``: the decode config for the
    decode tile; the wide tile doubles the warps at head_dim 256 (its accumulator). Guesses
    until the tuner measures them (docs/perf.md)."""
    if block_m == BLOCK_M:
        return decode_config(head_dim, arch)
    if head_dim == 256:  # sm89 has 99 KB of shared memory per block: one stage fits
        return (64, 8, 1) if arch == "sm89" else (64, 8, 2)
    return (64, 4, 2)


@functools.lru_cache(maxsize=None)
def tree_partial_spec(dtype: str, head_dim: int, block_m: int, arch: str,
                      config: tuple[int, int, int] | None = None) -> Spec:
    check_dtype(dtype)
    check_head_dim(head_dim)
    if block_m not in TREE_BLOCK_MS:
        raise ValueError(f"tree_partial BLOCK_M {block_m} is not compiled: {TREE_BLOCK_MS}")
    block_n, warps, stages = config or tree_partial_config(head_dim, block_m, arch)
    return make_spec(TREE_PARTIAL, dtype, warps, stages, HEAD_DIM=head_dim, BLOCK_M=block_m,
                     BLOCK_N=block_n)


@functools.lru_cache(maxsize=None)
def tree_final_spec(dtype: str, head_dim: int, arch: str,
                    config: tuple[int, int, int] | None = None) -> Spec:
    """One branch's GQA group per program, like the decode kernel, with its config."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    block_n, warps, stages = config or decode_config(head_dim, arch)
    return make_spec(TREE_FINAL, dtype, warps, stages, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
                     BLOCK_N=block_n)


def required_specs(arch: str) -> list[Spec]:
    """Every spec the functions above can return for ``arch``."""
    specs = [append_spec()]
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            specs += [decode_spec(dtype, head_dim, split, arch) for split in (False, True)]
            specs.append(merge_spec(dtype, head_dim))
            specs += [tree_partial_spec(dtype, head_dim, bm, arch) for bm in TREE_BLOCK_MS]
            specs.append(tree_final_spec(dtype, head_dim, arch))
    return specs


def decode_tiles_per_kv_head(num_qo_heads: int, num_kv_heads: int) -> int:
    return math.ceil(num_qo_heads // num_kv_heads / BLOCK_M)


def num_splits(num_seqs: int, programs_per_seq: int, max_seq_len: int, num_sms: int) -> int:
    """Split each sequence along its length until about two programs run per SM.

    Enough programs already: no split (the merge costs a launch and partial traffic).
    """
    programs = num_seqs * programs_per_seq
    if programs == 0 or programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))
