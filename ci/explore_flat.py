"""Each case of the cases file planned three ways (the planner's choice, the cost model's folds,
flat: every node folded), with paged_decode beside them (over each branch's materialised
copy, as the bench runs it, and over the tree's own pool and tables) and a packed flat plan
unpacked, timed interleaved: the data behind
the planner's estimated_us constants (csrc/core/planner.h). Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_flat.py [CASE...]"""
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench, timing
from flash_reasoning.ops.paged_decode import paged_decode

RUNS = 50


def explore(case):
    alloc, leaves = bench.case_allocator(case, random=False)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"]).half().cuda()
    out, decode_out = torch.empty_like(q), torch.empty_like(q)
    plans = {mode: TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], flat=mode)
             for mode in (None, False, True)}
    separate = bench.Separate.from_tree(alloc, leaves)
    fns = {mode: (lambda p=p: p.run(q, 0, out)) for mode, p in plans.items()}
    fns["paged_decode"] = lambda: separate.paged_decode(q, decode_out)
    tables, lengths = alloc.block_tables(leaves)
    fns["paged_decode, tree pool"] = lambda: paged_decode(q, alloc.k_pools[0], alloc.v_pools[0],
                                                          tables, lengths, out=decode_out)
    if not plans[True].arrays.separate_merge and plans[True].arrays.final_lanes > 1:
        unpacked = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], flat=True,
                                     separate_merge=False, final_lanes=1)
        fns["flat 1 lane"] = lambda: unpacked.run(q, 0, out)
    us = timing.median_us_each(fns, RUNS)
    estimate = {mode: plans[mode].arrays.stats["estimated_us"] for mode in (False, True)}
    computed = {mode: p.arrays.stats["computed_nodes"] for mode, p in plans.items()}
    picked = "flat" if computed[False] and not computed[None] else "tree"
    faster = "flat" if computed[False] and us[True] < us[False] else "tree"  # else: one plan
    print(f"{case['name']:24} auto({picked}) {us[None]:7.1f} | tree {us[False]:7.1f} "
          f"(est {estimate[False]:7.1f}) | flat {us[True]:7.1f} (est {estimate[True]:8.1f}) | "
          f"paged_decode {us['paged_decode']:7.1f} (tree pool {us['paged_decode, tree pool']:7.1f})"
          + (f" | flat 1 lane {us['flat 1 lane']:7.1f}" if "flat 1 lane" in us else "")
          + ("" if faster == picked else f"  <- {faster} faster"), flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    cases = {c["name"]: c for c in bench.load_cases()["cases"]}
    for name in sys.argv[1:] or cases:
        explore(cases[name])


if __name__ == "__main__":
    sys.exit(main())
