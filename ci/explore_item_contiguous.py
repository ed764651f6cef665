"""Upper bound of reading the separate-merge plans' items as runs of slots (issue 4, docs/perf.md
session 22). A plan that merges separately puts every branch's chunks in one ``tree_partial``
launch, the last chunk of each open (it reads to the branch's current length), so
``planner.contiguous_launches`` keeps that launch paged. Where the cases' pools hold each
branch's pages consecutively (a fresh pool), the launch JIT-compiled with ``CONTIGUOUS`` reads
the same tokens: its time is what a per-item choice could reach at most. Each case: the
shipped plan whole (AOT), then the partial launch JIT-compiled paged and contiguous, each
followed by the plan's (AOT) merge launch; outputs checked (a pool whose pages are not
consecutive prints WRONG). Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_item_contiguous.py [CASE...]"""
import sys

from aot.interpret import triton_args
from aot.kernels import JIT_FUNCTIONS
from flash_reasoning import TreeAttentionPlan, bench, runtime

sys.path.insert(0, "ci")
from explore_overlap import case_queries, poisoned_run, report, try_compile  # noqa: E402

CASES = ("seed_b1/q32kv8", "seed_b1/q16kv1", "seed_b1/q32kv32", "seed_b16/q32kv32",
         "seed_b16/q16kv1", "ft_1,10/q32kv8", "ft_1,10/q16kv1", "long_1,4/q32kv8",
         "long_1,4/q16kv1", "flat_64x2048/q16kv1")


def jit_partial(partial, contiguous):
    """``partial`` (a tree_partial launch) JIT-compiled at ``CONTIGUOUS`` = ``contiguous``."""
    constexprs = {**dict(partial.spec.constexprs), "CONTIGUOUS": int(contiguous), "PDL": 0}
    return lambda: JIT_FUNCTIONS["tree_partial"][partial.grid](
        *triton_args(partial), **constexprs, num_warps=partial.spec.num_warps,
        num_stages=partial.spec.num_stages)


def explore(name, case, runs=40):
    alloc, leaves, q = case_queries(case)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    out = q.new_empty(q.shape)
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    if not plan.arrays.separate_merge or len(launches) != 2:
        print(f"{name:22} not one partial launch and a merge launch: skipped", flush=True)
        return
    partial, merge = launches
    fns = {"shipped": lambda: plan.run(q, 0, out)}
    info = []
    for contiguous in (False, True):
        key = "contiguous" if contiguous else "paged"
        run_partial = jit_partial(partial, contiguous)
        if try_compile(key, run_partial, info):
            fns[key] = lambda f=run_partial: (f(), runtime.run([merge], q.device))
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run([plan], fn, out), runs)
    report(f"{name} ({plan.arrays.stats['partial_programs']} partial programs)", info, times)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
