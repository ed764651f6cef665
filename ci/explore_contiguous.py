"""Shared ranges read as one run of slots (issue 4, docs/perf.md session 19). A partial launch
whose items lie in consecutive pages of the pool (``planner.contiguous_launches``) runs the
contiguous ``tree_partial`` kernels: token ``n`` is slot ``first slot + n - start``, one page
id per item and no page arithmetic per token. The cases' trees are written into a fresh pool,
so each node's pages are consecutive; an item folded over several nodes crosses from one
node's pages to the next's and stays paged. Each case's plan as shipped (AOT) against the same plan on
the paged kernels (``contiguous=False``: what a pool whose pages are not consecutive runs),
interleaved, outputs checked against each other. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_contiguous.py [CASE...]"""
import sys

from flash_reasoning import TreeAttentionPlan, bench

sys.path.insert(0, "ci")
from explore_overlap import case_queries, time_plans  # noqa: E402

RUNS = 40


def explore(name, case):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    plan = TreeAttentionPlan(alloc, leaves, heads)
    paged = TreeAttentionPlan(alloc, leaves, heads, contiguous=False)
    kinds = "+".join(spec.family.removeprefix("tree_") + ("(c)" if spec.key.get("CONTIGUOUS")
                                                          else "")
                     for spec, _, _ in plan._templates)
    if not any(plan.contiguous.values()):
        print(f"{name:24} {kinds:28} no contiguous partial launch", flush=True)
        return
    times = time_plans(name, {"contiguous": plan, "paged": paged}, q, RUNS)
    print(f"{name:24} {kinds:28} " + " ".join(f"{k} {t:6.1f}" for k, t in times.items()),
          flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
