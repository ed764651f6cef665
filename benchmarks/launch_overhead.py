"""Host cost of a launch: ``plan.run`` per layer, ``tree_attention`` and ``paged_decode``,
against the GPU time of the work they queue; then where ``plan.run``'s host time goes: its
checks, ``refresh``, and one call of the C++ plan's prepared launches (converted and checked
once, per call only the q/k_pool/v_pool/out pointers), against the per-launch path
(``plan.launches`` + ``runtime.run``), whose output it must equal.

Tree: the seed's headline case (2048-token root, 256 leaves of 64 tokens, 32/8 heads,
head_dim 128, fp16), whose plan is one partial launch and one final launch.

- host us: wall time of a loop of calls (``time.perf_counter_ns``), no sync inside the loop.
  The calls run in batches of ``BATCH`` (at most ``2 * BATCH`` launches queued, far below
  the driver's queue depth) with a sync *between* batches, outside the timed loops: a launch
  then never waits for a free queue slot, so the GPU is never what is measured. The figure
  is the median batch's time per call. A small tree (4 leaves) gives the same plan shape
  with little GPU work, so its queue stays near empty.
- loop us: the same calls in one loop of ``CALLS`` with a sync only at the end: the steady
  rate when host and GPU overlap (about max(host, GPU) once the queue is full).
- GPU us: CUDA events around one call, L2 flushed, median (``timing.median_us``).

Target: host < 15 us per ``plan.run`` of a two-kernel run (a layer's GPU time is 10 us or more).
``python benchmarks/launch_overhead.py [--calls 2000] [--json out.json]``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from flash_reasoning import TreeAttentionPlan, runtime, tree_attention
from flash_reasoning.ops import tree_attention as tree_module
from flash_reasoning.ops.paged_decode import _validate as paged_validate
from flash_reasoning.ops.paged_decode import decode_launches, paged_decode
from flash_reasoning.tools import timing
from flash_reasoning.tools.bench import Separate, case_allocator, seed_case
from flash_reasoning.tools.synthetic import paged_problem

TARGET_US = 15.0
CALLS = 2000
BATCH = 20


def host_us(fn, calls: int = CALLS, batch: int = BATCH) -> float:
    """Host wall time per call of ``fn``: the median over timed loops of ``batch`` calls,
    synced between (outside the timing), so an interrupt or a collection in one loop does
    not move the figure."""
    per_call = []
    for _ in range(max(1, calls // batch)):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter_ns() - start) / batch / 1e3)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def loop_us(fn, calls: int = CALLS) -> float:
    """Per call of one loop of ``calls`` with a sync only at the end (host and GPU overlap)."""
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / calls / 1e3


class Setup:
    """The seed tree, its plan, q/out and the same paths stored separately for
    ``paged_decode``; a split ``paged_decode`` problem (few long sequences)."""

    def __init__(self) -> None:
        self.alloc, self.leaves = case_allocator(seed_case(256))
        self.ids = np.asarray(self.leaves)
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.q = torch.randn(len(self.leaves), 32, 128, generator=gen, device="cuda").half()
        self.out = torch.empty_like(self.q)
        self.plan = TreeAttentionPlan(self.alloc, self.leaves, 32)
        self.pools = (self.alloc.k_pools[0], self.alloc.v_pools[0])
        self.launches = self.plan.launches(self.q, *self.pools, self.out)
        self.separate = Separate.from_tree(self.alloc, self.leaves)
        self.split = paged_problem([8192] * 4, 32, 8, 128, device="cuda")
        self.split_out = torch.empty_like(self.split.q)
        small_alloc, small_leaves = case_allocator(seed_case(4, 256, 16))
        self.small_plan = TreeAttentionPlan(small_alloc, small_leaves, 32)
        self.small_q = self.q[:4].clone()
        self.small_out = torch.empty_like(self.small_q)

    def paged_args(self, split: bool) -> tuple:
        if split:
            p = self.split
            return p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, self.split_out
        s = self.separate
        pool_shape = (-1, s.block_size, *s.k.shape[2:])
        return (self.q, s.k.view(pool_shape), s.v.view(pool_shape), s.tables, s.lengths,
                self.out)

    def paged_launches(self, split: bool) -> list:
        args = self.paged_args(split)
        index = args[0].device.index
        return decode_launches(*args, 0.1, runtime.arch_of(index), runtime.num_sms(index))

    def calls(self) -> dict[str, tuple]:
        """name -> (call, number of kernel launches it makes)."""
        q, out, alloc = self.q, self.out, self.alloc
        return {
            "plan.run": (lambda: self.plan.run(q, 0, out), len(self.launches)),
            "plan.run (small tree)": (
                lambda: self.small_plan.run(self.small_q, 0, self.small_out),
                len(self.small_plan.launches(self.small_q, *self.pools, self.small_out))),
            "tree_attention (ids list)": (lambda: tree_attention(q, alloc, self.leaves, 0, out),
                                          len(self.launches)),
            "tree_attention (ids ndarray)": (lambda: tree_attention(q, alloc, self.ids, 0, out),
                                             len(self.launches)),
            "paged_decode (256 seqs)": (lambda: paged_decode(*self.paged_args(False)[:5],
                                                             out=out),
                                        len(self.paged_launches(False))),
            "paged_decode (4 x 8192, split)": (
                lambda: paged_decode(*self.paged_args(True)[:5], out=self.split_out),
                len(self.paged_launches(True))),
        }


def overhead_table(setup: Setup, calls: int) -> list[dict]:
    rows = []
    print(f"{'call':<32}{'launches':>9}{'host us':>10}{'loop us':>9}{'GPU us':>9}  host < GPU")
    for name, (fn, launches) in setup.calls().items():
        host_us(fn, 10 * BATCH)  # loads the cubins, builds the cached plan, warms the host
        row = {"call": name, "launches": launches, "host_us": host_us(fn, calls),
               "loop_us": loop_us(fn, calls), "gpu_us": timing.median_us(fn, runs=100)}
        rows.append(row)
        print(f"{name:<32}{launches:>9}{row['host_us']:10.2f}{row['loop_us']:9.2f}"
              f"{row['gpu_us']:9.2f}  {'yes' if row['host_us'] < row['gpu_us'] else 'NO'}")
    run = rows[0]["host_us"]
    print(f"plan.run host {run:.2f} us per layer -> target < {TARGET_US:.0f} us "
          f"{'met' if run < TARGET_US else 'MISSED'}")
    return rows


# ---- where plan.run's host time goes ----------------------------------------------------------

def old_path(setup: Setup):
    """The per-launch path (for comparison): the plan's Launch records, every argument
    converted in Python, one checked launcher call per kernel."""
    plan, q, out = setup.plan, setup.q, setup.out
    return lambda out=out: runtime.run(plan.launches(q, *setup.pools, out), q.device)


def plan_run_parts(setup: Setup) -> dict[str, object]:
    plan, q, out = setup.plan, setup.q, setup.out
    device = q.device
    stream = runtime.current_raw_stream(device.index)
    pointers = (q.data_ptr(), *(p.data_ptr() for p in setup.pools), out.data_ptr())
    alloc = setup.alloc
    return {
        "plan.run (whole)": lambda: plan.run(q, 0, out),
        "_quick_check (what run checks)": lambda: plan._quick_check(q, 0, out),
        "_validate (when it fails)": lambda: plan._validate(q, 0, out),
        "refresh (unchanged)": plan.refresh,
        "  data pointers (q, pools, out)": lambda: (
            q.data_ptr(), alloc.k_pools[0].data_ptr(), alloc.v_pools[0].data_ptr(),
            out.data_ptr()),
        "  current_raw_stream": lambda: runtime.current_raw_stream(device.index),
        "  core run (pointers given)": lambda: plan._core.run(*pointers, stream),
        "old path: launches + runtime.run": old_path(setup),
    }


def tree_attention_parts(setup: Setup) -> dict[str, object]:
    cached = tree_module._plans[setup.alloc]
    return {
        "np.asarray(ids list)": lambda: np.asarray(setup.leaves),
        "_plans.get (weak dict)": lambda: tree_module._plans.get(setup.alloc),
        "_same_ids (ndarray)": lambda: tree_module._same_ids(cached[1], setup.ids),
    }


def paged_decode_parts(setup: Setup, split: bool) -> dict[str, object]:
    args = setup.paged_args(split)
    launches = setup.paged_launches(split)
    index = args[0].device.index
    return {
        "_validate": lambda: paged_validate(*args),
        "decode_launches (Launch records)": lambda: decode_launches(
            *args, 0.1, runtime.arch_of(index), runtime.num_sms(index)),
        "runtime.run (per launch)": lambda: runtime.run(launches, args[0].device),
    }


def print_parts(title: str, parts: dict[str, object], calls: int) -> dict[str, float]:
    print(f"-- {title}")
    timed = {}
    for name, fn in parts.items():
        try:
            fn()
        except Exception as error:  # the parts call internals, which other work may rename
            print(f"   {name:<34}     n/a ({type(error).__name__}: {error})")
            continue
        timed[name] = host_us(fn, calls)
        print(f"   {name:<34}{timed[name]:8.2f} us")
    return timed


def profile_plan_run(setup: Setup, calls: int, top: int = 14) -> str:
    """cProfile of ``calls`` plan.run calls (its own overhead inflates small functions: read
    the shares, not the times)."""
    profiler = cProfile.Profile()
    profiler.enable()
    host_us(lambda: setup.plan.run(setup.q, 0, setup.out), calls)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def old_path_figures(setup: Setup, calls: int) -> dict[str, float]:
    """The per-launch path against ``plan.run``: its host time, and whether both write the
    same output (bit for bit) into poisoned buffers."""
    old = old_path(setup)
    expected = setup.plan.run(setup.q, 0, torch.full_like(setup.q, float("nan")))
    got = torch.full_like(setup.q, float("nan"))
    old(got)
    torch.cuda.synchronize()
    same = bool(torch.equal(expected, got))
    figures = {"per_launch_path_us": host_us(old, calls), "per_launch_matches_plan_run": same}
    print(f"-- the per-launch path (plan.launches + runtime.run): "
          f"{figures['per_launch_path_us']:.2f} us per call, output equal to plan.run: {same}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    setup = Setup()
    names = [launch.spec.name for launch in setup.launches]
    print(f"{torch.cuda.get_device_name()}; seed_b256 plan: {len(names)} launches "
          f"({', '.join(names)}); {args.calls} calls, batches of {BATCH}")
    result = {"device": torch.cuda.get_device_name(), "calls": args.calls, "batch": BATCH,
              "target_us": TARGET_US, "plan_launches": names,
              "rows": overhead_table(setup, args.calls)}
    if not args.no_profile:
        result["parts"] = {
            "plan.run": print_parts("plan.run, part by part", plan_run_parts(setup),
                                    args.calls),
            "tree_attention": print_parts("tree_attention's work before plan.run",
                                          tree_attention_parts(setup), args.calls),
            "paged_decode": print_parts("paged_decode (256 seqs)",
                                        paged_decode_parts(setup, False), args.calls),
            "paged_decode_split": print_parts("paged_decode (4 x 8192, split)",
                                              paged_decode_parts(setup, True), args.calls),
        }
        result.update(old_path_figures(setup, args.calls))
        result["cprofile"] = profile_plan_run(setup, args.calls)
        print(result["cprofile"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if result.get("per_launch_matches_plan_run") is False:
        print("FAILED: plan.run and the per-launch path wrote different outputs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
