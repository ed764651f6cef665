"""The planner's regret: each case planned as the planner chooses, then with each of its knobs
forced (``TreeAttentionPlan``'s tuning arguments: chunk length, merge mode, flat, final lanes,
one tile, early start), every distinct plan checked against the planner's and timed whole,
interleaved. Prints, per case, the planner's time and the best forced plan's; last, the cases
where a forced plan beats the planner's by more than ``--margin`` (the rules worth revisiting).
``--family NAME``: instead of the cases, the synthetic trees of ``FAMILIES[NAME]`` (one rule's
data, at several GQA groups) with that family's knobs only. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_knobs.py [--runs N] [--margin F] [--family NAME] [CASE...]"""
import argparse
import hashlib
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench

sys.path.insert(0, "ci")
from explore_overlap import case_queries, time_plans  # noqa: E402

#: (label, TreeAttentionPlan argument, values).
KNOBS = (("chunk", "target_chunk", (64, 128, 256, 512, 1024, 2048)),
         ("separate", "separate_merge", (False, True)),
         ("flat", "flat", (False, True)),
         ("lanes", "final_lanes", (1, 2, 4, 8, 16, 32)),
         ("one_tile", "one_tile", (False, True)),
         ("early", "early_final", (False, True)))
GROUPS_KV_HEADS = (32, 16, 8, 4)  # 32 query heads: GQA groups 1, 2, 4, 8


def level_case(nodes, tokens, num_kv_heads):
    """A family's tree (``bench.level_case``), named by its levels, 32 query heads."""
    name = f"{','.join(map(str, nodes))}x{','.join(map(str, tokens))}/q32kv{num_kv_heads}"
    return bench.level_case(name, nodes, tokens, num_kv_heads=num_kv_heads)


#: name -> (knob labels, trees). lanes: leaves under two computed nodes (ft_1,2,64's shape);
#: chunks: one root and its leaves (the seed's and ft_1,10's shape).
FAMILIES = {
    "lanes": (("lanes",), [level_case((1, 2, n), (8, 256, leaf), kv)
                           for kv in GROUPS_KV_HEADS for n in (16, 32, 64, 128, 256, 512)
                           for leaf in (16, 32, 64, 128)]),
    "chunks": (("chunk", "separate"), [level_case((1, n), (root, leaf), kv)
                                       for kv in (32, 8) for n in (1, 4, 10, 16, 64)
                                       for root in (1024, 2048, 4096, 32768)
                                       for leaf in (64, 400)]),
}


def signature(plan, q):
    """What tells two plans apart: their launches (kernel and grid), their work lists and
    when the last launch starts."""
    alloc = plan.allocator
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], torch.empty_like(q))
    digest = hashlib.sha1(plan.arrays.work.tobytes()).hexdigest()
    return (tuple((launch.spec.name, tuple(launch.grid)) for launch in launches), digest,
            plan.arrays.early_final)


def distinct_plans(alloc, leaves, q, heads, knobs=KNOBS):
    """The planner's plan ("auto") and each forced plan that differs from every earlier one."""
    plans = {"auto": TreeAttentionPlan(alloc, leaves, heads)}
    seen = {signature(plans["auto"], q)}
    for label, argument, values in knobs:
        for value in values:
            try:
                plan = TreeAttentionPlan(alloc, leaves, heads, **{argument: value})
            except ValueError:  # a value the plan cannot take (lanes past the tile, say)
                continue
            key = signature(plan, q)
            if key not in seen:
                seen.add(key)
                plans[f"{label}={value}"] = plan
    return plans


def explore(name, case, runs, regrets, margin, knobs=KNOBS):
    alloc, leaves, q = case_queries(case)
    plans = distinct_plans(alloc, leaves, q, case["num_qo_heads"], knobs)
    times = time_plans(name, plans, q, runs)
    auto = times["auto"]
    best = min(times, key=times.get)
    arrays = plans["auto"].arrays
    planned = f"auto(L{arrays.final_lanes},c{arrays.stats['chunk_tokens']})"
    print(f"{name:24} {planned} {auto:7.1f} | best {best} {times[best]:7.1f} "
          f"({times[best] / auto - 1:+.1%}) | "
          + " ".join(f"{k}:{v:.1f}" for k, v in times.items() if k != "auto"), flush=True)
    if times[best] < auto * (1 - margin):
        regrets.append((name, auto, best, times[best]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    regrets = []
    if args.family:
        labels, trees = FAMILIES[args.family]
        knobs = tuple(knob for knob in KNOBS if knob[0] in labels)
        print(torch.cuda.get_device_name(), "(us)", flush=True)
        for case in trees:
            explore(case["name"], case, args.runs, regrets, args.margin, knobs)
    else:
        bench.explore_cases(lambda name, case: explore(name, case, args.runs, regrets,
                                                       args.margin), args.cases)
    print(f"forced plans faster than the planner's by more than {args.margin:.0%}:", flush=True)
    for name, auto, best, us in regrets:
        print(f"    {name:24} auto {auto:7.1f} -> {best} {us:7.1f} ({us / auto - 1:+.1%})")


if __name__ == "__main__":
    sys.exit(main())
