"""Host cost of planning one tree-attention decode step: what ``TreeAttentionPlan`` does before
any upload, ``allocator.segment_tree(leaves)`` and then ``planner.plan(tree, shape)``, on bench
cases built by ``bench.case_allocator`` (every token written, as in a real decode).

Times are host wall time (time.perf_counter), median of many repetitions; nothing here touches
the GPU except building the case on it. Target: the step under 0.5 ms for 1024 branches
(planned once per decode step, ahead of every layer's run).
Run: ``python benchmarks/planning_host_cost.py [--device cpu] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flash_reasoning import planner, runtime
from flash_reasoning.tools import bench

CASES = ("ft_1,1024/q32kv8", "seed_b256/q32kv8", "ft_deep16/q32kv8")
TARGET_S = 0.5e-3
H100_SMS = 132  # the plan a CPU run times is the one the H100 would get


def median_s(call, reps: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_case(case: dict, device: str, reps: int) -> dict:
    alloc, leaves = bench.case_allocator(case, device=device)
    num_sms = runtime.num_sms(alloc.device.index) if alloc.device.type == "cuda" else H100_SMS
    shape = planner.Shape(case["num_qo_heads"], alloc.num_kv_heads, alloc.head_dim,
                          alloc.k_pools[0].element_size(), num_sms)
    tree = alloc.segment_tree(leaves)
    return {
        "case": case["name"], "branches": len(leaves), "nodes": tree.num_nodes,
        "segment_tree_us": 1e6 * median_s(lambda: alloc.segment_tree(leaves), reps),
        "plan_us": 1e6 * median_s(lambda: planner.plan(tree, shape), reps),
        "step_us": 1e6 * median_s(lambda: planner.plan(alloc.segment_tree(leaves), shape), reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the allocator's pools live (the planning is host work)")
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--cases-file", help="default: the copy shipped with the package")
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args()
    by_name = {c["name"]: c for c in bench.load_cases(args.cases_file)["cases"]}
    rows = [time_case(by_name[name], args.device, args.reps) for name in args.cases]
    print(f"device {args.device}; median of {args.reps} runs; step = segment tree + plan, "
          f"target < {TARGET_S * 1e6:.0f} us")
    print(f"{'case':<20} {'branches':>8} {'nodes':>6} {'tree us':>9} {'plan us':>9} "
          f"{'step us':>9}")
    for r in rows:
        verdict = "ok" if r["step_us"] < TARGET_S * 1e6 else "OVER"
        print(f"{r['case']:<20} {r['branches']:>8} {r['nodes']:>6} {r['segment_tree_us']:>9.1f} "
              f"{r['plan_us']:>9.1f} {r['step_us']:>9.1f}  {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
