"""``flash-reasoning``: ``info`` (what is installed and what would run) and ``bench``."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from . import __version__, bench, runtime


def cmd_info(_args) -> int:
    print(f"flash-reasoning {__version__}")
    print(f"artifacts: {runtime.artifact_root()}")
    for arch in runtime.available_archs():
        manifest = json.loads((runtime.artifact_root() / arch / "manifest.json").read_text())
        print(f"  {arch}: {len(manifest['kernels'])} kernels (triton "
              f"{manifest['triton_version']}, ptxas {manifest['ptxas_version']})")
    if not torch.cuda.is_available():
        print("device: none (CPU tensors run the PyTorch path)")
        return 0
    index = torch.cuda.current_device()
    print(f"device: {torch.cuda.get_device_name(index)} "
          f"(sm{''.join(map(str, torch.cuda.get_device_capability(index)))}) -> "
          f"cubins {runtime.arch_of(index)}")
    return 0


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():
        print("bench: no CUDA device; the GPU benchmark needs one", file=sys.stderr)
        return 2
    cases = bench.load_cases(args.cases)["cases"]
    if args.filter:
        cases = [c for c in cases if args.filter in c["name"]]
    bandwidth = bench.timing.copy_bandwidth_tbps()
    arch = runtime.arch_of(torch.cuda.current_device())
    print(f"GPU: {torch.cuda.get_device_name()}, arch {arch}, "
          f"copy bandwidth {bandwidth:.2f} TB/s, flash-reasoning {__version__}")
    runners = {"tree_attention": bench.bench_tree_attention,
               "paged_decode": bench.bench_paged_decode}
    ops = args.ops.split(",")
    unknown = set(ops) - set(runners)
    if unknown:
        print(f"bench: unknown --ops {sorted(unknown)}; choose from {sorted(runners)}",
              file=sys.stderr)
        return 2
    rows = []
    print("\n".join(bench.format_rows([]).splitlines()), flush=True)
    for case in cases:
        new = [runners[op](case, bandwidth, args.runs) for op in ops]
        print("\n".join(bench.format_rows(new).splitlines()[2:]), flush=True)
        rows += new
    print()
    print(bench.format_rows(rows))
    print(bench.summary(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flash-reasoning", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="package, artifacts, device and the cubins it would use")
    bench_parser = commands.add_parser("bench", help="time the kernels on the cases file")
    bench_parser.add_argument("--cases", default=None, help="cases JSON (default: shipped)")
    bench_parser.add_argument("--filter", default="", help="only cases whose name contains it")
    bench_parser.add_argument("--runs", type=int, default=100)
    bench_parser.add_argument("--ops", default="tree_attention,paged_decode",
                              help="comma-separated: tree_attention, paged_decode")
    args = parser.parse_args(argv)
    return {"info": cmd_info, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
