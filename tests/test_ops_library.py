"""flash_reasoning.ops.library: TreeAttentionPlan.run as the custom op
flash_reasoning::tree_attention_run passes torch.library.opcheck, runs inside a graph that
torch.compile captures whole, and names its plan by a handle that never outlives the plan."""
import ast
import gc
from pathlib import Path

import pytest
import torch

from conftest import gpu
from flash_reasoning import PhysicalKVAllocator, TreeAttentionPlan
from flash_reasoning.ops import library


def tree_plan(device="cpu", dtype=torch.float32, head_dim=16):
    """A 9-token root forked 3 times, one decode step appended, two layers."""
    gen = torch.Generator().manual_seed(0)
    alloc = PhysicalKVAllocator(32, 4, 2, head_dim, num_layers=2, dtype=dtype, device=device)

    def kv(n):
        return [torch.randn(n, 2, head_dim, generator=gen).to(device, dtype) for _ in "kv"]

    root = alloc.alloc_branch(0).branch_id
    for layer in range(2):
        alloc.write(root, layer, *kv(9))
    kids = [b.branch_id for b in alloc.alloc_branches(3, 9, root)]
    step = alloc.reserve(kids)
    for layer in range(2):
        alloc.append(step, layer, *kv(3))
    q = torch.randn(3, 4, head_dim, generator=gen).to(device, dtype)
    return TreeAttentionPlan(alloc, kids, 4), q


def test_opcheck():
    plan, q = tree_plan()
    torch.library.opcheck(torch.ops.flash_reasoning.tree_attention_run.default,
                          (q, library.plan_handle(plan), 1))


def test_op_equals_run_and_compiles_into_one_graph():
    plan, q = tree_plan()
    handle = library.plan_handle(plan)
    assert library.plan_handle(plan) == handle  # one handle per plan

    def step(q):
        return torch.ops.flash_reasoning.tree_attention_run(q * 2, handle, 1) + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # no graph break
    expected = plan.run(q * 2, 1) + 1
    torch.testing.assert_close(torch.ops.flash_reasoning.tree_attention_run(q * 2, handle, 1) + 1,
                               expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled(q), expected, rtol=0, atol=0)


def test_a_dead_plans_handle_raises_and_is_never_reused():
    plan, q = tree_plan()
    handle = library.plan_handle(plan)
    del plan
    gc.collect()
    with pytest.raises(ValueError, match=f"plan handle {handle} names no live"):
        torch.ops.flash_reasoning.tree_attention_run(q, handle, 0)
    other, _ = tree_plan()
    assert library.plan_handle(other) > handle
    with pytest.raises(TypeError, match="TreeAttentionPlan"):
        library.plan_handle(object())


def test_only_flash_reasoning_hf_imports_transformers_and_nothing_imports_the_op():
    """``import flash_reasoning`` stays instant: no module outside ``hf`` imports
    transformers, and only ``hf`` imports this module (which registers the op)."""
    package = Path(library.__file__).resolve().parent.parent
    for path in package.rglob("*.py"):
        if "hf" in path.relative_to(package).parts:
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module or "")
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        assert not any(name.split(".")[0] == "transformers" for name in imported), path
        assert not any(name.endswith("library") for name in imported), path


@gpu
def test_gpu_op_equals_run_under_compile():
    plan, q = tree_plan("cuda", torch.bfloat16, head_dim=128)
    handle = library.plan_handle(plan)
    compiled = torch.compile(
        lambda q: torch.ops.flash_reasoning.tree_attention_run(q, handle, 0), fullgraph=True)
    torch.testing.assert_close(compiled(q), plan.run(q, 0), rtol=0, atol=0)
