"""The tree-attention planner: from a segment tree to what each kernel program computes.

Every node of the :class:`~flash_reasoning.segment_tree.SegmentTree` is either *computed* once
for all the branches below it (its KV read once, one fp32 partial per branch written and merged later)
or *folded* into its consumers (its children and the branches ending at it), which then read
its tokens as part of their own range. The cost model folds a node when re-reading its KV costs
less than the partials it would write; an exclusive leaf always folds into its branch.

Each branch ends with a *final range* (what is left of its path after the computed nodes, read
through its own block table): the final kernel computes it, merges the branch's partials along
its path and writes the output. Long ranges (computed nodes and final ranges) are cut into
chunks so the grid fills the GPU; every chunk but a final range's last one becomes a partial
work item, tiled over its (branch, query head) rows. A final-kernel program walks its range's
KV tiles, then folds its branch's partials one after another; a plan where some program's walk
is ``kSeparateMergeSteps`` long, and whose final launch is too small to fill the GPU,
*merges separately* instead: every chunk of every final range
is a partial item (the last one *open*: it reads to its branch's length at run time), and a
merge kernel folds each (branch, head) row's partials in vectorised blocks; no final kernel
runs. A plan with no partials at all (nothing computed, nothing split) is a paged decode and
runs ``paged_decode``'s kernel. Where the GQA group leaves rows of the final kernel's tile
free, one final program serves ``final_lanes`` branches (1, or a power of two from 4, while one
program per SM remains; beside a lone root of one program per SM, until every packed program
fits two per SM beside it, in the wide final tile's rows where the root is estimated to outlast the final
launch) and walks their final ranges side by side. The final (or merge) launch starts
while the last partial launch runs: a final kernel at its programs' start (``early_final``:
it walks its own ranges before it waits for the partials), a merge kernel after their walks
(it has nothing to do before its wait). A plan that merges separately over both row tiles is
also planned with every item in the wide tile (*one tile*: one partial launch fewer, the
same folds), kept where it estimates faster.

Computing shared nodes saves HBM bytes but costs a partial launch and a merge, which a small
tree cannot repay (one KV head: 512 bytes a token). So the tree is also planned *flat* (every
node folded: each branch reads its whole path, as a paged decode does), and the plan whose
launches ``stats["estimated_us"]`` estimates faster is kept. Where a packed final program's
lanes begin their final ranges in the same folded node (a flat plan's sibling leaves, say),
the program walks that *shared range* once as a dense tile of all its rows, then each lane's
rest (``common``): a flat plan of a deep tree of short nodes then reads each node about once
per program, not once per branch.

The planner itself is C++ (``csrc/planner/planner.cc``), and so is the plan that lists a
tree's launches (``csrc/ops/tree_attention_plan.cc``): both front ends, Python's
``TreeAttentionPlan`` and the C ABI, plan and launch through the same code. This module
describes the planner's input and output, and plans without kernels (tests, tools).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _core
from .ops.checks import as_int
from .segment_tree import SegmentTree


@dataclass(frozen=True)
class Shape:
    """What the planner needs to know about the attention call and the GPU."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_sms: int


#: PlanOptions' choices that are yes, no or the cost model's (None).
_TRISTATE = ("separate_merge", "flat", "one_tile", "early_final", "host_nodes", "slot_runs")


@dataclass(frozen=True)
class PlanOptions:
    """The planner's choices forced, for tests, the tuner and comparisons (not the public
    API): the fields of ``PlanOptions`` in csrc/planner/planner.h, ``None`` leaving each to the
    cost model. ``target_chunk``: tokens per chunk; ``separate_merge``; ``flat`` (every node
    folded; ``False`` keeps the cost model's folds); ``final_lanes`` (1 to the wide final
    tile's rows over the GQA group); ``one_tile`` (every item in the wide tile, or each in its
    own); ``early_final`` (the last launch starts at the partial launch's start); ``host_nodes``
    (``False``: every computed node has items of its own); ``slot_runs`` (``False``: the page
    kernels only). ``arch`` and ``num_sms`` plan a CPU allocator's launches for that arch and SM
    count (the interpreter), or a GPU plan for another SM count."""
    target_chunk: int | None = None
    separate_merge: bool | None = None
    flat: bool | None = None
    final_lanes: int | None = None
    one_tile: bool | None = None
    early_final: bool | None = None
    host_nodes: bool | None = None
    slot_runs: bool | None = None
    arch: str | None = None
    num_sms: int | None = None

    def __post_init__(self) -> None:
        for name in _TRISTATE:
            value = getattr(self, name)
            if value is not None and type(value) is not bool:
                raise TypeError(f"{name} must be True, False or None, got {value!r}")
        for name in ("target_chunk", "final_lanes", "num_sms"):
            if getattr(self, name) is not None:
                as_int(name, getattr(self, name), low=1)
        if self.arch is not None and not isinstance(self.arch, str):
            raise TypeError(f"arch must be an arch name like 'sm90' or None, got {self.arch!r}")

    def core(self) -> dict[str, int]:
        """The C++ options: -1 where the cost model chooses, 0 for an unforced count."""
        forced = {name: -1 if getattr(self, name) is None else int(getattr(self, name))
                  for name in _TRISTATE}
        return {**forced, "target_chunk": self.target_chunk or 0,
                "final_lanes": self.final_lanes or 0}


@dataclass
class PlanArrays:
    """A plan on the host. Chunk ``c`` covers tokens ``[chunk_start[c], chunk_end[c])`` read
    through block-table row ``chunk_table_row[c]``, for the rows
    ``order[chunk_row_ptr[c]:chunk_row_ptr[c] + chunk_rows[c]]``, whose partials are entries
    ``chunk_entry0[c] + j``, stored in partial slot ``entry_slot[entry]``; an open chunk
    (``chunk_open[c]``) ends at its row's length at run time. ``items[block_m]`` are the int32
    records of ``tree_partial`` (fields ``TREE_ITEM_FIELDS``, run splits written). Branch (row)
    ``b``'s final range is ``[final_start[b], its length)``; it merges the partial slots
    ``merge_ptr[b]:merge_ptr[b + 1]`` (each branch's slots are contiguous). With
    ``separate_merge`` the final ranges are chunks too and no final kernel runs; else each
    final-kernel program serves ``final_lanes`` branches (rows ``order[p * final_lanes:]``, the
    packed kernel, when above 1; row ``p`` otherwise), in a tile of ``final_block_m`` rows (the
    wide packed tile's where its lanes need it); ``common`` (``[programs, 3]`` int32, fields
    ``specializations.COMMON_FIELDS``; no rows unless some packed program shares a range): the
    range [start, end) each packed program's lanes share at the start of their final ranges
    (the same pages), read once for all of them through row ``lead_row``'s table, the lanes'
    ``final_start`` moved to its end (an empty range where start == end); ``heads_first``, per
    row tile: its partial launch's grid is (KV heads, items), so that each item's heads run
    together, not (items, KV heads), where its items' planned lengths differ
    (``heads_first_order`` in csrc/planner/planner.h); ``final_heads_first``: the final launch's
    grid is (head tiles, programs), each program's KV heads together (``final_heads_first``
    there); ``early_final``: each partial launch lets the launch after it start at its
    programs' start, not after their walks. ``as_paged_decode``:
    the plan has no partials (nothing computed, nothing split) and the planner chose the lanes,
    so its one launch is a paged decode: ``paged_decode``'s kernel, unsplit, over the plan's
    tables (``runs_as_paged_decode`` in csrc/planner/planner.h says why). ``stats``: node
    and computed-node counts, the chunk length, the cost model's estimate, partial programs."""
    order: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_rows: np.ndarray
    chunk_row_ptr: np.ndarray
    chunk_table_row: np.ndarray
    chunk_entry0: np.ndarray
    chunk_open: np.ndarray
    items: dict[int, np.ndarray]
    final_start: np.ndarray
    merge_ptr: np.ndarray
    entry_slot: np.ndarray
    common: np.ndarray
    num_entries: int
    separate_merge: bool
    final_lanes: int
    final_block_m: int
    heads_first: dict[int, bool]
    final_heads_first: bool
    early_final: bool
    as_paged_decode: bool
    stats: dict

    @property
    def has_common(self) -> bool:
        """Whether some packed final program reads a shared range (the COMMON final kernel)."""
        return self.common.size > 0

    def final_range_starts(self) -> np.ndarray:
        """Each row's final range start, its program's shared range included (where the
        final kernel's walk of the row begins)."""
        starts = self.final_start.copy()
        if self.common.size:
            shared = self.common[np.arange(self.order.size) // self.final_lanes]
            lanes = shared[:, 1] < shared[:, 2]
            starts[self.order[lanes]] = shared[lanes, 1]
        return starts


def plan(tree: SegmentTree, shape: Shape, options: PlanOptions | None = None) -> PlanArrays:
    """The work of one decode step over ``tree`` (planning only: no kernels picked, no block
    tables read), as a :class:`~flash_reasoning.TreeAttentionPlan` of that tree would make it.
    ``options`` forces the planner's choices. ``ValueError`` when the partials would overflow
    the kernels' int32 indexing, for forced lanes out of range, or for a broken tree."""
    options = options or PlanOptions()
    dtype = {2: "float16", 4: "float32", 8: "float64"}.get(shape.dtype_bytes, "float16")
    core_shape = {"num_qo_heads": shape.num_qo_heads, "num_kv_heads": shape.num_kv_heads,
                  "head_dim": shape.head_dim, "dtype": dtype, "block_size": 1, "num_blocks": 1,
                  "sm_scale": 0.0}
    try:
        core = _core.TreePlan(None, core_shape, tree, None, 0, options.core(), shape.num_sms)
    except _core.CoreError as err:
        raise ValueError(str(err)) from None
    return PlanArrays(**core.arrays)
