"""Fault paths: pool exhaustion (all-or-nothing), branches freed twice or used after a prune,
plans used after the tree changed, and damaged artifacts (missing or corrupted cubin, a
manifest from another package version). Each gives a clear error and changes nothing."""
import hashlib
import json
import shutil

import pytest
import torch

import flash_reasoning
from conftest import HAS_GPU, allocator_snapshot, assert_allocator_unchanged, gpu
from flash_reasoning import (
    PhysicalKVAllocator,
    PoolExhausted,
    StalePlan,
    TreeAttentionPlan,
    UnknownBranch,
    paged_decode,
    reference,
    runtime,
    tree_attention,
)
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.ops.tree_attention import TABLE_HEADROOM_BLOCKS
from flash_reasoning.tools.synthetic import paged_problem, random_branches, random_kv

BS, KV_HEADS, HEAD_DIM = 4, 1, 8
CHILDREN = 10


def allocator_with(free_blocks: int, layers: int = 2) -> PhysicalKVAllocator:
    """A root of 6 tokens (one full block, one half full) and ``free_blocks`` free blocks."""
    alloc = PhysicalKVAllocator(1 + 2 + free_blocks, BS, KV_HEADS, HEAD_DIM, num_layers=layers,
                                device="cpu")
    root = alloc.alloc_branch(0).branch_id
    for layer in range(layers):
        alloc.write(root, layer, *rows(alloc, 6))
    return alloc


def children(alloc, position=6, count=CHILDREN):
    """``count`` forks of the root at ``position`` (6: sharing its half-full block)."""
    return [b.branch_id for b in alloc.alloc_branches(count, position, 0, position)]


def rows(alloc, n):
    return random_kv(alloc, torch.Generator(), n)


def steps_to_a_block_end(alloc):
    """Children at a block boundary, stepped to the end of their next block (CHILDREN blocks
    used): the next step needs CHILDREN fresh blocks again."""
    step = alloc.reserve(children(alloc, position=4))
    for _ in range(BS - 1):
        step = alloc.reserve(step)
    return step


# Each needs CHILDREN blocks when only CHILDREN - 1 are free: (extra blocks the setup uses,
# setup -> argument, the call).
EXHAUSTING = {
    # Every child's first token goes into the shared half-full block: a copy each.
    "reserve": (0, children, lambda a, ids: a.reserve(ids)),
    "append, one layer": (0, children, lambda a, ids: a.append(ids, 0, *rows(a, len(ids)))),
    "reserve from a step": (CHILDREN, steps_to_a_block_end, lambda a, step: a.reserve(step)),
    # Forks inside a block holding the parent's data beyond the fork: a copy each.
    "fork many": (0, lambda a: None, lambda a, _: a.alloc_branches(CHILDREN, 7, 0, 5)),
    # Tokens 6..6+4*CHILDREN-1: the root's own half-full block, then CHILDREN fresh ones. A
    # second root holds one more block, so the root's new length fits the pool (max_tokens).
    "write many tokens": (1, lambda a: a.write(a.alloc_branch(0).branch_id, 0, *rows(a, 1)),
                          lambda a, _: a.write(0, 1, *rows(a, CHILDREN * BS), start=6)),
}


def exhausting(name: str, spare: int):
    """The allocator, the call's argument and the call of scenario ``name``, with ``spare``
    free blocks beyond the CHILDREN - 1 that make the call fail."""
    extra, setup, call = EXHAUSTING[name]
    alloc = allocator_with(CHILDREN - 1 + extra + spare, layers=1 if "one layer" in name else 2)
    return alloc, setup(alloc), call


@pytest.mark.parametrize("name", sorted(EXHAUSTING))
def test_pool_exhaustion_changes_nothing_and_says_what_was_needed(name):
    alloc, arg, call = exhausting(name, spare=0)
    before = allocator_snapshot(alloc)
    with pytest.raises(PoolExhausted) as info:
        call(alloc, arg)
    assert (info.value.needed, info.value.free) == (CHILDREN, CHILDREN - 1)
    assert f"needs {CHILDREN} free blocks, only {CHILDREN - 1} are free" in str(info.value)
    assert_allocator_unchanged(alloc, before)


@pytest.mark.parametrize("name", sorted(EXHAUSTING))
def test_the_same_call_succeeds_with_one_more_free_block(name):
    alloc, arg, call = exhausting(name, spare=1)
    call(alloc, arg)
    assert alloc.memory_report().blocks_free == 0


def test_freeing_twice_is_an_error_that_changes_nothing():
    alloc = allocator_with(20)
    kids = children(alloc, count=3)
    alloc.free_branch(kids[0])
    before = allocator_snapshot(alloc)
    with pytest.raises(UnknownBranch, match=f"branch_id {kids[0]} is not a live branch"):
        alloc.free_branch(kids[0])
    with pytest.raises(UnknownBranch):
        alloc.prune(kids[0])
    assert_allocator_unchanged(alloc, before)


def test_pruned_branches_cannot_be_used():
    alloc = allocator_with(20)
    kids = children(alloc, count=2)
    grandchild = alloc.alloc_branch(7, parent_branch_id=kids[0]).branch_id
    step = alloc.reserve(kids)
    handle = alloc.branch(grandchild)
    assert sorted(alloc.prune(kids[0])) == sorted([kids[0], grandchild])
    before = allocator_snapshot(alloc)
    q = torch.zeros(2, 2, HEAD_DIM, dtype=torch.float16)
    uses = [lambda: tree_attention(q, alloc, [kids[1], grandchild]),
            lambda: TreeAttentionPlan(alloc, [kids[0]], 2),
            lambda: alloc.write(grandchild, 0, *rows(alloc, 1)),
            lambda: alloc.alloc_branch(3, parent_branch_id=kids[0], fork_position=1),
            lambda: alloc.free_branch(grandchild),
            lambda: handle.length]
    for use in uses:
        with pytest.raises(UnknownBranch, match="is not a live branch"):
            use()
    assert not handle.alive
    with pytest.raises(ValueError, match="stale"):  # the step held a pruned branch
        alloc.append(step, 0, *rows(alloc, 2))
    assert_allocator_unchanged(alloc, before)


# ---- plans and the allocator's tree -----------------------------------------------------------

def planned_forest(layers=1):
    alloc = PhysicalKVAllocator(400, BS, 2, 64, num_layers=layers, device="cpu")
    ids = random_branches(alloc, 8, 3, 20, seed=11)
    return alloc, ids, TreeAttentionPlan(alloc, ids, 4)


def queries(alloc, ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(ids), 4, alloc.head_dim, generator=gen).half()


def assert_correct(out, q, alloc, ids):
    ref = reference.tree_attention(q, alloc, ids)
    assert reference.relative_error(out, ref) < reference.TOLERANCE[q.dtype]


def longest(alloc, ids) -> int:
    return max(ids, key=alloc.length)


# Each changes the tree (or may: a free can recycle blocks); ``ids`` stay live.
TREE_CHANGES = {
    "fork": lambda a, ids: a.alloc_branch(a.length(ids[0]), parent_branch_id=ids[0]),
    "fork inside a block": lambda a, ids: a.alloc_branches(
        3, 40, longest(a, ids), a.length(longest(a, ids)) - 1),
    "new root": lambda a, ids: a.alloc_branch(5),
    "free another branch": lambda a, ids: a.free_branch(a.alloc_branch(2).branch_id),
    "prune another branch": lambda a, ids: a.prune(a.alloc_branch(2, ids[1], 0).branch_id),
    "overwrite": lambda a, ids: a.write(longest(a, ids), 0, *rows(a, 1), start=0),
}


@pytest.mark.parametrize("change", sorted(TREE_CHANGES))
def test_a_plan_is_never_silently_stale(change):
    alloc, ids, plan = planned_forest()
    q = queries(alloc, ids)
    assert_correct(plan.run(q), q, alloc, ids)
    TREE_CHANGES[change](alloc, ids)
    for use in (plan.refresh, lambda: plan.run(q)):
        with pytest.raises(StalePlan, match="build a new TreeAttentionPlan"):
            use()
    assert_correct(tree_attention(q, alloc, ids), q, alloc, ids)  # replans by itself


def test_a_plan_follows_growth_and_copy_on_write():
    """Steps, extending writes and the copies they make keep the plan valid and right."""
    alloc, ids, plan = planned_forest(layers=2)
    version = alloc.tree_version
    for seed in range(3):
        step = alloc.reserve(ids)              # copies every shared partial block
        for layer in range(2):
            alloc.append(step, layer, *random_kv(alloc, torch.Generator().manual_seed(seed),
                                                 len(ids)))
        alloc.write(ids[seed], 0, *rows(alloc, 5), start=alloc.length(ids[seed]))
        q = queries(alloc, ids, seed)
        assert alloc.tree_version == version
        assert_correct(plan.run(q), q, alloc, ids)


def test_growing_past_the_plans_tables_is_stale():
    alloc, ids, plan = planned_forest()
    grow = (TABLE_HEADROOM_BLOCKS + 2) * BS
    alloc.write(longest(alloc, ids), 0, *rows(alloc, grow), start=alloc.length(longest(alloc, ids)))
    q = queries(alloc, ids)
    with pytest.raises(StalePlan, match="grew past the plan's"):
        plan.run(q)
    assert_correct(tree_attention(q, alloc, ids), q, alloc, ids)


# ---- damaged artifacts ------------------------------------------------------------------------

@pytest.fixture
def artifacts(tmp_path, monkeypatch):
    """A copy of this package's artifacts for the device's arch (sm90 without a GPU), which
    the runtime uses for this test only: its contexts are forgotten on both sides."""
    arch = runtime.arch_of(0) if HAS_GPU else "sm90"
    shutil.copytree(runtime.artifact_root() / arch, tmp_path / arch)
    monkeypatch.setenv("FLASH_REASONING_ARTIFACTS", str(tmp_path))
    runtime.reset()
    yield tmp_path / arch
    runtime.reset()


def set_package_version(arch_dir, version):
    path = arch_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("package_version")
    if version is not None:
        manifest["package_version"] = version
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("version", ["0.0.9", None])
def test_a_manifest_of_another_version_is_refused(artifacts, version):
    assert runtime.host_context(artifacts.name, 132).arch == artifacts.name  # accepted
    runtime.reset()
    set_package_version(artifacts, version)
    with pytest.raises(RuntimeError) as info:
        runtime.host_context(artifacts.name, 132)
    message = str(info.value)
    assert f"was built by package version '{version or ''}', this library is " \
           f"{flash_reasoning.__version__}" in message and str(artifacts) in message


def first_cubin(arch_dir, problem) -> str:
    """The cubin file the first launch of this paged decode loads."""
    name = decode_launches(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                           problem.seq_lens, torch.empty_like(problem.q), 0.1,
                           arch_dir.name, runtime.num_sms(0))[0].spec.name
    manifest = json.loads((arch_dir / "manifest.json").read_text())
    return next(k["cubin"] for k in manifest["kernels"] if k["name"] == name)


def corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return hashlib.sha256(data).hexdigest()


@gpu
@pytest.mark.parametrize("damage", ["corrupted", "missing", "version"])
def test_gpu_damaged_artifacts_are_clear_errors(artifacts, damage):
    problem = paged_problem([300, 7], 8, 2, 128, device="cuda")
    cubin = artifacts / first_cubin(artifacts, problem)
    runtime.reset()  # first_cubin opened the device's context: the call below opens it again
    if damage == "corrupted":
        fragments = ["corrupted artifact", str(cubin), f"sha256 is {corrupt(cubin)}"]
    elif damage == "missing":
        cubin.unlink()
        fragments = [str(cubin)]
    else:
        set_package_version(artifacts, "0.0.9")
        fragments = ["was built by package version '0.0.9'", str(artifacts)]
    with pytest.raises(RuntimeError) as info:
        paged_decode(problem.q, problem.k_pool, problem.v_pool, problem.block_tables,
                     problem.seq_lens)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
