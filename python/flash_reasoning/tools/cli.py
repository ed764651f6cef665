"""``flash-reasoning``: ``bench`` (the main job), ``demo`` and ``info``."""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys

import torch

from .. import __version__, runtime, tuning_table
from . import bench, demo, family, report, timing


def cmd_info(_args) -> int:
    print(f"flash-reasoning {__version__}")
    print(f"artifacts: {runtime.artifact_root()}")
    print(f"C library: {_c_library()}")
    for arch in runtime.available_archs():
        manifest = runtime.load_manifest(arch)
        print(f"  {arch}: {len(manifest['kernels'])} kernels (triton "
              f"{manifest['triton_version']}, ptxas {manifest['ptxas_version']})")
        for kernel, labels in _configs_by_family(manifest).items():
            print(f"    {kernel} ({len(labels)}): " + "; ".join(labels))
    for arch in runtime.available_archs():
        print(f"dispatch {arch}: {_dispatch_source(arch)}")
    if not torch.cuda.is_available():
        print("device: none (CPU tensors run the PyTorch path)")
        return 0
    index = torch.cuda.current_device()
    print(f"device: {torch.cuda.get_device_name(index)} "
          f"(sm{''.join(map(str, torch.cuda.get_device_capability(index)))}, driver "
          f"{_driver_version()}) -> cubins {runtime.arch_of(index)}")
    return 0


def _dispatch_source(arch: str) -> str:
    """Where ``arch``'s kernel configs come from: a measured table or the heuristics."""
    table = tuning_table.load(arch)
    if table is None:
        return "heuristics in flash_reasoning/dispatch.py (no tuning table for this arch)"
    measured = ", ".join(f"{table.measured_on[k]}" for k in ("device", "date")
                         if k in table.measured_on)
    return f"{table.source} ({len(table.rules)} rule lists, measured on {measured})"


def _c_library() -> str:
    """The C ABI's library and include folder, or why they are missing."""
    from .. import capi
    try:
        return f"{capi.library_path()} (include {capi.include_dir()})"
    except FileNotFoundError as err:
        return f"not built ({err})"


def _configs_by_family(manifest: dict) -> dict[str, list[str]]:
    """Each kernel's compiled specializations, e.g. ``float16 HEAD_DIM=128 BLOCK_N=64 w4 s2``."""
    kernels: dict[str, list[str]] = {}
    for entry in manifest["kernels"]:
        key = {k: v for k, v in entry["key"].items() if k not in ("num_warps", "num_stages")}
        dtype = key.pop("dtype", None)
        label = " ".join([dtype or "-"] + [f"{k}={v}" for k, v in key.items()]
                         + [f"w{entry['num_warps']}", f"s{entry['num_stages']}"])
        kernels.setdefault(entry["kernel"], []).append(label)
    return {kernel: sorted(labels) for kernel, labels in sorted(kernels.items())}


def _driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cmd_bench(args) -> int:
    ops = tuple(args.ops.split(","))
    unknown = set(ops) - set(bench.OPS)
    if unknown:
        print(f"bench: unknown --ops {sorted(unknown)}; choose from {list(bench.OPS)}",
              file=sys.stderr)
        return 2
    if args.plot:
        report.require_matplotlib()
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    if cpu and args.device != "cpu":
        print("bench: no CUDA device found; running the small CPU version of the seed table "
              "through the PyTorch path (times are CPU times, no floor)")
    if args.family:
        cases = family.family_cases(args.family, args.family_size, args.seed,
                                    None if args.half == "all" else args.half,
                                    family.CPU if cpu else family.GPU)
    else:
        cases = bench.table_cases(None if cpu else bench.load_cases(args.cases), cpu)
    cases = [c for c in cases if args.filter in c["name"]]
    meta = _meta(cpu, args)
    print("  ".join(f"{key}: {value}" for key, value in meta.items()))
    machine = None if cpu else bench.Machine(meta["copy_bandwidth_tbps"], meta["matmul_tflops"],
                                             meta["launch_us"])
    rows: list[bench.Row] = []
    print(bench.format_header(), flush=True)
    for i, case in enumerate(cases):
        _progress(i, len(cases), case["name"])
        new = bench.run_case(case, ops, "cpu" if cpu else "cuda", args.runs, machine)
        _progress(i + 1, len(cases), "")
        print("\n".join(bench.format_row(r) for r in new), flush=True)
        rows += new
    print()
    print(bench.format_header())
    print("\n".join(bench.format_row(r) for r in rows))
    print(bench.summary(rows))
    for path, write in ((args.json, lambda p: report.write_json(p, meta, rows)),
                        (args.csv, lambda p: report.write_csv(p, rows)),
                        (args.plot, lambda p: report.plot(p, meta, rows))):
        if path:
            write(path)
            print(f"wrote {path}")
    return 0


def cmd_plot(args) -> int:
    report.require_matplotlib()
    meta, rows = report.read_json(args.rows)
    report.plot(args.png, meta, rows)
    print(f"wrote {args.png}")
    return 0


def _meta(cpu: bool, args) -> dict:
    meta = {"version": __version__, "date": datetime.date.today().isoformat(),
            "runs": args.runs}
    if cpu:
        return {**meta, "device": "cpu (PyTorch path)"}
    index = torch.cuda.current_device()
    return {**meta, "device": torch.cuda.get_device_name(index), "driver": _driver_version(),
            "cubins": runtime.arch_of(index),
            "copy_bandwidth_tbps": round(timing.copy_bandwidth_tbps(), 3),
            "matmul_tflops": round(timing.matmul_tflops(), 1),
            "launch_us": round(timing.launch_us(), 2)}


def _progress(done: int, total: int, what: str) -> None:
    """A progress bar on stderr when it is a terminal (logs get the streamed rows)."""
    if not sys.stderr.isatty():
        return
    filled = round(30 * done / max(total, 1))
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<28}", end="",
          file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flash-reasoning", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="package, kernels and configs, device, cubins it would use")
    bench_parser = commands.add_parser(
        "bench", help="the seed's table and the cases file: tree_attention against "
        "paged_decode and torch SDPA without sharing")
    bench_parser.add_argument("--cases", default=None, help="cases JSON (default: shipped)")
    bench_parser.add_argument("--filter", default="", help="only cases whose name contains it")
    bench_parser.add_argument("--runs", type=int, default=100, help="timed runs per op")
    bench_parser.add_argument("--ops", default=",".join(bench.OPS),
                              help=f"comma-separated subset of {','.join(bench.OPS)}")
    bench_parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                              help="cpu: the small CPU table even where a GPU exists")
    bench_parser.add_argument("--family", choices=sorted(family.FAMILIES),
                              help="a generated family of trees and model shapes instead of "
                              "the table (small ones on CPU): docs/performance.md")
    bench_parser.add_argument("--family-size", type=int, default=family.SIZE,
                              help=f"cases in the family, both halves (default {family.SIZE})")
    bench_parser.add_argument("--seed", type=int, default=0, help="the family's seed")
    bench_parser.add_argument("--half", choices=(*family.HALVES, "all"), default="held-out",
                              help="the family's cases to run: the half rules may be fitted "
                              "on, the held-out half they are judged on (default), or all")
    bench_parser.add_argument("--json", metavar="FILE", help="write every row as JSON")
    bench_parser.add_argument("--csv", metavar="FILE", help="write every row as CSV")
    bench_parser.add_argument("--plot", metavar="PNG", help="speedup and memory vs batch "
                              "(needs matplotlib: the [plot] extra)")
    demo.add_arguments(commands.add_parser("demo", help="a tree-of-thought decode "
                                           "simulation with random weights"))
    plot_parser = commands.add_parser("plot", help="the --plot figure from a --json file")
    plot_parser.add_argument("rows", help="a file written by bench --json")
    plot_parser.add_argument("png", help="the figure to write")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "bench": cmd_bench, "demo": demo.run,
            "plot": cmd_plot}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
