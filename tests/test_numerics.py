"""Numerical edge cases: logits of magnitude 1e4 and more in fp16 and bf16 (no overflow to
inf/NaN, split-K and tree merges included), head_dim 256, one sequence of 32k+ tokens (GPU),
the largest accepted sm_scale (right, not inf or NaN), and NaN inputs (they propagate to the
rows that read them; only an empty sequence gives zeros). Outputs are poisoned first and
checked against the float64 reference within reference.TOLERANCE."""
import math

import pytest
import torch

from conftest import GPU_MARKS, gpu, interpreter, poisoned_like
from flash_reasoning import (
    PhysicalKVAllocator,
    TreeAttentionPlan,
    paged_decode,
    reference,
    runtime,
    tree_attention,
)
from flash_reasoning.ops.checks import FLOAT16_MAX, max_scale
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.planner import PlanOptions
from flash_reasoning.tools.synthetic import paged_problem, random_kv
from flash_reasoning.tools.trees import build_branches, from_levels

DTYPES = [torch.float16, torch.bfloat16]
#: (center, spread) of the logits: every key's logit is center + spread * N(0, 1) (+ N(0, 1)).
#: Flat logits are held to fp32's resolution near them (ulp(1e4) ~ 1e-3: about 2e-4 relative
#: error at 1e4, 5e-4 at 3e4): 1e4 stays well inside fp16's tolerance. The last case goes far
#: past fp16's range (65504), peaked enough that fp32's resolution does not matter.
LOGITS = {"both signs": (0.0, 1e4), "near +1e4": (1e4, 100.0), "near -1e4": (-1e4, 100.0),
          "flat at 1e4": (1e4, 0.0), "both signs to 2e5": (0.0, 6e4)}
Q_NORM = 200.0
QO_HEADS, KV_HEADS = 8, 2


class LargeLogits:
    """Queries along one direction ``u`` (norms Q_NORM/2..Q_NORM) and keys whose logits
    against a query of norm Q_NORM are ``center + spread * N(0, 1)`` plus N(0, 1) from their
    components across ``u``; values N(0, 1). Every entry stays far inside fp16's range."""

    def __init__(self, head_dim: int, center: float, spread: float, dtype, device) -> None:
        self.gen = torch.Generator().manual_seed(0)
        u = torch.randn(head_dim, generator=self.gen)
        self.u = u / u.norm()
        self.center, self.spread = center, spread
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dtype, self.device = dtype, device

    def queries(self, n: int) -> torch.Tensor:
        norms = Q_NORM * (0.5 + 0.5 * torch.rand(n, QO_HEADS, 1, generator=self.gen))
        return self._cast(norms * self.u)

    def keys(self, n: int) -> torch.Tensor:
        logits = self.center + self.spread * torch.randn(n, KV_HEADS, 1, generator=self.gen)
        noise = torch.randn(n, KV_HEADS, self.u.numel(), generator=self.gen)
        return self._cast((logits * self.u + noise) / (self.scale * Q_NORM))

    def values(self, n: int) -> torch.Tensor:
        return self._cast(torch.randn(n, KV_HEADS, self.u.numel(), generator=self.gen))

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype).to(self.device)


def paged(logits: LargeLogits):
    """A paged problem (lengths 1, 37, 300) with large-logit queries and keys."""
    p = paged_problem([1, 37, 300], QO_HEADS, KV_HEADS, logits.u.numel(), device=logits.device)
    slots = p.k_pool.shape[0] * p.k_pool.shape[1]
    p.q = logits.queries(3)
    p.k_pool = logits.keys(slots).view(p.k_pool.shape)
    p.v_pool = logits.values(slots).view(p.v_pool.shape)
    return p


def tree(logits: LargeLogits):
    """A 200-token root under 4 leaves of 30 tokens, written with large-logit keys."""
    alloc = PhysicalKVAllocator(64, 16, KV_HEADS, logits.u.numel(), dtype=logits.dtype,
                                device=logits.device)
    leaves = build_branches(alloc, from_levels([1, 4], [200, 30]),
                            lambda node, layer, n: (logits.keys(n), logits.values(n)))
    return alloc, leaves


def assert_close(out, ref):
    assert torch.isfinite(out).all(), "inf or NaN in the output"
    err = reference.relative_error(out, ref)
    assert err < reference.TOLERANCE[out.dtype], f"relative error {err}"


def check_paged(p, splits: int, interpreted: bool, sm_scale: float | None = None) -> None:
    """``splits`` > 1: the merge kernel combines the splits' partials."""
    args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    out = poisoned_like(p.q)
    device = p.q.device
    arch, sms = ("sm90", 4) if interpreted else (runtime.arch_of(device.index),
                                                 runtime.num_sms(device.index))
    scale = 1 / math.sqrt(p.q.shape[-1]) if sm_scale is None else sm_scale
    launches = decode_launches(*args, out, scale, arch, sms, num_splits=splits)
    if interpreted:
        from aot.interpret import run_interpreted
        run_interpreted(launches)
    else:
        runtime.run(launches, device)
    assert_close(out, reference.paged_decode(*args, sm_scale=sm_scale))


def check_tree(logits: LargeLogits, interpreted: bool) -> None:
    """Chunks of 64 tokens: the root's partials are merged by the final kernel."""
    alloc, leaves = tree(logits)
    check_tree_plan(alloc, leaves, logits.queries(len(leaves)), interpreted)


def check_tree_plan(alloc, leaves, q, interpreted: bool, sm_scale: float | None = None) -> None:
    kw = dict(num_sms=4, arch="sm90") if interpreted else {}
    plan = TreeAttentionPlan(alloc, leaves, QO_HEADS, sm_scale,
                             _options=PlanOptions(target_chunk=64, **kw))
    assert plan.arrays.num_entries > 0
    out = poisoned_like(q)
    if interpreted:
        from aot.interpret import run_interpreted
        run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    else:
        plan.run(q, 0, out)
    assert_close(out, reference.tree_attention(q, alloc, leaves, sm_scale=sm_scale))


# ---- CPU: the interpreted kernels and the PyTorch path ------------------------------------

CPU_CASES = [(name, 64) for name in LOGITS] + [("both signs", 256)]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, head_dim", CPU_CASES)
def test_large_logits_interpreted(dtype, case, head_dim):
    logits = LargeLogits(head_dim, *LOGITS[case], dtype, "cpu")
    for splits in (1, 3):
        check_paged(paged(logits), splits, interpreted=True)
    check_tree(logits, interpreted=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(LOGITS))
def test_large_logits_torch_path(dtype, case):
    logits = LargeLogits(64, *LOGITS[case], dtype, "cpu")
    p = paged(logits)
    args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    assert_close(paged_decode(*args, out=poisoned_like(p.q)), reference.paged_decode(*args))
    alloc, leaves = tree(logits)
    q = logits.queries(len(leaves))
    assert_close(tree_attention(q, alloc, leaves, out=poisoned_like(q)),
                 reference.tree_attention(q, alloc, leaves))


def test_the_logits_are_as_large_as_claimed():
    """Guards the construction above: the logits' spread and center are what LOGITS says."""
    for center, spread in LOGITS.values():
        logits = LargeLogits(64, center, spread, torch.float32, "cpu")
        q = logits.queries(1)[0, 0]
        scores = logits.keys(2000)[:, 0] @ q * logits.scale * Q_NORM / q.norm()
        spread = math.hypot(spread, 1.0)  # the N(0, 1) across u
        assert abs(scores.mean() - center) < 0.1 * spread
        assert 0.9 * spread < scores.std() < 1.1 * spread


# ---- the largest accepted sm_scale: right, never inf or NaN ----------------------------------
# max_scale(head_dim) keeps float32 scores of float16 inputs within half the float32 range. At
# that scale random inputs give a hard maximum. Extreme inputs give the largest scores a
# float16 product sum reaches, +-max_scale * head_dim * 65504**2 (* log2 e in the kernels): q
# is 65504 everywhere, every key -65504 everywhere but the first of each sequence (+65504; the
# signs swap for a negative scale), so the online softmax subtracts a maximum of about half the
# float32 range from scores of minus that, and the answer is the first token's value. (Scores
# tied at such magnitudes across partials would be merged to float32's resolution of their
# LSE, far coarser than log(count): ties are kept inside one sequence's first token.)

def extreme_keys(n: int, first: bool, sign: int, dtype, device) -> torch.Tensor:
    """K rows of -sign * 65504 everywhere, the first +sign * 65504 when ``first``."""
    rows = torch.full((n, KV_HEADS, 64), -sign * FLOAT16_MAX)
    if first and n:
        rows[0] = sign * FLOAT16_MAX
    return rows.to(dtype).to(device)


def scale_problems(extreme: bool, sign: int, dtype, device):
    """(paged problem, allocator, leaves, tree queries) at head_dim 64: random N(0, 1) data, or
    the extreme inputs above (values random)."""
    gen = torch.Generator().manual_seed(0)
    p = paged_problem([1, 37, 300], QO_HEADS, KV_HEADS, 64, dtype=dtype, device=device)
    alloc = PhysicalKVAllocator(64, 16, KV_HEADS, 64, dtype=dtype, device=device)

    def fill(node, layer, n):
        k, v = random_kv(alloc, gen, n)
        return (extreme_keys(n, node == 0, sign, dtype, device) if extreme else k), v
    leaves = build_branches(alloc, from_levels([1, 4], [200, 30]), fill)
    q = torch.randn(len(leaves), QO_HEADS, 64, generator=gen).to(dtype).to(device)
    if extreme:
        slots = p.k_pool.shape[0] * p.k_pool.shape[1]
        k_pool = extreme_keys(slots, False, sign, dtype, device).view(p.k_pool.shape)
        k_pool[p.block_tables[:, 0].long(), 0] = sign * FLOAT16_MAX
        p.k_pool, p.q = k_pool, torch.full_like(p.q, FLOAT16_MAX)
        q = torch.full_like(q, FLOAT16_MAX)
    return p, alloc, leaves, q


SCALE_CASES = [pytest.param(dtype, False, id=f"random-{dtype}".replace("torch.", ""))
               for dtype in DTYPES] + [pytest.param(torch.float16, True, id="extreme-float16")]


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("dtype, extreme", SCALE_CASES)
def test_the_largest_scale_is_computed_right_torch_path(dtype, extreme, sign):
    scale = sign * max_scale(64)
    p, alloc, leaves, q = scale_problems(extreme, sign, dtype, "cpu")
    args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    assert_close(paged_decode(*args, scale, out=poisoned_like(p.q)),
                 reference.paged_decode(*args, sm_scale=scale))
    assert_close(tree_attention(q, alloc, leaves, out=poisoned_like(q), sm_scale=scale),
                 reference.tree_attention(q, alloc, leaves, sm_scale=scale))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreter),
                                    pytest.param("cuda", marks=GPU_MARKS)])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("dtype, extreme", SCALE_CASES)
def test_the_largest_scale_is_computed_right(dtype, extreme, sign, device):
    """The kernels (interpreted on CPU) at the largest sm_scale the checks accept."""
    scale = sign * max_scale(64)
    p, alloc, leaves, q = scale_problems(extreme, sign, dtype, device)
    interpreted = device == "cpu"
    for splits in (1, 3):
        check_paged(p, splits, interpreted=interpreted, sm_scale=scale)
    check_tree_plan(alloc, leaves, q, interpreted=interpreted, sm_scale=scale)


def test_flat_logits_of_1e8_are_normalised_torch_path():
    """37 equal keys at logit 9.6e7 (float32's ulp there is 8, more than log(37)): the weights
    are 1/37 each, as the kernels normalise them (by their sum, not by exp(-lse))."""
    gen = torch.Generator().manual_seed(0)
    alloc = PhysicalKVAllocator(8, 16, KV_HEADS, 64, device="cpu")
    bid = alloc.alloc_branch(0).branch_id
    k = torch.full((37, KV_HEADS, 64), 4000.0, dtype=torch.float16)
    alloc.write(bid, 0, k, random_kv(alloc, gen, 37)[1])
    q = torch.full((1, QO_HEADS, 64), 3000.0, dtype=torch.float16)  # q.k / 8 = 9.6e7
    assert_close(tree_attention(q, alloc, [bid], out=poisoned_like(q)),
                 reference.tree_attention(q, alloc, [bid]))


# ---- NaN inputs propagate ---------------------------------------------------------------------

def assert_same_nans_else_close(out, ref):
    """NaN exactly where the float64 reference has NaN; the rest within tolerance."""
    out, ref = out.cpu(), ref.cpu()
    assert torch.equal(out.isnan(), ref.isnan()), "NaN in other places than the reference's"
    finite = ~ref.isnan()
    assert_close(out[finite], ref[finite])


def test_nan_in_q_or_k_propagates_paged_decode_torch_path():
    """Sequence 0 has a NaN query head, sequence 2 a NaN key (KV head 1, position 4: query
    heads 4..7 read it), sequence 1 is empty (zeros), sequence 3 is clean."""
    p = paged_problem([5, 0, 7, 9], QO_HEADS, KV_HEADS, 64)
    p.q[0, 3, 10] = float("nan")
    p.k_pool[int(p.block_tables[2, 0]), 4, 1, 0] = float("nan")
    args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    out, ref = paged_decode(*args, out=poisoned_like(p.q)), reference.paged_decode(*args)
    assert ref[0, 3].isnan().all() and ref[2, 4:].isnan().all() and not ref[1].any()
    assert int(ref.isnan().any(-1).sum()) == 5  # the NaN reaches those rows only
    assert_same_nans_else_close(out, ref)


def test_nan_in_q_or_k_propagates_tree_attention_torch_path():
    """A NaN key in the shared root reaches every branch (their KV head 0 rows), a NaN query
    head its own row; a root-only branch of length 0 reads zeros."""
    gen = torch.Generator().manual_seed(0)
    alloc = PhysicalKVAllocator(64, 16, KV_HEADS, 64, device="cpu")
    leaves = build_branches(alloc, from_levels([1, 4], [40, 30]),
                            lambda node, layer, n: random_kv(alloc, gen, n))
    k, v = random_kv(alloc, gen, 1)
    k[0, 0, 5] = float("nan")
    alloc.write(leaves[0], 0, k, v, start=3)  # copy on write: only leaf 0 reads it
    ids = leaves + [alloc.alloc_branch(0).branch_id]
    q = torch.randn(len(ids), QO_HEADS, 64, generator=gen).half()
    q[1, 6, 0] = float("nan")
    ref = reference.tree_attention(q, alloc, ids)
    assert ref[0, :4].isnan().all() and ref[1, 6].isnan().all() and not ref[-1].any()
    assert int(ref.isnan().any(-1).sum()) == 5
    plan = TreeAttentionPlan(alloc, ids, QO_HEADS, _options=PlanOptions(target_chunk=16))
    assert_same_nans_else_close(plan.run(q, 0, poisoned_like(q)), ref)


# ---- GPU --------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", sorted(LOGITS))
def test_gpu_large_logits(dtype, head_dim, case):
    logits = LargeLogits(head_dim, *LOGITS[case], dtype, "cuda")
    for splits in (1, 3):
        check_paged(paged(logits), splits, interpreted=False)
    check_tree(logits, interpreted=False)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_sequence_of_32k_tokens(dtype, head_dim):
    """One 33001-token branch (not a block multiple) and four short forks of it, through
    tree_attention and paged_decode."""
    length = 32 * 1024 + 233
    alloc = PhysicalKVAllocator(-(-length // 16) + 64, 16, KV_HEADS, head_dim, dtype=dtype,
                                device="cuda")
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, length))
    ids = [root]
    for position in (0, 4096, length - 1, length):
        kid = alloc.alloc_branch(position, parent_branch_id=root, fork_position=position)
        alloc.write(kid.branch_id, 0, *random_kv(alloc, gen, 50), start=position)
        ids.append(kid.branch_id)
    q = torch.randn(len(ids), QO_HEADS, head_dim, generator=gen).to(dtype).cuda()
    ref = reference.tree_attention(q, alloc, ids)
    assert_close(tree_attention(q, alloc, ids, out=poisoned_like(q)), ref)
    tables, lengths = alloc.block_tables(ids)
    assert_close(paged_decode(q, alloc.k_pools[0], alloc.v_pools[0], tables, lengths,
                              out=poisoned_like(q)), ref)


@gpu
def test_gpu_nan_in_q_or_k_propagates():
    """The kernels, as the PyTorch path: NaN where the reference has NaN, zeros for an empty
    sequence."""
    p = paged_problem([5, 0, 7, 9], QO_HEADS, KV_HEADS, 64, device="cuda")
    p.q[0, 3, 10] = float("nan")
    p.k_pool[int(p.block_tables[2, 0]), 4, 1, 0] = float("nan")
    args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
    assert_same_nans_else_close(paged_decode(*args, out=poisoned_like(p.q)),
                                reference.paged_decode(*args))
