"""GPU timing as the benchmarks do it: CUDA events, L2 flushed before every run, median."""
from __future__ import annotations

import statistics

import torch

#: Larger than any current L2 (H100: 50 MB), so one write evicts everything.
L2_FLUSH_BYTES = 256 << 20


def median_us(fn, runs: int = 100, warmup: int = 5) -> float:
    """Median time of ``fn()`` in microseconds; the L2 is flushed before each run."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_bandwidth_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time): the floor's denominator."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), runs=20)
    return 2 * nbytes / (us * 1e-6) / 1e12
