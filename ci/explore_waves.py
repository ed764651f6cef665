"""Partial launches of one program per SM, so final programs run beside them (issue 4,
docs/perf.md session 20). The planner cuts computed nodes into chunks of ``kWaves`` (2)
programs per SM (csrc/core/planner.h). A root program (64 rows, 4 warps) holds ~26K
registers and 112 KB of shared memory: two per SM leave no room for a final program (2 warps x
240 registers, 39 KB), one leaves room for two, and the final launch, started early, walks
the leaves beside the root. Each plan with computed nodes and a final kernel timed as planned
and at 2x and 4x its chunk length (where that changes the plan), and, at each chunk length,
merged separately (the leaves' chunks a narrow partial launch beside the root's, which no
final program waits in), interleaved, outputs checked against each other. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_waves.py [CASE...]"""
import sys

from flash_reasoning import TreeAttentionPlan, bench

sys.path.insert(0, "ci")
from explore_overlap import case_queries, time_plans  # noqa: E402


def explore(name, case, runs=40):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    plan = TreeAttentionPlan(alloc, leaves, heads)
    stats = plan.arrays.stats
    if plan.arrays.separate_merge or not stats["computed_nodes"]:
        print(f"{name:24} no computed node under a final kernel", flush=True)
        return
    chunk = stats["chunk_tokens"]
    plans = {f"chunk {chunk}": plan}
    for factor in (2, 4):
        other = TreeAttentionPlan(alloc, leaves, heads, target_chunk=chunk * factor)
        programs = other.arrays.stats["partial_programs"]
        if programs != plans[next(reversed(plans))].arrays.stats["partial_programs"]:
            plans[f"chunk {chunk * factor}"] = other
    for key in list(plans):
        plans[key + " sep"] = TreeAttentionPlan(alloc, leaves, heads, separate_merge=True,
                                                target_chunk=plans[key].arrays.stats[
                                                    "chunk_tokens"])
    times = time_plans(name, plans, q, runs)
    print(f"{name:24} " + "  ".join(
        f"{key} {plans[key].arrays.stats['partial_programs']}: {us:6.1f}"
        for key, us in times.items()), flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
