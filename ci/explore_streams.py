"""Partial launches side by side: a plan that merges separately runs its partial launches
(a wide-tile one for the shared nodes, a narrow one for the branches' own ranges) one after
another on one stream, so a compute-bound root never overlaps the leaves' HBM traffic. Each
case timed as shipped, forced final merge, forced separate merge (one stream), separate with
its partial launches on two streams (joined before the merge), and separate with every
partial item in the wide tile (``one_tile``: one partial launch); then each separate launch
alone. Run on
a GPU: PYTHONPATH=.:python python3 ci/explore_streams.py [CASE...]"""
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench, runtime, timing

RUNS = 30


def two_streams(launches, device, side, first_on_side):
    """The partial launches split over the current stream and ``side`` (the wide one on
    ``side`` when ``first_on_side``), joined before the merge launch."""
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    partials, merge = launches[:-1], launches[-1]
    on_side = [partials[0]] if first_on_side else [partials[-1]]
    on_main = [launch for launch in partials if launch is not on_side[0]]

    def run():
        main = torch.cuda.current_stream()
        fork.record(main)
        side.wait_event(fork)
        with torch.cuda.stream(side):
            runtime.run(on_side, device)
        join.record(side)
        runtime.run(on_main, device)
        main.wait_event(join)
        runtime.run([merge], device)
    return run


def explore(name, case):
    alloc, leaves = bench.case_allocator(case)
    heads = case["num_qo_heads"]
    q = torch.randn(len(leaves), heads, case["head_dim"], device="cuda").to(alloc.dtype)
    out = torch.empty_like(q)
    plans = {"shipped": TreeAttentionPlan(alloc, leaves, heads),
             "final": TreeAttentionPlan(alloc, leaves, heads, separate_merge=False),
             "separate": TreeAttentionPlan(alloc, leaves, heads, separate_merge=True),
             "one tile": TreeAttentionPlan(alloc, leaves, heads, separate_merge=True,
                                           one_tile=True)}
    fns = {key: (lambda p=p: p.run(q, 0, out)) for key, p in plans.items()}
    sep = plans["separate"]
    launches = sep.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    if len(launches) > 2:
        side = torch.cuda.Stream()
        fns["2 streams"] = two_streams(launches, q.device, side, True)
        fns["2 streams rev"] = two_streams(launches, q.device, side, False)

    def poisoned_run(fn):
        out.fill_(float("nan"))
        fn()
        return out.clone()
    times = bench.check_and_time(name, fns, poisoned_run, RUNS)
    alone = "+".join(f"{timing.median_us(lambda l=l: runtime.run([l], q.device), RUNS):.1f}"
                     for l in launches)
    mode = "sep" if plans["shipped"].arrays.separate_merge else "fin"
    print(f"{name:24} ({mode}) " + " ".join(f"{k} {t:6.1f}" for k, t in times.items())
          + f" | separate alone {alone}", flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
