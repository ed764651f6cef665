"""TreeAttentionPlan.run captured in a CUDA graph: the replay matches the eager run and the
float64 reference, before and after decode steps that only append (refresh, then replay)."""
import pytest
import torch

from conftest import gpu, poisoned_like
from flash_reasoning import PhysicalKVAllocator, TreeAttentionPlan, reference, runtime
from flash_reasoning.tools.bench import case_allocator, seed_case
from flash_reasoning.tools.synthetic import random_branches, random_kv

STEPS = 3


def seed_tree():
    """The headline shape (2048-token root, 256 leaves of 64, 32/8 heads, head_dim 128):
    the leaves end on a block boundary, so the first step gives each a new block."""
    return case_allocator(seed_case(256), device="cuda")


def random_forest():
    """Uneven depths and forks inside blocks, two layers."""
    alloc = PhysicalKVAllocator(64 * 20 + 8, 16, 8, 128, num_layers=2, device="cuda")
    return alloc, random_branches(alloc, 64, 5, 200, seed=11)


class CapturedRun:
    """``plan.run`` of every layer captured once, into static q and out buffers."""

    def __init__(self, plan: TreeAttentionPlan, q: torch.Tensor):
        layers = plan.allocator.num_layers
        self.q = q.clone()
        self.outs = [torch.empty_like(q) for _ in range(layers)]
        for layer, out in enumerate(self.outs):  # loads the cubins outside the capture
            plan.run(self.q, layer, out)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for layer, out in enumerate(self.outs):
                plan.run(self.q, layer, out)

    def replay(self, q: torch.Tensor) -> list[torch.Tensor]:
        """Replay with ``q`` (copied in); every output poisoned first, so a row the
        replay misses fails."""
        self.q.copy_(q)
        for out in self.outs:
            out.copy_(poisoned_like(out))
        self.graph.replay()
        torch.cuda.synchronize()
        return self.outs


def check_layers(outs, plan, q):
    """Each layer's replayed output equals the eager run bit for bit and is within the
    tolerance of the float64 reference."""
    alloc, ids = plan.allocator, plan.branch_ids.tolist()
    for layer, replayed in enumerate(outs):
        eager = plan.run(q, layer, poisoned_like(q))
        assert torch.equal(replayed, eager), f"layer {layer}: replay differs from eager"
        err = reference.relative_error(replayed,
                                       reference.tree_attention(q, alloc, ids, layer))
        assert err < reference.TOLERANCE[q.dtype], f"layer {layer}: relative error {err}"


def decode_step(alloc, step, gen):
    """One step that only appends: reserve a position in every branch, write every layer."""
    step = alloc.reserve(step)
    for layer in range(alloc.num_layers):
        alloc.append(step, layer, *random_kv(alloc, gen, step.branch_ids.size))
    return step


def random_q(plan, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(plan.num_branches, plan.num_qo_heads, plan.head_dim, generator=gen)
    return q.to(plan.allocator.dtype).cuda()


@gpu
@pytest.mark.parametrize("tree", [seed_tree, random_forest], ids=["seed_b256", "forest"])
def test_replay_matches_eager_and_reference_across_decode_steps(tree):
    alloc, ids = tree()
    plan = TreeAttentionPlan(alloc, ids, 32)
    captured = CapturedRun(plan, random_q(plan, 0))
    q = random_q(plan, 1)
    check_layers(captured.replay(q), plan, q)
    gen, step = torch.Generator().manual_seed(2), ids
    tables_before = plan.tables.clone()
    for i in range(STEPS):
        step = decode_step(alloc, step, gen)
        plan.refresh()  # the graph reads the plan's tables and lengths: update them in place
        q = random_q(plan, 10 + i)
        check_layers(captured.replay(q), plan, q)
    assert not torch.equal(plan.tables, tables_before)  # the steps took new blocks


@gpu
def test_replay_of_the_prepared_launches_equals_the_per_launch_path():
    """The captured ``run`` (its prepared launches) writes bit for bit what launching
    ``launches()`` one by one, outside any graph, writes."""
    alloc, ids = random_forest()
    plan = TreeAttentionPlan(alloc, ids, 32)
    q = random_q(plan, 4)
    replayed = CapturedRun(plan, random_q(plan, 5)).replay(q)
    for layer, out in enumerate(replayed):
        per_launch = poisoned_like(q)
        runtime.run(plan.launches(q, alloc.k_pools[layer], alloc.v_pools[layer], per_launch),
                    q.device)
        torch.cuda.synchronize()
        assert torch.equal(out, per_launch), f"layer {layer}"
