"""Requested tree shapes (tools.trees): FastTree files, level lists, and building their
branches in an allocator."""

import numpy as np
import pytest
import torch

from conftest import TINY_BLOCK, constant_rows, tiny_allocator
from flash_reasoning.allocator import PhysicalKVAllocator
from flash_reasoning.tools.bench import load_cases
from flash_reasoning.tools.trees import TreeSpec, build_branches, from_levels, load_fasttree

BS = TINY_BLOCK


# ---- tree specs -------------------------------------------------------------------------

def test_load_fasttree(tmp_path):
    path = tmp_path / "tree.txt"
    path.write_text("5\n-1 0 50 2\n0 1 100 2\n0 2 100 0\n1 3 150 0\n1 4 150 0\n")
    spec = load_fasttree(path)
    assert spec.parent.tolist() == [-1, 0, 0, 1, 1]
    assert spec.leaves().tolist() == [2, 3, 4]
    assert (spec.unique_tokens, spec.logical_tokens) == (550, 150 + 300 + 300)


@pytest.mark.parametrize("text, match", [
    ("3\n-1 0 8 1\n0 1 4 0\n", "header says 3"),
    ("-1 0 8 2\n0 1 4 0\n", "declares 2 children"),
    ("-1 0 8 1\n0 2 4 0\n", "ids must be 0..1"),
    ("-1 0 8\n", "parent id seqlen num_children"),
    ("-1 0 x 0\n", "non-integer"),
])
def test_load_fasttree_rejects_bad_files(tmp_path, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_fasttree(path)


def test_tree_spec_rejects_cycles():
    with pytest.raises(ValueError, match="cycle"):
        TreeSpec(np.array([1, 0]), np.array([1, 1]))


def test_from_levels_parents():
    spec = from_levels([1, 2, 4], [8, 4, 2])
    assert spec.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert spec.node_start().tolist() == [0, 8, 8, 12, 12, 12, 12]


def bench_shapes():
    cases = load_cases()["cases"]  # the cases file the package ships
    shapes = {}
    for case in cases:
        key = (tuple(case["nodes_per_level"]), tuple(case["tokens_per_level"]))
        shapes[key] = (case["unique_tokens"], case["logical_tokens"], case["branches"])
    return sorted(shapes.items())


@pytest.mark.parametrize("shape, expected", bench_shapes())
def test_bench_cases_token_counts(shape, expected):
    spec = from_levels(*shape)
    unique, logical, branches = expected
    assert (spec.unique_tokens, spec.logical_tokens) == (unique, logical)
    # Nothing is written, so no data block is used; the pool is only as large as a branch may be.
    longest = int((spec.node_start() + spec.seqlen).max())
    alloc = PhysicalKVAllocator(1 + -(-longest // 16), 16, 1, 2, dtype=torch.float32,
                                device="cpu")
    leaves = build_branches(alloc, spec)
    assert len(leaves) == branches and alloc.live_branch_ids() == sorted(leaves)
    tree = alloc.segment_tree(leaves)
    assert (tree.unique_tokens, tree.logical_tokens) == (unique, logical)
    only_children = sum(len(kids) == 1 for kids in spec.children())  # merged into parents
    assert tree.num_nodes == spec.num_nodes - only_children


def test_build_branches_fills_shared_content():
    spec = from_levels([1, 3], [6, 2])  # forks at 6, inside a block
    alloc = tiny_allocator()
    fill = lambda node, layer, n: constant_rows(n, float(node + 1))  # noqa: E731
    leaves = build_branches(alloc, spec, fill=fill)
    for i, bid in enumerate(leaves):
        tables, lengths = alloc.block_tables([bid])
        pos = torch.arange(int(lengths[0]))
        k = alloc.k_pools[0].reshape(-1, 1, 2)[tables[0, pos // BS].long() * BS + pos % BS]
        assert k[:, 0, 0].tolist() == [1.0] * 6 + [i + 2.0] * 2
    # Block 0 is shared; each leaf copied the partial block 1 (positions 4..7) on write.
    assert alloc.memory_report().tokens_physical == 4 + 3 * 4
