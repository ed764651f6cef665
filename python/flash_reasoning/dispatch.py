"""Which precompiled specialization serves a call, and how the work is split.

Small functions (no tensors, no device queries) so they can be read, tested and tuned in
isolation; the rules they follow come from the arch's tuning table (``tuning_table``, read once
and cached; ``reset`` forgets it) or the documented heuristics. ``required_specs`` lists
everything these functions can return for an arch: the AOT grid compiles at least that, and a
test checks every manifest holds it.
"""
from __future__ import annotations

import functools
import math

from . import tuning_table
from .specializations import (
    APPEND_KV,
    DTYPES,
    MERGE_SPLITS,
    PAGED_DECODE,
    TREE_FINAL,
    TREE_MERGE,
    TREE_PARTIAL,
    TREE_QUERIES,
    Spec,
    make_spec,
)
from .tuning_table import Config, Rule, Rules

HEAD_DIMS = (64, 128, 256)
#: Page sizes (KV block sizes) the attention kernels are also compiled for, as a constant
#: (``PAGE``): per-token page arithmetic becomes shifts (H100: shared roots' compute-bound
#: tiles 12-14% faster). Any other size runs the ``PAGE`` 0 kernels,
#: which take it at run time.
COMPILED_PAGE_SIZES = (16,)
#: The ``PAGE`` values each attention specialization is compiled with: 0 (any page size), then
#: every compiled size.
PAGE_KERNELS = (0, *COMPILED_PAGE_SIZES)
#: Rule lists whose kernel is also compiled to read each range as runs of consecutive slots
#: (``SLOT_RUNS``: the most runs an item's range lies in, ``planner.item_runs``; one run: H100,
#: seed_b256/q32kv8 64.6 -> 61.7 us, ft_1,1024/q32kv8 173.1 -> 165.3; two, a root folded into
#: its children's items: ft_1,4,16,512/q32kv8 102.3 -> 89.1), for any page size. Each run count
#: has its own rule lists (``.../one_run``, ``.../two_runs``: :data:`SLOT_RUN_RULE_SUFFIXES`,
#: which the C ABI names alike), from the tuning table where it has them, else those of the
#: kernels that take the page size at run time.
SLOT_RUN_KERNELS = ("tree_partial",)
#: The runs of consecutive slots the slot-run kernels are compiled for (csrc/planner/planner.h's
#: kMaxItemRuns is the last), and each one's rule-list suffix.
SLOT_RUN_RULE_SUFFIXES = {1: "one_run", 2: "two_runs"}
SLOT_RUN_COUNTS = tuple(SLOT_RUN_RULE_SUFFIXES)
#: Query rows per program: the GQA group padded to the smallest tensor-core tile.
BLOCK_M = 16
#: Splits (partial slots) merged per step of the merge kernels' loops.
MERGE_BLOCK_S = 16
APPEND_BLOCK = 1024
#: A split shorter than this costs more in partial traffic than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


#: Query-row tiles of ``tree_partial``: a node's (branch, head) rows fill tiles of one size.
TREE_BLOCK_MS = (16, 64)
#: The packed final kernel's wide tile (rows): more lanes than the narrow tile's BLOCK_M
#: holds, planned beside a lone root that outlasts the leaves (``planner``).
FINAL_WIDE_BLOCK_M = 32
#: Rows of a ``tree_queries`` tile (its queries x the GQA group): the wide partial tile's, so
#: that a sequence's queries fill the tensor-core tile a shared node's branches would.
QUERY_TILE_BLOCK_M = TREE_BLOCK_MS[1]
#: (kernel, block_m) of every rule list of one dtype and head_dim: ``paged_decode`` (one
#: program per sequence and GQA tile), ``paged_decode_split`` (a split decode: few programs),
#: ``tree_final``, ``tree_final_packed`` (several branches per program, ``Plan.final_lanes``),
#: ``tree_final_packed_wide`` (as many as :data:`FINAL_WIDE_BLOCK_M` rows hold),
#: ``tree_final_common`` and ``tree_final_common_wide`` (packed programs that first walk the
#: range their lanes share, ``PlanArrays.common``), each of these five as ``..._draft`` (its
#: rows' draft tokens read as their draft masks allow), ``tree_queries`` and
#: ``tree_queries_draft`` (query tiles: several queries of one sequence a program),
#: ``tree_queries_lanes`` and ``tree_queries_lanes_draft`` (query tiles whose lanes are short
#: sequences) and
#: ``tree_partial`` (a list per query-row tile). A rule list (``tuning_table.Rules``) gives a
#: config by the launch's programs per SM and the most tokens one program walks; the manifest
#: exports the same lists.
_FINAL_KEYS = {"tree_final": {"PACKED": 0},
               "tree_final_packed": {"PACKED": 1, "COMMON": 0, "BLOCK_M": BLOCK_M},
               "tree_final_packed_wide": {"PACKED": 1, "COMMON": 0, "BLOCK_M": FINAL_WIDE_BLOCK_M},
               "tree_final_common": {"PACKED": 1, "COMMON": 1, "BLOCK_M": BLOCK_M},
               "tree_final_common_wide": {"PACKED": 1, "COMMON": 1, "BLOCK_M": FINAL_WIDE_BLOCK_M}}
_QUERY_KEYS = {"tree_queries": {"DRAFT": 0, "LANES": 0},
               "tree_queries_draft": {"DRAFT": 1, "LANES": 0},
               "tree_queries_lanes": {"DRAFT": 0, "LANES": 1},
               "tree_queries_lanes_draft": {"DRAFT": 1, "LANES": 1}}
RULE_LISTS = (("paged_decode", None), ("paged_decode_split", None)) + \
    tuple((kernel, None) for kernel in _FINAL_KEYS) + \
    tuple((f"{kernel}_draft", None) for kernel in _FINAL_KEYS) + \
    tuple((kernel, None) for kernel in _QUERY_KEYS) + \
    tuple(("tree_partial", block_m) for block_m in TREE_BLOCK_MS)
#: The kernel family and the specialization keys each rule list's kernel stands for.
RULE_LIST_SPECS = {"paged_decode": ("paged_decode", {"SPLIT": 0}),
                   "paged_decode_split": ("paged_decode", {"SPLIT": 1}),
                   **{kernel: ("tree_final", {**key, "DRAFT": 0})
                      for kernel, key in _FINAL_KEYS.items()},
                   **{f"{kernel}_draft": ("tree_final", {**key, "DRAFT": 1})
                      for kernel, key in _FINAL_KEYS.items()},
                   **{kernel: ("tree_queries", {**key, "BLOCK_M": QUERY_TILE_BLOCK_M})
                      for kernel, key in _QUERY_KEYS.items()},
                   "tree_partial": ("tree_partial", {})}

#: Heuristics where no tuning table was measured. Decode-tile configs for ranges of at most
#: this many tokens: a short range is mostly fixed cost, so small tiles that let many programs
#: share an SM win (H100: 2048 ranges of 8 tokens 100 us at 16/2/1, 243 us at 64/4/3; H200: 64
#: leaves of 64 tokens 35.8 us at 32/4/2, 42.3 at 64/4/2).
SHORT_RANGE_CONFIGS = ((None, 16, (16, 2, 1)), (None, 32, (32, 2, 2)), (None, 64, (32, 4, 2)))
#: Many programs over longer ranges: two stages (more programs per SM) beat three.
LONG_RANGE_CONFIG = (64, 4, 2)
#: Few programs (a split decode): nothing else hides a lone program's latency, so a deeper
#: pipeline (one range of 2048 tokens: 50.7 us at 64/4/3, 60.7 at 64/4/2).
FEW_PROGRAMS_CONFIG = (64, 4, 3)
#: head_dim 256 on archs without a table for it: eight warps for its accumulator (not measured
#: there; sm90's table, measured on an H200, walks the 64-row tile at four warps).
HEAD_DIM_256_CONFIG = (64, 8, 2)
#: Packed final programs walk several short ranges side by side: a 64-token tile shared by the
#: lanes, two warps; head_dim 256 a 32-token tile, four warps (H100, 256 leaves of 64 tokens x
#: 8 KV heads at 4 lanes: 33.9 us at 64/2/2, 37.1 at 32/2/2, 38.9 at 128/4/2; head_dim 256
#: 69.8 at 32/4/2, 87.6 at 64/8/2).
PACKED_FINAL_CONFIGS = {64: (64, 2, 2), 128: (64, 2, 2), 256: (32, 4, 2)}
#: The wide packed tile: a 32-token KV tile (a token per lane at least: BLOCK_N >= its rows),
#: three stages, two warps (H100, 256 leaves of 64 tokens x 8 KV heads beside a 2048-token
#: root at 8 lanes: 50.4 us at 32/2/3, 56.1 at 64/2/2, 62.6 at 32/4/3, 71.2 at 32/4/2; its 255
#: registers spill 12 at 2 warps, none at 4). head_dim 64 takes the
#: same, 256 the narrow tile's config (neither measured).
PACKED_WIDE_FINAL_CONFIGS = {64: (32, 2, 3), 128: (32, 2, 3), 256: (32, 4, 2)}
#: Packed programs with a shared range walk it at the lanes' tile: in the narrow final tile a
#: 64-token tile and two warps, in the wide one a 128-token tile and four (H100, ft_deep16/q32kv8
#: flat: 4 lanes 64.6 us at 64/2/2, 76.7 at 32/2/2, 98.4 at 64/4/2, 84.1 at 128/4/2; 8 lanes
#: 62.0 at 128/4/2, 66.6 at 32/2/2, 67.4 at 64/2/2, 76.7 at 64/4/2).
#: head_dim 256 the packed kernels' config (not measured).
COMMON_FINAL_CONFIGS = {64: (64, 2, 2), 128: (64, 2, 2), 256: (32, 4, 2)}
COMMON_WIDE_FINAL_CONFIGS = {64: (128, 4, 2), 128: (128, 4, 2), 256: (32, 4, 2)}
#: Query tiles (64 rows) walk with a 64-token tile, four warps, two stages (H200, head_dim 128,
#: 8 several-query steps of 300-2300-token walks: 4-9% faster than at three stages on each,
#: 28-75% faster than at 8 warps or with a 128-token tile; a 128-row tile at 8 warps was 2-5%
#: faster on three 2048-token walks, 1.9x slower where 16 queries filled half of it, 8-83%
#: slower on 300-token walks).
QUERY_TILE_CONFIG = (64, 4, 2)
#: ... and where the tile reads its sequence's first run of slots through TMA
#: (:func:`query_tiles_read_tensor_maps`), three stages (H200, extends of 16-256 queries on a
#: 2048-token prompt: 0.72-0.78x the time of the paged walk at two stages; the TMA run at two
#: stages only 0.89-0.93x).
QUERY_TILE_TMA_CONFIG = (64, 4, 3)


def heuristic_rules(kernel: str, head_dim: int, arch: str, block_m: int | None = None) -> Rules:
    """The documented rules of an arch without a tuning table (sm80 and sm89 here, and any key
    a table lacks), from H100 sweeps of the attention loop over ranges of 8-2048 tokens.

    The wide ``tree_partial`` tile walks long shared ranges with three stages (H100: 16 tiles
    x 2048 tokens 49.0 us, 57.6 at two), query tiles (``tree_queries``, the same rows) with
    :data:`QUERY_TILE_CONFIG` (:data:`QUERY_TILE_TMA_CONFIG` where they read through TMA),
    head_dim 256 both with the wide tile's; sm89 has 99 KB of
    shared memory per block: one stage less. They pick by range alone (any program count)."""
    queries = kernel.startswith("tree_queries")
    if queries and query_tiles_read_tensor_maps(arch, head_dim, "_lanes" in kernel):
        return _any_launch(QUERY_TILE_TMA_CONFIG)
    if queries and head_dim != 256:
        return _any_launch(QUERY_TILE_CONFIG)
    if (kernel == "tree_partial" and block_m != BLOCK_M) or queries:
        if arch == "sm89":
            return _any_launch((64, 8, 1) if head_dim == 256 else (64, 4, 2))
        return _any_launch(HEAD_DIM_256_CONFIG if head_dim == 256 else (64, 4, 3))
    if kernel == "tree_final_packed":
        return _any_launch(PACKED_FINAL_CONFIGS[head_dim])
    if kernel == "tree_final_packed_wide":
        return _any_launch(PACKED_WIDE_FINAL_CONFIGS[head_dim])
    if kernel == "tree_final_common":
        return _any_launch(COMMON_FINAL_CONFIGS[head_dim])
    if kernel == "tree_final_common_wide":
        return _any_launch(COMMON_WIDE_FINAL_CONFIGS[head_dim])
    if head_dim == 256:
        return _any_launch(HEAD_DIM_256_CONFIG)
    if kernel == "paged_decode_split":
        return _any_launch(FEW_PROGRAMS_CONFIG)
    return SHORT_RANGE_CONFIGS + _any_launch(LONG_RANGE_CONFIG)


def _any_launch(config: Config) -> Rules:
    return ((None, None, config),)


def rule_key(kernel: str, dtype: str, head_dim: int, block_m: int | None = None,
             page_size: int = 0, slot_runs: int = 0) -> str:
    """The name of a rule list, in tuning tables and the manifest: ``tree_final/float16/128``,
    ``tree_partial/float16/128/64``; the manifest also names the same rules for the kernels of
    a compiled page size, ``tree_final/float16/128/page16``, and the slot-run kernels' lists
    (``slot_runs``: runs of slots, :data:`SLOT_RUN_RULE_SUFFIXES`),
    ``tree_partial/float16/128/64/one_run`` and ``.../two_runs``."""
    known = tuple(dict.fromkeys(k for k, _ in RULE_LISTS))
    if kernel not in known:
        raise ValueError(f"no dispatch rules for kernel {kernel!r}; known: {known}")
    key = f"{kernel}/{dtype}/{head_dim}"
    key = key if kernel != "tree_partial" else f"{key}/{block_m}"
    if slot_runs:
        _check_slot_runs(kernel, slot_runs)
        return f"{key}/{SLOT_RUN_RULE_SUFFIXES[slot_runs]}"
    page = compiled_page(page_size)
    return f"{key}/page{page}" if page else key


def parse_rule_key(key: str) -> tuple[str, str, int, int | None, int]:
    """(kernel, dtype, head_dim, block_m, slot_runs) of a key :func:`rule_key` made (a
    compiled page size's ``/page<N>`` dropped: it picks by its page-size-free list's rules)."""
    kernel, dtype, head_dim, *rest = key.split("/")
    if rest and rest[-1].startswith("page"):
        rest.pop()
    runs = {suffix: r for r, suffix in SLOT_RUN_RULE_SUFFIXES.items()}
    slot_runs = runs[rest.pop()] if rest and rest[-1] in runs else 0
    return kernel, dtype, int(head_dim), int(rest[0]) if rest else None, slot_runs


def _check_slot_runs(kernel: str, runs: int) -> None:
    if kernel not in SLOT_RUN_KERNELS:
        raise ValueError(f"{kernel} has no slot-run kernels; those that do: "
                         f"{SLOT_RUN_KERNELS}")
    if runs not in SLOT_RUN_COUNTS:
        raise ValueError(f"no slot-run kernels read {runs!r} runs of slots; compiled: "
                         f"{SLOT_RUN_COUNTS}")


def addressings(kernel: str) -> tuple[tuple[int, int], ...]:
    """(page size, slot_runs) of each compiled way ``kernel``'s rule lists address K/V: the
    page kernels (:data:`PAGE_KERNELS`; slot_runs 0), then, for :data:`SLOT_RUN_KERNELS`,
    each count of runs of slots (:data:`SLOT_RUN_COUNTS`; page size 0: any)."""
    pages = tuple((page, 0) for page in PAGE_KERNELS)
    if kernel not in SLOT_RUN_KERNELS:
        return pages
    return pages + tuple((0, runs) for runs in SLOT_RUN_COUNTS)


def compiled_page(page_size: int) -> int:
    """The ``PAGE`` constexpr of a pool of ``page_size``-token blocks: the size itself where it
    is compiled (:data:`COMPILED_PAGE_SIZES`), else 0 (the kernels read it at run time)."""
    return page_size if page_size in COMPILED_PAGE_SIZES else 0


@functools.lru_cache(maxsize=None)
def rules(kernel: str, dtype: str, head_dim: int, arch: str,
          block_m: int | None = None, slot_runs: int = 0) -> tuple[Rules, str]:
    """The rule list serving ``kernel`` (its ``slot_runs`` kernels': runs of slots) and where
    it comes from: the arch's tuning table (shipped, or ``$FLASH_REASONING_TUNING``) when it
    has the key, else the page kernels' list (slot-run kernels), or the final kernel's without
    draft masks (a draft kernel: the same walk, a mask more), else the heuristics."""
    key = rule_key(kernel, dtype, head_dim, block_m, 0, slot_runs)
    table = tuning_table.load(arch)
    if table is not None and key in table.rules:
        return table.rules[key], table.source
    if slot_runs:
        return rules(kernel, dtype, head_dim, arch, block_m)
    if kernel.endswith("_draft"):
        return rules(kernel.removesuffix("_draft"), dtype, head_dim, arch)
    return heuristic_rules(kernel, head_dim, arch, block_m), "heuristic"


def pick_rule(rule_list: Rules, max_tokens: int | None, programs: int | None = None,
              num_sms: int | None = None) -> Rule:
    """The first rule serving a launch of ``programs`` programs on ``num_sms`` SMs, each
    walking at most ``max_tokens`` tokens (``None``: unknown, served as many and long). The
    C ABI compares the same way: ``programs <= max_programs_per_sm * num_sms``."""
    for rule in rule_list:
        per_sm, bound, _ = rule
        few_enough = per_sm is None or (programs is not None and num_sms is not None
                                        and programs <= per_sm * num_sms)
        if few_enough and (bound is None or (max_tokens is not None and max_tokens <= bound)):
            return rule
    raise ValueError(f"rules {rule_list} end without a rule for any launch")


@functools.lru_cache(maxsize=None)  # a paged decode asks once per call
def config_for(kernel: str, dtype: str, head_dim: int, arch: str, max_tokens: int | None = None,
               block_m: int | None = None, programs: int | None = None,
               num_sms: int | None = None, slot_runs: int = 0) -> Config:
    """(BLOCK_N, num_warps, num_stages) of a ``kernel`` launch of ``programs`` programs on
    ``num_sms`` SMs that walk at most ``max_tokens`` tokens each (``None``: unknown, served
    as many and long); ``slot_runs``: its slot-run kernels' (:func:`rules`)."""
    rule_list = rules(kernel, dtype, head_dim, arch, block_m, slot_runs)[0]
    return pick_rule(rule_list, max_tokens, programs, num_sms)[2]


def config_reason(kernel: str, dtype: str, head_dim: int, arch: str, max_tokens: int | None,
                  block_m: int | None = None, programs: int | None = None,
                  num_sms: int | None = None, slot_runs: int = 0) -> str:
    """Why :func:`config_for` gives its config: the rule list's source and the matched rule."""
    rule_list, source = rules(kernel, dtype, head_dim, arch, block_m, slot_runs)
    per_sm, bound, _ = pick_rule(rule_list, max_tokens, programs, num_sms)
    fewer = [p for p, _, _ in rule_list if p is not None]
    shorter = [b for p, b, _ in rule_list if p == per_sm and b is not None]
    parts = [_bound_reason("programs", "per SM", per_sm, fewer, programs, "many"),
             _bound_reason("range", "tokens", bound, shorter, max_tokens, "long")]
    return f"{source}: {', '.join(p for p in parts if p) or 'one config for any launch'}"


def _bound_reason(what: str, unit: str, bound, lower: list, value, unknown: str) -> str:
    """``range <= 64 tokens``, ``range > 64 tokens``, ``range unknown: long``, or nothing
    when no rule of the list bounds ``what``."""
    if bound is not None:
        return f"{what} <= {bound:g} {unit}"
    if not lower:
        return ""
    return f"{what} unknown: {unknown}" if value is None else f"{what} > {lower[-1]:g} {unit}"


def reset() -> None:
    """Forget the loaded tuning tables and the rules and specs made from them (after
    ``$FLASH_REASONING_TUNING`` changes)."""
    tuning_table.load.cache_clear()
    for cached in (rules, config_for, decode_spec, tree_partial_spec, tree_final_spec,
                   tree_merge_spec, tree_queries_spec):
        cached.cache_clear()


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
                config: Config | None = None, page_size: int = 0) -> Spec:
    """The decode kernel for a call over ``page_size``-token blocks (0: the kernel for any
    size); ``config`` (BLOCK_N, warps, stages) overrides the rules (a tuning run times each
    compiled candidate this way)."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    kernel = "paged_decode_split" if split else "paged_decode"
    block_n, warps, stages = config or config_for(kernel, dtype, head_dim, arch)
    return make_spec(PAGED_DECODE, dtype, warps, stages, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
                     BLOCK_N=block_n, SPLIT=int(split), PAGE=compiled_page(page_size))


@functools.lru_cache(maxsize=None)
def merge_spec(dtype: str, head_dim: int) -> Spec:
    check_dtype(dtype)
    check_head_dim(head_dim)
    return make_spec(MERGE_SPLITS, dtype, 4, 1, HEAD_DIM=head_dim, BLOCK_S=MERGE_BLOCK_S)


#: head_dims whose wide slot-run walk reads K/V through TMA descriptors on sm90
#: (:func:`reads_through_tensor_maps`). Not 64: there its plans read the same or slower through
#: them (H100, ft_1,1024/q32kv8 at head_dim 64 83.7 -> 91.9 us, seed_b256/q32kv8 34.3 -> 34.5);
#: at 256 faster (seed_b256/q32kv8 156.7 -> 146.3, ft_1,1024/q32kv8 459.9 -> 429.5).
TENSOR_MAP_HEAD_DIMS = (128, 256)


def reads_through_tensor_maps(arch: str, head_dim: int, block_m: int, slot_runs: int) -> int:
    """``tree_partial``'s ``TMA`` constexpr: 1 where the wide tile's slot-run walk loads its K/V
    tiles through TMA descriptors the launcher encodes on the host (sm90, head_dim
    :data:`TENSOR_MAP_HEAD_DIMS`): H100, ft_1,1024/q32kv8's root launch 90.4 -> 81.0 us, the
    whole step 159 -> 148. Descriptors built by each program instead cost short programs more
    than they save (ft_1,256/q32kv8's root launch 12.4 -> 14.3 us)."""
    return int(arch == "sm90" and slot_runs > 0 and block_m == TREE_BLOCK_MS[1]
               and head_dim in TENSOR_MAP_HEAD_DIMS)


def query_tiles_read_tensor_maps(arch: str, head_dim: int, lanes: bool) -> int:
    """``tree_queries``' ``TMA`` constexpr: 1 where a tile of one lane reads its sequence's first
    run of consecutive slots through TMA descriptors (sm90, head_dim 128, where it was measured:
    H200, extend of 64 queries on 64 branches of a 2048-token prompt 392.0 -> 306.4 us)."""
    return int(arch == "sm90" and head_dim == 128 and not lanes)


def grid_dependency(arch: str) -> int:
    """The tree kernels' ``PDL`` constexpr on ``arch``: 1 where the GPU has programmatic
    dependent launch (sm90). The final (or merge) launch then starts while the partial launch
    ends: its programs load their queries and walk their own ranges, and wait for the partial
    launch only before merging its partials (H100: 1-13% off most two-launch plans); a
    two-tile plan's second partial launch starts beside the first and waits for it at its end
    (ft_1,16,64/q32kv8 35.0 -> 28.4 us)."""
    return int(arch == "sm90")


@functools.lru_cache(maxsize=None)
def tree_merge_spec(dtype: str, head_dim: int, arch: str) -> Spec:
    """One (branch, query head) row per program, its partial slots MERGE_BLOCK_S at a time."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    return make_spec(TREE_MERGE, dtype, 4, 1, HEAD_DIM=head_dim, BLOCK_S=MERGE_BLOCK_S,
                     PDL=grid_dependency(arch))


@functools.lru_cache(maxsize=None)
def append_spec() -> Spec:
    return make_spec(APPEND_KV, None, 4, 1, BLOCK=APPEND_BLOCK)


@functools.lru_cache(maxsize=None)
def tree_partial_spec(dtype: str, head_dim: int, block_m: int, arch: str,
                      config: Config | None = None, page_size: int = 0,
                      slot_runs: int = 0) -> Spec:
    """``slot_runs``: the kernel that reads each item's range as that many runs of
    consecutive slots (1 or 2: ``planner.item_runs``), for any page size."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    if block_m not in TREE_BLOCK_MS:
        raise ValueError(f"tree_partial BLOCK_M {block_m} is not compiled: {TREE_BLOCK_MS}")
    if slot_runs:
        _check_slot_runs("tree_partial", slot_runs)
    block_n, warps, stages = config or config_for("tree_partial", dtype, head_dim, arch,
                                                  block_m=block_m, slot_runs=slot_runs)
    return make_spec(TREE_PARTIAL, dtype, warps, stages, HEAD_DIM=head_dim, BLOCK_M=block_m,
                     BLOCK_N=block_n, PAGE=0 if slot_runs else compiled_page(page_size),
                     SLOT_RUNS=int(slot_runs),
                     TMA=reads_through_tensor_maps(arch, head_dim, block_m, slot_runs),
                     PDL=grid_dependency(arch))


@functools.lru_cache(maxsize=None)
def tree_final_spec(dtype: str, head_dim: int, arch: str, config: Config | None = None,
                    packed: bool = False, page_size: int = 0, wide: bool = False,
                    common: bool = False, draft: bool = False) -> Spec:
    """One branch's GQA group per program, like the decode kernel, or (``packed``) the groups
    of several branches, in the narrow tile or (``wide``) :data:`FINAL_WIDE_BLOCK_M` rows;
    ``common``: packed programs that first walk the range their lanes share; ``draft``: the
    rows' draft tokens read as their draft masks allow."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    kernel = tree_final_kernel(packed, wide, common, draft)
    block_n, warps, stages = config or config_for(kernel, dtype, head_dim, arch)
    return make_spec(TREE_FINAL, dtype, warps, stages, HEAD_DIM=head_dim,
                     BLOCK_M=RULE_LIST_SPECS[kernel][1].get("BLOCK_M", BLOCK_M),
                     BLOCK_N=block_n, PACKED=int(packed), COMMON=int(common), DRAFT=int(draft),
                     PAGE=compiled_page(page_size), PDL=grid_dependency(arch))


@functools.lru_cache(maxsize=None)
def tree_queries_spec(dtype: str, head_dim: int, arch: str, config: Config | None = None,
                      page_size: int = 0, draft: bool = False, lanes: bool = False) -> Spec:
    """Query tiles (several queries of one sequence a program, :data:`QUERY_TILE_BLOCK_M`
    rows); ``draft``: the rows' draft tokens read as their draft masks allow; ``lanes``: tiles
    whose lanes are short sequences."""
    check_dtype(dtype)
    check_head_dim(head_dim)
    kernel = "tree_queries" + ("_lanes" if lanes else "") + ("_draft" if draft else "")
    block_n, warps, stages = config or config_for(kernel, dtype, head_dim, arch)
    return make_spec(TREE_QUERIES, dtype, warps, stages, HEAD_DIM=head_dim,
                     BLOCK_M=QUERY_TILE_BLOCK_M, BLOCK_N=block_n, DRAFT=int(draft),
                     LANES=int(lanes), TMA=query_tiles_read_tensor_maps(arch, head_dim, lanes),
                     PAGE=compiled_page(page_size))


def kernel_spec(kernel: str, dtype: str, head_dim: int, arch: str, config: Config,
                block_m: int | None = None, page_size: int = 0,
                slot_runs: int = 0) -> Spec:
    """The spec of a rule list's kernel (:data:`RULE_LISTS`) at ``config``, for one of its
    :func:`addressings`."""
    if slot_runs:
        _check_slot_runs(kernel, slot_runs)
    if kernel == "tree_partial":
        return tree_partial_spec(dtype, head_dim, block_m, arch, config, page_size, slot_runs)
    if kernel.startswith("tree_queries"):
        return tree_queries_spec(dtype, head_dim, arch, config, page_size,
                                 kernel.endswith("_draft"), "_lanes" in kernel)
    if kernel.startswith("tree_final"):
        base = kernel.removesuffix("_draft")
        return tree_final_spec(dtype, head_dim, arch, config, base != "tree_final", page_size,
                               base.endswith("_wide"), base.startswith("tree_final_common"),
                               base != kernel)
    return decode_spec(dtype, head_dim, kernel == "paged_decode_split", arch, config, page_size)


def tree_final_kernel(packed: bool, wide: bool = False, common: bool = False,
                      draft: bool = False) -> str:
    """The rule list of a ``tree_final`` launch: packed programs (several branches each) have
    their own, one per final tile, and so do packed programs with a shared range; each has a
    twin that applies draft masks."""
    if (wide or common) and not packed:
        raise ValueError("the wide final tile and shared ranges are packed kernels': one "
                         "branch's group fits the narrow tile and has no lanes to share with")
    kernel = "tree_final"
    if packed:
        kernel = "tree_final_common" if common else "tree_final_packed"
        kernel = f"{kernel}_wide" if wide else kernel
    return f"{kernel}_draft" if draft else kernel


def rule_kernel(spec: Spec) -> str:
    """The kernel of the rule list that picks ``spec`` (:data:`RULE_LIST_SPECS`)."""
    return next(kernel for kernel, (family, key) in RULE_LIST_SPECS.items()
                if family == spec.family and all(spec.key[k] == v for k, v in key.items()))


def rule_specs(dtype: str, head_dim: int, arch: str) -> dict[str, list[tuple]]:
    """Every rule list of one dtype and head_dim, by key, its configs replaced by their
    kernel specs: ``(max_programs_per_sm, max_tokens, spec)``, for each of a kernel's
    :func:`addressings` (a compiled page size picks the configs of any page size's list)."""
    return {rule_key(kernel, dtype, head_dim, block_m, page_size, slot_runs):
            [(per_sm, bound, kernel_spec(kernel, dtype, head_dim, arch, config, block_m,
                                         page_size, slot_runs))
             for per_sm, bound, config in rules(kernel, dtype, head_dim, arch, block_m,
                                                slot_runs)[0]]
            for kernel, block_m in RULE_LISTS
            for page_size, slot_runs in addressings(kernel)}


def required_specs(arch: str) -> list[Spec]:
    """Every spec the functions above can return for ``arch``: what the AOT grid compiles."""
    specs = [append_spec()]
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            specs += [merge_spec(dtype, head_dim), tree_merge_spec(dtype, head_dim, arch)]
            for rule_list in rule_specs(dtype, head_dim, arch).values():
                specs += [spec for _, _, spec in rule_list]
    return list(dict.fromkeys(specs))


def decode_tiles_per_kv_head(num_qo_heads: int, num_kv_heads: int) -> int:
    return math.ceil(num_qo_heads // num_kv_heads / BLOCK_M)


def split_reason(num_seqs: int, programs_per_seq: int, max_seq_len: int, num_sms: int,
                 splits: int) -> str:
    """Why a paged decode takes ``splits`` splits (csrc/ops/paged_decode.cc's
    ``paged_decode_splits``: toward two programs per SM, each split at least
    :data:`MIN_TOKENS_PER_SPLIT` tokens, at most :data:`MAX_SPLITS`)."""
    programs = num_seqs * programs_per_seq
    if splits > 1:
        return f"{programs} programs < {num_sms} SMs: split toward 2 programs per SM"
    if programs == 0 or programs >= num_sms:
        return f"{programs} programs: enough for {num_sms} SMs, or none"
    return f"too short to split (< 2 x {MIN_TOKENS_PER_SPLIT} tokens)"


def dispatch_rules(arch: str, only: dict | None = None) -> dict:
    """The rules as data, for the manifest: a C caller of ``libflash_reasoning`` picks by them
    the kernels these functions pick (``[[max_programs_per_sm, max_tokens, kernel name], ...]``
    by key, ``None`` for any, simplified where rules name the same kernel). ``only``: the
    lists of a tuning table's keys (each with its compiled page sizes' and slot runs'), no
    constants: what a table chosen at run time replaces in the manifest's rules."""
    if only is not None:
        wanted = {parse_rule_key(key)[:4] for key in only}
        rules_out = {key: rule_list for key, rule_list in dispatch_rules(arch)["rules"].items()
                     if key.count("/") >= 2 and parse_rule_key(key)[:4] in wanted}
        return {"rules": rules_out, "constants": {}}
    rules_out = {"append_kv": [[None, None, append_spec().name]]}
    for dtype in DTYPES:
        for hd in HEAD_DIMS:
            for kernel, spec in (("merge_splits", merge_spec(dtype, hd)),
                                 ("tree_merge", tree_merge_spec(dtype, hd, arch))):
                rules_out[f"{kernel}/{dtype}/{hd}"] = [[None, None, spec.name]]
            for key, rule_list in rule_specs(dtype, hd, arch).items():
                named = tuple((per_sm, bound, spec.name) for per_sm, bound, spec in rule_list)
                rules_out[key] = [list(rule) for rule in tuning_table.simplify(named)]
    constants = {"block_m": BLOCK_M, "tree_block_m_narrow": TREE_BLOCK_MS[0],
                 "tree_block_m_wide": TREE_BLOCK_MS[1],
                 "tree_final_block_m_wide": FINAL_WIDE_BLOCK_M,
                 "tree_queries_block_m": QUERY_TILE_BLOCK_M, "merge_block_s": MERGE_BLOCK_S,
                 "append_block": APPEND_BLOCK, "min_tokens_per_split": MIN_TOKENS_PER_SPLIT,
                 "max_splits": MAX_SPLITS}
    return {"rules": rules_out, "constants": constants}
