"""The tree-attention planner: from a segment tree to what each kernel program computes.

Every node of the :class:`~flash_reasoning.tree.SegmentTree` is either *computed* once for all
the branches below it (its KV read once, one fp32 partial per branch written and merged later)
or *folded* into its consumers (its children and the branches ending at it), which then read
its tokens as part of their own range. The cost model folds a node when re-reading its KV costs
less than the partials it would write; an exclusive leaf always folds into its branch.

Each branch ends with a *final range* (what is left of its path after the computed nodes, read
through its own block table): the final kernel computes it, merges the branch's partials along
its path and writes the output. Long ranges (computed nodes and final ranges) are cut into
chunks so the grid fills the GPU; every chunk but a final range's last one becomes a partial
work item, tiled over its (branch, query head) rows.

Vectorised numpy throughout, except one loop over tree depth for the folding decisions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import dispatch
from .specializations import TREE_ITEM_FIELDS
from .tree import SegmentTree

#: Re-read KV of a folded node costs this fraction of an HBM byte: its consumers run close
#: together in the grid, so most re-reads hit L2.
REREAD_WEIGHT = 0.5
#: A chunk shorter than this costs more in partials than its parallelism gains.
MIN_CHUNK_TOKENS = 256
#: Programs per SM the chunking aims for.
WAVES = 2
#: Chunk boundaries fall on multiples of the kernels' KV tile.
CHUNK_ALIGN = 64


@dataclass(frozen=True)
class Shape:
    """What the planner needs to know about the attention call and the GPU."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_sms: int

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def partial_bytes_per_row(self) -> int:
        """One branch's fp32 partial (output and LSE of every head), written then read."""
        return 2 * self.num_qo_heads * (self.head_dim + 1) * 4


@dataclass
class PlanArrays:
    """A plan on the host. Chunk ``c`` covers tokens ``[chunk_start[c], chunk_end[c])`` read
    through block-table row ``chunk_table_row[c]``, for the rows
    ``order[chunk_row_ptr[c]:chunk_row_ptr[c] + chunk_rows[c]]``, whose partials are entries
    ``chunk_entry0[c] + j``, stored in partial slot ``entry_slot[entry]``. ``items[block_m]``
    are the int32 records of ``tree_partial`` (fields ``TREE_ITEM_FIELDS``). Branch (row)
    ``b``'s final range is ``[final_start[b], its length)``; it merges the partial slots
    ``merge_ptr[b]:merge_ptr[b + 1]`` (each branch's slots are contiguous)."""
    order: np.ndarray
    chunk_start: np.ndarray
    chunk_end: np.ndarray
    chunk_rows: np.ndarray
    chunk_row_ptr: np.ndarray
    chunk_table_row: np.ndarray
    chunk_entry0: np.ndarray
    items: dict[int, np.ndarray]
    final_start: np.ndarray
    merge_ptr: np.ndarray
    entry_slot: np.ndarray
    num_entries: int
    stats: dict = field(default_factory=dict)


# ---- the cost model: small pure functions ----------------------------------------------------

def fold_into_consumers(consumers: np.ndarray, eff_len: np.ndarray, rows: np.ndarray,
                        shape: Shape) -> np.ndarray:
    """Fold a node when its consumers re-reading its KV costs less than the partials of
    computing it once (one per row below it, written and read back)."""
    reread = (consumers - 1) * eff_len * (shape.kv_bytes_per_token * REREAD_WEIGHT)
    return reread < rows * shape.partial_bytes_per_row


def tile_rows(flat_rows: np.ndarray) -> np.ndarray:
    """The ``tree_partial`` tile (BLOCK_M) of nodes with these many (branch, head) rows."""
    small = dispatch.TREE_BLOCK_MS[0]
    return np.where(flat_rows <= small, small, dispatch.TREE_BLOCK_MS[1])


def chunk_tokens(programs: np.ndarray, lengths: np.ndarray, shape: Shape) -> int:
    """Tokens per program that spread all the work over ``WAVES`` programs per SM."""
    work = int((programs * lengths).sum())
    return max(MIN_CHUNK_TOKENS, math.ceil(work / (WAVES * shape.num_sms)))


def chunk_length(lengths: np.ndarray, target: int) -> np.ndarray:
    """Chunk length of each range: about ``target``, a multiple of CHUNK_ALIGN."""
    pieces = np.maximum(1, np.rint(lengths / target)).astype(np.int64)
    per_piece = -(-lengths // pieces)
    return np.maximum(CHUNK_ALIGN, -(-per_piece // CHUNK_ALIGN) * CHUNK_ALIGN)


# ---- the plan ------------------------------------------------------------------------------

def plan(tree: SegmentTree, shape: Shape, target_chunk: int | None = None) -> PlanArrays:
    """The work of one decode step over ``tree`` (``target_chunk`` overrides the chunking,
    for tuning)."""
    n = tree.branch_ids.size
    fold, eff_start = _fold_decisions(tree, shape)
    computed = np.flatnonzero(~fold)
    final_start = _final_starts(tree, fold, eff_start)

    # Ranges: computed nodes first, then each branch's final range.
    lo = np.concatenate([eff_start[computed], final_start])
    hi = np.concatenate([tree.node_end[computed], tree.lengths]).astype(np.int64)
    rows = np.concatenate([tree.node_hi[computed] - tree.node_lo[computed],
                           np.ones(n, np.int64)])
    inverse_order = np.empty(n, np.int64)
    inverse_order[tree.order] = np.arange(n)
    row_ptr = np.concatenate([tree.node_lo[computed], inverse_order])
    table_row = np.concatenate([tree.order[tree.node_lo[computed]], np.arange(n)])
    block_m = tile_rows(rows * shape.group)
    programs = -(-rows * shape.group // block_m) * shape.num_kv_heads

    length = hi - lo
    target = target_chunk or chunk_tokens(programs, length, shape)
    step = chunk_length(length, target)
    pieces = np.maximum(1, -(-length // step))
    is_final = np.arange(lo.size) >= computed.size
    # A final range's last chunk is the final kernel's: only the others become partials.
    partial_pieces = pieces - is_final
    final_start = (lo + (pieces - 1) * step)[is_final]

    chunk_range = np.repeat(np.arange(lo.size), partial_pieces)
    within = np.arange(chunk_range.size) - np.repeat(np.cumsum(partial_pieces)
                                                     - partial_pieces, partial_pieces)
    c_start = lo[chunk_range] + within * step[chunk_range]
    c_end = np.minimum(c_start + step[chunk_range], hi[chunk_range])
    c_rows = rows[chunk_range]
    c_entry0 = np.cumsum(c_rows) - c_rows
    num_entries = int(c_rows.sum())
    if num_entries * shape.num_qo_heads >= 2**31:  # the kernels index partials in int32
        raise ValueError(f"the plan needs {num_entries} partials of {shape.num_qo_heads} "
                         "heads: too many for one step; split the branches over calls")
    merge_ptr, entry_slot = _merge_slots(tree.order, row_ptr[chunk_range], c_rows,
                                         num_entries, n)
    arrays = PlanArrays(
        order=tree.order.astype(np.int32), chunk_start=c_start, chunk_end=c_end,
        chunk_rows=c_rows, chunk_row_ptr=row_ptr[chunk_range],
        chunk_table_row=table_row[chunk_range], chunk_entry0=c_entry0, items={},
        final_start=final_start.astype(np.int32), merge_ptr=merge_ptr,
        entry_slot=entry_slot, num_entries=num_entries)
    arrays.items = _items(arrays, block_m[chunk_range], shape.group)
    arrays.stats = {"nodes": tree.num_nodes, "computed_nodes": int(computed.size),
                    "chunk_tokens": int(target), "partial_chunks": int(chunk_range.size),
                    "entries": num_entries,
                    "partial_programs": {bm: int(a.shape[0]) * shape.num_kv_heads
                                         for bm, a in arrays.items.items()}}
    return arrays


def _depths(parent: np.ndarray) -> np.ndarray:
    """Depth of each node (roots 0), by pointer jumping: O(log depth) vector steps."""
    depth = (parent >= 0).astype(np.int64)
    up = parent.copy()
    while (up >= 0).any():
        has = up >= 0
        depth = np.where(has, depth + depth[np.where(has, up, 0)], depth)
        up = np.where(has, up[np.where(has, up, 0)], -1)
    return depth


def _fold_decisions(tree: SegmentTree, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """Top-down: whether each node folds, and where its range starts once its folded
    ancestors are prepended (``eff_start``)."""
    count = tree.num_nodes
    parent = tree.node_parent
    children = np.bincount(parent[parent >= 0], minlength=count)
    ending = np.bincount(tree.end_node[tree.end_node >= 0], minlength=count)
    rows = tree.node_hi - tree.node_lo
    fold = np.zeros(count, bool)
    eff_start = tree.node_start.astype(np.int64)
    depth = _depths(parent)
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[by_depth], np.arange(int(depth.max(initial=-1)) + 2))
    for level in range(bounds.size - 1):
        nodes = by_depth[bounds[level]:bounds[level + 1]]
        up = parent[nodes]
        inherit = (up >= 0) & fold[np.where(up >= 0, up, 0)]
        eff_start[nodes] = np.where(inherit, eff_start[np.where(inherit, up, 0)],
                                    tree.node_start[nodes])
        fold[nodes] = fold_into_consumers(children[nodes] + ending[nodes],
                                          tree.node_end[nodes] - eff_start[nodes],
                                          rows[nodes], shape)
    return fold, eff_start


def _final_starts(tree: SegmentTree, fold: np.ndarray, eff_start: np.ndarray) -> np.ndarray:
    """Where each branch's final range starts: its end node's folded range, or its length
    when that node is computed (nothing left to read). Empty branches start at 0."""
    end = tree.end_node
    if not tree.num_nodes:
        return np.zeros(end.size, np.int64)
    safe = np.where(end >= 0, end, 0)
    start = np.where(fold[safe], eff_start[safe], tree.lengths)
    return np.where(end >= 0, start, 0).astype(np.int64)


def _merge_slots(order: np.ndarray, chunk_row_ptr: np.ndarray, chunk_rows: np.ndarray,
                 num_entries: int, num_branches: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots that make each branch's partials contiguous: entry ``chunk_entry0[c] + j``
    belongs to row ``order[chunk_row_ptr[c] + j]``; returns (per-branch slot ranges as a
    CSR pointer, slot of each entry)."""
    first = np.cumsum(chunk_rows) - chunk_rows
    within = np.arange(num_entries) - np.repeat(first, chunk_rows)
    owner = order[np.repeat(chunk_row_ptr, chunk_rows) + within]
    slot = np.empty(num_entries, np.int32)
    slot[np.argsort(owner, kind="stable")] = np.arange(num_entries, dtype=np.int32)
    ptr = np.zeros(num_branches + 1, np.int32)
    np.cumsum(np.bincount(owner, minlength=num_branches), out=ptr[1:])
    return ptr, slot


def _items(arrays: PlanArrays, chunk_block_m: np.ndarray, group: int) -> dict[int, np.ndarray]:
    """The ``tree_partial`` records of each tile size: one per (chunk, row tile)."""
    tiles = -(-arrays.chunk_rows * group // chunk_block_m)
    chunk = np.repeat(np.arange(tiles.size), tiles)
    tile = np.arange(chunk.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    fields = {"table_row": arrays.chunk_table_row[chunk], "kv_start": arrays.chunk_start[chunk],
              "kv_end": arrays.chunk_end[chunk], "row_ptr": arrays.chunk_row_ptr[chunk],
              "num_rows": arrays.chunk_rows[chunk],
              "first_flat_row": tile * chunk_block_m[chunk],
              "entry0": arrays.chunk_entry0[chunk], "unused": np.zeros(chunk.size, np.int64)}
    records = np.stack([fields[name] for name in TREE_ITEM_FIELDS], axis=1).astype(np.int32)
    return {int(bm): records[chunk_block_m[chunk] == bm] for bm in np.unique(chunk_block_m)}
