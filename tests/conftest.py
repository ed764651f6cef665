import os
import sys
from pathlib import Path

import pytest

# The interpreter must be chosen before triton is first imported; CPU tests run the real
# kernels through it. aot/ (kernel sources) is importable from the repository root.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy  # noqa: E402
import torch  # noqa: E402

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
# Triton 3.6's interpreter calls int() on 1-element arrays, which numpy 2.4 rejects; the
# test extra pins numpy<2.4, a GPU machine's own numpy may be newer.
interpreter = pytest.mark.skipif(tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4),
                                 reason="Triton 3.6's interpreter needs numpy<2.4")


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so a row the kernel never writes fails the check."""
    return torch.full_like(t, float("nan"))
