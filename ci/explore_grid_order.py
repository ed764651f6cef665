"""The launches' program order (issue 4, docs/perf.md sessions 27 to 29): each case's plan as
shipped, then with every partial launch's ``heads_first`` flipped (a grid of (KV heads, items),
each item's heads together, against (items, KV heads), each head's items together: the same
cubins, a runtime argument), then with the final launch's flipped (a grid of (head tiles,
programs) against (programs, head tiles)); whole steps and each launch alone, through
``runtime.run`` (not ``plan.run``'s prepared launches: the bench decides), outputs checked
against the shipped plan's (us, interleaved, L2 flushed). The planner runs a partial launch
heads first where a launch of at most 4 programs per SM has a longest item at least twice its
shortest (``heads_first_order`` in csrc/core/planner.h), the final launch where it is packed
without shared ranges over token rows of at least 4 KB (``final_heads_first``; one-branch final
launches have one order). Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_grid_order.py [CASE...]"""
import sys

import torch

from aot.interpret import triton_args
from flash_reasoning import TreeAttentionPlan, bench, runtime, timing
from flash_reasoning.runtime import Launch
from flash_reasoning.specializations import TREE_FINAL, TREE_PARTIAL

sys.path.insert(0, "ci")
from explore_overlap import case_queries, poisoned_run  # noqa: E402

CASES = ("ft_1,4,16,512/q32kv8", "ft_1,4,16,512/q32kv32", "ft_1,4,16,512/q16kv1",
         "ft_1,1024/q32kv8", "ft_1,1024/q32kv32", "seed_b256/q32kv8", "ft_1,16,64/q32kv8",
         "ft_1,16,64/q32kv32", "ft_deep16/q32kv32", "ft_1,10/q32kv8", "ft_1,10/q32kv32",
         "long_1,4/q32kv8", "long_1,4/q32kv32", "flat_64x2048/q16kv1", "ft_1,256/q32kv8",
         "seed_b128/q32kv8", "ft_deep16/q32kv8")
HEADS_FIRST = {f.name: f.param_names.index("heads_first") for f in (TREE_PARTIAL, TREE_FINAL)}


def orderable(launch, family):
    """Whether ``launch`` is of ``family`` and reads its order from ``heads_first``: every
    partial launch, packed final launches only."""
    return launch.spec.family == family and (family != "tree_final"
                                             or dict(launch.spec.constexprs)["PACKED"])


def flipped(launch, family):
    """``launch`` with its programs' order flipped if it is an orderable launch of ``family``."""
    if not orderable(launch, family):
        return launch
    args = triton_args(launch)
    at = HEADS_FIRST[family]
    args[at] = 1 - int(args[at])
    return Launch(launch.spec, (launch.grid[1], launch.grid[0], 1), tuple(args))


def order(launch):
    """How ``launch``'s grid runs its programs, in words."""
    return "heads first" if launch.args[HEADS_FIRST[launch.spec.family]] else "items first"


def explore(name, case, runs=40):
    alloc, leaves, q = case_queries(case)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    out = torch.empty_like(q)
    shipped = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    device = q.device
    fns = {"whole shipped": lambda: runtime.run(shipped, device)}
    expected = poisoned_run([plan], fns["whole shipped"], out)
    orders = []
    for family in HEADS_FIRST:
        launches = [x for x in shipped if orderable(x, family)]
        if not launches:
            continue
        other = [flipped(x, family) for x in shipped]
        fns[f"whole, {family} flipped"] = lambda o=other: runtime.run(o, device)
        if not torch.equal(poisoned_run([plan], fns[f"whole, {family} flipped"], out), expected):
            print(f"{name}: {family} flipped WRONG (not the shipped plan's output)", flush=True)
        for i, launch in enumerate(launches):
            fns[f"{family} {i} shipped"] = lambda x=launch: runtime.run([x], device)
            fns[f"{family} {i} flipped"] = lambda x=flipped(launch, family): runtime.run([x],
                                                                                        device)
        orders.append(f"{family} {'/'.join(order(x) for x in launches)}")
    times = timing.median_us_each(fns, runs)
    print(f"{name} (shipped: {', '.join(orders)}; items "
          f"{[len(r) for r in plan.arrays.items.values()]})", flush=True)
    for key, us in times.items():
        print(f"    {key:32} {us:7.1f}", flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
