"""Model-based fuzzing of the allocator and tree attention.

A hypothesis state machine draws allocator operations: roots, forks (at and inside blocks,
``count`` 0 included), decode steps (``reserve``, then ``append`` in some layers; the one-call
form; a held step reserved again or appended later; several tokens per branch in one step),
writes that extend or overwrite, truncations, frees, prunes, and calls that must fail (pool
exhaustion, lengths past ``max_tokens``, stale steps, bad input). It holds plans across them.
After every step it compares the allocator with :class:`Model`, an account of every branch's
tokens kept without the allocator: each branch's length and the K/V every position reads (bit
for bit, every layer), refcounts against the references in the live tables, the free count,
and attention (every held plan, right or ``StalePlan`` only when the tree changed or the
branches outgrew it, and a fresh plan) against the float64 reference from the model. Every
failed operation leaves the allocator bitwise unchanged, and a call that changes nothing keeps
the versions.

CPU: the PyTorch path after every step; a few examples plan for the kernels and run them in
Triton's interpreter at their end. GPU: the same machine and model with the real kernels,
``FLASH_REASONING_FUZZ_EXAMPLES`` examples (default 200) of larger shapes; the test prints
what it tried."""
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conftest import allocator_snapshot, assert_allocator_unchanged, gpu, interpreter, poisoned_like
from flash_reasoning import (
    PhysicalKVAllocator,
    PoolExhausted,
    StalePlan,
    TreeAttentionPlan,
    UnknownBranch,
    planner,
    reference,
)
from flash_reasoning.allocator import ZERO_BLOCK
from flash_reasoning.ops.tree_attention import MAX_DRAFT_TOKENS
from flash_reasoning.tools.synthetic import draft_tree_mask


@dataclass(frozen=True)
class Limits:
    """How large the drawn problems get."""
    head_dims: tuple
    block_sizes: tuple
    max_kv_heads: int
    max_group: int
    max_tokens: int        # per write
    max_blocks: int        # pool size (small pools exhaust, and reach max_tokens)
    target_chunks: tuple   # planner overrides (small ones force partials and merges)
    near_limit: int        # roots near max_tokens only where it is at most this
    max_branches: int      # live branches (roots and forks stop there)
    plan_branches: int     # branches in a checked plan (a random subset beyond)
    max_queries: int       # per branch, in the plans that take several (q_lens)
    examples: int
    steps: int             # operations per example


CPU = Limits(head_dims=(64,), block_sizes=(1, 2, 5, 16), max_kv_heads=2, max_group=4,
             max_tokens=40, max_blocks=120, target_chunks=(None, 16, 16), near_limit=200,
             max_branches=12, plan_branches=8, max_queries=16, examples=60, steps=30)
INTERPRETED = Limits(head_dims=(64,), block_sizes=(2, 5, 16), max_kv_heads=2, max_group=4,
                     max_tokens=30, max_blocks=60, target_chunks=(None, 16, 16),
                     near_limit=100, max_branches=8, plan_branches=6, max_queries=8, examples=20,
                     steps=15)
GPU = Limits(head_dims=(64, 128, 256), block_sizes=(1, 7, 16, 16), max_kv_heads=4,
             max_group=8, max_tokens=300, max_blocks=3000, target_chunks=(None, None, 16, 64),
             near_limit=5000, max_branches=64, plan_branches=64, max_queries=64, steps=30,
             examples=int(os.environ.get("FLASH_REASONING_FUZZ_EXAMPLES", "200")))


@dataclass
class Tally:
    examples: int = 0
    steps: int = 0
    attention: int = 0       # plan outputs checked against the reference
    stale: int = 0           # held plans found stale
    exhausted: int = 0
    refused: int = 0         # bad input, limits, stale steps: refused with nothing changed
    interpreted: int = 0     # plan outputs of the interpreted kernels
    query_rows: int = 0      # query rows checked in plans with several queries per branch
    draft_rows: int = 0      # of them, rows under a draft mask


class Model:
    """What each live branch reads, per layer: K and V rows ``[length, kv_heads, head_dim]``.
    Forks copy the parent's rows below the fork, growth reads zero, writes overwrite."""

    def __init__(self, alloc: PhysicalKVAllocator) -> None:
        self.alloc = alloc
        self.rows: dict[int, list[list[torch.Tensor]]] = {}  # id -> [layer][k or v]
        self.parent: dict[int, int | None] = {}               # every id ever, for prune

    def live(self) -> list[int]:
        return sorted(self.rows)

    def dead(self) -> list[int]:
        return sorted(set(self.parent) - set(self.rows))

    def add(self, bid: int, parent: int | None, position: int, length: int) -> None:
        a = self.alloc
        self.parent[bid] = parent
        if parent is None:
            empty = torch.zeros(0, a.num_kv_heads, a.head_dim, dtype=a.dtype)
            self.rows[bid] = [[empty, empty] for _ in range(a.num_layers)]
        else:
            self.rows[bid] = [[t[:position].clone() for t in kv] for kv in self.rows[parent]]
        self.grow(bid, length)

    def grow(self, bid: int, length: int) -> None:
        for kv in self.rows[bid]:
            for i, t in enumerate(kv):
                kv[i] = torch.cat([t, t.new_zeros(length - t.shape[0], *t.shape[1:])])

    def write(self, bid: int, layer: int, start: int, k, v) -> None:
        self.grow(bid, max(self.length(bid), start + k.shape[0]))
        for t, new in zip(self.rows[bid][layer], (k, v)):
            t[start:start + new.shape[0]] = new.cpu()

    def length(self, bid: int) -> int:
        return self.rows[bid][0][0].shape[0]

    def descendants(self, bid: int) -> set[int]:
        """``bid`` and every live branch forked from it or its descendants, dead or alive."""
        def under(b):
            while b is not None and b != bid:
                b = self.parent[b]
            return b == bid
        return {b for b in self.rows if under(b)}


@dataclass
class HeldStep:
    """A reserved decode step and the branches forked from or freed since (stale if any is
    one of its own)."""
    step: object
    ids: list[int]
    touched: set = field(default_factory=set)

    @property
    def stale(self) -> bool:
        return bool(self.touched.intersection(self.ids))


def make_plan(alloc, ids, num_qo_heads: int, knobs: dict, gen: torch.Generator,
              most: int) -> TreeAttentionPlan:
    """A plan with the planner's forcing knobs (a ``planner.PlanOptions``), one query per
    branch or :func:`some_q_lens`, with draft masks half the time."""
    q_lens = some_q_lens(alloc, ids, gen, most)
    return TreeAttentionPlan(alloc, ids, num_qo_heads, q_lens=q_lens,
                             mask=None if q_lens is None else some_masks(q_lens, gen),
                             _options=planner.PlanOptions(**knobs))


def some_q_lens(alloc, ids, gen: torch.Generator, most: int):
    """None (one query per branch) half the time, else 0 to ``most`` queries per branch (at
    most its length)."""
    if torch.randint(0, 2, (1,), generator=gen).item():
        return None
    return [int(torch.randint(0, min(n, most) + 1, (1,), generator=gen))
            for n in alloc.lengths(ids)]


def some_masks(q_lens, gen: torch.Generator):
    """None half the time, else per branch a random draft tree's mask, random bits or None (a
    branch of more than MAX_DRAFT_TOKENS queries: None)."""
    if torch.randint(0, 2, (1,), generator=gen).item():
        return None
    kinds = (lambda n: draft_tree_mask(n, gen), lambda n: torch.rand(n, n, generator=gen) < 0.5,
             lambda n: None)
    return [kinds[int(torch.randint(0, 3, (1,), generator=gen))](n) if n <= MAX_DRAFT_TOKENS
            else None for n in q_lens]


def interpreted_output(plan: TreeAttentionPlan, q: torch.Tensor, layer: int) -> torch.Tensor:
    """The plan's launches run by Triton's interpreter (a CPU plan that names an arch)."""
    from aot.interpret import run_interpreted
    alloc = plan.allocator
    plan.refresh()
    out = poisoned_like(q)
    run_interpreted(plan.launches(q, alloc.k_pools[layer], alloc.v_pools[layer], out))
    return out


class FuzzMachine(RuleBasedStateMachine):
    """One allocator's history; subclasses set LIMITS, DEVICE, INTERPRET and TALLY."""
    LIMITS = CPU
    DEVICE = "cpu"
    INTERPRET = False   # plan for sm90 and run the interpreted kernels at the end
    TALLY = Tally()

    @initialize(data=st.data())
    def setup(self, data):
        limits = self.LIMITS
        head_dim = data.draw(st.sampled_from(limits.head_dims), label="head_dim")
        self.alloc = PhysicalKVAllocator(
            num_blocks=data.draw(st.integers(2, limits.max_blocks), label="num_blocks"),
            block_size=data.draw(st.sampled_from(limits.block_sizes), label="block_size"),
            num_kv_heads=data.draw(st.integers(1, limits.max_kv_heads if head_dim < 256 else 2)),
            head_dim=head_dim, num_layers=data.draw(st.integers(1, 2), label="num_layers"),
            dtype=data.draw(st.sampled_from([torch.float16, torch.bfloat16])),
            device=self.DEVICE)
        self.model = Model(self.alloc)
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        self.num_qo_heads = self.alloc.num_kv_heads * data.draw(st.integers(1, limits.max_group))
        self.knobs = dict(
            target_chunk=data.draw(st.sampled_from(limits.target_chunks)),
            separate_merge=data.draw(st.sampled_from([None, False, True])),
            flat=data.draw(st.sampled_from([None, False, True])),
            final_lanes=data.draw(st.sampled_from([None, 1, 2, 4])),
            one_tile=data.draw(st.sampled_from([None, True])),
            query_block=data.draw(st.sampled_from([None, 1, 3, 8])),
            query_tiles=data.draw(st.sampled_from([None, False, True])),
            sequence_folds=data.draw(st.sampled_from([None, False, True])),
            **({"arch": "sm90", "num_sms": 4} if self.INTERPRET else {}))
        self.plans: list[tuple[TreeAttentionPlan, tuple]] = []  # (plan, tree_version built at)
        self.held: HeldStep | None = None
        self.TALLY.examples += 1

    # ---- helpers ------------------------------------------------------------------------

    def kv(self, n: int):
        shape = (n, self.alloc.num_kv_heads, self.alloc.head_dim)
        return [torch.randn(shape, generator=self.gen).to(self.alloc.dtype).to(self.DEVICE)
                for _ in range(2)]

    def attempt(self, action, refused=None) -> tuple[bool, object]:
        """(True, ``action()``), or (False, None) when the pool is exhausted; ``refused``
        (an exception type, or a (type, message fragment) pair) predicts that the call must
        fail so. Either failure must leave the allocator bitwise unchanged."""
        before = allocator_snapshot(self.alloc)
        if refused is not None:
            error, fragment = refused if isinstance(refused, tuple) else (refused, None)
            with pytest.raises(error, match=fragment):
                action()
            assert_allocator_unchanged(self.alloc, before)
            self.TALLY.refused += 1
            return False, None
        try:
            return True, action()
        except PoolExhausted as err:
            assert err.needed > err.free == self.alloc.memory_report().blocks_free
            assert_allocator_unchanged(self.alloc, before)
            self.TALLY.exhausted += 1
            return False, None

    def past_limit(self, length: int):
        """The refusal a growth to ``length`` must meet, or None."""
        if length > self.alloc.max_tokens:
            return ValueError, "a branch holds at most max_tokens"
        return None

    def touch(self, ids) -> None:
        """Branches forked from or freed: a held step of theirs is stale."""
        if self.held is not None:
            self.held.touched.update(ids)

    def pick(self, data, label="branch"):
        return data.draw(st.sampled_from(self.model.live()), label=label)

    def write_at(self, bid: int, layer: int, start: int, n: int) -> None:
        k, v = self.kv(n)
        overwrite = start < self.model.length(bid)
        version = self.alloc.tree_version
        done, _ = self.attempt(lambda: self.alloc.write(bid, layer, k, v, start=start),
                               self.past_limit(start + n))
        if done:
            self.model.write(bid, layer, start, k, v)
            assert (self.alloc.tree_version != version) == overwrite

    # ---- operations ---------------------------------------------------------------------

    @precondition(lambda self: len(self.model.rows) < self.LIMITS.max_branches)
    @rule(data=st.data(), unwritten=st.integers(0, 2), near_limit=st.booleans())
    def root(self, data, unwritten, near_limit):
        """A root, unwritten (reads zero) or near max_tokens, then written in every layer."""
        limit = self.alloc.max_tokens
        near_limit = near_limit and limit <= self.LIMITS.near_limit
        length = max(0, limit - unwritten) if near_limit else unwritten
        done, branch = self.attempt(lambda: self.alloc.alloc_branch(length),
                                    self.past_limit(length))
        if not done:
            return
        self.model.add(branch.branch_id, None, 0, length)
        written = data.draw(st.integers(0, self.LIMITS.max_tokens), label="written")
        for layer in range(self.alloc.num_layers):
            self.write_at(branch.branch_id, layer, length, written)

    @precondition(lambda self: 0 < len(self.model.rows) < self.LIMITS.max_branches)
    @rule(data=st.data(), boundary=st.booleans(), count=st.integers(0, 4),
          extra=st.integers(0, 3))
    def fork(self, data, boundary, count, extra):
        count = min(count, self.LIMITS.max_branches - len(self.model.rows))
        parent = self.pick(data, "parent")
        length = self.model.length(parent)
        bs = self.alloc.block_size
        choices = [p for p in range(length + 1) if (p % bs == 0) == boundary] or [length]
        position = data.draw(st.sampled_from(choices), label="position")
        version = self.alloc.tree_version, self.alloc.table_version
        done, kids = self.attempt(lambda: self.alloc.alloc_branches(count, position + extra,
                                                                     parent, position),
                                  self.past_limit(position + extra))
        if not done:
            return
        assert len(kids) == count
        if count == 0:  # changes nothing, held plans stay valid
            assert (self.alloc.tree_version, self.alloc.table_version) == version
            return
        self.touch([parent])
        for kid in kids:
            assert (kid.parent_id, kid.fork_position, kid.length) == (parent, position,
                                                                      position + extra)
            self.model.add(kid.branch_id, parent, position, position + extra)

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data(), extend=st.booleans())
    def write(self, data, extend):
        """Extend a branch, or write anywhere up to its end (overwrites)."""
        bid = self.pick(data)
        length = self.model.length(bid)
        start = length if extend else data.draw(st.integers(0, length), label="start")
        layer = data.draw(st.integers(0, self.alloc.num_layers - 1), label="layer")
        self.write_at(bid, layer, start, data.draw(st.integers(1, self.LIMITS.max_tokens)))

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data(), one_call=st.booleans())
    def step(self, data, one_call):
        """A decode step over some branches: reserve, then append in some layers (or the
        one-layer append(ids, ...)); the step is held for later rules."""
        ids = data.draw(st.lists(st.sampled_from(self.model.live()), min_size=1, unique=True),
                        label="ids")
        layers = data.draw(st.sets(st.integers(0, self.alloc.num_layers - 1)), label="layers")
        k, v = self.kv(len(ids))
        refused = self.past_limit(1 + max(map(self.model.length, ids)))
        version = self.alloc.tree_version
        if self.alloc.num_layers == 1 and layers and one_call:
            done, step = self.attempt(lambda: self.alloc.append(ids, 0, k, v), refused)
        else:
            done, step = self.attempt(lambda: self.alloc.reserve(ids), refused)
            for layer in layers if done else ():
                self.alloc.append(step, layer, k, v)
        if not done:
            return
        assert self.alloc.tree_version == version  # growth keeps plans valid
        self.held = HeldStep(step, ids)
        for i, bid in enumerate(ids):
            position = self.model.length(bid)
            self.model.grow(bid, position + 1)
            for layer in layers:
                self.model.write(bid, layer, position, k[i:i + 1], v[i:i + 1])

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def multi_token_step(self, data):
        """``reserve(ids, counts)``: a continuation or a draft per branch (0 to 40 tokens each),
        then one append per layer of all of them."""
        ids = data.draw(st.lists(st.sampled_from(self.model.live()), min_size=1, unique=True),
                        label="ids")
        counts = data.draw(st.lists(st.integers(0, 40), min_size=len(ids), max_size=len(ids)),
                           label="counts")
        layers = data.draw(st.sets(st.integers(0, self.alloc.num_layers - 1)), label="layers")
        starts = [self.model.length(b) for b in ids]
        refused = self.past_limit(max(s + n for s, n in zip(starts, counts)))
        version = self.alloc.tree_version
        done, step = self.attempt(lambda: self.alloc.reserve(ids, counts), refused)
        if not done:
            return
        assert self.alloc.tree_version == version  # growth keeps plans valid
        kv = {layer: self.kv(sum(counts)) for layer in layers}
        for layer, (k, v) in kv.items():
            self.alloc.append(step, layer, k, v)
        for i, (bid, start, n) in enumerate(zip(ids, starts, counts)):
            self.model.grow(bid, start + n)
            first = sum(counts[:i])
            for layer, (k, v) in kv.items():
                self.model.write(bid, layer, start, k[first:first + n], v[first:first + n])

    @precondition(lambda self: self.held is not None)
    @rule(data=st.data(), again=st.booleans())
    def held_step(self, data, again):
        """The held step, later: reserve the next token from it (``reserve(step)``) or append
        its reserved tokens in a layer; stale once one of its branches was forked from or
        freed."""
        held = self.held
        refused = (ValueError, "step is stale") if held.stale else None
        if again:
            if refused is None:
                refused = self.past_limit(1 + max(map(self.model.length, held.ids)))
            done, step = self.attempt(lambda: self.alloc.reserve(held.step), refused)
            if done:
                for bid in held.ids:
                    self.model.grow(bid, self.model.length(bid) + 1)
                self.held = HeldStep(step, held.ids)
            return
        layer = data.draw(st.integers(0, self.alloc.num_layers - 1), label="layer")
        k, v = self.kv(len(held.ids))
        done, _ = self.attempt(lambda: self.alloc.append(held.step, layer, k, v), refused)
        for i, bid in enumerate(held.ids if done else ()):
            position = int(held.step.positions[i])
            self.model.write(bid, layer, position, k[i:i + 1], v[i:i + 1])

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def free(self, data):
        bid = self.pick(data)
        self.alloc.free_branch(bid)
        self.touch([bid])
        del self.model.rows[bid]

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def prune(self, data):
        bid = self.pick(data)
        freed = self.alloc.prune(bid)
        assert sorted(freed) == sorted(self.model.descendants(bid))
        self.touch(freed)
        for b in freed:
            del self.model.rows[b]

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def truncate(self, data):
        """Roll a branch back (rejected draft tokens): its first positions stay, its children
        keep theirs."""
        bid = self.pick(data)
        length = self.model.length(bid)
        n = data.draw(st.integers(max(0, length - 3 * self.alloc.block_size), length),
                      label="truncated to")
        version = self.alloc.tree_version, self.alloc.table_version
        self.alloc.truncate(bid, n)
        if n == length:  # changes nothing, held plans and steps stay valid
            assert (self.alloc.tree_version, self.alloc.table_version) == version
            return
        assert self.alloc.tree_version != version[0]
        self.touch([bid])
        for kv in self.model.rows[bid]:
            kv[0], kv[1] = kv[0][:n].clone(), kv[1][:n].clone()

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def exhaust(self, data):
        """A write into more fresh blocks than are free (or past max_tokens)."""
        bid = self.pick(data)
        length, bs = self.model.length(bid), self.alloc.block_size
        free = self.alloc.memory_report().blocks_free
        self.write_at(bid, 0, length, (free + 1) * bs)

    @rule(data=st.data())
    def bad_input(self, data):
        """A call with one bad argument: refused, naming it, with nothing changed."""
        _name, call, refused = data.draw(st.sampled_from(self.bad_calls(data)), label="bad")
        self.attempt(call, refused)

    def bad_calls(self, data) -> list:
        a, live, dead = self.alloc, self.model.live(), self.model.dead()
        unknown = max(self.model.parent, default=-1) + 1
        k, v = self.kv(1)
        calls = [
            ("unknown id", lambda: a.reserve([unknown]), (UnknownBranch, f"{unknown}")),
            ("uint64 id", lambda: a.segment_tree(np.array([2**64 - 1], np.uint64)),
             (UnknownBranch, "18446744073709551615")),
            ("float ids", lambda: a.reserve([0.0]), (TypeError, "sequence of ints")),
            ("past max_tokens", lambda: a.alloc_branch(a.max_tokens + 1),
             (ValueError, f"must be <= {a.max_tokens}")),
            ("negative count", lambda: a.alloc_branches(-1, 0), (ValueError, "count")),
            ("fork of unknown", lambda: a.alloc_branches(0, 0, unknown),
             (UnknownBranch, f"{unknown}")),
        ]
        if dead:
            gone = dead[-1]
            calls += [("freed id", lambda: a.write(gone, 0, k, v), (UnknownBranch, f"{gone}")),
                      ("truncate a freed id", lambda: a.truncate(gone, 0), UnknownBranch),
                      ("free twice", lambda: a.free_branch(gone), UnknownBranch)]
        if live:
            bid = self.pick(data, "bad target")
            n = self.model.length(bid)
            calls += [
                ("repeated ids", lambda: a.reserve([bid, bid]), (ValueError, "distinct")),
                ("hole", lambda: a.write(bid, 0, k, v, start=n + 1), (ValueError, "no holes")),
                ("layer", lambda: a.write(bid, a.num_layers, k, v), (ValueError, "layer")),
                ("dtype", lambda: a.write(bid, 0, k.float(), v.float()), TypeError),
                ("shape", lambda: a.write(bid, 0, k[:, :, :1], v), (ValueError, "shape")),
                ("scale", lambda: TreeAttentionPlan(a, live, self.num_qo_heads, 1e38),
                 (ValueError, "sm_scale")),
            ]
            calls += [("truncate past the end", lambda: a.truncate(bid, n + 1),
                       (ValueError, "truncate only shortens")),
                      ("truncate below zero", lambda: a.truncate(bid, -1),
                       (ValueError, "num_tokens"))]
            if n < a.max_tokens:
                calls.append(("fork past the end", lambda: a.alloc_branch(n + 1, bid, n + 1),
                              (ValueError, "fork_position")))
            if n:
                calls.append(("shorter than the fork", lambda: a.alloc_branches(
                    2, n - 1, bid, n), (ValueError, "num_tokens")))
        return calls

    @precondition(lambda self: self.model.rows)
    @rule(data=st.data())
    def hold_plan(self, data):
        """A plan over some live branches in any order, kept across later operations."""
        ids = data.draw(st.lists(st.sampled_from(self.model.live()), min_size=1,
                                 max_size=self.LIMITS.plan_branches, unique=True),
                        label="plan ids")
        plan = make_plan(self.alloc, ids, self.num_qo_heads, self.knobs, self.gen,
                         self.LIMITS.max_queries)
        self.plans = self.plans[-2:] + [(plan, self.alloc.tree_version)]

    # ---- after every step -----------------------------------------------------------------

    @invariant()
    def every_branch_reads_what_the_model_says(self):
        if not hasattr(self, "alloc"):
            return
        self.TALLY.steps += 1
        live = self.model.live()
        assert self.alloc.live_branch_ids() == live
        if not live:
            return
        tables, lengths = self.alloc.block_tables(live)
        assert lengths.tolist() == [self.model.length(b) for b in live]
        for i, bid in enumerate(live):
            n = int(lengths[i])
            for layer in range(self.alloc.num_layers):
                for pool, expected in zip((self.alloc.k_pools[layer], self.alloc.v_pools[layer]),
                                          self.model.rows[bid][layer]):
                    got = reference.gather_sequence(pool, tables[i], n).cpu()
                    assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), \
                        (bid, layer)

    @invariant()
    def refcounts_are_the_references(self):
        if not hasattr(self, "alloc"):
            return
        a = self.alloc
        held = np.zeros(a.num_blocks, np.int64)
        live = self.model.live()
        if live:
            tables, lengths = a.block_tables(live)
            for row, n in zip(tables.cpu().numpy(), lengths.tolist()):
                blocks = row[:-(-n // a.block_size)]
                np.add.at(held, blocks[blocks != ZERO_BLOCK], 1)
        assert np.array_equal(a._refcount, held)
        free = a._free[:a._free_top]
        assert len(set(free.tolist())) == free.size and ZERO_BLOCK not in free
        assert set(np.flatnonzero(held).tolist()).isdisjoint(free.tolist())
        report = a.memory_report()
        assert report.blocks_used == np.count_nonzero(held) and report.blocks_free == free.size
        assert report.blocks_used + report.blocks_free == report.blocks_total
        assert report.tokens_logical == sum(map(self.model.length, live))

    @invariant()
    def attention_is_right_or_stale(self):
        """Every held plan, then a fresh one over the live branches (some, where many) in a
        random order."""
        if not hasattr(self, "alloc"):
            return
        kept = []
        for plan, version in self.plans:
            try:
                self.check_attention(plan)
                kept.append((plan, version))
            except StalePlan:  # only for a changed tree, or branches past the plan's tables
                assert self.alloc.tree_version != version or self.outgrown(plan)
                self.TALLY.stale += 1
        self.plans = kept
        live = self.model.live()
        if live:
            order = torch.randperm(len(live), generator=self.gen)[:self.LIMITS.plan_branches]
            ids = [live[i] for i in order.tolist()]
            self.check_attention(make_plan(self.alloc, ids, self.num_qo_heads, self.knobs,
                                           self.gen, self.LIMITS.max_queries))

    def outgrown(self, plan) -> bool:
        return self.alloc.block_tables(plan.branch_ids)[0].shape[1] > plan.tables.shape[1]

    def check_attention(self, plan, interpreted: bool = False) -> None:
        layer = int(torch.randint(0, self.alloc.num_layers, (1,), generator=self.gen))
        ids = plan.branch_ids.tolist()
        q = torch.randn(plan.num_rows, plan.num_qo_heads, plan.head_dim, generator=self.gen)
        q = q.to(self.alloc.dtype).to(self.DEVICE)
        if interpreted:
            out = interpreted_output(plan, q, layer)
            self.TALLY.interpreted += 1
        else:
            out = plan.run(q, layer, poisoned_like(q))
        keys = [self.model.rows[b][layer][0] for b in ids]
        values = [self.model.rows[b][layer][1] for b in ids]
        if plan.q_lens is None:
            expected = reference.decode_attention(q, keys, values)
        else:
            expected = reference.query_attention(q, keys, values, plan.q_lens.tolist(),
                                                 masks=plan.mask)
            self.TALLY.query_rows += plan.num_rows
            if plan.mask is not None:
                self.TALLY.draft_rows += sum(len(m) for m in plan.mask if m is not None)
        err = reference.relative_error(out, expected)
        assert err < reference.TOLERANCE[q.dtype], f"relative error {err}"
        self.TALLY.attention += 1

    def teardown(self):
        """The interpreted kernels: the held plans still valid, and a fresh plan (over a new
        unwritten root where the history ended with no branch)."""
        if not self.INTERPRET or not hasattr(self, "alloc"):
            return
        if not self.model.rows:
            length = min(8, self.alloc.max_tokens)
            self.model.add(self.alloc.alloc_branch(length).branch_id, None, 0, length)
        plans = [plan for plan, version in self.plans if version == self.alloc.tree_version
                 and not self.outgrown(plan)]
        live = self.model.live()
        for plan in plans + [make_plan(self.alloc, live, self.num_qo_heads, self.knobs,
                                       self.gen, self.LIMITS.max_queries)]:
            self.check_attention(plan, interpreted=True)


def fuzz(limits: Limits, device: str, interpret: bool = False) -> Tally:
    tally = Tally()
    machine = type("Fuzz", (FuzzMachine,), {"LIMITS": limits, "DEVICE": device,
                                            "INTERPRET": interpret, "TALLY": tally})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=limits.examples, stateful_step_count=limits.steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much]))
    return tally


def test_fuzz_torch_path():
    tally = fuzz(CPU, "cpu")
    assert tally.examples >= CPU.examples and tally.attention > tally.examples
    assert tally.refused and tally.exhausted and tally.query_rows and tally.draft_rows


@interpreter
def test_fuzz_kernels_interpreted():
    tally = fuzz(INTERPRETED, "cpu", interpret=True)
    assert tally.examples >= INTERPRETED.examples and tally.interpreted >= tally.examples


@gpu
def test_gpu_fuzz(capsys):
    tally = fuzz(GPU, "cuda")
    with capsys.disabled():
        print(f"\nfuzz on {torch.cuda.get_device_name()}: {tally.examples} histories, "
              f"{tally.steps} steps, {tally.attention} plan outputs checked "
              f"({tally.query_rows} rows of several queries per branch, {tally.draft_rows} "
              f"of them under draft masks, {tally.stale} "
              f"held plans stale), {tally.exhausted} pool exhaustions, {tally.refused} "
              f"refused calls")
    assert tally.examples >= GPU.examples
