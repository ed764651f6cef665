"""The partial launches of the deep trees (issue 4, docs/perf.md session 25): each case planned
with the cost model's re-read weight and with heavier ones (fewer folds: more computed nodes,
whose ranges lie in consecutive pages and take the contiguous kernels), each plan timed whole,
its partial launches alone as shipped (AOT) and JIT-compiled at each wide-tile config (the
items, addressing and grid unchanged); outputs of the whole plans checked (us, interleaved, L2
flushed). ``--items``: each case's wide partial launch alone with its items reordered and by range
length (``subsets``); ``--profile CASE TOKENS``: its items of at least TOKENS tokens alone, three
times, for Nsight Compute (``profile``). Run on a GPU: PYTHONPATH=.:python python3
ci/explore_partial.py [--items] [CASE...] | --profile CASE TOKENS

(Session 26's ``--runs``, items read as two runs of slots by a patched kernel, became the
shipped two-run kernels: ``planner.item_runs``.)"""
import functools
import sys

import numpy as np
import torch

from aot.interpret import triton_args
from flash_reasoning import TreeAttentionPlan, bench, planner, runtime, timing
from flash_reasoning.ops.tree_attention import ordered_grid
from flash_reasoning.runtime import Launch
from flash_reasoning.specializations import TREE_ITEM_FIELDS, TREE_PARTIAL

sys.path.insert(0, "ci")
from explore_overlap import (case_queries, jit_launch, poisoned_run, report,  # noqa: E402
                             try_compile)

CASES = ("ft_1,4,16,512/q32kv8", "ft_1,4,16,512/q32kv32", "ft_1,4,16,512/q16kv1",
         "ft_1,1024/q32kv8", "seed_b256/q32kv8", "ft_deep16/q32kv8", "ft_1,16,64/q32kv8",
         "ft_1,4,256/q32kv8", "ft_1,10/q32kv8")
WEIGHTS = (planner.REREAD_WEIGHT, 2.0)
CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2))


def plan_with_weight(alloc, leaves, heads, weight):
    """``TreeAttentionPlan`` with the planner's re-read weight set to ``weight``."""
    original = planner.plan
    planner.plan = functools.partial(original, reread_weight=weight)
    try:
        return TreeAttentionPlan(alloc, leaves, heads)
    finally:
        planner.plan = original


def describe(launch):
    c = dict(launch.spec.constexprs)
    return (f"BM{c['BLOCK_M']} {c['BLOCK_N']}/{launch.spec.num_warps}/{launch.spec.num_stages} "
            f"page{c['PAGE']} contig{c['CONTIGUOUS']} grid {launch.grid[0]}x{launch.grid[1]}")


def explore(name, case, runs=30):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    out = q.new_empty(q.shape)
    plans, whole, parts, info = {}, {}, {}, []
    for weight in WEIGHTS:
        plan = plan_with_weight(alloc, leaves, heads, weight)
        launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
        tag = f"w{weight:g}"
        plans[tag] = plan
        whole[f"whole {tag} ({plan.arrays.stats['computed_nodes']} computed)"] = \
            lambda p=plan: p.run(q, 0, out)
        for i, launch in enumerate(launches[:-1]):
            key = f"{tag} partial{i} {describe(launch)}"
            parts[f"{key} AOT"] = lambda l=launch: runtime.run([l], q.device)
            if dict(launch.spec.constexprs)["BLOCK_M"] != 64:
                continue
            for config in CONFIGS:
                run = jit_launch(launch, config)
                label = f"{key} JIT {'/'.join(map(str, config))}"
                if try_compile(label, run, info):
                    parts[label] = run
    times = bench.check_and_time(name, whole, lambda fn: poisoned_run(plans.values(), fn, out),
                                 runs)
    times.update(timing.median_us_each(parts, runs))
    report(name, info, times)


ITEMS = [name for name, _ in TREE_PARTIAL.params].index("items")
HEADS_FIRST = [name for name, _ in TREE_PARTIAL.params].index("heads_first")
START, END = TREE_ITEM_FIELDS.index("kv_start"), TREE_ITEM_FIELDS.index("kv_end")


def wide_partial(case):
    """The wide partial launch of the planner's plan of ``case`` (None where it has none), its
    item records and their range lengths, and the queries' device."""
    alloc, leaves, q = case_queries(case)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], q.new_empty(q.shape))
    wide = [l for l in launches[:-1] if dict(l.spec.constexprs)["BLOCK_M"] == 64]
    records = plan.arrays.items.get(64)
    lengths = None if records is None else records[:, END] - records[:, START]
    return (wide[0] if wide else None), records, lengths, q.device


def with_items(launch, records, index, device):
    """``launch`` over the items ``records[index]`` alone."""
    items = torch.from_numpy(np.ascontiguousarray(records[index])).to(device)
    args = triton_args(launch)
    args[ITEMS] = items
    heads_first = args[HEADS_FIRST]
    heads = launch.grid[0] if heads_first else launch.grid[1]
    return Launch(launch.spec, ordered_grid(len(index), heads, heads_first), tuple(args))


def subsets(name, case, runs=30):
    """The wide partial launch of the planner's plan alone, then with its items reordered (the
    longest first) and each range length's items alone: where its time goes."""
    launch, records, lengths, device = wide_partial(case)
    if launch is None:
        return
    picks = {"planned": np.arange(len(records)),
             "longest first": np.argsort(-lengths, kind="stable")}
    picks.update({f"{n}-token items alone": np.flatnonzero(lengths == n)
                  for n in np.unique(lengths)})
    picks["first half alone"] = np.arange(len(records) // 2)
    fns = {f"{key} ({len(index)} items)":
           (lambda l=with_items(launch, records, index, device): runtime.run([l], device))
           for key, index in picks.items()}
    report(f"{name} wide partial launch {describe(launch)}", [],
           timing.median_us_each(fns, runs))


def profile(name, case, min_tokens):
    """The wide partial launch's items of at least ``min_tokens`` tokens, run three times, for a
    profiler: ``ncu --kernel-name regex:tree_partial --launch-skip 2 --launch-count 1 ...``."""
    launch, records, lengths, device = wide_partial(case)
    chosen = np.flatnonzero(lengths >= min_tokens)
    one = with_items(launch, records, chosen, device)
    for _ in range(3):
        runtime.run([one], device)
    torch.cuda.synchronize()
    print(f"{name}: {one.spec.name} over {len(chosen)} items, grid {one.grid}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--items"]:
        bench.explore_cases(subsets, sys.argv[2:])
    elif sys.argv[1:2] == ["--profile"]:
        bench.explore_cases(lambda name, case: profile(name, case, int(sys.argv[3])),
                            sys.argv[2:3])
    else:
        bench.explore_cases(explore, sys.argv[1:] or CASES)
