"""The planner's regret: the sweep its rules are fitted on. Each case is planned as the planner
chooses, then with each of its knobs forced (chunk length, merge mode, flat, final lanes, one
tile, early start, hosted nodes); every distinct plan is checked against the planner's output,
then timed whole and alone, as the bench times a plan (a plan whose last launch overlaps its
partial launch reads several us slower when timed interleaved with heavier plans). Prints, per
case, the planner's time and the best forced plan's; last, the cases where a forced plan beats
the planner's by more than ``--margin``: the rules worth refitting.

``--family NAME`` times the synthetic trees of ``FAMILIES[NAME]`` instead of the benchmark's
cases (one rule's data at several GQA groups), with that family's knobs only; a bench family
(``flash-reasoning bench --family``, every knob) takes ``--half``. The last lines give, over
the cases, the planner's time and the best plan's against the roofline (measured in the same
run as the bench measures it): what refitting the rules could win at most, one knob at a time.
Run on a GPU: ``python benchmarks/planner_regret.py [--runs N] [--margin F] [--family NAME
[--half HALF]] [--json OUT] [CASE...]``"""
import argparse
import datetime
import hashlib
import json
import sys

import torch

from flash_reasoning import TreeAttentionPlan
from flash_reasoning.planner import PlanOptions
from flash_reasoning.tools import bench, family, timing

#: (label, planner option, values).
KNOBS = (("chunk", "target_chunk", (64, 128, 256, 512, 1024, 2048)),
         ("separate", "separate_merge", (False, True)),
         ("flat", "flat", (False, True)),
         ("lanes", "final_lanes", (1, 2, 4, 8, 16, 32)),
         ("one_tile", "one_tile", (False, True)),
         ("early", "early_final", (False, True)),
         ("host_nodes", "host_nodes", (False, True)))
GROUPS_KV_HEADS = (32, 16, 8, 4)  # 32 query heads: GQA groups 1, 2, 4, 8
MAX_ERROR = 1e-2


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


def forced_plan(alloc, leaves, num_qo_heads, option=None, value=None):
    """The plan with ``option`` forced to ``value`` (the planner's own plan without one)."""
    forced = {} if option is None else {option: value}
    return TreeAttentionPlan(alloc, leaves, num_qo_heads, _options=PlanOptions(**forced))


def signature(plan, q):
    """What tells two plans apart: their launches (kernel and grid), their work lists and
    when the last launch starts."""
    alloc = plan.allocator
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], torch.empty_like(q))
    work = plan.arrays.items
    digest = hashlib.sha1(b"".join(work[m].tobytes() for m in sorted(work))).hexdigest()
    return (tuple((launch.spec.name, tuple(launch.grid)) for launch in launches), digest,
            plan.arrays.early_final)


def distinct_plans(alloc, leaves, q, num_qo_heads, knobs=KNOBS):
    """The planner's plan ("auto") and each forced plan that differs from every earlier one."""
    plans = {"auto": forced_plan(alloc, leaves, num_qo_heads)}
    seen = {signature(plans["auto"], q)}
    for label, option, values in knobs:
        for value in values:
            try:
                plan = forced_plan(alloc, leaves, num_qo_heads, option, value)
            except ValueError:  # a value it cannot take (the core's InvalidArgument too)
                continue
            key = signature(plan, q)
            if key not in seen:
                seen.add(key)
                plans[f"{label}={value}"] = plan
    return plans


def poisoned_output(plans, plan, q, out):
    """``plan``'s output, with every plan's partials and the output poisoned first, so that a
    row no launch writes, or a partial read before it is written, shows as NaN."""
    for p in plans.values():
        p.partial_out.fill_(float("nan"))
        p.partial_lse.fill_(float("nan"))
    out.fill_(float("nan"))
    plan.run(q, 0, out)
    torch.cuda.synchronize()
    return out.clone().float()


def time_plans(name, plans, q, runs):
    """Each plan checked against the first (a mismatch is printed WRONG), then timed alone:
    us by key."""
    out = torch.empty_like(q)
    expected = poisoned_output(plans, next(iter(plans.values())), q, out)
    for key, plan in plans.items():
        error = (poisoned_output(plans, plan, q, out) - expected).abs().max().item()
        if not error < MAX_ERROR:
            print(f"{name} {key}: WRONG, max error {error}", flush=True)
    return {key: timing.median_us(lambda p=plan: p.run(q, 0, out), runs)
            for key, plan in plans.items()}


def case_queries(case):
    """A case's pool on the GPU, its leaves and random queries in the pool's dtype."""
    alloc, leaves = bench.case_allocator(case)
    q = torch.randn(len(leaves), case["num_qo_heads"], alloc.head_dim, device="cuda")
    return alloc, leaves, q.to(alloc.dtype)


def sweep(name, case, runs, regrets, margin, knobs=KNOBS) -> dict:
    """One case: its distinct plans timed, a line printed, a regret recorded past ``margin``;
    the times by plan."""
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
    return times


def chosen_cases(args) -> tuple[dict, tuple]:
    """The cases to sweep by name, and the knobs to force."""
    if args.family in FAMILIES:
        labels, trees = FAMILIES[args.family]
        return ({case["name"]: case for case in trees},
                tuple(knob for knob in KNOBS if knob[0] in labels))
    if args.family:
        cases = family.family_cases(args.family, family.SIZE, half=args.half)
        return {c["name"]: c for c in cases}, KNOBS
    cases = {c["name"]: c for c in bench.table_cases(bench.load_cases(), cpu=False)}
    unknown = [name for name in args.cases if name not in cases]
    if unknown:
        raise SystemExit(f"no such case: {', '.join(unknown)} (known: {', '.join(cases)})")
    return {name: cases[name] for name in args.cases or cases}, KNOBS


def summary(cases, times, machine) -> dict:
    """Geometric means over the cases: the planner's and the best plan's time over the
    roofline, and the planner's over the best's."""
    rooflines = {name: bench.roofline_us(cases[name], machine) for name in times}
    auto = [t["auto"] / rooflines[name] for name, t in times.items()]
    best = [min(t.values()) / rooflines[name] for name, t in times.items()]
    return {"cases": len(times), "planner_over_roofline": bench.geomean(auto),
            "best_over_roofline": bench.geomean(best),
            "planner_over_best": bench.geomean([a / b for a, b in zip(auto, best)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--family", choices=sorted({*FAMILIES, *family.FAMILIES}))
    parser.add_argument("--half", choices=family.HALVES, default="fit",
                        help="a bench family's half (default: fit, the one rules are fitted on)")
    parser.add_argument("--json", help="write the times, rooflines and summary here")
    parser.add_argument("cases", nargs="*", help="benchmark cases (default: every GPU case)")
    args = parser.parse_args()
    cases, knobs = chosen_cases(args)
    machine = bench.Machine(timing.copy_bandwidth_tbps(), timing.matmul_tflops(),
                            timing.launch_us())
    print(torch.cuda.get_device_name(), "(us)", machine, flush=True)
    regrets = []
    times = {name: sweep(name, case, args.runs, regrets, args.margin, knobs)
             for name, case in cases.items()}
    print(f"forced plans faster than the planner's by more than {args.margin:.0%}:", flush=True)
    for name, auto, best, us in regrets:
        print(f"    {name:24} auto {auto:7.1f} -> {best} {us:7.1f} ({us / auto - 1:+.1%})")
    totals = summary(cases, times, machine)
    print("geometric means: " + ", ".join(f"{k} {v:.3g}" for k, v in totals.items()))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                "command": " ".join(sys.argv), **vars(machine)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": totals, "times": times}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
