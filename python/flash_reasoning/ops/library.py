"""``TreeAttentionPlan.run`` as a ``torch.library`` custom op, so a compiled model
(``torch.compile``) can call it: ``torch.ops.flash_reasoning.tree_attention_run(q, plan, layer)``.

A plan is a Python object (host-side work lists, device buffers, the allocator it reads), and
an op's schema takes tensors and scalars only; so the op names its plan by an int *handle*
from :func:`plan_handle`. The registry holds plans weakly (a handle never keeps a plan, its
buffers or its allocator alive) and never reuses a handle: a handle whose plan is gone raises,
it cannot silently name a newer plan. An int is also what compilation wants: a constant in
the graph that dynamo guards on, so one compiled graph serves every step of one plan (a new
plan, after the tree changed, is a new constant). The op returns a new tensor and mutates
nothing (functional, so no aliasing annotations are needed); its fake implementation gives
``q``'s shape, dtype and device, which is all ``run`` guarantees.

Importing this module registers the op (``import flash_reasoning`` does not import it).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from .tree_attention import TreeAttentionPlan

_next_handle = itertools.count(1)
_plans: weakref.WeakValueDictionary[int, TreeAttentionPlan] = weakref.WeakValueDictionary()
_handles: weakref.WeakKeyDictionary[TreeAttentionPlan, int] = weakref.WeakKeyDictionary()


def plan_handle(plan: TreeAttentionPlan) -> int:
    """The op's handle for ``plan`` (the same int for as long as the plan lives)."""
    if not isinstance(plan, TreeAttentionPlan):
        raise TypeError(f"plan must be a TreeAttentionPlan, got {type(plan).__name__}")
    handle = _handles.get(plan)
    if handle is None:
        handle = next(_next_handle)
        _plans[handle] = plan
        _handles[plan] = handle
    return handle


def plan_of(handle: int) -> TreeAttentionPlan:
    """The live plan ``handle`` names; raises when it was never issued or its plan is gone."""
    plan = _plans.get(handle)
    if plan is None:
        raise ValueError(f"plan handle {handle} names no live TreeAttentionPlan (never issued "
                         f"by plan_handle(), or its plan was garbage-collected); keep the plan "
                         f"alive while graphs that call the op with its handle run")
    return plan


@torch.library.custom_op("flash_reasoning::tree_attention_run", mutates_args=())
def tree_attention_run(q: torch.Tensor, plan: int, layer: int) -> torch.Tensor:
    """``plan_of(plan).run(q, layer)``: ``q`` ``[num_branches, num_qo_heads, head_dim]``
    in the pool's dtype; returns a new tensor of q's shape."""
    return plan_of(plan).run(q.contiguous(), layer)


@tree_attention_run.register_fake
def _tree_attention_run_fake(q: torch.Tensor, plan: int, layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
