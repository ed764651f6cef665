"""Validation at every public entry point: one test per rule, each over every entry point the
rule applies to. A rejected call raises TypeError/ValueError naming the argument, what was
expected and what was given, and changes nothing: the allocator (branches, lengths, tables,
refcounts, versions, pools), the plan's buffers, the paged problem and the output buffers
are bit for bit as before."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import (
    allocator_snapshot,
    assert_allocator_unchanged,
    every_pool,
    gpu,
    poisoned_like,
    same_bits,
)
from flash_reasoning import (
    PhysicalKVAllocator,
    TreeAttentionPlan,
    UnknownBranch,
    kv_cache,
    paged_decode,
    reference,
    tree_attention,
)
from flash_reasoning.allocator import MAX_TOKENS, DecodeStep
from flash_reasoning.ops.checks import check_scale, max_scale
from flash_reasoning.planner import PlanOptions
from flash_reasoning.tools.synthetic import PagedProblem, paged_problem, random_branches, random_kv

KV_HEADS, QO_HEADS, HEAD_DIM, LAYERS = 2, 4, 64, 2


@dataclass
class World:
    """Valid arguments for every entry point; each case spoils one of them."""
    alloc: PhysicalKVAllocator
    ids: list[int]
    dead: int                # a freed branch id
    plan: TreeAttentionPlan
    step: DecodeStep         # the current decode step of ``ids``
    q: torch.Tensor          # queries of ``ids``
    out: torch.Tensor        # poisoned: a rejected call must leave it so
    kv: tuple                # one K/V row per branch of ``ids``
    problem: PagedProblem    # for paged_decode: sequence 0 leaves table entries unused
    pd_out: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        p = self.problem
        return [self.q, self.out, *self.kv, p.q, p.k_pool, p.v_pool, p.block_tables,
                p.seq_lens, self.pd_out, self.plan.tables, self.plan.lengths]


def make_world(device="cpu") -> World:
    alloc = PhysicalKVAllocator(64, 4, KV_HEADS, HEAD_DIM, num_layers=LAYERS, device=device)
    ids = random_branches(alloc, 5, 3, 12, seed=0)
    dead = alloc.alloc_branch(3, parent_branch_id=ids[0], fork_position=1).branch_id
    alloc.free_branch(dead)
    plan = TreeAttentionPlan(alloc, ids, QO_HEADS)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(ids), QO_HEADS, HEAD_DIM, generator=gen).half().to(device)
    problem = paged_problem([5, 40], QO_HEADS, KV_HEADS, HEAD_DIM, device=device)
    return World(alloc, ids, dead, plan, alloc.reserve(ids), q, poisoned_like(q),
                 random_kv(alloc, gen, len(ids)), problem, poisoned_like(problem.q))


@pytest.fixture
def world():
    return make_world()


def rejected(world: World, call, error, fragments) -> None:
    """``call(world)`` raises ``error`` whose message holds every fragment (``{dead}`` stands
    for the freed branch id), and changes nothing."""
    before = allocator_snapshot(world.alloc), [t.clone() for t in world.tensors()]
    with pytest.raises(error) as info:
        call(world)
    message = str(info.value)
    for fragment in fragments:
        fragment = fragment.format(dead=world.dead)
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_allocator_unchanged(world.alloc, before[0])
    assert all(same_bits(a, b) for a, b in zip(world.tensors(), before[1]))


def decode(w: World, **change):
    """paged_decode over the world's problem with some arguments replaced."""
    p = w.problem
    args = dict(q=p.q, k_pool=p.k_pool, v_pool=p.v_pool, block_tables=p.block_tables,
                seq_lens=p.seq_lens, out=w.pd_out)
    return paged_decode(**{**args, **change})


def write_slots(w: World, pool=None, slots=None, k=None):
    """kv_cache.write_slots into layer 0's pools of the world's allocator, two rows."""
    k_pool = w.alloc.k_pools[0] if pool is None else pool
    slots = torch.tensor([4, 5]) if slots is None else slots
    rows = w.kv[0][:2] if k is None else k
    return kv_cache.write_slots(k_pool, w.alloc.v_pools[0], slots, rows, w.kv[1][:2])


def other_allocator(dtype=torch.float16, head_dim=HEAD_DIM):
    alloc = PhysicalKVAllocator(8, 4, KV_HEADS, head_dim, dtype=dtype, device="cpu")
    return alloc, [alloc.alloc_branch(5).branch_id]


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values, with the first two dimensions' strides swapped."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def cases(*items):
    """pytest params from (id, call, error, fragments) tuples."""
    return [pytest.param(*rest, id=name) for name, *rest in items]


# ---- the valid calls run (every rejection below is caused by the one spoiled argument) ------

def test_the_valid_calls_run(world):
    w = world
    ref = reference.tree_attention(w.q, w.alloc, w.ids, 1)
    assert reference.relative_error(tree_attention(w.q, w.alloc, w.ids, layer=1), ref) < \
        reference.TOLERANCE[torch.float16]
    assert w.plan.run(w.q, np.int64(1), w.out) is w.out and not w.out.isnan().any()
    assert not decode(w, sm_scale=np.float32(0.2)).isnan().any()
    for layer in range(LAYERS):
        w.alloc.append(w.step, layer, *w.kv)
    w.alloc.write(w.ids[0], 0, *random_kv(w.alloc, torch.Generator(), 2))
    write_slots(w)
    assert UnknownBranch(3).args == (3,) and isinstance(UnknownBranch(3), ValueError)


# ---- rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention q", lambda w: tree_attention(w.q.tolist(), w.alloc, w.ids), TypeError,
     ["q must be a torch.Tensor", "got list"]),
    ("run q", lambda w: w.plan.run(w.q.numpy()), TypeError, ["q must be", "got ndarray"]),
    ("run out", lambda w: w.plan.run(w.q, 0, []), TypeError, ["out must be", "got list"]),
    *[(f"paged_decode {name}", lambda w, name=name: decode(w, **{name: [1]}), TypeError,
       [f"{name} must be a torch.Tensor", "got list"])
      for name in ("q", "k_pool", "v_pool", "block_tables", "seq_lens", "out")],
    ("write k", lambda w: w.alloc.write(w.ids[0], 0, [0.0], w.kv[1][:1]), TypeError,
     ["k must be a torch.Tensor", "got list"]),
    ("append v", lambda w: w.alloc.append(w.step, 0, w.kv[0], None), TypeError,
     ["v must be a torch.Tensor", "got NoneType"]),
    ("write_slots slots", lambda w: write_slots(w, slots=[4, 5]), TypeError,
     ["slots must be a torch.Tensor", "got list"]),
    ("plan allocator", lambda w: TreeAttentionPlan(w.alloc.k_pools[0], w.ids, 4), TypeError,
     ["allocator must be a PhysicalKVAllocator", "got Tensor"]),
))
def test_tensor_arguments_must_be_tensors(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention q", lambda w: tree_attention(w.q.float(), w.alloc, w.ids), TypeError,
     ["q must be torch.float16, got torch.float32"]),
    ("run out", lambda w: w.plan.run(w.q, 0, w.out.bfloat16()), TypeError,
     ["out must be torch.float16, got torch.bfloat16"]),
    ("paged_decode q", lambda w: decode(w, q=w.problem.q.float()), TypeError,
     ["q has dtype float32", "compiled: ('float16', 'bfloat16')"]),
    ("paged_decode v_pool", lambda w: decode(w, v_pool=w.problem.v_pool.bfloat16()), TypeError,
     ["v_pool must be torch.float16, got torch.bfloat16"]),
    ("paged_decode block_tables", lambda w: decode(w, block_tables=w.problem.block_tables.long()),
     TypeError, ["block_tables must be torch.int32, got torch.int64"]),
    ("paged_decode seq_lens", lambda w: decode(w, seq_lens=w.problem.seq_lens.long()),
     TypeError, ["seq_lens must be torch.int32, got torch.int64"]),
    ("write k", lambda w: w.alloc.write(w.ids[0], 0, w.kv[0].float(), w.kv[1]), TypeError,
     ["k must be torch.float16 (the pool's dtype), got torch.float32"]),
    ("append v", lambda w: w.alloc.append(w.step, 0, w.kv[0], w.kv[1].bfloat16()), TypeError,
     ["v must be torch.float16", "got torch.bfloat16"]),
    ("write_slots slots", lambda w: write_slots(w, slots=torch.tensor([4.0, 5.0])), TypeError,
     ["slots must be int32 or int64, got torch.float32"]),
))
def test_dtypes_are_checked(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    # "meta" tensors stand in for another device on a CPU-only machine.
    ("tree_attention q", lambda w: tree_attention(w.q.to("meta"), w.alloc, w.ids), ValueError,
     ["q is on meta, expected cpu (the allocator's device)"]),
    ("run out", lambda w: w.plan.run(w.q, 0, w.out.to("meta")), ValueError,
     ["out is on meta, expected cpu"]),
    ("paged_decode k_pool", lambda w: decode(w, k_pool=w.problem.k_pool.to("meta")), ValueError,
     ["k_pool is on meta, expected cpu (q's device)"]),
    ("paged_decode seq_lens", lambda w: decode(w, seq_lens=w.problem.seq_lens.to("meta")),
     ValueError, ["seq_lens is on meta, expected cpu"]),
    ("paged_decode out", lambda w: decode(w, out=w.pd_out.to("meta")), ValueError,
     ["out is on meta, expected cpu"]),
    ("write k", lambda w: w.alloc.write(w.ids[0], 0, *(t[:1].to("meta") for t in w.kv)),
     ValueError, ["k must be on cpu (the pool's device), got meta"]),
    ("append v", lambda w: w.alloc.append(w.step, 1, w.kv[0], w.kv[1].to("meta")), ValueError,
     ["v must be on cpu", "got meta"]),
    ("write_slots slots", lambda w: write_slots(w, slots=torch.tensor([4, 5], device="meta")),
     ValueError, ["slots are on meta, the pool on cpu"]),
))
def test_tensors_must_be_on_the_allocators_or_qs_device(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention q 2-D", lambda w: tree_attention(w.q[0], w.alloc, w.ids), ValueError,
     ["q must be [num_branches, num_qo_heads, head_dim], got (4, 64)"]),
    ("run q head_dim", lambda w: w.plan.run(w.q[..., :32].contiguous()), ValueError,
     ["q must be [num_branches, num_qo_heads, head_dim] = (5, 4, 64), got (5, 4, 32)"]),
    ("run out heads", lambda w: w.plan.run(w.q, 0, w.out[:, :2].contiguous()), ValueError,
     ["out must be", "= (5, 4, 64), got (5, 2, 64)"]),
    ("paged_decode k_pool", lambda w: decode(w, k_pool=w.problem.k_pool[:, :, :1].contiguous()),
     ValueError, ["k_pool ", "and v_pool", "differ"]),
    ("paged_decode v_pool dims", lambda w: decode(w, v_pool=w.problem.v_pool[0]), ValueError,
     ["v_pool must be [num_blocks, block_size, num_kv_heads, 64], got (16, 2, 64)"]),
    ("paged_decode out", lambda w: decode(w, out=w.pd_out[:1].clone()), ValueError,
     ["out must have q's shape (2, 4, 64), got (1, 4, 64)"]),
    ("write k heads", lambda w: w.alloc.write(w.ids[0], 0, *(t[:1, :1] for t in w.kv)),
     ValueError, ["k must have shape (1, 2, 64) (tokens, num_kv_heads, head_dim), got (1, 1, 64)"]),
    ("append k rows", lambda w: w.alloc.append(w.step, 0, w.kv[0][:4], w.kv[1]), ValueError,
     ["k must have shape (5, 2, 64)", "got (4, 2, 64)"]),
    ("write_slots pool", lambda w: write_slots(w, pool=w.alloc.k_pools[0][0]), ValueError,
     ["k_pool must be [num_blocks, block_size, num_kv_heads, head_dim], got (4, 2, 64)"]),
    ("write_slots slots 2-D", lambda w: write_slots(w, slots=torch.tensor([[4, 5]])), ValueError,
     ["slots must be 1-D, got shape (1, 2)"]),
))
def test_shapes_are_checked(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention fewer", lambda w: tree_attention(w.q[:-1], w.alloc, w.ids), ValueError,
     ["q must be [num_branches, num_qo_heads, head_dim] = (5, 4, 64), got (4, 4, 64)"]),
    ("tree_attention more", lambda w: tree_attention(torch.cat([w.q, w.q[:1]]), w.alloc, w.ids),
     ValueError, ["= (5, 4, 64), got (6, 4, 64)"]),
    ("run", lambda w: w.plan.run(w.q[1:]), ValueError, ["= (5, 4, 64), got (4, 4, 64)"]),
    ("paged_decode block_tables", lambda w: decode(w, block_tables=w.problem.block_tables[:1]),
     ValueError, ["block_tables must be [2, max_blocks], got (1, 3)"]),
    ("paged_decode seq_lens", lambda w: decode(w, seq_lens=w.problem.seq_lens[:1]), ValueError,
     ["seq_lens must be [2], got (1,)"]),
))
def test_q_rows_must_match_the_branches(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention q", lambda w: tree_attention(noncontiguous(w.q), w.alloc, w.ids),
     ValueError, ["q must be contiguous, got shape (5, 4, 64) with strides (64, 320, 1)"]),
    ("run out", lambda w: w.plan.run(w.q, 0, noncontiguous(w.out)), ValueError,
     ["out must be contiguous, got shape (5, 4, 64)"]),
    ("paged_decode q", lambda w: decode(w, q=noncontiguous(w.problem.q)), ValueError,
     ["q must be contiguous"]),
    ("paged_decode out", lambda w: decode(w, out=noncontiguous(w.pd_out)), ValueError,
     ["out must be contiguous"]),
    ("paged_decode block_tables", lambda w: decode(
        w, block_tables=noncontiguous(w.problem.block_tables)), ValueError,
     ["block_tables must be contiguous, got shape (2, 3) with strides (1, 2)"]),
))
def test_strided_q_out_and_tables_are_rejected(world, call, error, fragments):
    rejected(world, call, error, fragments)


def test_strided_kv_rows_are_handled():
    """K/V rows are inputs only: any strides write the same bits as a contiguous copy."""
    strided, dense = make_world(), make_world()
    k, v = (noncontiguous(t) for t in strided.kv)
    assert not k.is_contiguous() and torch.equal(k, strided.kv[0])
    strided.alloc.append(strided.step, 0, k, v)
    dense.alloc.append(dense.step, 0, *dense.kv)
    strided.alloc.write(strided.ids[1], 1, k[:3], v[:3], start=2)
    dense.alloc.write(dense.ids[1], 1, *(t[:3] for t in dense.kv), start=2)
    assert same_contents(strided.alloc, dense.alloc)


def same_contents(a: PhysicalKVAllocator, b: PhysicalKVAllocator) -> bool:
    """Every live branch reads the same bits in both (free blocks are not compared: they
    hold uninitialised memory)."""
    def contents(alloc):
        ids = alloc.live_branch_ids()
        tables, lengths = alloc.block_tables(ids)
        return [reference.gather_sequence(pool, tables[i], int(n))
                for pool in every_pool(alloc) for i, n in enumerate(lengths.tolist())]
    return all(same_bits(x, y) for x, y in zip(contents(a), contents(b), strict=True))


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention", lambda w: tree_attention(w.q[:, :3].contiguous(), w.alloc, w.ids),
     ValueError, ["num_qo_heads must be a positive multiple of the allocator's num_kv_heads (2),"
                  " got 3"]),
    ("plan zero", lambda w: TreeAttentionPlan(w.alloc, w.ids, 0), ValueError,
     ["num_qo_heads must be >= 1, got 0"]),
    ("plan float", lambda w: TreeAttentionPlan(w.alloc, w.ids, 4.0), TypeError,
     ["num_qo_heads must be an int, got float 4.0"]),
    ("paged_decode", lambda w: decode(w, q=w.problem.q[:, :3].contiguous(),
                                      out=w.pd_out[:, :3].contiguous()), ValueError,
     ["num_qo_heads (3) must be a multiple of num_kv_heads (2)"]),
))
def test_qo_heads_must_be_a_multiple_of_kv_heads(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("paged_decode head_dim", lambda w: paged_decode(*_head_dim_32_problem()), ValueError,
     ["q has head_dim 32, which is not compiled; compiled: (64, 128, 256)"]),
    ("plan head_dim", lambda w: TreeAttentionPlan(*other_allocator(head_dim=32), 2,
                                                                   _options=PlanOptions(
                                                                                        arch="sm90")),
                                                                                        ValueError,
     ["allocator has head_dim 32, which is not compiled"]),
    ("plan dtype", lambda w: TreeAttentionPlan(*other_allocator(torch.float32), 2,
                                                                _options=PlanOptions(arch="sm90")),
     TypeError, ["allocator has dtype float32, which is not compiled"]),
    ("cuda allocator dtype", lambda w: PhysicalKVAllocator(4, 4, 1, 64, dtype=torch.float32,
                                                           device="cuda"),
     TypeError, ["the allocator has dtype float32"]),
))
def test_only_compiled_head_dims_and_dtypes_reach_the_kernels(world, call, error, fragments):
    rejected(world, call, error, fragments)


def _head_dim_32_problem():
    p = paged_problem([3], 2, 1, 32)
    return p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention unknown", lambda w: tree_attention(w.q, w.alloc, w.ids[:-1] + [999]),
     UnknownBranch, ["branch_id 999 is not a live branch"]),
    ("tree_attention freed", lambda w: tree_attention(w.q, w.alloc, w.ids[:-1] + [w.dead]),
     UnknownBranch, ["branch_id {dead} is not a live branch (unknown, freed or pruned)"]),
    ("tree_attention repeated", lambda w: tree_attention(w.q, w.alloc, w.ids[:-1] + w.ids[:1]),
     ValueError, ["branch_ids must be distinct, got 0 2 times"]),
    ("plan repeated", lambda w: TreeAttentionPlan(w.alloc, w.ids + w.ids[2:3], 4), ValueError,
     ["branch_ids must be distinct"]),
    ("plan floats", lambda w: TreeAttentionPlan(w.alloc, [0.0, 1.0], 4), TypeError,
     ["branch_ids must be a 1-D sequence of ints", "dtype float64"]),
    ("reserve freed", lambda w: w.alloc.reserve([w.ids[0], w.dead]), UnknownBranch,
     ["branch_id {dead}"]),
    ("free twice", lambda w: w.alloc.free_branch(w.dead), UnknownBranch, ["{dead}"]),
    ("prune freed", lambda w: w.alloc.prune(w.dead), UnknownBranch, ["{dead}"]),
    ("write freed", lambda w: w.alloc.write(w.dead, 0, *(t[:1] for t in w.kv)), UnknownBranch,
     ["{dead}"]),
    ("fork freed", lambda w: w.alloc.alloc_branches(2, 3, parent_branch_id=w.dead),
     UnknownBranch, ["{dead}"]),
))
def test_branch_ids_must_be_live_and_distinct(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention", lambda w: tree_attention(w.q, w.alloc, w.ids, layer=2), ValueError,
     ["layer must lie in [0, 1], got 2"]),
    ("run negative", lambda w: w.plan.run(w.q, -1), ValueError, ["layer must lie in [0, 1]",
                                                                 "got -1"]),
    ("run bool", lambda w: w.plan.run(w.q, True), TypeError, ["layer must be an int, got bool"]),
    ("run float", lambda w: w.plan.run(w.q, 0.0), TypeError, ["layer must be an int, got float"]),
    ("write", lambda w: w.alloc.write(w.ids[0], 2, *(t[:1] for t in w.kv)), ValueError,
     ["layer must lie in [0, 1], got 2"]),
    ("append", lambda w: w.alloc.append(w.step, -1, *w.kv), ValueError,
     ["layer must lie in [0, 1], got -1"]),
))
def test_layer_must_be_in_range(world, call, error, fragments):
    rejected(world, call, error, fragments)


SCALE_ENTRY_POINTS = {
    "tree_attention": lambda w, s: tree_attention(w.q, w.alloc, w.ids, sm_scale=s),
    "TreeAttentionPlan": lambda w, s: TreeAttentionPlan(w.alloc, w.ids, 4, sm_scale=s),
    "paged_decode": lambda w, s: decode(w, sm_scale=s),
}
ABOVE_BOUND = float(np.nextafter(max_scale(HEAD_DIM), np.inf))
BAD_SCALES = [(float("nan"), ValueError, "got nan"), (float("inf"), ValueError, "got inf"),
              (-float("inf"), ValueError, "got -inf"), (1e39, ValueError, "got 1e+39"),
              (1e38, ValueError, "got 1e+38"), (ABOVE_BOUND, ValueError, f"got {ABOVE_BOUND!r}"),
              (-ABOVE_BOUND, ValueError, f"got {-ABOVE_BOUND!r}"),
              (True, TypeError, "got bool True"), ("0.5", TypeError, "got str '0.5'"),
              (torch.tensor(0.5), TypeError, "got Tensor")]


@pytest.mark.parametrize("entry", sorted(SCALE_ENTRY_POINTS))
@pytest.mark.parametrize("scale, error, given", BAD_SCALES, ids=lambda x: repr(x)[:12])
def test_sm_scale_must_be_a_finite_real_within_the_bound(world, entry, scale, error, given):
    expected = ("sm_scale must be finite and at most 4.29457e+26 in magnitude for head_dim 64"
                if error is ValueError else "sm_scale must be a real")
    rejected(world, lambda w: SCALE_ENTRY_POINTS[entry](w, scale), error, [expected, given])


@pytest.mark.parametrize("entry", sorted(SCALE_ENTRY_POINTS))
@pytest.mark.parametrize("scale", [max_scale(HEAD_DIM), -max_scale(HEAD_DIM), 0.0, -0.3])
def test_scales_within_the_bound_are_accepted(world, entry, scale):
    """Zero (uniform weights) and negative scales too; test_numerics checks the answers."""
    assert SCALE_ENTRY_POINTS[entry](world, scale) is not None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_c_abi_accepts_exactly_the_scales_python_accepts(head_dim):
    """The C ABI's float sm_scale (0: the default) against check_scale: the largest float32
    within the bound and its negation pass both, the next float32 above fails both."""
    from test_capi import FR_INVALID_ARGUMENT, FR_OK, CApi, small_problem
    api = CApi()
    context = api.host_context()
    try:
        inside = float(np.float32(max_scale(head_dim)))
        if inside > max_scale(head_dim):
            inside = float(np.nextafter(np.float32(inside), np.float32(0)))
        outside = float(np.nextafter(np.float32(inside), np.float32(np.inf)))
        for scale, accepted in [(inside, True), (-inside, True), (-1.0, True), (1e-30, True),
                                (outside, False), (-outside, False), (float("nan"), False)]:
            problem = small_problem()
            problem.shape.update(head_dim=head_dim, sm_scale=scale)
            status, message, plan = api.plan(context, problem)
            assert status == (FR_OK if accepted else FR_INVALID_ARGUMENT), (scale, message)
            if plan is not None:
                api.lib.frPlanDestroy(plan)
            else:
                assert "shape.sm_scale must be finite and at most" in message
                assert f"for head_dim {head_dim}" in message
            try:
                check_scale(scale, head_dim)
                assert accepted, scale
            except ValueError:
                assert not accepted, scale
    finally:
        api.lib.frContextDestroy(context)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("plan target_chunk", lambda w: TreeAttentionPlan(w.alloc, w.ids, 4,
                                                      _options=PlanOptions(target_chunk=0)),
     ValueError, ["target_chunk must be >= 1, got 0"]),
    ("plan num_sms", lambda w: TreeAttentionPlan(w.alloc, w.ids, 4,
                                                 _options=PlanOptions(num_sms=2.5)), TypeError,
     ["num_sms must be an int, got float 2.5"]),
    ("alloc num_tokens", lambda w: w.alloc.alloc_branch(MAX_TOKENS + 1), ValueError,
     [f"num_tokens must be <= 252, got {MAX_TOKENS + 1}", "max_tokens = 252, the pool's 63"]),
    ("alloc_branches count", lambda w: w.alloc.alloc_branches(True, 3), TypeError,
     ["count must be an int, got bool True"]),
))
def test_sizes_must_be_ints_in_range(world, call, error, fragments):
    rejected(world, call, error, fragments)


@pytest.mark.parametrize("call, error, fragments", cases(
    ("past the pool", lambda w: write_slots(w, slots=torch.tensor([4, 64 * 4])), ValueError,
     ["slots must lie in [0, 255] (num_blocks * block_size), got [4, 256]"]),
    ("negative", lambda w: write_slots(w, slots=torch.tensor([-1, 5])), ValueError,
     ["slots must lie in [0, 255]", "got [-1, 5]"]),
    ("repeated", lambda w: write_slots(w, slots=torch.tensor([5, 5])), ValueError,
     ["slots must be distinct, got 1 repeated"]),
))
def test_write_slots_writes_only_distinct_slots_of_the_pool(world, call, error, fragments):
    rejected(world, call, error, fragments)


def test_a_step_is_valid_only_in_its_allocator(world):
    other = make_world()
    rejected(world, lambda w: w.alloc.append(other.step, 0, *w.kv), ValueError,
             ["step was reserved by another allocator"])
    rejected(world, lambda w: w.alloc.reserve(other.step), ValueError, ["another allocator"])


@pytest.mark.parametrize("entry", [-1, 9])
def test_paged_decode_tables_must_name_pool_blocks(world, entry):
    """On CPU; on CUDA the tables are trusted (checking would sync)."""
    tables = world.problem.block_tables.clone()
    tables[0, 2] = 8                                         # the last block: fine
    assert not decode(world, block_tables=tables, out=None).isnan().any()
    tables[1, 2] = entry
    rejected(world, lambda w: decode(w, block_tables=tables), ValueError,
             ["block_tables entries must lie in [0, 8] (the pool's blocks)", f"got {entry}"])


# ---- plan.run's checks -------------------------------------------------------------------------

@pytest.mark.parametrize("spoil", [
    lambda t: t.float(), lambda t: t.bfloat16(), lambda t: t[1:],
    lambda t: t[..., :32].contiguous(), lambda t: t[None], noncontiguous, lambda t: t.to("meta"),
    lambda t: t.numpy(), lambda t: [t],
], ids=["float32", "bfloat16", "rows", "head_dim", "4-D", "strides", "meta", "ndarray", "list"])
def test_run_refuses_a_spoiled_q_or_out(world, spoil):
    bad = spoil(world.q)
    for call in (lambda: world.plan.run(bad), lambda: world.plan.run(world.q, 0, bad)):
        with pytest.raises((TypeError, ValueError)):
            call()


# ---- on the GPU -------------------------------------------------------------------------------

def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


@gpu
@pytest.mark.parametrize("call, error, fragments", cases(
    ("tree_attention q", lambda w: tree_attention(w.q.cpu(), w.alloc, w.ids), ValueError,
     ["q is on cpu, expected cuda:0 (the allocator's device)"]),
    ("paged_decode k_pool", lambda w: decode(w, k_pool=w.problem.k_pool.cpu()), ValueError,
     ["k_pool is on cpu, expected cuda:0 (q's device)"]),
    ("write k", lambda w: w.alloc.write(w.ids[0], 0, *(t[:1].cpu() for t in w.kv)),
     ValueError, ["k must be on cuda:0 (the pool's device), got cpu"]),
    ("run q misaligned", lambda w: w.plan.run(misaligned(w.q)), ValueError,
     ["q's data must be 16-byte aligned"]),
    ("paged_decode out misaligned", lambda w: decode(w, out=misaligned(w.pd_out)), ValueError,
     ["out's data must be 16-byte aligned"]),
    ("write_slots past the pool", lambda w: write_slots(w, slots=torch.tensor([4, 256],
                                                                              device="cuda")),
     ValueError, ["slots must lie in [0, 255]", "got [4, 256]"]),
))
def test_gpu_devices_alignment_and_slots(call, error, fragments):
    rejected(make_world("cuda"), call, error, fragments)


@gpu
def test_gpu_misaligned_and_strided_kv_rows_are_handled():
    odd, dense = make_world("cuda"), make_world("cuda")
    k, v = (misaligned(t) for t in odd.kv)
    odd.alloc.append(odd.step, 0, k, v)
    odd.alloc.write(odd.ids[1], 1, noncontiguous(k[:3]), v[:3], start=2)
    dense.alloc.append(dense.step, 0, *dense.kv)
    dense.alloc.write(dense.ids[1], 1, *(t[:3] for t in dense.kv), start=2)
    assert same_contents(odd.alloc, dense.alloc)


class _Subclass(torch.Tensor):
    pass


@gpu
def test_gpu_run_quick_check_accepts_only_what_the_full_check_accepts():
    """``plan.run`` skips ``_validate`` when its quick check passes: every spoiled argument
    must fail the quick check (and then the full one), the valid ones must pass both."""
    w = make_world("cuda")
    plan, q = w.plan, w.q
    out = torch.empty_like(q)
    spoiled = {"float32": q.float(), "rows": q[1:], "4-D": q[None], "strides": noncontiguous(q),
               "misaligned": misaligned(q), "cpu": q.cpu(), "list": [q]}
    for name, bad in spoiled.items():
        for args in ((bad, 0, None), (q, 0, bad)):
            assert not plan._quick_check(*args), name
            with pytest.raises((TypeError, ValueError)):
                plan._validate(*args)
    for layer in (True, np.int64(0), -1, w.alloc.num_layers, 0.0):
        assert not plan._quick_check(q, layer, out), repr(layer)
    for args in ((q, 0, None), (q, 0, out), (q, w.alloc.num_layers - 1, out)):
        assert plan._quick_check(*args)
        plan._validate(*args)
    # a subclass takes the full check, which accepts it
    sub = q.as_subclass(_Subclass)
    assert not plan._quick_check(sub, 0, out)
    plan._validate(sub, 0, out)
