"""GPU timing as the benchmarks do it: CUDA events, L2 flushed before every run, median.

The times are GPU times: after the flush the stream spins for ``HOST_HEADROOM_CYCLES`` so the
host has queued all of ``fn``'s launches before the start event, and host overhead (Python,
argument packing) is not counted. Host cost is measured separately (``host_us``).
"""
from __future__ import annotations

import statistics
import time

import torch

#: Larger than any current L2 (H100: 50 MB), so one write evicts everything.
L2_FLUSH_BYTES = 256 << 20
#: GPU cycles (~0.2 ms at 1.8 GHz) spent after the flush while the host queues ``fn``.
HOST_HEADROOM_CYCLES = 400_000


def median_us(fn, runs: int = 100, warmup: int = 5) -> float:
    """Median time of ``fn()`` in microseconds; the L2 is flushed before each run.

    The flush *reads* a buffer larger than L2: a write would leave L2 full of dirty lines
    whose write-back to HBM then lands inside the timed region (~17 us on an H100)."""
    return median_us_each({"fn": fn}, runs, warmup)["fn"]


def median_us_each(fns: dict, runs: int = 100, warmup: int = 5) -> dict:
    """:func:`median_us` of each of ``fns`` (by key), their runs interleaved round by round so
    that drift (clocks, temperature) reaches each alike: what comparisons of configs need."""
    flush = torch.ones(L2_FLUSH_BYTES // 8, dtype=torch.int64, device="cuda")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    events = {key: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(runs)] for key in fns}
    for i in range(runs):
        for key, fn in fns.items():
            start, end = events[key][i]
            flush.sum()
            torch.cuda._sleep(HOST_HEADROOM_CYCLES)
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return {key: statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3
            for key, pairs in events.items()}


def copy_bandwidth_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time): the floor's denominator."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), runs=20)
    return 2 * nbytes / (us * 1e-6) / 1e12


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matrix-multiply rate (2 n^3 FLOPs / time) of an n-cube product: the roofline's
    compute term's denominator."""
    a = torch.randn(n, n, device="cuda").to(dtype)
    b, c = torch.randn_like(a), torch.empty_like(a)
    us = median_us(lambda: torch.mm(a, b, out=c), runs=20)
    return 2 * n**3 / (us * 1e-6) / 1e12


def launch_us() -> float:
    """A launch's fixed cost: a 4-byte write, timed as every op is (L2 flushed, GPU time)."""
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    return median_us(lambda: word.fill_(1), runs=100)


def host_us(fn, runs: int = 200) -> float:
    """Median host time of ``fn()`` in microseconds (the GPU work it queues is not waited
    for; the queue is drained every 50 calls so it never fills)."""
    times = []
    for i in range(runs):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6
