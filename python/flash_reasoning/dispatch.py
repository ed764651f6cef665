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


#: Decode-tile configs (BLOCK_N, num_warps, num_stages) for ranges of at most this many
#: tokens: a short range is mostly fixed cost, so small tiles that let many programs share an
#: SM win (H100: 2048 ranges of 8 tokens 100 us at 16/2/1, 243 us at 64/4/3; H200: 64
#: leaves of 64 tokens 35.8 us at 32/4/2, 42.3 at 64/4/2; docs/perf.md).
SHORT_RANGE_CONFIGS = ((16, (16, 2, 1)), (32, (32, 2, 2)), (64, (32, 4, 2)))
#: Many programs over longer ranges: two stages (more programs per SM) beat three.
LONG_RANGE_CONFIG = (64, 4, 2)
#: Few programs (a split decode): nothing else hides a lone program's latency, so a deeper
#: pipeline (one range of 2048 tokens: 50.7 us at 64/4/3, 60.7 at 64/4/2).
FEW_PROGRAMS_CONFIG = (64, 4, 3)


def decode_config(head_dim: int, arch: str, max_tokens: int | None = None,
                  few_programs: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a decode-tile kernel (``paged_decode``,
    ``tree_final``, the narrow ``tree_partial``) whose programs walk at most ``max_tokens``
    tokens each (``None``: unknown, long).

    From the H100 sweep of ``ci/explore_attend.py`` (docs/perf.md); sm80 and sm89 use the
    same until they are measured, head_dim 256 keeps its measured config.
    """
    del arch
    if head_dim == 256:
        return (64, 8, 2)
    if few_programs:
        return FEW_PROGRAMS_CONFIG
    for bound, config in SHORT_RANGE_CONFIGS:
        if max_tokens is not None and max_tokens <= bound:
            return config
    return LONG_RANGE_CONFIG


def range_configs(head_dim: int, arch: str) -> list[tuple[int, int, int]]:
    """Every config :func:`decode_config` returns for many programs, whatever the range."""
    bounds = [None] + [bound for bound, _ in SHORT_RANGE_CONFIGS]
    return list(dict.fromkeys(decode_config(head_dim, arch, b) for b in bounds))


def check_head_dim(head_dim: int, owner: str = "the call") -> None:
    """ValueError, naming ``owner``, unless the kernels were compiled for ``head_dim``."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{owner} has head_dim {head_dim}, which is not compiled; compiled: "
                         f"{HEAD_DIMS}")


def check_dtype(dtype: str, owner: str = "the call") -> None:
    """TypeError, naming ``owner``, unless the kernels were compiled for ``dtype``."""
    if dtype not in DTYPES:
        raise TypeError(f"{owner} has dtype {dtype}, which is not compiled; compiled: "
                        f"{tuple(DTYPES)}")


@functools.lru_cache(maxsize=None)  # a Spec per call would cost host time per launch
def decode_spec(dtype: str, head_dim: int, split: bool, arch: str,
                config: tuple[int, int, int] | None = None) -> Spec:
    """The decode kernel for a call; ``config`` (BLOCK_N, warps, stages) overrides the
    heuristic (a tuning run times each compiled candidate this way)."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    block_n, warps, stages = config or decode_config(head_dim, arch, few_programs=split)
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


def tree_partial_config(head_dim: int, block_m: int, arch: str,
                        max_tokens: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of ``tree_partial`` for items of at most
    ``max_tokens``: the decode config for the decode tile. The wide tile walks long shared
    ranges with three stages (H100: 16 tiles x 2048 tokens 49.0 us, 57.6 at two); it
    doubles the warps at head_dim 256 (its accumulator). sm89 has 99 KB of shared memory
    per block: one stage less."""
    if block_m == BLOCK_M:
        return decode_config(head_dim, arch, max_tokens)
    if head_dim == 256:
        return (64, 8, 1) if arch == "sm89" else (64, 8, 2)
    return (64, 4, 2) if arch == "sm89" else (64, 4, 3)


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
    """One branch's GQA group per program, like the decode kernel; ``config`` from
    :func:`decode_config` for the plan's longest final range."""
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
            configs = range_configs(head_dim, arch)
            specs += [decode_spec(dtype, head_dim, False, arch, c) for c in configs]
            specs.append(decode_spec(dtype, head_dim, True, arch))
            specs.append(merge_spec(dtype, head_dim))
            specs.append(tree_partial_spec(dtype, head_dim, TREE_BLOCK_MS[1], arch))
            specs += [tree_partial_spec(dtype, head_dim, BLOCK_M, arch, c) for c in configs]
            specs += [tree_final_spec(dtype, head_dim, arch, c) for c in configs]
    return list(dict.fromkeys(specs))


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


def _range_rules(choose) -> list[list]:
    """``[[max_tokens or None, kernel name], ...]`` of ``choose(max_tokens) -> Spec`` over the
    range bounds, a bound dropped where the next one picks the same kernel."""
    bounds = [bound for bound, _ in SHORT_RANGE_CONFIGS] + [None]
    rules = [[bound, choose(bound).name] for bound in bounds]
    return [rule for rule, after in zip(rules, rules[1:] + [None])
            if after is None or after[1] != rule[1]]


def dispatch_rules(arch: str) -> dict:
    """The rules above as data, for the manifest: a C caller of ``libflash_reasoning`` picks
    by them the kernels these functions pick (keys ``family/dtype/head_dim[/block_m]``)."""
    rules = {"append_kv": [[None, append_spec().name]]}
    for dtype in DTYPES:
        for hd in HEAD_DIMS:
            at = f"{dtype}/{hd}"
            rules[f"paged_decode/{at}"] = _range_rules(lambda n: decode_spec(
                dtype, hd, False, arch, decode_config(hd, arch, n)))
            rules[f"paged_decode_split/{at}"] = [[None, decode_spec(dtype, hd, True, arch).name]]
            rules[f"merge_splits/{at}"] = [[None, merge_spec(dtype, hd).name]]
            rules[f"tree_final/{at}"] = _range_rules(lambda n: tree_final_spec(
                dtype, hd, arch, decode_config(hd, arch, n)))
            for block_m in TREE_BLOCK_MS:
                rules[f"tree_partial/{at}/{block_m}"] = _range_rules(lambda n: tree_partial_spec(
                    dtype, hd, block_m, arch, tree_partial_config(hd, block_m, arch, n)))
    constants = {"block_m": BLOCK_M, "tree_block_m_narrow": TREE_BLOCK_MS[0],
                 "tree_block_m_wide": TREE_BLOCK_MS[1], "merge_block_s": MERGE_BLOCK_S,
                 "append_block": APPEND_BLOCK, "min_tokens_per_split": MIN_TOKENS_PER_SPLIT,
                 "max_splits": MAX_SPLITS}
    return {"rules": rules, "constants": constants}
