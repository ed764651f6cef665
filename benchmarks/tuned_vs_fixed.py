"""The tree-attention benchmark under the tuned dispatch and under each single fixed config.

For every case of the bench (the seed's table and the cases file) and every config compiled
for some rule list, ``tune.fixed_rules`` pins that config wherever it is compiled (through a
``FLASH_REASONING_TUNING`` table written here); the tuned run uses the table dispatch reads
(``$FLASH_REASONING_TUNING`` when set, else the shipped one), and a run with an empty table
shows the heuristics. Each plan's output is checked against the tuned one
(poisoned first), then timed like the bench (CUDA events, L2 flushed, median). A case where a
fixed config beats the tuned dispatch by more than ``--tolerance`` is listed.

``python benchmarks/tuned_vs_fixed.py [--filter seed] [--runs 30] [--json out.json]``
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

from flash_reasoning import TreeAttentionPlan, bench, dispatch, reference, runtime, timing, tune
from flash_reasoning import tuning_table


def settings(arch: str, folder: Path) -> dict[str, Path | None]:
    """``{"tuned": table or None, "heuristic": table, "64/4/2": table, ...}``: the table
    dispatch reads now (``$FLASH_REASONING_TUNING`` or the shipped one), an empty table (the
    heuristics everywhere) and one per compiled config."""
    manifest = json.loads((runtime.artifact_root() / arch / "manifest.json").read_text())
    tuned = os.environ.get(tuning_table.ENV_VAR)
    out: dict[str, Path | None] = {"tuned": Path(tuned) if tuned else None,
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
    alloc, leaves = bench.case_allocator(case)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"], generator=gen)
    q = q.to(bench.dtype_of(case)).cuda()
    times, expected = {}, None
    for name, table in tables.items():
        use(table)
        plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
        out = plan.run(q, 0, torch.full_like(q, float("nan")))
        expected = out if expected is None else expected
        error = reference.relative_error(out, expected)
        if not error <= 4e-3:  # each within 2e-3 of float64; NaN fails too
            raise AssertionError(f"{case['name']} {name}: error {error} against the tuned run")
        buffer = torch.empty_like(q)
        times[name] = timing.median_us(lambda: plan.run(q, 0, buffer), runs)
    use(tables["tuned"])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filter", default="")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="a fixed config this much faster than tuned counts as a loss")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = runtime.require_cuda()
    arch = runtime.arch_of(device.index)
    cases = [c for c in bench.table_cases(bench.load_cases(), cpu=False)
             if args.filter in c["name"]]
    losses, rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        tables = settings(arch, Path(folder))
        print(f"{torch.cuda.get_device_name(device)} {arch}: tuned vs {len(tables) - 2} fixed "
              f"configs, {args.runs} runs")
        print(f"{'case':22} {'tuned us':>9} {'best fixed':>16} {'tuned/best':>10} "
              f"{'worst fixed':>17} {'heuristic':>9}")
        for case in cases:
            times = run_case(case, tables, args.runs)
            fixed = {k: v for k, v in times.items() if k not in ("tuned", "heuristic")}
            best, worst = min(fixed, key=fixed.get), max(fixed, key=fixed.get)
            ratio = times["tuned"] / fixed[best]
            print(f"{case['name']:22} {times['tuned']:9.1f} {fixed[best]:8.1f} {best:>7} "
                  f"{ratio:10.3f} {fixed[worst]:8.1f} {worst:>8} {times['heuristic']:9.1f}",
                  flush=True)
            rows.append({"case": case["name"], "us": times})
            if ratio > 1 + args.tolerance:
                losses.append(case["name"])
    # Above 1: the tuned dispatch is slower than that setting on the geometric mean.
    per_config = {k: math.exp(sum(math.log(r["us"]["tuned"] / r["us"][k]) for r in rows)
                              / len(rows)) for k in tables if k != "tuned"}
    print("geomean tuned / fixed: " + ", ".join(f"{k} {v:.3f}" for k, v in per_config.items()))
    print(f"tuned slower than the best fixed config by > {args.tolerance:.0%} on "
          f"{len(losses)} of {len(rows)} cases{': ' + ', '.join(losses) if losses else ''}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                         "arch": arch, "runs": args.runs, "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
