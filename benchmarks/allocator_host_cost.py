"""Host cost of the allocator's hot calls: forking 256 branches off a 2048-token root (one
``alloc_branches`` call, and 256 ``alloc_branch`` calls), and one batched decode step for 256
branches (reserve + one append per layer).

Times are host wall time (time.perf_counter) until the call returns, median of many
repetitions; on CUDA the GPU work is only launched.
Run: ``python benchmarks/allocator_host_cost.py``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flash_reasoning.allocator import PhysicalKVAllocator

ROOT_TOKENS, BRANCHES, HEADS, HEAD_DIM = 2048, 256, 8, 128


def new_allocator(device: str, num_layers: int) -> tuple[PhysicalKVAllocator, int]:
    alloc = PhysicalKVAllocator(num_blocks=1024, block_size=16, num_kv_heads=HEADS,
                                head_dim=HEAD_DIM, num_layers=num_layers, device=device)
    root = alloc.alloc_branch(0).branch_id
    prompt = torch.randn(ROOT_TOKENS, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    for layer in range(num_layers):
        alloc.write(root, layer, prompt, prompt)
    return alloc, root


def fork_all(alloc: PhysicalKVAllocator, root: int) -> list[int]:
    return [b.branch_id for b in alloc.alloc_branches(BRANCHES, ROOT_TOKENS, root)]


def fork_one_by_one(alloc: PhysicalKVAllocator, root: int) -> list[int]:
    return [alloc.alloc_branch(ROOT_TOKENS, parent_branch_id=root).branch_id
            for _ in range(BRANCHES)]


def time_forks(alloc: PhysicalKVAllocator, root: int, reps: int, fork=fork_all) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        ids = fork(alloc, root)
        times.append(time.perf_counter() - start)
        for bid in ids:
            alloc.free_branch(bid)
    return times


def time_steps(alloc: PhysicalKVAllocator, root: int, reps: int, device: str,
               chained: bool) -> tuple[list[float], list[float]]:
    """Per step: reserve alone, and reserve + append of every layer. Every 16th step of a
    branch takes a new block (copy of the zero block) and is included. ``chained``: each
    step reserves from the previous one (``reserve(step)``), else from the id list."""
    k = torch.randn(BRANCHES, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    reserve_times, step_times, steps_per_family = [], [], 32
    for _ in range(max(1, reps // steps_per_family)):
        ids = fork_all(alloc, root)
        step = alloc.reserve(ids)
        for _ in range(steps_per_family):
            start = time.perf_counter()
            step = alloc.reserve(step if chained else ids)
            reserved = time.perf_counter()
            for layer in range(alloc.num_layers):
                alloc.append(step, layer, k, k)
            done = time.perf_counter()
            reserve_times.append(reserved - start)
            step_times.append(done - start)
        for bid in ids:
            alloc.free_branch(bid)
    return reserve_times, step_times


def report(name: str, times: list[float], target_s: float) -> None:
    median = statistics.median(times)
    verdict = "ok" if median < target_s else "OVER"
    print(f"{name:<40} median {median * 1e6:9.1f} us   p90 "
          f"{sorted(times)[int(0.9 * len(times))] * 1e6:9.1f} us   "
          f"target < {target_s * 1e6:.0f} us  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    alloc, root = new_allocator(args.device, args.layers)
    time_forks(alloc, root, 5)  # warm-up
    fork_times = time_forks(alloc, root, args.reps // 4)
    loop_times = time_forks(alloc, root, args.reps // 4, fork_one_by_one)
    timed = {chained: time_steps(alloc, root, args.reps * 4, args.device, chained)
             for chained in (False, True)}
    print(f"device {args.device}, {args.layers} layer(s), {BRANCHES} branches, root "
          f"{ROOT_TOKENS} tokens, block 16, {HEADS} kv heads x {HEAD_DIM}, fp16")
    report("fork 256 branches (alloc_branches)", fork_times, 2e-3)
    report("fork 256 branches (alloc_branch x256)", loop_times, 2e-3)
    for chained, form in ((False, "reserve(ids)"), (True, "reserve(step)")):
        reserve_times, step_times = timed[chained]
        report(f"decode step: {form}", reserve_times, 100e-6)
        report(f"decode step: {form} + {args.layers} append", step_times, 100e-6)


if __name__ == "__main__":
    main()
