"""The tree-attention benchmark under the tuned dispatch and under each single fixed config.

For every case of the bench (the seed's table and the cases file) and every config compiled
for some rule list, ``tune.fixed_rules`` pins that config wherever it is compiled (through a
``FLASH_REASONING_TUNING`` table written here); the tuned run uses the table dispatch reads
(``$FLASH_REASONING_TUNING`` when set, else the shipped one), and a run with an empty table
shows the heuristics. Each plan's output is checked against the tuned one (poisoned first),
then timed like the bench (CUDA events, L2 flushed, median), the distinct plans interleaved;
settings whose plans launch the same kernels share one timing. A case where a fixed config
beats the tuned dispatch by more than ``--tolerance`` is timed again, the two plans alone
with ``--confirm-runs`` runs: the fastest of a dozen noisy timings reads low (the winner's
curse: on a 23 us case, the best fixed config read 3.1% under the table in one run and not
in the previous one), a fresh timing of the pair does not. Only a loss the second timing
confirms counts. ``--table
NAME=PATH`` adds a candidate table, compared with the fixed configs like the tuned one (say,
tables chosen with other ``--bands`` from one ``--raw`` run).

``python benchmarks/tuned_vs_fixed.py [--filter seed] [--runs 30] [--json out.json]
[--table bands_2=t2.json ...]``
(build with ``FLASH_REASONING_AOT_GRID=wide`` so every candidate is there to pin).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from flash_reasoning import TreeAttentionPlan, dispatch, reference, runtime, tuning_table
from flash_reasoning.tools import bench, timing, tune


def settings(arch: str, folder: Path, candidates: dict[str, Path]) -> dict[str, Path | None]:
    """``{"tuned": table or None, **candidates, "heuristic": table, "64/4/2": table, ...}``:
    the table dispatch reads now (``$FLASH_REASONING_TUNING`` or the shipped one), the
    candidate tables, an empty table (the heuristics everywhere) and one per compiled config."""
    manifest = runtime.load_manifest(arch)
    tuned = os.environ.get(tuning_table.ENV_VAR)
    out: dict[str, Path | None] = {"tuned": Path(tuned) if tuned else None, **candidates,
                                   "heuristic": folder / "heuristic.json"}
    tuning_table.write(out["heuristic"], arch, {}, {"heuristic": True})
    configs = sorted({c for dtype in ("float16", "bfloat16") for hd in dispatch.HEAD_DIMS
                      for kernel, block_m in dispatch.RULE_LISTS
                      for c in tune.compiled_configs(
                          manifest, dispatch.rule_key(kernel, dtype, hd, block_m))})
    for config in configs:
        path = folder / ("fixed_" + "_".join(map(str, config)) + ".json")
        tuning_table.write(path, arch, tune.fixed_rules(arch, config, manifest), {"fixed": config})
        out["/".join(map(str, config))] = path
    return out


def use(table: Path | None) -> None:
    if table is None:
        os.environ.pop(tuning_table.ENV_VAR, None)
    else:
        os.environ[tuning_table.ENV_VAR] = str(table)
    dispatch.reset()


def run_case(case: dict, tables: dict[str, Path | None], runs: int) -> dict[str, float]:
    """Each setting's time on ``case``. Settings whose plans launch the same kernels share
    one timing (a difference between them could only be noise); the distinct plans are
    timed interleaved (``timing.median_us_each``)."""
    alloc, leaves = bench.case_allocator(case)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"], generator=gen)
    q = q.to(bench.dtype_of(case)).cuda()
    buffer, expected = torch.empty_like(q), None
    kernels_of, plans = {}, {}
    for name, table in tables.items():
        use(table)
        plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
        out = plan.run(q, 0, torch.full_like(q, float("nan")))
        expected = out if expected is None else expected
        error = reference.relative_error(out, expected)
        if not error <= 2 * reference.TOLERANCE[q.dtype]:  # each within TOLERANCE; NaN fails
            raise AssertionError(f"{case['name']} {name}: error {error} against the tuned run")
        kernels = tuple(launch.spec.name for launch in plan.launches(
            q, alloc.k_pools[0], alloc.v_pools[0], buffer))
        kernels_of[name] = kernels
        plans.setdefault(kernels, plan)
    use(tables["tuned"])
    times = timing.median_us_each({kernels: (lambda p=plan: p.run(q, 0, buffer))
                                   for kernels, plan in plans.items()}, runs)
    return {name: times[kernels] for name, kernels in kernels_of.items()}


def confirm_losses(case: dict, row: dict, tables: dict[str, Path | None],
                   candidates: list[str], fixed_names: list[str], tolerance: float,
                   runs: int) -> None:
    """For each candidate a fixed config beat by more than ``tolerance``: the two timed
    again on their own; ``row["confirm"][candidate]`` records the config and both times."""
    best = min(fixed_names, key=row["us"].get)
    for name in candidates:
        if row["us"][name] <= (1 + tolerance) * row["us"][best]:
            continue
        again = run_case(case, {"tuned": tables[name], best: tables[best]}, runs)
        row.setdefault("confirm", {})[name] = {"fixed": best, "us": again["tuned"],
                                               "fixed_us": again[best]}
        print(f"  {name} against {best}, {runs} runs: {again['tuned']:.1f} / {again[best]:.1f} us "
              f"= {again['tuned'] / again[best]:.3f}", flush=True)


def loses(row: dict, name: str, fixed_names: list[str], tolerance: float) -> bool:
    """Whether a fixed config beats candidate ``name`` by more than ``tolerance``, on the
    confirming timing where there is one."""
    confirmed = row.get("confirm", {}).get(name)
    if confirmed:
        return confirmed["us"] > (1 + tolerance) * confirmed["fixed_us"]
    return row["us"][name] > (1 + tolerance) * min(row["us"][k] for k in fixed_names)


def named_table(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    tuning_table.read(Path(path))  # a bad table fails here, not halfway through the cases
    return name, Path(path)


def report(rows: list[dict], candidates: list[str], fixed_names: list[str],
           tolerance: float) -> int:
    """Per candidate table: its geometric mean over each other setting, and the cases where a
    fixed config beats it by more than ``tolerance`` (confirmed); returns the most losses."""
    most = 0
    for name in candidates:
        others = [k for k in rows[0]["us"] if k != name]
        ratios = {k: math.exp(sum(math.log(r["us"][name] / r["us"][k]) for r in rows) / len(rows))
                  for k in others}
        # Above 1: the candidate is slower than that setting on the geometric mean.
        print(f"geomean {name} / other: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        losses = [r["case"] for r in rows if loses(r, name, fixed_names, tolerance)]
        print(f"{name} slower than the best fixed config by > {tolerance:.0%} (confirmed) on "
              f"{len(losses)} of {len(rows)} cases{': ' + ', '.join(losses) if losses else ''}")
        most = max(most, len(losses))
    return most


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="a fixed config this much faster than tuned counts as a loss")
    parser.add_argument("--confirm-runs", type=int, default=200,
                        help="runs of the second timing of a loss")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--table", type=named_table, action="append", default=[],
                        metavar="NAME=PATH", help="another candidate table to compare")
    args = parser.parse_args()
    candidates = dict(args.table)
    device = runtime.require_cuda()
    arch = runtime.arch_of(device.index)
    cases = [c for c in bench.table_cases(bench.load_cases(), cpu=False)
             if args.filter in c["name"]]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tables = settings(arch, Path(folder), candidates)
        fixed_names = [k for k in tables if k not in ("tuned", "heuristic", *candidates)]
        print(f"{torch.cuda.get_device_name(device)} {arch}: tuned vs {len(fixed_names)} fixed "
              f"configs, {args.runs} runs")
        print(f"{'case':22} {'tuned us':>9} {'best fixed':>16} {'tuned/best':>10} "
              f"{'worst fixed':>17} {'heuristic':>9}")
        for case in cases:
            times = run_case(case, tables, args.runs)
            fixed = {k: times[k] for k in fixed_names}
            best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
            ratio = times["tuned"] / fixed[best]
            print(f"{case['name']:22} {times['tuned']:9.1f} {fixed[best]:8.1f} {best:>7} "
                  f"{ratio:10.3f} {fixed[worst]:8.1f} {worst:>8} {times['heuristic']:9.1f}" +
                  "".join(f" {k} {times[k]:.1f}" for k in candidates), flush=True)
            rows.append({"case": case["name"], "us": times})
            confirm_losses(case, rows[-1], tables, ["tuned", *candidates], fixed_names,
                           args.tolerance, args.confirm_runs)
    losses = report(rows, ["tuned", *candidates], fixed_names, args.tolerance)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                         "arch": arch, "runs": args.runs,
                                         "confirm_runs": args.confirm_runs, "rows": rows}) + "\n")
    return 1 if losses else 0


if __name__ == "__main__":
    raise SystemExit(main())
