"""PhysicalKVAllocator on CPU: a stateful model check, exhaustion, the seed quick start, bad
input."""
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import allocator_snapshot, assert_allocator_unchanged
from flash_reasoning.allocator import ZERO_BLOCK, PhysicalKVAllocator, PoolExhausted, UnknownBranch
from flash_reasoning.segment_tree import SegmentTree

BS, HEADS, DIM, LAYERS = 4, 1, 2, 2


def small_allocator(num_blocks=10, layers=LAYERS):
    return PhysicalKVAllocator(num_blocks, BS, HEADS, DIM, num_layers=layers,
                               dtype=torch.float32, device="cpu")


def token_rows(values):
    """K rows whose every element encodes the token's value (and V the negation); value 0
    (never written) gives zeros."""
    base = torch.tensor(values, dtype=torch.float32)[:, None, None]
    k = base + 0.25 * torch.arange(DIM, dtype=torch.float32) * (base != 0)
    return k.expand(len(values), HEADS, DIM).contiguous(), (-k).expand(
        len(values), HEADS, DIM).contiguous()


def gathered(alloc, branch_id, layer):
    """The branch's K/V read through its block table, positions 0..length-1."""
    tables, lengths = alloc.block_tables([branch_id])
    pos = torch.arange(int(lengths[0]))
    slots = tables[0, pos // BS].long() * BS + pos % BS
    k = alloc.k_pools[layer].reshape(-1, HEADS, DIM)[slots]
    v = alloc.v_pools[layer].reshape(-1, HEADS, DIM)[slots]
    return k, v


def check_invariants(alloc, model_lengths):
    ids = alloc.live_branch_ids()
    assert sorted(model_lengths) == ids
    held = np.zeros(alloc.num_blocks, np.int64)
    if ids:
        tables, lengths = alloc.block_tables(ids)
        assert lengths.tolist() == [model_lengths[b] for b in ids]
        for row, length in zip(tables.numpy(), lengths.tolist()):
            live = row[:-(-length // BS)]
            assert (row[live.size:] == ZERO_BLOCK).all()  # nothing held beyond the length
            np.add.at(held, live[live != ZERO_BLOCK], 1)
    assert np.array_equal(alloc._refcount, held)
    free = alloc._free[:alloc._free_top]
    assert len(set(free.tolist())) == free.size and ZERO_BLOCK not in free
    used = set(np.flatnonzero(held).tolist())
    assert used.isdisjoint(free.tolist())
    assert len(used) + free.size == alloc.num_blocks - 1
    report = alloc.memory_report()
    assert report.blocks_used == len(used) and report.blocks_free == free.size
    assert report.blocks_used + report.blocks_free == report.blocks_total
    assert report.tokens_logical == sum(model_lengths.values())
    assert report.bytes_saved == report.bytes_separate - report.bytes_used
    for pool in alloc._pools:
        assert not pool[ZERO_BLOCK].any()


def reference_segment_tree(alloc, branch_ids):
    """``segment_tree`` as it was before it read the table mirror in place: the rows' tables
    copied out, the zero-block check in numpy, then the tables' tree or the keys'."""
    ids, rows = alloc._distinct_rows(branch_ids)
    lengths = alloc._lengths[rows]
    columns = -(-int(lengths.max(initial=0)) // BS)
    tables = alloc._tables[rows, :columns]
    if not (tables[np.arange(columns) * BS < lengths[:, None]] == ZERO_BLOCK).any():
        event("segment tree from the tables")
        return SegmentTree.from_tables(ids, lengths, tables.astype(np.int32), BS)
    event("segment tree from the keys")
    breaks = alloc._breakpoints(ids, lengths)
    return SegmentTree.from_keys(ids, lengths, breaks,
                                 alloc._position_keys(ids, rows, lengths, breaks))


class AllocatorMachine(RuleBasedStateMachine):
    """Random forks (at and inside blocks), writes, decode steps, frees, prunes on a pool of 9
    data blocks; a shadow model holds each branch's tokens per layer (0 = never written)."""

    def __init__(self):
        super().__init__()
        self.alloc = small_allocator()
        self.tokens: dict[int, list[list[float]]] = {}  # branch -> per layer token values
        self.parent: dict[int, int | None] = {}         # fork history, dead branches too
        self.counter = 0

    def fresh(self, n):
        self.counter += n
        return list(range(self.counter - n + 1, self.counter + 1))

    def lengths(self):
        return {b: len(t[0]) for b, t in self.tokens.items()}

    def attempt(self, call, predicted_need=None):
        """Run a call; on PoolExhausted check it changed nothing. True when it succeeded."""
        before = allocator_snapshot(self.alloc)
        try:
            call()
        except PoolExhausted as err:
            event("pool exhausted")
            assert err.needed > err.free == self.alloc._free_top
            if predicted_need is not None:
                assert err.needed == predicted_need
            assert_allocator_unchanged(self.alloc, before)
            return False
        return True

    def need(self, pairs):
        """Blocks a write into (branch, column) pairs needs: zero-block entries, and shared
        blocks unless every holder writes them (then one keeps it)."""
        tables = self.alloc._tables
        refs = self.alloc._refcount
        writers: dict[int, int] = {}
        total = 0
        for bid, col in pairs:
            block = int(tables[self.alloc._row_of[bid], col]) if col < tables.shape[1] else 0
            if block == ZERO_BLOCK:
                total += 1
            elif refs[block] > 1:
                writers[block] = writers.get(block, 0) + 1
        return total + sum(w - (w == refs[b]) for b, w in writers.items())

    @rule(n=st.integers(0, 10))
    def root(self, n):
        branch = self.alloc.alloc_branch(n)
        self.tokens[branch.branch_id] = [[0.0] * n for _ in range(LAYERS)]
        self.parent[branch.branch_id] = None

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), boundary=st.booleans(), extra=st.integers(0, 6),
          count=st.sampled_from([None, 0, 1, 2, 3]))
    def fork(self, data, boundary, extra, count):
        """``count`` None: one ``alloc_branch``; else one ``alloc_branches(count, ...)``."""
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        length = len(self.tokens[parent][0])
        choices = [p for p in range(length + 1) if (p % BS == 0) == boundary] or [length]
        position = data.draw(st.sampled_from(choices))
        made = []
        if count is None:
            call = lambda: made.append(self.alloc.alloc_branch(  # noqa: E731
                position + extra, parent_branch_id=parent, fork_position=position))
        else:
            call = lambda: made.extend(self.alloc.alloc_branches(  # noqa: E731
                count, position + extra, parent_branch_id=parent, fork_position=position))
        if not self.attempt(call):
            return
        assert len(made) == (1 if count is None else count)
        first = made[0].branch_id if made else 0
        assert [c.branch_id for c in made] == list(range(first, first + len(made)))
        for child in made:
            assert (child.parent_id, child.fork_position, child.length) == (
                parent, position, position + extra)
            self.tokens[child.branch_id] = [t[:position] + [0.0] * extra
                                            for t in self.tokens[parent]]
            self.parent[child.branch_id] = parent

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), n=st.integers(1, 6))
    def write(self, data, layer, n):
        bid = data.draw(st.sampled_from(sorted(self.tokens)))
        length = len(self.tokens[bid][0])
        start = data.draw(st.integers(0, length))
        values = self.fresh(n)
        need = self.need([(bid, c) for c in range(start // BS, (start + n - 1) // BS + 1)])
        k, v = token_rows(values)
        if self.attempt(lambda: self.alloc.write(bid, layer, k, v, start=start), need):
            for layer_tokens in self.tokens[bid]:
                layer_tokens.extend([0.0] * max(0, start + n - length))
            self.tokens[bid][layer][start:start + n] = values

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), layers=st.lists(st.integers(0, LAYERS - 1), max_size=LAYERS,
                                          unique=True))
    def decode_step(self, data, layers):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                 unique=True))
        need = self.need([(b, len(self.tokens[b][0]) // BS) for b in ids])
        steps = []
        if not self.attempt(lambda: steps.append(self.alloc.reserve(ids)), need):
            return
        for bid in ids:
            for layer_tokens in self.tokens[bid]:
                layer_tokens.append(0.0)
        for layer in layers:
            values = self.fresh(len(ids))
            self.alloc.append(steps[0], layer, *token_rows(values))
            for bid, value in zip(ids, values):
                self.tokens[bid][layer][-1] = value

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        bid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.free_branch(bid)
        del self.tokens[bid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def prune(self, data):
        bid = data.draw(st.sampled_from(sorted(self.tokens)))
        doomed = {b for b in self.tokens if self.descends(b, bid)}
        assert sorted(self.alloc.prune(bid)) == sorted(doomed)
        for b in doomed:
            del self.tokens[b]

    def descends(self, bid, ancestor):
        while bid is not None and bid != ancestor:
            bid = self.parent[bid]
        return bid == ancestor

    @invariant()
    def consistent(self):
        check_invariants(self.alloc, self.lengths())

    @invariant()
    def segment_tree_matches_the_reference(self):
        ids = sorted(self.tokens, reverse=True)  # rows out of table order
        tree, reference = self.alloc.segment_tree(ids), reference_segment_tree(self.alloc, ids)
        for field in fields(SegmentTree):
            assert np.array_equal(getattr(tree, field.name), getattr(reference, field.name))

    @invariant()
    def contents_match_the_model(self):
        for bid, layers in self.tokens.items():
            for layer, values in enumerate(layers):
                expect_k, expect_v = token_rows(values) if values else (
                    torch.zeros(0, HEADS, DIM),) * 2
                k, v = gathered(self.alloc, bid, layer)
                assert torch.equal(k, expect_k) and torch.equal(v, expect_v), (bid, layer)


AllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase


# ---- targeted ---------------------------------------------------------------------------

def forked_family(alloc, children=6, prefix=6):
    root = alloc.alloc_branch(prefix)
    alloc.write(root.branch_id, 0, *token_rows(list(range(1, prefix + 1))))
    return root, [alloc.alloc_branch(prefix, parent_branch_id=root.branch_id).branch_id
                  for _ in range(children)]


def test_exhaustion_in_batched_step_changes_nothing():
    alloc = small_allocator(num_blocks=6, layers=1)  # 5 data blocks: 2 for the root
    _, kids = forked_family(alloc)
    before = allocator_snapshot(alloc)
    with pytest.raises(PoolExhausted) as info:
        alloc.append(kids, 0, *token_rows(list(range(100, 106))))
    # Six writers of the shared partial block (the root holds it too): six copies; 3 free.
    assert (info.value.needed, info.value.free) == (6, 3)
    assert "6" in str(info.value) and "3" in str(info.value)
    assert_allocator_unchanged(alloc, before)
    alloc.append(kids[:3], 0, *token_rows([7, 8, 9]))  # what fits still works
    check_invariants(alloc, {b: alloc.length(b) for b in alloc.live_branch_ids()})


def test_exhaustion_in_write_changes_nothing():
    alloc = small_allocator(num_blocks=3, layers=1)
    root = alloc.alloc_branch(0)
    before = allocator_snapshot(alloc)
    with pytest.raises(PoolExhausted) as info:
        alloc.write(root.branch_id, 0, *token_rows(list(range(3 * BS))))
    assert (info.value.needed, info.value.free) == (3, 2)
    assert_allocator_unchanged(alloc, before)


def test_last_holders_keep_a_shared_block():
    alloc = small_allocator(num_blocks=8, layers=1)
    root, kids = forked_family(alloc, children=2)
    alloc.free_branch(root.branch_id)
    used = alloc.memory_report().blocks_used
    alloc.append(kids, 0, *token_rows([50, 60]))
    assert alloc.memory_report().blocks_used == used + 1  # one copy, one keeps it
    assert gathered(alloc, kids[0], 0)[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 50]
    assert gathered(alloc, kids[1], 0)[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 60]


def test_growing_over_a_siblings_data_reads_zero():
    alloc = small_allocator(num_blocks=8)
    root = alloc.alloc_branch(0)
    alloc.write(root.branch_id, 0, *token_rows([1, 2, 3]))
    # Forking at 1 inside the block holding 2, 3: the child's positions 1..2 must read zero.
    child = alloc.alloc_branch(3, parent_branch_id=root.branch_id, fork_position=1)
    assert gathered(alloc, child.branch_id, 0)[0][:, 0, 0].tolist() == [1, 0, 0]
    short = alloc.alloc_branch(1, parent_branch_id=root.branch_id, fork_position=1)
    alloc.free_branch(root.branch_id)  # `short` now owns a block with data beyond it
    step = alloc.reserve([short.branch_id])
    alloc.append(step, 0, *token_rows([9]))  # layer 1 not written: reads zero
    assert gathered(alloc, short.branch_id, 0)[0][:, 0, 0].tolist() == [1, 9]
    assert gathered(alloc, short.branch_id, 1)[0][:, 0, 0].tolist() == [0, 0]


def test_seed_quick_start_on_cpu():
    alloc = PhysicalKVAllocator(num_blocks=1024, block_size=16, num_kv_heads=8, head_dim=128,
                                device="cpu")
    root = alloc.alloc_branch(num_tokens=2048)
    branches = [alloc.alloc_branch(2112, parent_branch_id=root.branch_id, fork_position=2048)
                for _ in range(256)]
    assert [b.length for b in branches[:2]] == [2112, 2112]
    report = alloc.memory_report()
    assert report.blocks_used == 0 and report.tokens_logical == 2048 + 256 * 2112
    ids = [b.branch_id for b in branches]
    tables, lengths = alloc.block_tables(ids)
    assert tables.shape == (256, 132) and tables.dtype == torch.int32
    assert lengths.dtype == torch.int32 and int(lengths[0]) == 2112
    k = torch.randn(256, 8, 128, dtype=torch.float16)
    alloc.append(ids, 0, k, k)
    assert alloc.memory_report().blocks_used == 256 and branches[0].length == 2113
    tree = alloc.segment_tree(ids)
    assert tree.unique_tokens == 2048 + 256 * 65


def test_block_tables_cache_tracks_changes():
    alloc = small_allocator(num_blocks=8, layers=1)
    _, kids = forked_family(alloc, children=2)
    first = alloc.block_tables(kids)
    assert alloc.block_tables(kids)[0] is first[0]
    alloc.append(kids, 0, *token_rows([7, 8]))
    tables, lengths = alloc.block_tables(kids)
    assert lengths.tolist() == [7, 7] and not torch.equal(tables, first[0])


def test_host_tables_are_the_block_tables_read_in_place():
    """What planning reads: the mirror itself (no copy), read-only, each branch's row in it
    holding block_tables' entries."""
    alloc = small_allocator(num_blocks=8, layers=1)
    _, kids = forked_family(alloc, children=2)
    alloc.append(kids, 0, *token_rows([7, 8]))
    mirror, rows = alloc.host_tables(kids[::-1])
    tables, _ = alloc.block_tables(kids[::-1])
    assert np.array_equal(mirror[rows, :tables.shape[1]], tables.cpu().numpy())
    assert not mirror.flags.writeable and mirror.base is not None
    with pytest.raises(ValueError):
        mirror[0, 0] = 1


def test_free_parent_keeps_children_valid():
    alloc = small_allocator(num_blocks=8, layers=1)
    root, kids = forked_family(alloc, children=2)
    alloc.free_branch(root.branch_id)
    assert not root.alive and alloc.branch(kids[0]).parent_id == root.branch_id
    assert gathered(alloc, kids[1], 0)[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(UnknownBranch, match=str(root.branch_id)):
        root.length


# ---- bad input: one rule each, state unchanged ------------------------------------------

def _family():
    alloc = small_allocator(num_blocks=8)
    root = alloc.alloc_branch(0)
    alloc.write(root.branch_id, 0, *token_rows([1, 2, 3, 4, 5]))
    child = alloc.alloc_branch(5, parent_branch_id=root.branch_id)
    return alloc, root.branch_id, child.branch_id


K1 = token_rows([1])


@pytest.mark.parametrize("call, error, match", [
    (lambda a, r, c: a.alloc_branch(4, parent_branch_id=99), UnknownBranch, "99"),
    (lambda a, r, c: a.alloc_branch(9, parent_branch_id=r, fork_position=6), ValueError,
     "fork_position must lie in \\[0, 5\\]"),
    (lambda a, r, c: a.alloc_branch(9, parent_branch_id=r, fork_position=-1), ValueError,
     "fork_position must be >= 0"),
    (lambda a, r, c: a.alloc_branch(3, parent_branch_id=r, fork_position=4), ValueError,
     "num_tokens .* >= fork_position=4"),
    (lambda a, r, c: a.alloc_branch(-1), ValueError, "num_tokens must be >= 0"),
    (lambda a, r, c: a.alloc_branch(2.5), TypeError, "num_tokens must be an int"),
    (lambda a, r, c: a.alloc_branch(2, fork_position=1), ValueError, "parent_branch_id"),
    (lambda a, r, c: a.alloc_branches(-1, 5, r), ValueError, "count must be >= 0"),
    (lambda a, r, c: a.alloc_branches(2.0, 5, r), TypeError, "count must be an int"),
    (lambda a, r, c: a.alloc_branches(2, 5, 99), UnknownBranch, "99"),
    (lambda a, r, c: a.alloc_branches(2, 3, r, 4), ValueError, "num_tokens .* >= fork_pos"),
    (lambda a, r, c: a.alloc_branches(7, 6, r, 3), PoolExhausted, "needs 7 free blocks"),
    (lambda a, r, c: a.write(r, 2, *K1), ValueError, "layer must lie in \\[0, 1\\]"),
    (lambda a, r, c: a.write(r, 0, *K1, start=6), ValueError, "start must lie in \\[0, 5\\]"),
    (lambda a, r, c: a.write(r, 0, K1[0].half(), K1[1].half()), TypeError, "torch.float32"),
    (lambda a, r, c: a.write(r, 0, K1[0][:, :, :1], K1[1]), ValueError, "shape"),
    (lambda a, r, c: a.write(r, 0, K1[0], [1.0]), TypeError, "v must be a torch.Tensor"),
    (lambda a, r, c: a.write(77, 0, *K1), UnknownBranch, "77"),
    (lambda a, r, c: a.reserve([r, r]), ValueError, "distinct"),
    (lambda a, r, c: a.reserve([r, 12]), UnknownBranch, "12"),
    (lambda a, r, c: a.reserve([[r]]), TypeError, "1-D sequence of ints"),
    (lambda a, r, c: a.reserve([float(r)]), TypeError, "1-D sequence of ints"),
    (lambda a, r, c: a.reserve([True]), TypeError, "1-D sequence of ints"),
    (lambda a, r, c: a.append([r], 0, *K1), ValueError, "reserve"),
    (lambda a, r, c: a.free_branch(5), UnknownBranch, "5"),
    (lambda a, r, c: a.prune(-1), UnknownBranch, "-1"),
    (lambda a, r, c: a.segment_tree([c, c]), ValueError, "distinct"),
    (lambda a, r, c: a.segment_tree([r, 12]), UnknownBranch, "12"),
    (lambda a, r, c: a.segment_tree([float(r)]), TypeError, "1-D sequence of ints"),
])
def test_bad_input_changes_nothing(call, error, match):
    alloc, root, child = _family()
    before = allocator_snapshot(alloc)
    with pytest.raises(error, match=match):
        call(alloc, root, child)
    assert_allocator_unchanged(alloc, before)


def test_stale_step_is_rejected():
    alloc, root, _ = _family()
    step = alloc.reserve([root])
    alloc.alloc_branch(0)  # a fork could now share the step's block
    before = allocator_snapshot(alloc)
    with pytest.raises(ValueError, match="stale"):
        alloc.append(step, 0, *K1)
    assert_allocator_unchanged(alloc, before)


def test_unknown_branch_is_a_key_error_naming_the_id():
    alloc = small_allocator()
    with pytest.raises(KeyError, match="branch_id 3 is not a live branch"):
        alloc.length(3)


def test_memory_report_counts_shared_tokens_once():
    alloc = small_allocator(num_blocks=8, layers=2)
    _, kids = forked_family(alloc, children=3)
    report = alloc.memory_report()
    per_token = 2 * HEADS * DIM * 4
    assert report.bytes_per_token_per_layer == per_token
    assert report.tokens_logical == 6 * 4 and report.tokens_physical == 6
    assert report.blocks_used == 2 and report.bytes_used == 2 * 2 * BS * per_token
    assert report.bytes_separate == 4 * 2 * 2 * BS * per_token
    assert report.to_dict()["bytes_saved"] == report.bytes_saved > 0


def _replay_history(device):
    """Forks inside and at block boundaries, prefill, batched appends (CoW of shared partial
    blocks), a prune: the same history on any device."""
    alloc = PhysicalKVAllocator(64, 16, 8, 128, num_layers=2, dtype=torch.float16,
                                device=device)
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return [torch.randn(n, 8, 128, generator=gen).half().to(device) for _ in range(2)]

    root = alloc.alloc_branch(num_tokens=0)
    for layer in range(2):
        alloc.write(root.branch_id, layer, *rows(40))
    kids = [alloc.alloc_branch(40, root.branch_id, p).branch_id for p in (40, 37, 32, 40)]
    for _ in range(5):
        step = alloc.reserve(kids)
        for layer in range(2):
            alloc.append(step, layer, *rows(len(kids)))
    alloc.prune(kids[-1])
    return alloc, kids[:-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_append_and_copy_on_write_match_cpu_path():
    cpu, ids = _replay_history("cpu")
    gpu, gpu_ids = _replay_history("cuda")
    assert ids == gpu_ids
    for branch_id in ids:
        for layer in range(2):
            for a, b in zip(gathered_any(cpu, branch_id, layer),
                            gathered_any(gpu, branch_id, layer)):
                assert torch.equal(a, b.cpu())


def gathered_any(alloc, branch_id, layer):
    from flash_reasoning.reference import gather_sequence
    tables, lengths = alloc.block_tables([branch_id])
    n = int(lengths[0])
    return (gather_sequence(alloc.k_pools[layer], tables[0], n),
            gather_sequence(alloc.v_pools[layer], tables[0], n))


def test_reserve_from_the_previous_step_matches_reserve_from_ids():
    by_ids, by_step = small_allocator(num_blocks=40), small_allocator(num_blocks=40)
    kids = [forked_family(alloc, children=3)[1] for alloc in (by_ids, by_step)]
    step = by_step.reserve(kids[1])
    by_ids.reserve(kids[0])
    for value in range(2, 9):  # crosses a block boundary: new blocks, copy-on-write
        rows = token_rows([value] * 3)
        by_ids.append(by_ids.reserve(kids[0]), 0, *rows)
        step = by_step.reserve(step)
        by_step.append(step, 0, *rows)
    for a, b in zip(*kids):
        assert torch.equal(gathered(by_ids, a, 0)[0], gathered(by_step, b, 0)[0])
    by_step.alloc_branch(0)  # the step's rows may now be stale
    before = allocator_snapshot(by_step)
    with pytest.raises(ValueError, match="stale"):
        by_step.reserve(step)
    assert_allocator_unchanged(by_step, before)
