"""Differential fuzzing of tree_attention: random allocator histories (roots, forks at random
positions and inside blocks, decode steps, writes that copy on write or overwrite, frees,
prunes, pool exhaustion) then attention over the live branches, against the float64
reference computed from :class:`Model`, an account of what every branch must read that is
kept without the allocator. A plan held across part of the history must either raise
StalePlan or still be right.

On CPU the kernels run in Triton's interpreter (few, small examples) and the PyTorch path
runs more; on the GPU, FLASH_REASONING_FUZZ_EXAMPLES examples (default 200) of larger
trees, and the test prints how many trees were tried."""
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import allocator_snapshot, assert_allocator_unchanged, gpu, interpreter, poisoned_like
from flash_reasoning import (
    PhysicalKVAllocator,
    PoolExhausted,
    StalePlan,
    TreeAttentionPlan,
    reference,
)
from flash_reasoning.planner import PlanOptions


@dataclass(frozen=True)
class Limits:
    """How large the drawn problems get."""
    head_dims: tuple
    block_sizes: tuple
    max_kv_heads: int
    max_group: int
    max_tokens: int        # per write
    ops: tuple             # (fewest, most) operations per half of a history
    max_blocks: int        # pool size (small pools exhaust)
    target_chunks: tuple   # planner overrides (small ones force partials and merges)


CPU = Limits(head_dims=(64,), block_sizes=(2, 5, 16), max_kv_heads=2, max_group=4,
             max_tokens=40, ops=(6, 14), max_blocks=120, target_chunks=(None, 16, 16))
GPU = Limits(head_dims=(64, 128, 256), block_sizes=(1, 7, 16, 16), max_kv_heads=4,
             max_group=8, max_tokens=300, ops=(6, 20), max_blocks=3000,
             target_chunks=(None, None, 16, 64))


@dataclass
class Tally:
    trees: int = 0
    branches: int = 0
    exhausted: int = 0
    stale: int = 0


class Model:
    """What each live branch reads, per layer: K and V rows ``[length, kv_heads, head_dim]``.
    Forks copy the parent's rows below the fork, growth reads zero, writes overwrite."""

    def __init__(self, alloc: PhysicalKVAllocator) -> None:
        self.alloc = alloc
        self.rows: dict[int, list[list[torch.Tensor]]] = {}  # id -> [layer][k or v]
        self.parent: dict[int, int | None] = {}               # every id ever, for prune

    def live(self) -> list[int]:
        return sorted(self.rows)

    def add(self, bid: int, parent: int | None, position: int, length: int) -> None:
        a = self.alloc
        self.parent[bid] = parent
        self.rows[bid] = [[torch.zeros(0, a.num_kv_heads, a.head_dim, dtype=a.dtype)] * 2
                          for _ in range(a.num_layers)]
        if parent is not None:
            self.rows[bid] = [[t[:position].clone() for t in kv] for kv in self.rows[parent]]
        self.grow(bid, length)

    def grow(self, bid: int, length: int) -> None:
        for kv in self.rows[bid]:
            for i, t in enumerate(kv):
                zeros = t.new_zeros(length - t.shape[0], *t.shape[1:])
                kv[i] = torch.cat([t, zeros])

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


class History:
    """Random allocator operations drawn by hypothesis, mirrored in a Model."""

    def __init__(self, data, alloc, limits: Limits, tally: Tally) -> None:
        self.data, self.alloc, self.limits, self.tally = data, alloc, limits, tally
        self.model = Model(alloc)
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))

    def draw(self, strategy):
        return self.data.draw(strategy)

    #: Every operation, weighted by repetition; growth only keeps plans valid.
    ANY = ("root", "fork", "fork", "write", "write", "extend", "step", "step", "free", "prune")
    GROWTH = ("extend", "step")

    def run(self, ops: int, names=ANY) -> None:
        for _ in range(ops):
            live = self.model.live()
            getattr(self, self.draw(st.sampled_from(names)) if live else "root")(live)

    def attempt(self, action) -> tuple[bool, object]:
        """(True, ``action()``), or (False, None) when the pool is exhausted: then nothing
        may have changed."""
        before = allocator_snapshot(self.alloc)
        try:
            return True, action()
        except PoolExhausted:
            assert_allocator_unchanged(self.alloc, before)
            self.tally.exhausted += 1
            return False, None

    def kv(self, n: int):
        shape = (n, self.alloc.num_kv_heads, self.alloc.head_dim)
        return [torch.randn(shape, generator=self.gen).to(self.alloc.dtype).to(
            self.alloc.device) for _ in range(2)]

    # ---- operations ----------------------------------------------------------------------

    def root(self, live) -> None:
        unwritten = self.draw(st.integers(0, 2))
        bid = self.alloc.alloc_branch(unwritten).branch_id
        self.model.add(bid, None, 0, unwritten)
        for layer in range(self.alloc.num_layers):
            self.write_at(bid, layer, unwritten, self.draw(st.integers(0, self.limits.max_tokens)))

    def fork(self, live) -> None:
        parent = self.draw(st.sampled_from(live))
        position = self.draw(st.integers(0, self.model.length(parent)))
        count = self.draw(st.integers(1, 4))
        length = position + self.draw(st.integers(0, 3))
        _, kids = self.attempt(lambda: self.alloc.alloc_branches(count, length, parent, position))
        for kid in kids or []:
            self.model.add(kid.branch_id, parent, position, length)

    def write(self, live) -> None:
        bid = self.draw(st.sampled_from(live))
        start = self.draw(st.integers(0, self.model.length(bid)))
        layer = self.draw(st.integers(0, self.alloc.num_layers - 1))
        self.write_at(bid, layer, start, self.draw(st.integers(1, self.limits.max_tokens)))

    def extend(self, live) -> None:
        bid = self.draw(st.sampled_from(live))
        layer = self.draw(st.integers(0, self.alloc.num_layers - 1))
        self.write_at(bid, layer, self.model.length(bid),
                      self.draw(st.integers(1, self.limits.max_tokens)))

    def write_at(self, bid: int, layer: int, start: int, n: int) -> None:
        k, v = self.kv(n)
        if self.attempt(lambda: self.alloc.write(bid, layer, k, v, start=start))[0]:
            self.model.write(bid, layer, start, k, v)

    def step(self, live) -> None:
        """One decode step over some branches: reserve, then append in some layers."""
        ids = self.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        layers = self.draw(st.sets(st.integers(0, self.alloc.num_layers - 1)))
        k, v = self.kv(len(ids))
        if self.alloc.num_layers == 1 and layers and self.draw(st.booleans()):
            done, _ = self.attempt(lambda: self.alloc.append(ids, 0, k, v))  # one-call form
        else:
            done, step = self.attempt(lambda: self.alloc.reserve(ids))
            for layer in layers if done else ():
                self.alloc.append(step, layer, k, v)
        if not done:
            return
        for i, bid in enumerate(ids):
            position = self.model.length(bid)
            self.model.grow(bid, position + 1)
            for layer in layers:
                self.model.write(bid, layer, position, k[i:i + 1], v[i:i + 1])

    def free(self, live) -> None:
        bid = self.draw(st.sampled_from(live))
        self.alloc.free_branch(bid)
        del self.model.rows[bid]

    def prune(self, live) -> None:
        bid = self.draw(st.sampled_from(live))
        freed = self.alloc.prune(bid)
        assert sorted(freed) == sorted(self.model.descendants(bid))
        for b in freed:
            del self.model.rows[b]


def attend(plan: TreeAttentionPlan, q: torch.Tensor, layer: int) -> torch.Tensor:
    """The plan's output: real kernels on CUDA; on CPU the interpreted kernels when the plan
    names an arch, else the PyTorch path. Raises StalePlan like ``run``."""
    alloc = plan.allocator
    if q.is_cuda or plan.arch is None:
        return plan.run(q, layer, poisoned_like(q))
    from aot.interpret import run_interpreted
    plan.refresh()
    out = poisoned_like(q)
    run_interpreted(plan.launches(q, alloc.k_pools[layer], alloc.v_pools[layer], out))
    return out


def check(plan: TreeAttentionPlan, model: Model, history: History) -> None:
    """The plan's output over a random layer against the reference from the model."""
    layer = history.draw(st.integers(0, model.alloc.num_layers - 1))
    ids = plan.branch_ids.tolist()
    q = torch.randn(len(ids), plan.num_qo_heads, plan.head_dim, generator=history.gen)
    q = q.to(model.alloc.dtype).to(model.alloc.device)
    out = attend(plan, q, layer)
    keys = [model.rows[b][layer][0] for b in ids]
    values = [model.rows[b][layer][1] for b in ids]
    err = reference.relative_error(out, reference.decode_attention(q, keys, values))
    assert err < reference.TOLERANCE[q.dtype], f"relative error {err}"


def draw_allocator(data, limits: Limits, device: str) -> PhysicalKVAllocator:
    head_dim = data.draw(st.sampled_from(limits.head_dims))
    return PhysicalKVAllocator(
        num_blocks=data.draw(st.integers(8, limits.max_blocks)),
        block_size=data.draw(st.sampled_from(limits.block_sizes)),
        num_kv_heads=data.draw(st.integers(1, limits.max_kv_heads if head_dim < 256 else 2)),
        head_dim=head_dim, num_layers=data.draw(st.integers(1, 2)),
        dtype=data.draw(st.sampled_from([torch.float16, torch.bfloat16])), device=device)


def fuzz_one(data, limits: Limits, device: str, interpreted: bool, tally: Tally) -> None:
    """One history: half, a plan, the other half (growth only, or anything: the plan stays
    right or is stale), then a new plan over a random order of the live branches."""
    alloc = draw_allocator(data, limits, device)
    history = History(data, alloc, limits, tally)
    group = data.draw(st.integers(1, limits.max_group))
    num_qo_heads = alloc.num_kv_heads * group
    plan_kw = dict(target_chunk=data.draw(st.sampled_from(limits.target_chunks)),
                   separate_merge=data.draw(st.sampled_from([None, False, True])),
                   flat=data.draw(st.sampled_from([None, False, True])),
                   final_lanes=data.draw(st.sampled_from([None, 1, max(1, 16 // group),
                                                          max(1, 32 // group)])),
                   one_tile=data.draw(st.sampled_from([None, True])),
                   **(dict(arch="sm90", num_sms=4) if interpreted else {}))

    history.run(data.draw(st.integers(*limits.ops)))
    held = TreeAttentionPlan(alloc, history.model.live(), num_qo_heads,
                             _options=PlanOptions(**plan_kw))
    growth_only = data.draw(st.booleans())
    history.run(data.draw(st.integers(*limits.ops)),
                History.GROWTH if growth_only else History.ANY)
    try:
        check(held, history.model, history)
    except StalePlan:  # only for a changed tree, or branches past the plan's tables
        assert alloc.tree_version != held.tree_version or \
            alloc.block_tables(held.branch_ids)[0].shape[1] > held.tables.shape[1]
        tally.stale += 1

    ids = data.draw(st.permutations(history.model.live()))
    check(TreeAttentionPlan(alloc, ids, num_qo_heads, _options=PlanOptions(**plan_kw)),
          history.model, history)
    report = alloc.memory_report()
    assert report.blocks_used + report.blocks_free == report.blocks_total
    assert report.tokens_logical == sum(map(history.model.length, history.model.live()))
    tally.trees += 1
    tally.branches += len(ids)


def fuzz(examples: int, limits: Limits, device: str, interpreted: bool = False) -> Tally:
    tally = Tally()

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def one(data):
        fuzz_one(data, limits, device, interpreted, tally)

    one()
    return tally


@interpreter
def test_fuzz_kernels_interpreted():
    assert fuzz(30, CPU, "cpu", interpreted=True).trees >= 30


def test_fuzz_torch_path():
    assert fuzz(150, CPU, "cpu").trees >= 150


@gpu
def test_gpu_fuzz(capsys):
    examples = int(os.environ.get("FLASH_REASONING_FUZZ_EXAMPLES", "200"))
    tally = fuzz(examples, GPU, "cuda")
    with capsys.disabled():
        print(f"\nfuzz on {torch.cuda.get_device_name()}: {tally.trees} trees tried "
              f"({tally.branches} branches; {tally.stale} held plans stale, "
              f"{tally.exhausted} pool exhaustions)")
    assert tally.trees >= examples
