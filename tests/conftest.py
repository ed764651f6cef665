import importlib.util
import os
import socket
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


#: The marks of a test that needs a CUDA GPU: ``gpu`` (``pytest -m gpu`` runs them alone, as
#: ci/gpu_check.sh does), and skipped without one. ``pytest.param(..., marks=GPU_MARKS)``.
GPU_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU"))


def gpu(test):
    """Decorates a test that needs a CUDA GPU with :data:`GPU_MARKS`."""
    for mark in GPU_MARKS:
        test = mark(test)
    return test


# Triton 3.6's interpreter calls int() on 1-element arrays, which numpy 2.4 rejects; the
# test extra pins numpy<2.4, a GPU machine's own numpy may be newer.
interpreter = pytest.mark.skipif(tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4),
                                 reason="Triton 3.6's interpreter needs numpy<2.4")


@pytest.fixture
def one_thread():
    """Tiny matmuls (the Hugging Face tests' models): threads only contend, and the CI machine
    may be shared. ``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: The block size of :func:`tiny_allocator`.
TINY_BLOCK = 4


def tiny_allocator(num_blocks: int = 64):
    """A CPU float32 allocator of ``TINY_BLOCK``-token blocks, one KV head of 2: for tests of
    tree structure, whose rows are :func:`constant_rows`."""
    from flash_reasoning.allocator import PhysicalKVAllocator
    return PhysicalKVAllocator(num_blocks, TINY_BLOCK, 1, 2, dtype=torch.float32, device="cpu")


def constant_rows(n: int, value: float = 1.0):
    """K and V rows for :func:`tiny_allocator`: K all ``value``, V its negation."""
    k = torch.full((n, 1, 2), value)
    return k, -k


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so a row the kernel never writes fails the check."""
    return torch.full_like(t, float("nan"))


def every_pool(alloc):
    """The allocator's K and V pools of every layer."""
    return (*alloc.k_pools, *alloc.v_pools)


def allocator_snapshot(alloc):
    """Everything the allocator holds, to check that a failed call changed nothing."""
    arrays = {name: getattr(alloc, name).copy() for name in
              ("_tables", "_lengths", "_refcount", "_fill", "_free", "_row_of")}
    rest = (alloc._free_top, alloc._next_id, sorted(alloc._branches), dict(alloc._lineage),
            dict(alloc._live_parent), {b: set(c) for b, c in alloc._live_children.items()},
            alloc._free_rows[:alloc._free_rows_top].tolist(), alloc.tree_version,
            alloc.table_version, alloc.memory_report())
    pools = [p.clone() for p in every_pool(alloc)]
    return arrays, rest, pools


def assert_allocator_unchanged(alloc, before):
    arrays, rest, pools = allocator_snapshot(alloc)
    # The table mirror may have grown columns (capacity, all the zero block): not a change.
    width = before[0]["_tables"].shape[1]
    assert not arrays["_tables"][:, width:].any(), "_tables beyond the old width"
    arrays["_tables"] = arrays["_tables"][:, :width]
    for name, value in before[0].items():
        assert numpy.array_equal(arrays[name], value), name
    assert rest == before[1]
    assert all(same_bits(a, b) for a, b in zip(pools, before[2]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: free blocks hold uninitialised memory, possibly NaN."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def free_port() -> int:
    """A TCP port free now on this machine (torchrun's rendezvous for multi-process tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
