"""Host cost of a launch: ``plan.run`` per layer, ``tree_attention`` and ``paged_decode``,
against the GPU time of the work they queue; then where ``plan.run``'s host time goes.

Tree: the seed's headline case (2048-token root, 256 leaves of 64 tokens, 32/8 heads,
head_dim 128, fp16), whose plan is one partial launch and one final launch.

- host us: wall time of a loop of calls (``time.perf_counter_ns``), no sync inside the loop.
  The calls run in batches of ``BATCH`` (at most ``2 * BATCH`` launches queued, far below
  the driver's queue depth) with a sync *between* batches, outside the timed loops: a launch
  then never waits for a free queue slot, so the GPU is never what is measured.
- loop us: the same calls in one loop of ``CALLS`` with a sync only at the end: the steady
  rate when host and GPU overlap (about max(host, GPU) once the queue is full).
- GPU us: CUDA events around one call, L2 flushed, median (``timing.median_us``).

Target (issue 5): host < 15 us per ``plan.run`` of a two-kernel run.
``python benchmarks/launch_overhead.py [--calls 2000] [--json out.json]``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from flash_reasoning import TreeAttentionPlan, runtime, timing, tree_attention
from flash_reasoning.bench import Separate, case_allocator, seed_case
from flash_reasoning.ops import tree_attention as tree_module
from flash_reasoning.ops.paged_decode import _validate as paged_validate
from flash_reasoning.ops.paged_decode import decode_launches, paged_decode
from flash_reasoning.synthetic import paged_problem

TARGET_US = 15.0
CALLS = 2000
BATCH = 100


def host_us(fn, calls: int = CALLS, batch: int = BATCH) -> float:
    """Host wall time per call of ``fn``: timed loops of ``batch`` calls, synced between."""
    total_ns = 0
    for _ in range(max(1, calls // batch)):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        total_ns += time.perf_counter_ns() - start
    torch.cuda.synchronize()
    return total_ns / (max(1, calls // batch) * batch) / 1e3


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
        fn()  # loads the cubins, builds the cached plan
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

class PrepackedRun:
    """A sketch of a faster ``plan.run`` (not the library's code): the raw pointers of
    everything the plan owns and of the pools are taken once, so a call checks q/out,
    refreshes, reads two data pointers and calls the launcher once per kernel."""

    def __init__(self, plan: TreeAttentionPlan) -> None:
        self.plan = plan
        self.expected = (plan.num_branches, plan.num_qo_heads, plan.head_dim)
        alloc = plan.allocator
        self.dtype, self.device = alloc.dtype, alloc.device
        self.pools = [(k.data_ptr(), v.data_ptr()) for k, v in zip(alloc.k_pools,
                                                                    alloc.v_pools)]
        self.kernels = [(spec.name, grid, [runtime._raw(a) for a in middle], with_out)
                        for spec, grid, middle, with_out in plan._templates]
        self.scalars = list(plan._scalars)
        self.launcher = runtime._launcher_for(self.device.index)

    def run(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> torch.Tensor:
        for t in (q, out):
            if t.shape != self.expected or t.dtype != self.dtype or not t.is_contiguous() \
                    or t.get_device() != self.device.index:
                raise ValueError("bad q or out")
        self.plan.refresh()
        q_ptr, out_ptr = q.data_ptr(), out.data_ptr()
        if (q_ptr | out_ptr) % runtime.POINTER_ALIGN:
            raise ValueError("unaligned q or out")
        stream = runtime._current_raw_stream(self.device.index)
        k_ptr, v_ptr = self.pools[layer]
        for name, grid, middle, with_out in self.kernels:
            args = [q_ptr, k_ptr, v_ptr, *middle, *((out_ptr,) if with_out else ()),
                    *self.scalars]
            self.launcher.launch(name, grid, args, stream)
        return out


def plan_run_parts(setup: Setup) -> dict[str, object]:
    plan, q, out, launches = setup.plan, setup.q, setup.out, setup.launches
    device = q.device
    launcher = runtime._launcher_for(device.index)
    stream = runtime._current_raw_stream(device.index)
    raws = [[runtime._raw(a) for a in launch.args] for launch in launches]
    return {
        "plan.run (whole)": lambda: plan.run(q, 0, out),
        "_validate": lambda: plan._validate(q, 0, out),
        "refresh (unchanged)": plan.refresh,
        "launches (build Launch list)": lambda: plan.launches(q, *setup.pools, out),
        "runtime.run (given the list)": lambda: runtime.run(launches, device),
        "  _raw of every arg": lambda: [[runtime._raw(a) for a in launch.args]
                                        for launch in launches],
        "  _current_raw_stream": lambda: runtime._current_raw_stream(device.index),
        "  launcher.launch (raw args)": lambda: [
            launcher.launch(launch.spec.name, launch.grid, raw, stream)
            for launch, raw in zip(launches, raws)],
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
        "decode_launches": lambda: decode_launches(*args, 0.1, runtime.arch_of(index),
                                                   runtime.num_sms(index)),
        "runtime.run": lambda: runtime.run(launches, args[0].device),
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


def prepacked_figures(setup: Setup, calls: int) -> dict[str, float]:
    fast = PrepackedRun(setup.plan)
    expected = setup.plan.run(setup.q, 0, torch.full_like(setup.q, float("nan")))
    got = fast.run(setup.q, 0, torch.full_like(setup.q, float("nan")))
    torch.cuda.synchronize()
    same = bool(torch.equal(expected, got))
    figures = {"prepacked_run_us": host_us(lambda: fast.run(setup.q, 0, setup.out), calls),
               "prepacked_matches_plan_run": same}
    print(f"-- sketch: plan.run with pre-packed pointers (PrepackedRun): "
          f"{figures['prepacked_run_us']:.2f} us per call, output equal to plan.run: {same}")
    return figures


def main() -> None:
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
        result.update(prepacked_figures(setup, args.calls))
        result["cprofile"] = profile_plan_run(setup, args.calls)
        print(result["cprofile"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
