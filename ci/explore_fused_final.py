"""One launch where the final programs hold a 64-row tile: the flat plan (every node folded) at
the lanes 64 rows hold (16 at GQA group 4), each program walking its lanes' shared path once
as a dense tile (``tree_final`` with ``COMMON``), then its lanes' leaves side by side; no
partials, no merge. The shipped kernel JIT-compiled at BLOCK_M 64 (the planner planned with
its wide final tile set to 64 rows), against the planner's plan; and where its time goes: the
same launch with the leaves' walk cut out (the shared walk alone) and with the shared walk cut
out (the leaves alone). Outputs checked (the cut variants read WRONG, as they must). The data
behind docs/perf.md session 28. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_fused_final.py [CASE...]"""
import sys

from flash_reasoning import TreeAttentionPlan, bench, dispatch

sys.path.insert(0, "ci")
from explore_overlap import (case_queries, jit_launch, poisoned_run, report,  # noqa: E402
                             try_compile, variant)

CASES = ("ft_1,1024/q32kv8", "ft_1,4,16,512/q32kv8", "ft_1,1024/q16kv1", "seed_b256/q32kv8",
         "ft_1,256/q32kv8", "ft_deep16/q32kv8")
ROWS = 64
CONFIGS = ((64, 4, 3), (64, 4, 2), (128, 4, 2))
LANES_CALL = "        m_i, l_i, acc = attend_lanes(m_i, l_i, acc, qt, lane, k_pool, v_pool,\n"
MODULES = {  # None: the shipped kernels
    "": None,
    " shared walk alone": variant("fused_shared_only",
                                  (LANES_CALL, "        _cut = (m_i, l_i, acc, qt, lane, k_pool, "
                                               "v_pool,\n")),
}


def fused_plan(alloc, leaves, num_qo_heads):
    """The flat plan at the lanes ROWS hold: planned as if the wide final tile had ROWS rows."""
    wide = dispatch.FINAL_WIDE_BLOCK_M
    dispatch.FINAL_WIDE_BLOCK_M = ROWS
    try:
        return TreeAttentionPlan(alloc, leaves, num_qo_heads, flat=True,
                                 final_lanes=ROWS * alloc.num_kv_heads // num_qo_heads)
    finally:
        dispatch.FINAL_WIDE_BLOCK_M = wide


def explore(name, case, runs=30):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    out = q.new_empty(q.shape)
    auto = TreeAttentionPlan(alloc, leaves, heads)
    fns = {f"planner ({len(auto._templates)} launches)": lambda: auto.run(q, 0, out)}
    fused = fused_plan(alloc, leaves, heads)
    launch = fused.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)[-1]
    shared = fused.arrays.common
    info = [f"{fused.arrays.final_lanes} lanes, grid {launch.grid}, shared path up to "
            f"{int((shared[:, 2] - shared[:, 1]).max(initial=0))} tokens"]
    for tag, module in MODULES.items():
        for config in CONFIGS:
            key = f"fused {'/'.join(map(str, config))}{tag}"
            run = jit_launch(launch, config, module, BLOCK_M=ROWS)
            if try_compile(key, run, info):
                fns[key] = run
    fns["fused 64/4/3 leaves alone"] = jit_launch(launch, CONFIGS[0], BLOCK_M=ROWS, COMMON=0)
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run([auto, fused], fn, out),
                                 runs)
    report(name, info, times)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
