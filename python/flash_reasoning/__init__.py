"""flash-reasoning: tree-aware decode attention over refcounted paged KV blocks.

Kernels are Triton, compiled ahead of time to cubins and launched by a small C++ launcher:
importing this package never imports triton and never compiles anything. Exports load on
first use, so the AOT build can import ``specializations`` and ``dispatch`` without torch.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "PhysicalKVAllocator": "allocator", "PoolExhausted": "allocator",
    "UnknownBranch": "allocator", "paged_decode": "ops.paged_decode",
    "available_archs": "runtime", "tree_attention": "ops.tree_attention",
    "TreeAttentionPlan": "ops.tree_attention", "StalePlan": "ops.tree_attention",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flash_reasoning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
