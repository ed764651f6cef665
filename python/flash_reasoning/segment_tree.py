"""The segment tree of live branches: what the attention planner works on.

A node is a maximal token range ``[start, end)`` read from the same physical KV slots by the
same set of branches, so its KV can be read once for all of them. The allocator derives it
(``PhysicalKVAllocator.segment_tree``) from block tables, lengths and fork history; this
module turns per-position keys (or block tables) into the tree, through the C++ core that the
C ABI also uses (``csrc/planner/segment_tree.cc``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _core


@dataclass(frozen=True)
class SegmentTree:
    """Shared segments of a set of branches (row ``i`` = ``branch_ids[i]``).

    Nodes are numbered in DFS pre-order (a parent before its children). Node ``v`` covers
    tokens ``[node_start[v], node_end[v])``; its parent (``-1`` for a root: branches with no
    common prefix form a forest) ends where it starts. The rows below ``v`` are
    ``order[node_lo[v]:node_hi[v]]`` (contiguous, because ``order`` is a DFS order of the rows).
    Row ``i``'s path runs from a root to ``end_node[i]`` (the node ending at its length; ``-1``
    for an empty branch): ``path_nodes[path_ptr[i]:path_ptr[i + 1]]``. A branch may end at an
    inner node (another branch extends it). A tree of query rows (:func:`query_rows`) names a
    branch once per query.
    """
    branch_ids: np.ndarray
    lengths: np.ndarray
    node_start: np.ndarray
    node_end: np.ndarray
    node_parent: np.ndarray
    node_lo: np.ndarray
    node_hi: np.ndarray
    order: np.ndarray
    end_node: np.ndarray
    path_ptr: np.ndarray
    path_nodes: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def node_len(self) -> np.ndarray:
        return self.node_end - self.node_start

    @property
    def unique_tokens(self) -> int:
        """Tokens read once per step when every node is read once."""
        return int(self.node_len.sum())

    @property
    def logical_tokens(self) -> int:
        return int(self.lengths.sum())

    def rows_below(self, node: int) -> np.ndarray:
        """Rows (indices into ``branch_ids``) whose path contains ``node``."""
        return self.order[self.node_lo[node]:self.node_hi[node]]

    def path(self, row: int) -> np.ndarray:
        return self.path_nodes[self.path_ptr[row]:self.path_ptr[row + 1]]

    @classmethod
    def from_keys(cls, branch_ids: np.ndarray, lengths: np.ndarray, breaks: np.ndarray,
                  keys: np.ndarray) -> "SegmentTree":
        """The tree of rows whose token ``t`` is identified by ``keys[row, c]`` for
        ``breaks[c] <= t < breaks[c + 1]`` (``-1`` at and beyond the row's length).

        ``breaks`` must hold 0 and every row length, so that two rows share exactly the tokens
        before the first breakpoint where their keys differ (a trie over the rows, built by
        the C++ core that the C ABI also uses: ``csrc/planner/segment_tree.cc``).
        """
        arrays = _core.segment_tree(lengths, breaks, keys)
        return cls(branch_ids=own_ids(branch_ids), **arrays)

    @classmethod
    def from_tables(cls, branch_ids: np.ndarray, lengths: np.ndarray, tables: np.ndarray,
                    block_size: int, rows: np.ndarray | None = None,
                    unwritten_block: int | None = None) -> "SegmentTree | None":
        """The tree of rows holding ``lengths[i]`` tokens in blocks ``tables[rows[i]]``
        (default ``tables[i]``): rows listing the same block at the same column share its
        tokens, up to the shorter row's end. Read in place when ``tables`` is C-contiguous
        int64 (the allocator's table mirror). ``None`` when some row's tokens lie in
        ``unwritten_block`` (the allocator's zero block: reading it says nothing of sharing)."""
        arrays = _core.segment_tree_from_tables(lengths, tables, block_size, rows,
                                                    unwritten_block)
        return None if arrays is None else cls(branch_ids=own_ids(branch_ids), **arrays)


def query_rows(q_lens: np.ndarray, block: int = 1,
               masked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows of several query tokens per branch: branch ``i``'s ``q_lens[i]`` rows, in
    branch order, row ``j`` of them holding its first ``length_i - q_lens[i] + j + 1`` tokens
    (what its query ``j`` attends causally). Returns each row's branch index and the offset
    of its length from its branch's (``j + 1 - q_lens[i]``, at most 0), so that the rows
    follow their branches as they grow.

    ``block`` > 1 rounds each row's new tokens down to a multiple of ``block``
    (``(j + 1) // block * block``): the rows a plan is built on, so that the queries of a block
    share the new tokens before it as a node; each row then grows to its causal length at run
    time, into its plan's final range, as decode rows grow. ``masked`` (bool per branch):
    branches whose queries verify a draft under a mask: their rows hold the tokens before the
    new ones (offset ``-q_lens[i]``), whatever the block; the new tokens are each row's draft
    tokens, read as its mask allows."""
    counts = np.asarray(q_lens, np.int64)
    branch = np.repeat(np.arange(counts.size), counts)
    first = np.cumsum(counts) - counts
    new = (np.arange(branch.size) - first[branch] + 1) // block * block
    if masked is not None:
        new[np.asarray(masked, bool)[branch]] = 0
    return branch, new - counts[branch]


def own_ids(branch_ids) -> np.ndarray:
    """A read-only int64 copy of the caller's ids: engines refill their id buffers in place,
    and a tree (or a plan made from it) must keep naming the branches it was built for."""
    ids = np.array(branch_ids, dtype=np.int64, copy=True)
    ids.flags.writeable = False
    return ids
