"""The tree-attention planner: from a segment tree to what each kernel program computes.

Every node of the :class:`~flash_reasoning.tools.trees.SegmentTree` is either *computed* once for all
the branches below it (its KV read once, one fp32 partial per branch written and merged later)
or *folded* into its consumers (its children and the branches ending at it), which then read
its tokens as part of their own range. The cost model folds a node when re-reading its KV costs
less than the partials it would write; an exclusive leaf always folds into its branch.

Each branch ends with a *final range* (what is left of its path after the computed nodes, read
through its own block table): the final kernel computes it, merges the branch's partials along
its path and writes the output. Long ranges (computed nodes and final ranges) are cut into
chunks so the grid fills the GPU; every chunk but a final range's last one becomes a partial
work item, tiled over its (branch, query head) rows. A final-kernel program walks its range's
KV tiles, then folds its branch's partials one after another; a plan where some program's walk
is ``SEPARATE_MERGE_STEPS`` long, and whose final launch is too small to fill the GPU,
*merges separately* instead: every chunk of every final range
is a partial item (the last one *open*: it reads to its branch's length at run time), and a
merge kernel folds each (branch, head) row's partials in vectorised blocks; no final kernel
runs. A plan with no partials at all (nothing computed, nothing split) is a paged decode and
runs ``paged_decode``'s kernel. Where the GQA group leaves rows of the final kernel's tile
free, one final program serves ``final_lanes`` branches (1, or a power of two from 4, while one
program per SM remains; beside a lone root of one program per SM, until every packed program fits two per
SM beside it, in the wide final tile's rows where the root is estimated to outlast the final
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

The planner itself is C++ (``csrc/core/planner.cc``), shared with the C ABI so that a C++
runtime plans exactly as Python does; this module describes its input and output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _core, dispatch
from .segment_tree import SegmentTree

#: The cost model's weight (csrc/core/planner.h, with its chunking constants): re-read KV of
#: a folded node costs this fraction of an HBM byte (most re-reads hit L2).
REREAD_WEIGHT = _core.REREAD_WEIGHT
#: Serial steps (KV tiles + partials) of a final-kernel program from which a plan merges
#: separately (csrc/core/planner.h).
SEPARATE_MERGE_STEPS = _core.SEPARATE_MERGE_STEPS


@dataclass(frozen=True)
class Shape:
    """What the planner needs to know about the attention call and the GPU."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_sms: int


@dataclass
class PlanArrays:
    """A plan on the host. Chunk ``c`` covers tokens ``[chunk_start[c], chunk_end[c])`` read
    through block-table row ``chunk_table_row[c]``, for the rows
    ``order[chunk_row_ptr[c]:chunk_row_ptr[c] + chunk_rows[c]]``, whose partials are entries
    ``chunk_entry0[c] + j``, stored in partial slot ``entry_slot[entry]``; an open chunk
    (``chunk_open[c]``) ends at its row's length at run time. ``items[block_m]`` are the int32
    records of ``tree_partial`` (fields ``TREE_ITEM_FIELDS``; views of ``work``). Branch (row)
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
    (``heads_first_order`` in csrc/core/planner.h); ``final_heads_first``: the final launch's
    grid is (head tiles, programs), each program's KV heads together (``final_heads_first``
    there); ``early_final``: each partial launch lets the launch after it start at its
    programs' start, not after their walks. ``as_paged_decode``:
    the plan has no partials (nothing computed, nothing split) and the planner chose the lanes,
    so its one launch is a paged decode: ``paged_decode``'s kernel, unsplit, over the plan's
    tables (``runs_as_paged_decode`` in csrc/core/planner.h says why). ``work``
    holds order, final_start, merge_ptr, entry_slot and each tile's items packed for one
    upload (common after entry_slot), list ``i`` from ``work_offsets[i]``."""
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
    work: np.ndarray
    work_offsets: np.ndarray
    separate_merge: bool
    final_lanes: int
    final_block_m: int
    heads_first: dict[int, bool]
    final_heads_first: bool
    early_final: bool
    as_paged_decode: bool
    stats: dict = field(default_factory=dict)

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


def plan(tree: SegmentTree, shape: Shape, target_chunk: int | None = None,
         reread_weight: float = REREAD_WEIGHT, separate_merge: bool | None = None,
         flat: bool | None = None, final_lanes: int | None = None,
         one_tile: bool | None = None, early_final: bool | None = None,
         host_nodes: bool | None = None) -> PlanArrays:
    """The work of one decode step over ``tree`` (``target_chunk``, ``reread_weight``,
    ``separate_merge``, ``flat``, ``final_lanes``, ``one_tile``, ``early_final`` and ``host_nodes``
    override the cost model, for tuning and tests; ``flat=False`` keeps the cost model's folds,
    ``True`` folds every node; ``final_lanes`` from 1 to the wide final tile's 32 rows over the
    GQA group; ``one_tile=True`` puts every item in the wide tile, ``False`` each in its own;
    ``early_final=True`` starts the last launch early even where the plan merges separately; a
    plan without partial launches never does; ``host_nodes=False`` gives every computed node items
    of its own, where the planner reads a node whose rows are whole row tiles of its nearest
    computed ancestor's in that ancestor's items). ``ValueError``
    when the partials would overflow the kernels' int32 indexing, or for lanes out of range."""
    if final_lanes is not None and (type(final_lanes) is not int or final_lanes < 1):
        raise ValueError(f"final_lanes must be a positive int or None, got {final_lanes!r}")
    try:
        raw = _core.plan(tree, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim,
                             shape.dtype_bytes, shape.num_sms, dispatch.TREE_BLOCK_MS,
                             dispatch.FINAL_WIDE_BLOCK_M,
                             target_chunk or 0, reread_weight,
                             _tristate(separate_merge), _tristate(flat),
                             final_lanes or 0, _tristate(one_tile), _tristate(early_final),
                             _tristate(host_nodes))
    except _core.CoreError as err:
        raise ValueError(str(err)) from None
    stats = {"nodes": tree.num_nodes, "computed_nodes": raw.pop("computed_nodes"),
             "chunk_tokens": raw.pop("chunk_tokens"), "estimated_us": raw.pop("estimated_us"),
             "partial_chunks": raw["chunk_start"].size,
             "entries": raw["num_entries"],
             "partial_programs": {bm: int(a.shape[0]) * shape.num_kv_heads
                                  for bm, a in raw["items"].items()}}
    return PlanArrays(**raw, stats=stats)


def item_runs(arrays: PlanArrays, tables: np.ndarray, rows: np.ndarray,
              block_size: int) -> dict[int, int]:
    """Per row tile of ``arrays.items``: how its partial launch may read the items, as the runs
    of consecutive slots the most scattered one lies in (1 or 2: the contiguous ``tree_partial``
    kernels; 0: the page kernels): each item closed, inside its row's shared ranges (blocks
    that stay put while the plan is valid) and broken at most once between pages. Where two
    runs, each item's ``run_split`` field is written in place (``arrays.items`` are views of
    ``arrays.work``: before the upload). Branch ``i``'s block table is ``tables[rows[i]]``
    (int64, host memory, read in place: ``PhysicalKVAllocator.host_tables``). The C ABI decides
    the same way (``csrc/core/planner.h``, ``item_runs``)."""
    return {block_m: _core.item_runs(records, arrays.final_start, tables, rows, block_size)
            for block_m, records in arrays.items.items()}


def _tristate(choice: bool | None) -> int:
    """The C++ options' encoding: -1 for the cost model's choice, else 0 or 1."""
    return -1 if choice is None else int(choice)
