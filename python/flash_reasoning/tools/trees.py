"""Requested tree shapes for benchmarks, tests and the demo: FastTree's tree files
(``parent id seqlen num_children`` per line) and level lists (the cases file), and
``build_branches``, which creates such a tree's branches in an allocator.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..allocator import PhysicalKVAllocator


@dataclass(frozen=True)
class TreeSpec:
    """A tree shape: node ``i`` holds ``seqlen[i]`` tokens after its parent's (``parent[i]``,
    ``-1`` for a root). Every leaf is one branch (root-to-leaf tokens)."""
    parent: np.ndarray
    seqlen: np.ndarray

    def __post_init__(self) -> None:
        parent, seqlen = np.asarray(self.parent, np.int64), np.asarray(self.seqlen, np.int64)
        if parent.ndim != 1 or parent.shape != seqlen.shape:
            raise ValueError(f"parent and seqlen must be 1-D of one length, got shapes "
                             f"{parent.shape} and {seqlen.shape}")
        if parent.size and (parent.min() < -1 or parent.max() >= parent.size):
            raise ValueError(f"parent ids must lie in [-1, {parent.size - 1}], got "
                             f"[{parent.min()}, {parent.max()}]")
        if (seqlen < 0).any():
            raise ValueError(f"seqlen must be >= 0, got {int(seqlen.min())}")
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "seqlen", seqlen)
        if self.topological_order().size != parent.size:
            raise ValueError("parent links form a cycle: not a tree")

    @property
    def num_nodes(self) -> int:
        return int(self.parent.size)

    def topological_order(self) -> np.ndarray:
        """Node indices, each after its parent (breadth first from the roots)."""
        children = self.children()
        order = [v for v in range(self.num_nodes) if self.parent[v] < 0]
        for v in order:  # grows while iterating: a BFS
            order.extend(children[v])
        return np.asarray(order, np.int64)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for v, p in enumerate(self.parent.tolist()):
            if p >= 0:
                kids[p].append(v)
        return kids

    def node_start(self) -> np.ndarray:
        """Token position where each node starts (the tokens of its ancestors)."""
        start = np.zeros(self.num_nodes, np.int64)
        for v in self.topological_order().tolist():
            p = self.parent[v]
            if p >= 0:
                start[v] = start[p] + self.seqlen[p]
        return start

    def leaves(self) -> np.ndarray:
        has_child = np.zeros(self.num_nodes, bool)
        has_child[self.parent[self.parent >= 0]] = True
        return np.flatnonzero(~has_child)

    @property
    def unique_tokens(self) -> int:
        return int(self.seqlen.sum())

    @property
    def logical_tokens(self) -> int:
        leaves = self.leaves()
        return int((self.node_start()[leaves] + self.seqlen[leaves]).sum())


def load_fasttree(path: str | Path) -> TreeSpec:
    """Read a FastTree tree file: an optional first line with the node count, then one
    ``parent id seqlen num_children`` line per node (``parent`` -1 for the root; ids
    0..n-1). ``num_children`` is checked against the parent links."""
    lines = [ln.split() for ln in Path(path).read_text().splitlines() if ln.strip()]
    declared = int(lines.pop(0)[0]) if lines and len(lines[0]) == 1 else None
    rows = [_parse_node_line(path, i, fields) for i, fields in enumerate(lines)]
    n = len(rows)
    if declared is not None and declared != n:
        raise ValueError(f"{path}: header says {declared} nodes, the file lists {n}")
    ids = sorted(r[1] for r in rows)
    if ids != list(range(n)):
        raise ValueError(f"{path}: node ids must be 0..{n - 1}, each once; got {ids}")
    parent, seqlen, declared_kids = (np.zeros(n, np.int64) for _ in range(3))
    for p, node, length, kids in rows:
        parent[node], seqlen[node], declared_kids[node] = p, length, kids
    spec = TreeSpec(parent, seqlen)
    actual = np.asarray([len(k) for k in spec.children()], np.int64)
    bad = np.flatnonzero(actual != declared_kids)
    if bad.size:
        v = int(bad[0])
        raise ValueError(f"{path}: node {v} declares {declared_kids[v]} children, "
                         f"{actual[v]} nodes name it as parent")
    return spec


def _parse_node_line(path, index: int, fields: list[str]) -> tuple[int, int, int, int]:
    if len(fields) != 4:
        raise ValueError(f"{path}: node line {index + 1} must be 'parent id seqlen "
                         f"num_children', got {' '.join(fields)!r}")
    try:
        p, node, length, kids = (int(f) for f in fields)
    except ValueError as err:
        raise ValueError(f"{path}: node line {index + 1} holds a non-integer: {fields}") from err
    return p, node, length, kids


def from_levels(nodes_per_level: Sequence[int], tokens_per_level: Sequence[int]) -> TreeSpec:
    """The benchmark trees: level ``i`` has ``nodes_per_level[i]`` nodes of
    ``tokens_per_level[i]`` tokens; node ``j`` of level ``i`` has parent
    ``(j * n_prev) // n_i`` of level ``i - 1``. Nodes are numbered level by level."""
    if len(nodes_per_level) != len(tokens_per_level) or not nodes_per_level:
        raise ValueError(f"nodes_per_level and tokens_per_level must be non-empty and of one "
                         f"length, got {list(nodes_per_level)} and {list(tokens_per_level)}")
    if min(nodes_per_level) < 1:
        raise ValueError(f"nodes_per_level must be >= 1 each, got {list(nodes_per_level)}")
    parents, seqlen, offset = [], [], 0
    for level, (n, tokens) in enumerate(zip(nodes_per_level, tokens_per_level)):
        prev = nodes_per_level[level - 1] if level else 0
        first_prev = offset - prev
        parents += [first_prev + (j * prev) // n if level else -1 for j in range(n)]
        seqlen += [tokens] * n
        offset += n
    return TreeSpec(np.asarray(parents, np.int64), np.asarray(seqlen, np.int64))


#: ``fill(node, layer, num_tokens) -> (k, v)``, each ``[num_tokens, num_kv_heads, head_dim]``.
Fill = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]


def build_branches(allocator: PhysicalKVAllocator, spec: TreeSpec,
                   fill: Fill | None = None) -> list[int]:
    """Create ``spec``'s branches in ``allocator``; returns the leaf branch ids (leaves in
    node order).

    Each node gets a branch ending at the node's last token, forked from its parent node's
    branch at the node's start; ``fill`` (optional) writes the node's own tokens in every
    layer before its children fork, so they share it. The branches of inner nodes are freed
    at the end: the leaves keep the shared blocks, their ``parent_id`` names dead branches.
    Unwritten tokens read zero (the allocator's zero block); no data block is used then.
    """
    start = spec.node_start()
    branch_of: dict[int, int] = {}
    for v in spec.topological_order().tolist():
        p, end = int(spec.parent[v]), int(start[v] + spec.seqlen[v])
        if p < 0:
            branch = allocator.alloc_branch(end)
        else:
            branch = allocator.alloc_branch(end, parent_branch_id=branch_of[p],
                                            fork_position=int(start[v]))
        branch_of[v] = branch.branch_id
        for layer in range(allocator.num_layers if fill is not None else 0):
            k, val = fill(v, layer, int(spec.seqlen[v]))
            allocator.write(branch.branch_id, layer, k, val, start=int(start[v]))
    leaves = spec.leaves()
    for v in sorted(set(branch_of) - set(leaves.tolist())):
        allocator.free_branch(branch_of[v])
    return [branch_of[v] for v in leaves.tolist()]
