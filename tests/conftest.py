import os
import sys
from pathlib import Path

import pytest

# The interpreter must be chosen before triton is first imported; CPU tests run the real
# kernels through it. aot/ (kernel sources) is importable from the repository root.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so a row the kernel never writes fails the check."""
    return torch.full_like(t, float("nan"))
