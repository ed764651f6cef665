"""The tree-attention planner's input, options and output.

The planner cuts a :class:`~flash_reasoning.segment_tree.SegmentTree` into work: each node
*computed* once for the branches below it (a partial per branch, merged later) or *folded* into
its consumers; long ranges cut into chunks (partial work items over tiles of (branch, head)
rows); each branch's *final range* walked, and its partials merged, by the final kernel, or
everything chunked and merged by a separate merge kernel; final programs packed with several
branches (*lanes*), reading their lanes' *shared range* once; the whole tree *flat* where the
cost model finds that faster. ``docs/algorithm.md`` describes it.

The planner is C++ (``csrc/planner/planner.cc``), and so is the plan that lists a tree's
launches (``csrc/ops/tree_attention_plan.cc``): Python's ``TreeAttentionPlan`` and the C ABI plan
and launch through the same code. :func:`plan` plans without kernels (tests, tools).
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
_TRISTATE = ("separate_merge", "flat", "one_tile", "early_final", "host_nodes", "slot_runs",
             "query_tiles", "sequence_folds")


@dataclass(frozen=True)
class PlanOptions:
    """The planner's choices forced, for tests, the tuner and comparisons (not the public
    API): the fields of ``PlanOptions`` in csrc/planner/planner.h, ``None`` leaving each to the
    cost model. ``target_chunk``: tokens per chunk; ``separate_merge``; ``flat`` (every node
    folded; ``False`` keeps the cost model's folds); ``final_lanes`` (1 to the wide final
    tile's rows over the GQA group); ``one_tile`` (every item in the wide tile, or each in its
    own); ``early_final`` (the last launch starts at the partial launch's start); ``host_nodes``
    (``False``: every computed node has items of its own); ``slot_runs`` (``False``: the page
    kernels only); ``query_tiles`` (a several-query plan as query tiles, or never; by default
    where its tiles are full enough and no tree choice is forced: ``query_tiles_win`` in
    csrc/planner/planner.h); ``query_block`` (a several-query tree plan's rows rounded to it:
    ``ops.tree_attention.QUERY_BLOCK``); ``sequence_folds`` (a several-query tree plan's short
    nodes that only one branch's queries read folded into their final ranges, or never; by
    default where that plan estimates faster: ``kSequenceFoldTokens`` there). ``arch`` and
    ``num_sms`` plan a CPU allocator's launches for that arch and SM count (the interpreter),
    or a GPU plan for another SM count."""
    target_chunk: int | None = None
    separate_merge: bool | None = None
    flat: bool | None = None
    final_lanes: int | None = None
    one_tile: bool | None = None
    early_final: bool | None = None
    host_nodes: bool | None = None
    slot_runs: bool | None = None
    query_tiles: bool | None = None
    sequence_folds: bool | None = None
    query_block: int | None = None
    arch: str | None = None
    num_sms: int | None = None

    def __post_init__(self) -> None:
        for name in _TRISTATE:
            value = getattr(self, name)
            if value is not None and type(value) is not bool:
                raise TypeError(f"{name} must be True, False or None, got {value!r}")
        for name in ("target_chunk", "final_lanes", "num_sms", "query_block"):
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
    tables (``runs_as_paged_decode`` in csrc/planner/planner.h says why). ``draft_masks``
    (int64 ``[rows, 2]``, no rows in a plan without drafts): each row's last
    ``draft_masks[b, 0]`` tokens are draft tokens, read in its final range where bit k of
    ``draft_masks[b, 1]`` allows the k-th. ``query_tiles`` (``[tiles, 4]`` int32, fields
    ``specializations.QUERY_TILE_FIELDS``; no rows unless the plan runs as query tiles): rows
    ``first_row`` to ``first_row + rows - 1``, lanes of ``lane_rows`` consecutive queries of one
    sequence whose first ``shared`` tokens are the same slots, one ``tree_queries`` program per
    tile and KV head, each row over its whole sequence (the plan is flat, with no partials).
    ``stats``: node and computed-node counts, the chunk length, the cost model's estimate,
    partial programs."""
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
    draft_masks: np.ndarray
    query_tiles: np.ndarray
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


def plan(tree: SegmentTree, shape: Shape, options: PlanOptions | None = None,
         row_sequence: np.ndarray | None = None) -> PlanArrays:
    """The work of one decode step over ``tree`` (planning only: no kernels picked, no block
    tables read), as a :class:`~flash_reasoning.TreeAttentionPlan` of that tree would make it.
    ``options`` forces the planner's choices; ``row_sequence`` (int per row, rows of one
    sequence consecutive: several queries of a branch) lets query tiles group rows and a tree
    plan fold a node only one sequence reads (``PlanOptions.sequence_folds``).
    ``ValueError`` when the partials would overflow the kernels' int32 indexing, for forced
    lanes out of range, or for a broken tree."""
    options = options or PlanOptions()
    dtype = {2: "float16", 4: "float32", 8: "float64"}.get(shape.dtype_bytes, "float16")
    core_shape = {"num_qo_heads": shape.num_qo_heads, "num_kv_heads": shape.num_kv_heads,
                  "head_dim": shape.head_dim, "dtype": dtype, "block_size": 1, "num_blocks": 1,
                  "sm_scale": 0.0}
    core = _core.TreePlan(None, core_shape, tree, None, 0, options.core(), shape.num_sms,
                          row_sequence=row_sequence)  # refusals: _core.InvalidArgument
    return PlanArrays(**core.arrays)
