"""Final programs that read their lanes' shared range once (issue 4, docs/perf.md session 25).

A packed final program serves ``lanes`` consecutive branches of the tree order; where they
begin their final ranges in the same folded node, it walks that range once as a dense tile of
all its rows (``tree_final`` with ``COMMON``, ``PlanArrays.common``), then each lane's rest.
Each case: the planner's plan whole, and the flat plan (every node folded, no partials, one
launch) at the narrow and the wide final tile's lanes, as shipped (AOT) and JIT-compiled at each
config; outputs checked (us, interleaved, L2 flushed). The data behind ``kSharedRangeWalk``
(csrc/core/planner.h). Run on a GPU: PYTHONPATH=.:python python3 ci/explore_common.py [CASE...]"""
import sys

from flash_reasoning import TreeAttentionPlan, bench

sys.path.insert(0, "ci")
from explore_overlap import (case_queries, jit_launch, poisoned_run, report,  # noqa: E402
                             try_compile)

CASES = ("ft_deep16/q32kv8", "ft_deep16/q32kv32", "ft_deep16/q16kv1", "ft_1,16,64/q32kv8",
         "ft_1,2,64/q32kv8", "ft_1,4,256/q32kv8", "ft_1,256/q32kv8", "ft_1,256/q16kv1",
         "ft_1,4,256/q16kv1", "ft_1,4,16,512/q32kv8")
CONFIGS = ((32, 2, 2), (64, 2, 2), (64, 4, 2), (128, 4, 2))
ROWS = (16, 32)  # the narrow and the wide final tile: lanes = rows // GQA group


def explore(name, case, runs=30):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    group = heads // alloc.num_kv_heads
    out = q.new_empty(q.shape)
    auto = TreeAttentionPlan(alloc, leaves, heads)
    kind = "shared ranges" if auto.arrays.has_common else f"{len(auto._templates)} launches"
    fns = {f"planner (L{auto.arrays.final_lanes}, {kind})": lambda: auto.run(q, 0, out)}
    plans, info = [auto], []
    for lanes in sorted({max(1, rows // group) for rows in ROWS}):
        try:
            flat = TreeAttentionPlan(alloc, leaves, heads, flat=True, final_lanes=lanes)
        except ValueError:  # lanes past the wide tile
            continue
        plans.append(flat)
        launch = flat.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)[-1]
        shared = flat.arrays.common
        walk = int((shared[:, 2] - shared[:, 1]).max(initial=0))
        fns[f"flat L{lanes} (shared {walk} tokens) AOT"] = lambda p=flat: p.run(q, 0, out)
        for config in CONFIGS:
            if config[0] < lanes:  # a KV tile holds a token of each lane
                continue
            run = jit_launch(launch, config)
            key = f"flat L{lanes} JIT {'/'.join(map(str, config))}"
            if try_compile(key, run, info):
                fns[key] = run
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run(plans, fn, out), runs)
    report(name, info, times)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
