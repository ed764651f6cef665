"""The partial launches' program order (issue 4, docs/perf.md session 27): each case's plan as
shipped, then with every partial launch's ``heads_first`` flipped (a grid of (KV heads, items),
each item's heads together, against (items, KV heads), each head's items together: the same
cubins, a runtime argument); whole steps and each partial launch alone, through
``runtime.run`` (not ``plan.run``'s prepared launches: the bench decides), outputs checked
against the shipped plan's (us, interleaved, L2 flushed). The planner runs heads first where a
launch of at most 4 programs per SM has a longest item at least twice its shortest
(``heads_first_order`` in csrc/core/planner.h). Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_grid_order.py [CASE...]"""
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench, runtime, timing
from flash_reasoning.runtime import Launch
from flash_reasoning.specializations import TREE_PARTIAL

sys.path.insert(0, "ci")
from explore_overlap import case_queries, poisoned_run  # noqa: E402

CASES = ("ft_1,4,16,512/q32kv8", "ft_1,4,16,512/q32kv32", "ft_1,4,16,512/q16kv1",
         "ft_1,1024/q32kv8", "ft_1,1024/q32kv32", "seed_b256/q32kv8", "ft_1,16,64/q32kv8",
         "ft_1,16,64/q32kv32", "ft_deep16/q32kv32", "ft_1,10/q32kv8", "ft_1,10/q32kv32",
         "long_1,4/q32kv8", "long_1,4/q32kv32", "flat_64x2048/q16kv1")
HEADS_FIRST = [name for name, _ in TREE_PARTIAL.params].index("heads_first")


def flipped(launch):
    """``launch`` with its partial programs' order flipped (other launches as they are)."""
    if launch.spec.family != "tree_partial":
        return launch
    args = list(launch.args)
    args[HEADS_FIRST] = 1 - int(args[HEADS_FIRST])
    return Launch(launch.spec, (launch.grid[1], launch.grid[0], 1), tuple(args))


def explore(name, case, runs=40):
    alloc, leaves, q = case_queries(case)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    out = torch.empty_like(q)
    shipped = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    partials = [x for x in shipped if x.spec.family == "tree_partial"]
    if not partials:
        print(f"{name:24} no partial launch", flush=True)
        return
    orders = "/".join("heads first" if x.args[HEADS_FIRST] else "items first" for x in partials)
    other = [flipped(x) for x in shipped]
    device = q.device
    fns = {"whole shipped": lambda: runtime.run(shipped, device),
           "whole flipped": lambda: runtime.run(other, device)}
    for i, launch in enumerate(partials):
        fns[f"partial {i} shipped"] = lambda x=launch: runtime.run([x], device)
        fns[f"partial {i} flipped"] = lambda x=flipped(launch): runtime.run([x], device)
    expected = poisoned_run([plan], fns["whole shipped"], out)
    if not torch.equal(poisoned_run([plan], fns["whole flipped"], out), expected):
        print(f"{name}: flipped order WRONG (not the shipped plan's output)", flush=True)
    times = timing.median_us_each(fns, runs)
    print(f"{name} (shipped: {orders}; items {[len(r) for r in plan.arrays.items.values()]})",
          flush=True)
    for key, us in times.items():
        print(f"    {key:24} {us:7.1f}", flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
