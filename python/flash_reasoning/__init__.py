"""flash-reasoning: tree-aware decode attention over refcounted paged KV blocks.

Kernels are Triton, compiled ahead of time to cubins and launched by a small C++ launcher:
importing this package never imports triton and never compiles anything.
"""
__version__ = "0.1.0"

from .allocator import PhysicalKVAllocator, PoolExhausted, UnknownBranch  # noqa: E402
from .paged_decode import paged_decode  # noqa: E402
from .runtime import available_archs  # noqa: E402

__all__ = ["__version__", "PhysicalKVAllocator", "PoolExhausted", "UnknownBranch",
           "available_archs", "paged_decode"]
