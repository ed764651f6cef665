"""SegmentTree: the tree of shared ranges, from the allocator's fork histories and from block
tables, and its checks."""
import random
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY_BLOCK, constant_rows, tiny_allocator
from flash_reasoning import _core
from flash_reasoning.allocator import PhysicalKVAllocator
from flash_reasoning.segment_tree import SegmentTree

BS = TINY_BLOCK


def write(alloc, bid, n, start=None):
    alloc.write(bid, 0, *constant_rows(n), start=alloc.length(bid) if start is None else start)


def nodes(tree):
    """(start, end, branch ids below) per node, in node order."""
    return [(int(s), int(e), sorted(tree.branch_ids[tree.rows_below(v)].tolist()))
            for v, (s, e) in enumerate(zip(tree.node_start, tree.node_end))]


def test_root_and_forks_at_a_block_boundary():
    alloc = tiny_allocator()
    root = alloc.alloc_branch(8)
    a = alloc.alloc_branch(10, parent_branch_id=root.branch_id)
    b = alloc.alloc_branch(11, parent_branch_id=root.branch_id)
    ids = [root.branch_id, a.branch_id, b.branch_id]
    tree = alloc.segment_tree(ids)
    assert nodes(tree) == [(0, 8, ids), (8, 10, [a.branch_id]), (8, 11, [b.branch_id])]
    assert tree.path(0).tolist() == [0] and tree.path(2).tolist() == [0, 2]
    assert tree.unique_tokens == 8 + 2 + 3 and tree.logical_tokens == 29


def test_fork_inside_a_block_shares_only_positions_before_it():
    alloc = tiny_allocator()
    root = alloc.alloc_branch(0)
    write(alloc, root.branch_id, 6)
    a = alloc.alloc_branch(5, parent_branch_id=root.branch_id, fork_position=5)
    ids = [root.branch_id, a.branch_id]
    assert nodes(alloc.segment_tree(ids)) == [(0, 5, ids), (5, 6, [root.branch_id])]
    write(alloc, a.branch_id, 1)  # copies the partial block: only [0, 4) is read once now
    assert nodes(alloc.segment_tree(ids)) == [(0, 4, ids), (4, 6, [root.branch_id]),
                                              (4, 6, [a.branch_id])]


def test_copy_on_write_ends_sharing_at_the_copied_block():
    alloc = tiny_allocator()
    root = alloc.alloc_branch(0)
    write(alloc, root.branch_id, 12)
    a = alloc.alloc_branch(12, parent_branch_id=root.branch_id)
    write(alloc, a.branch_id, 1, start=5)  # rewrites position 5: block 1 is copied
    ids = [root.branch_id, a.branch_id]
    assert nodes(alloc.segment_tree(ids)) == [(0, 4, ids), (4, 12, [root.branch_id]),
                                              (4, 12, [a.branch_id])]


def test_freed_parent_keeps_the_shared_segment():
    alloc = tiny_allocator()
    root = alloc.alloc_branch(0)
    write(alloc, root.branch_id, 7)
    kids = [alloc.alloc_branch(9, parent_branch_id=root.branch_id).branch_id
            for _ in range(2)]
    alloc.free_branch(root.branch_id)
    assert nodes(alloc.segment_tree(kids)) == [(0, 7, kids), (7, 9, kids[:1]),
                                               (7, 9, kids[1:])]


def test_unrelated_roots_form_a_forest():
    alloc = tiny_allocator()
    ids = [alloc.alloc_branch(5).branch_id, alloc.alloc_branch(0).branch_id,
           alloc.alloc_branch(3).branch_id]
    tree = alloc.segment_tree(ids)
    assert sorted(nodes(tree)) == [(0, 3, [ids[2]]), (0, 5, [ids[0]])]
    assert (tree.node_parent == -1).all() and tree.end_node[1] == -1


# ---- random trees vs a brute-force per-position check ----------------------------------

def random_forest(seed):
    """Random forks (at and inside blocks), writes and frees; returns the allocator and
    the fork history {branch: (parent, fork position)} of every branch ever made."""
    rng = random.Random(seed)
    alloc, history = tiny_allocator(num_blocks=256), {}
    for _ in range(rng.randint(1, 25)):
        live = alloc.live_branch_ids()
        action = rng.random()
        if not live or action < 0.15:
            bid = alloc.alloc_branch(rng.randint(0, 9)).branch_id
            history[bid] = (None, 0)
        elif action < 0.55:
            parent = rng.choice(live)
            p = rng.randint(0, alloc.length(parent))
            bid = alloc.alloc_branch(p + rng.randint(0, 6), parent_branch_id=parent,
                                     fork_position=p).branch_id
            history[bid] = (parent, p)
        elif action < 0.9:
            bid = rng.choice(live)
            write(alloc, bid, rng.randint(1, 6), start=rng.randint(0, alloc.length(bid)))
        elif len(live) > 1:
            alloc.free_branch(rng.choice(live))
    return alloc, history


def origin(history, bid, t):
    """The branch whose tokens position t of `bid` comes from (fork history only)."""
    parent, p = history[bid]
    while parent is not None and t < p:
        bid, (parent, p) = parent, history[parent]
    return bid


def brute_shared(alloc, history, a, b):
    """Tokens a and b share: same origin and same physical slot, for every earlier token."""
    tables, lengths = alloc.block_tables([a, b])
    shared = 0
    while (shared < min(lengths.tolist())
           and origin(history, a, shared) == origin(history, b, shared)
           and tables[0, shared // BS] == tables[1, shared // BS]):
        shared += 1
    return shared


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_match_brute_force(seed):
    alloc, history = random_forest(seed)
    ids = alloc.live_branch_ids()
    random.Random(seed).shuffle(ids)
    tree = alloc.segment_tree(ids)
    for i, a in enumerate(ids):
        path = tree.path(i)
        assert tree.node_end[path[-1]] == alloc.length(a) if len(path) else alloc.length(a) == 0
        for j, b in enumerate(ids):
            common = [v for v in path if v in set(tree.path(j).tolist())]
            depth = int(tree.node_end[common[-1]]) if common else 0
            assert depth == brute_shared(alloc, history, a, b), (a, b)
    for v in range(tree.num_nodes):
        below = set(tree.rows_below(v).tolist())
        assert below == {i for i in range(len(ids)) if v in tree.path(i).tolist()}
        parent = tree.node_parent[v]
        assert tree.node_len[v] > 0
        if parent >= 0:  # maximal: a child covers fewer branches than its parent
            assert parent < v and tree.node_end[parent] == tree.node_start[v]
            assert below < set(tree.rows_below(parent).tolist())


@pytest.mark.parametrize("seed", range(30))
def test_tree_from_block_tables_equals_the_allocators(seed):
    """The C ABI reads sharing from block tables alone; with every token written (no zero
    blocks) that must give the allocator's tree, node for node."""
    from flash_reasoning.tools.synthetic import random_branches
    alloc = PhysicalKVAllocator(600, BS, 1, 2, device="cpu")
    ids = random_branches(alloc, 1 + seed % 30, 1 + seed % 8, seed % 20, seed=seed,
                          roots=1 + seed % 3)
    ids_arr, rows = alloc._distinct_rows(ids)
    lengths = alloc._lengths[rows]
    breaks = alloc._breakpoints(ids_arr, lengths)
    by_keys = SegmentTree.from_keys(ids_arr, lengths, breaks,
                                    alloc._position_keys(ids_arr, rows, lengths, breaks))
    tables, _ = alloc.block_tables(ids)
    by_tables = SegmentTree.from_tables(ids_arr, lengths, tables.numpy(), BS)
    assert sorted(nodes(by_tables)) == sorted(nodes(by_keys))


# ---- the C++ trie against Python references -------------------------------------------

def same_trees(a, b):
    return all(np.array_equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


def trie_order(row_keys, terminal):
    """Rows stably sorted by their key sequences, each cut after its first terminal key
    (rows agreeing up to a terminal key are equal): the order the C++ trie gives."""
    def cut(keys):
        ends = [c for c, key in enumerate(keys) if terminal(key)]
        return tuple(keys[:ends[0] + 1] if ends else keys)
    return sorted(range(len(row_keys)), key=lambda i: cut(row_keys[i]))


@st.composite
def table_mirrors(draw):
    """(mirror, rows, lengths, block_size): a table mirror with spare rows and columns, read
    through distinct rows in any order; few block ids, so that rows share."""
    n, spare = draw(st.integers(0, 10)), draw(st.integers(0, 3))
    block_size, columns = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    cells = st.lists(st.integers(0, 3), min_size=columns + 1, max_size=columns + 1)
    mirror = np.array(draw(st.lists(cells, min_size=n + spare, max_size=n + spare)),
                      np.int64).reshape(n + spare, columns + 1)
    rows = np.array(draw(st.permutations(range(n + spare)))[:n], np.int64)
    lengths = np.array(draw(st.lists(st.integers(0, columns * block_size), min_size=n,
                                     max_size=n)), np.int64)
    return mirror, rows, lengths, block_size


@settings(max_examples=300, deadline=None)
@given(table_mirrors())
def test_tables_read_in_place_give_their_copys_tree(case):
    mirror, rows, lengths, bs = case
    ids = np.arange(rows.size) + 100
    in_place = SegmentTree.from_tables(ids, lengths, mirror, bs, rows)
    assert same_trees(in_place, SegmentTree.from_tables(ids, lengths, mirror[rows], bs))
    assert same_trees(in_place, SegmentTree.from_tables(ids, lengths,
                                                        mirror[rows].astype(np.int32), bs))


@settings(max_examples=300, deadline=None)
@given(table_mirrors())
def test_table_tree_matches_a_per_token_check(case):
    """Order: the stable sort of the rows' (block, tokens in it) keys; every two rows share
    exactly the tokens before their first different block (or the shorter one's end)."""
    mirror, rows, lengths, bs = case
    tree = SegmentTree.from_tables(np.arange(rows.size), lengths, mirror, bs, rows)
    tables = mirror[rows]
    columns = mirror.shape[1] - 1
    keys = [[(int(t[c]), min(bs, n - c * bs)) if n > c * bs else (-1, 0)
             for c in range(columns)] for t, n in zip(tables, lengths.tolist())]
    assert tree.order.tolist() == trie_order(keys, lambda key: key[1] < bs)
    for a in range(rows.size):
        for b in range(rows.size):
            shared = 0
            while (shared < min(lengths[a], lengths[b])
                   and tables[a, shared // bs] == tables[b, shared // bs]):
                shared += 1
            common = set(tree.path(a).tolist()) & set(tree.path(b).tolist())
            assert max((int(tree.node_end[v]) for v in common), default=0) == shared


@settings(max_examples=300, deadline=None)
@given(table_mirrors(), st.integers(0, 3))
def test_unwritten_block_is_found_in_any_row(case, block):
    """None exactly when some row holds `block` among the blocks holding its tokens."""
    mirror, rows, lengths, bs = case
    written = np.arange(mirror.shape[1]) * bs < lengths[:, None]
    holds = bool((mirror[rows][written] == block).any())
    tree = SegmentTree.from_tables(np.arange(rows.size), lengths, mirror, bs, rows,
                                   unwritten_block=block)
    assert (tree is None) == holds
    if tree is not None:
        assert same_trees(tree, SegmentTree.from_tables(np.arange(rows.size), lengths,
                                                        mirror, bs, rows))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_keyed_tree_order_is_the_stable_sort_of_the_keys(data):
    n = data.draw(st.integers(0, 10))
    lengths = np.array(data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)),
                       np.int64)
    extra = data.draw(st.lists(st.integers(0, 12), max_size=4))
    breaks = np.unique(np.concatenate([[0], lengths, extra])).astype(np.int64)
    keys = np.array([[data.draw(st.integers(0, 2)) if start < length else -1
                      for start in breaks.tolist()] for length in lengths.tolist()],
                    np.int64).reshape(n, breaks.size)
    arrays = _core.segment_tree(lengths, breaks, keys)
    assert arrays["order"].tolist() == trie_order(keys.tolist(), lambda key: key == -1)


def test_table_rows_are_checked():
    lengths, mirror = np.array([4, 4]), np.zeros((3, 2), np.int64)
    with pytest.raises(ValueError, match="rows must index"):
        SegmentTree.from_tables([0, 1], lengths, mirror, 2, np.array([0, 3]))
    with pytest.raises(ValueError, match="rows must be"):
        SegmentTree.from_tables([0, 1], lengths, mirror, 2, np.array([0]))
    with pytest.raises(ValueError, match="capacity"):
        SegmentTree.from_tables([0, 1], lengths, mirror, 1, np.array([0, 1]))


# ---- broken input is an error, never an abort -------------------------------------------------

@pytest.mark.parametrize("breaks, keys, match", [
    ([0, 8], [[1, -1], [1, -1]], "breaks must hold every row length"),   # 12 is missing
    ([0, 12, 8], [[1, -1, 2], [1, 2, -1]], "strictly increasing"),
    ([4, 8, 12], [[1, 2, -1], [1, 2, 3]], "breaks must start at 0"),
    ([0, 8, 12], [[1, 2, 3], [1, 2, 3]], "must be -1 exactly at and beyond"),
])
def test_keys_and_breaks_are_checked(breaks, keys, match):
    """The trie reads keys by break: breaks that miss a length, go backwards or do not start
    at 0, and keys that are not -1 exactly past a row's length, are refused (they aborted the
    process in the C++ core before)."""
    with pytest.raises(_core.CoreError, match=match):
        SegmentTree.from_keys([0, 1], np.array([8, 12]), np.array(breaks), np.array(keys))


def test_the_tree_keeps_its_own_ids():
    """Engines refill id buffers in place: a tree (and a plan made from it) keeps the ids it
    was built for, read-only."""
    alloc = tiny_allocator()
    ids = np.array([alloc.alloc_branch(5).branch_id for _ in range(2)])
    tree = alloc.segment_tree(ids)
    ids[:] = [7, 8]
    assert tree.branch_ids.tolist() == [0, 1] and not tree.branch_ids.flags.writeable
