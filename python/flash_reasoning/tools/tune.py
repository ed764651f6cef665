"""The tuner: ``python -m flash_reasoning.tools.tune`` times every compiled candidate config of each
kernel on a grid of workloads and writes the arch's tuning table (``tuning_table``).

Workloads are what the kernels meet in use: the planner's own plans over two-level and deeper
trees (shared prefix length, branch count, leaf length, GQA group) and paged decodes (sequence
count, length, group), for each dtype and head_dim. Every launch of a workload is timed alone
(CUDA events, L2 flushed, median; the candidates' runs interleaved) with each candidate that
is compiled for its rule list (``dispatch.RULE_LISTS``). A launch's *band* is the first of
``--bands`` (programs per SM) its program count fits under, or the last, open band; its
*bucket* is the power of two nearest (in log scale) to the most tokens one of its programs
walks. In each band and bucket the config with the lowest geometric mean of time over each
workload's fastest wins (the least total time instead measured 0.5% slower on the benchmark),
and each winner serves the lengths of its band nearer to its bucket than to the next one. Rule
lists with one compiled candidate keep their rules untimed.

Candidates are what the artifacts hold: build with ``FLASH_REASONING_AOT_GRID=wide`` to measure
the full candidate grid (``aot/grid.py``). ``--fixed N/W/S`` writes a table that pins one
config wherever it is compiled (the benchmark compares the tuned table against each).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import __version__, dispatch, runtime, tuning_table
from ..ops.paged_decode import decode_launches
from ..ops.tree_attention import TreeAttentionPlan
from ..specializations import DTYPES
from ..tuning_table import Config, Rules
from . import timing
from .bench import case_allocator
from .synthetic import paged_problem

NUM_QO_HEADS = 32
GROUPS = (1, 4, 8)
#: Two-level trees: a shared prefix, then one leaf per branch.
PREFIXES, BRANCHES, LEAVES = (256, 2048), (1, 4, 16, 64, 256, 1024), (8, 32, 64, 128, 512)
#: Deeper trees (nodes per level, tokens per level but the last), leaves of these lengths: a
#: final range then merges a partial per computed level. The third is FastTree's four-level
#: tree: its wide launch mixes a 1280-token range with many short ones, where BLOCK_N 32 beats
#: the 64 that long ranges alone prefer (H100: 75.3 against 83.1 us).
DEEP_TREES = (((1, 4, 64), (1024, 128)), ((1, 4, 16, 256), (512, 256, 64)),
              ((1, 4, 16, 512), (1024, 256, 128)))
DEEP_LEAVES = (16, 64, 256)
PAGED_SEQS, PAGED_LENGTHS = (1, 4, 16, 64, 256), (16, 64, 256, 1024, 4096, 16384)
#: Paged workloads larger than this many tokens are skipped (memory and time).
MAX_PAGED_TOKENS = 1 << 19
#: Programs per SM where rule lists split (``--bands``): up to about one wave of programs,
#: deep pipelines and wide tiles win; with many programs per SM, small tiles of two warps
#: (H100: final ranges of 128 tokens, 128 programs best at 64/4/3, 8192 at 32/2/2, +30%).
PROGRAMS_PER_SM_BANDS = (2, 8)


@dataclass(frozen=True)
class Sample:
    """One timed launch: rule list ``key``, its workload, the most tokens one program walks,
    its program count, the config and its median time."""
    key: str
    workload: str
    max_tokens: int
    programs: int
    config: Config
    us: float

    @property
    def bucket(self) -> int:
        return bucket_of(self.max_tokens)

    def band(self, num_sms: int, bands: tuple[float, ...]) -> float | None:
        """The first of ``bands`` (programs per SM) this launch fits under; ``None``: more."""
        return next((b for b in bands if self.programs <= b * num_sms), None)


def bucket_of(max_tokens: int) -> int:
    """The power of two nearest ``max_tokens`` in log scale (a range of 0 tokens: 1)."""
    return 2 ** round(math.log2(max(max_tokens, 1)))


def band_rules(band: float | None, winners: dict[int, Config]) -> Rules:
    """One band's rules from each bucket's winner: a bucket serves lengths up to the geometric
    mean of it and the next bucket (nearest in log scale); the last serves any length."""
    buckets = sorted(winners)
    bounds = [math.isqrt(a * b) for a, b in zip(buckets, buckets[1:])] + [None]
    return tuple((band, bound, winners[b]) for bound, b in zip(bounds, buckets))


def choose(samples: list[Sample], num_sms: int,
           bands: tuple[float, ...] = PROGRAMS_PER_SM_BANDS) -> dict[str, Rules]:
    """Per rule list, its rules from the samples: each band's and bucket's winner
    (:func:`_winner`); the last band measured serves any program count."""
    cells: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for s in samples:
        cells[s.key][s.band(num_sms, bands)][s.bucket].append(s)
    out = {}
    for key, by_band in cells.items():
        measured = sorted(by_band, key=lambda b: math.inf if b is None else b)
        last = len(measured) - 1
        rules = [rule for i, band in enumerate(measured) for rule in band_rules(
            None if i == last else band,
            {bucket: _winner(group) for bucket, group in by_band[band].items()})]
        out[key] = tuning_table.simplify(tuple(rules))
    return out


def _winner(samples: list[Sample]) -> Config:
    """The config with the lowest geometric mean, over the bucket's workloads (each must have
    run it), of its time over the workload's fastest."""
    best = defaultdict(lambda: math.inf)
    for s in samples:
        best[s.workload] = min(best[s.workload], s.us)
    ratios = defaultdict(list)
    for s in samples:
        ratios[s.config].append(math.log(s.us / best[s.workload]))
    return min((c for c, r in ratios.items() if len(r) == len(best)),
               key=lambda c: (statistics.fmean(ratios[c]), c))


def compiled_configs(manifest: dict, key: str) -> list[Config]:
    """The (BLOCK_N, warps, stages) configs compiled for rule list ``key`` (a slot_runs
    kernels' list, ``.../one_run`` or ``.../two_runs``: theirs)."""
    kernel, dtype, head_dim, block_m, slot_runs = dispatch.parse_rule_key(key)
    family, wanted = dispatch.RULE_LIST_SPECS[kernel]
    addressing = {"SLOT_RUNS": slot_runs} if kernel in dispatch.SLOT_RUN_KERNELS else {}
    wanted = {"BLOCK_M": block_m or dispatch.BLOCK_M, **wanted, **addressing,
              "dtype": dtype, "HEAD_DIM": head_dim}
    return sorted({(k["key"]["BLOCK_N"], k["num_warps"], k["num_stages"])
                   for k in manifest["kernels"] if k["kernel"] == family
                   and all(k["key"].get(name) == value for name, value in wanted.items())})


class Tuner:
    """Times candidates on one device; ``samples`` collects every timing."""

    def __init__(self, device: torch.device, runs: int, only: tuple[str, ...] = ()) -> None:
        self.device = device
        self.arch = runtime.arch_of(device.index)
        self.num_sms = runtime.num_sms(device.index)
        self.manifest = runtime.load_manifest(self.arch)
        self.runs = runs
        self.only = only
        self.samples: list[Sample] = []

    def candidates(self, key: str) -> list[Config]:
        """The configs to time for rule list ``key``: none where one is compiled (nothing to
        choose) or where ``only`` names other lists."""
        if self.only and not any(part in key for part in self.only):
            return []
        configs = compiled_configs(self.manifest, key)
        return configs if len(configs) > 1 else []

    def time_tree(self, dtype: str, head_dim: int, group: int, levels: tuple, leaf: int) -> None:
        """Each launch of the planner's plan for a tree, with every candidate."""
        keys = [dispatch.rule_key(k, dtype, head_dim, b, 0, runs)
                for k, b in dispatch.RULE_LISTS if k.startswith("tree")
                for _, runs in dispatch.addressings(k)]
        if not any(self.candidates(key) for key in keys):
            return
        nodes, tokens = levels
        case = {"nodes_per_level": list(nodes), "tokens_per_level": [*tokens, leaf],
                "num_kv_heads": NUM_QO_HEADS // group, "head_dim": head_dim, "dtype": dtype}
        alloc, leaves = case_allocator(case, "cuda", random=False)
        plan = TreeAttentionPlan(alloc, leaves, NUM_QO_HEADS)
        q = torch.randn(len(leaves), NUM_QO_HEADS, head_dim, device="cuda").to(alloc.dtype)
        launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], torch.empty_like(q))
        name = f"tree {nodes}x{[*tokens, leaf]} g{group} {dtype} d{head_dim}"
        for launch, (rule, max_tokens, programs) in zip(launches, plan.launch_picks):
            if rule.split("/")[0] not in dict(dispatch.RULE_LISTS):
                continue  # tree_merge: one config, no rule list
            kernel = dispatch.rule_kernel(launch.spec)
            keys = launch.spec.key
            block_m = keys["BLOCK_M"] if kernel == "tree_partial" else None
            page, slot_runs = keys["PAGE"], keys.get("SLOT_RUNS", 0)
            # The page kernels of any size pool under one list; each run count has its own.
            key = dispatch.rule_key(kernel, dtype, head_dim, block_m, 0, slot_runs)
            runs = {config: [replace(launch, spec=dispatch.kernel_spec(
                kernel, dtype, head_dim, self.arch, config, block_m, page, slot_runs))]
                for config in self.candidates(key)}
            self._sample(key, name, max_tokens, programs, runs)

    def time_paged(self, dtype: str, head_dim: int, group: int, seqs: int, length: int) -> None:
        """A paged decode (split when its programs are few) with every candidate."""
        if not any(self.candidates(dispatch.rule_key(kernel, dtype, head_dim))
                   for kernel in ("paged_decode", "paged_decode_split")):
            return
        p = paged_problem([length] * seqs, NUM_QO_HEADS, NUM_QO_HEADS // group, head_dim,
                          dtype=getattr(torch, dtype), device="cuda")
        out = torch.empty_like(p.q)
        args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens, out, 0.1, self.arch,
                self.num_sms)
        first = decode_launches(*args)
        split = len(first) > 1
        key = dispatch.rule_key("paged_decode_split" if split else "paged_decode", dtype, head_dim)
        splits = first[0].grid[2]
        tokens = math.ceil(p.block_tables.shape[1] * p.k_pool.shape[1] / splits)
        name = f"paged {seqs}x{length} g{group} {dtype} d{head_dim}"
        runs = {config: decode_launches(*args, num_splits=splits, config=config)
                for config in self.candidates(key)}
        self._sample(key, name, tokens, math.prod(first[0].grid), runs)

    def _sample(self, key, workload, max_tokens, programs, launches: dict) -> None:
        """Time each config's launches, interleaved (``timing.median_us_each``)."""
        if not launches:
            return
        fns = {config: (lambda ls=ls: runtime.run(ls, self.device))
               for config, ls in launches.items()}
        times = timing.median_us_each(fns, runs=self.runs, warmup=2)
        self.samples += [Sample(key, workload, max_tokens, programs, config, us)
                         for config, us in times.items()]


def workloads(dtypes, head_dims):
    """(method name, args) of every workload of the grid."""
    for dtype in dtypes:
        for head_dim in head_dims:
            for group in GROUPS:
                for prefix in PREFIXES:
                    for branches in BRANCHES:
                        for leaf in LEAVES:
                            yield "time_tree", (dtype, head_dim, group,
                                                ((1, branches), (prefix,)), leaf)
                for tree in DEEP_TREES:
                    for leaf in DEEP_LEAVES:
                        yield "time_tree", (dtype, head_dim, group, tree, leaf)
                for seqs in PAGED_SEQS:
                    for length in PAGED_LENGTHS:
                        if seqs * length <= MAX_PAGED_TOKENS:
                            yield "time_paged", (dtype, head_dim, group, seqs, length)


def fixed_rules(arch: str, config: Config, manifest: dict) -> dict[str, Rules]:
    """The current rules of ``arch`` with ``config`` pinned in every rule list compiling it."""
    out = {}
    for dtype in DTYPES:
        for head_dim in dispatch.HEAD_DIMS:
            for kernel, block_m in dispatch.RULE_LISTS:
                key = dispatch.rule_key(kernel, dtype, head_dim, block_m)
                current = dispatch.rules(kernel, dtype, head_dim, arch, block_m)[0]
                pinned = config in compiled_configs(manifest, key)
                out[key] = ((None, None, config),) if pinned else current
    return out


def rechoose(raw: Path, out: Path | None, bands: tuple[float, ...]) -> int:
    """Write the table that :func:`choose` makes from a ``--raw`` file's timings (read as gzip
    when its name ends in .gz)."""
    opener = gzip.open if str(raw).endswith(".gz") else open
    with opener(raw, "rt") as f:
        data = json.load(f)
    measured_on = data["measured_on"]
    if "num_sms" not in measured_on:
        raise SystemExit(f"{raw}: timings without program counts (an older tuner); tune again")
    samples = [Sample(s["key"], s["workload"], s["max_tokens"], s["programs"],
                      tuple(s["config"]), s["us"]) for s in data["samples"]]
    arch = measured_on["arch"]
    out = out or Path(f"tuning-{arch}.json")
    tuning_table.write(out, arch, choose(samples, measured_on["num_sms"], bands),
                       {**measured_on, "timings": len(samples), "bands": list(bands)})
    print(f"wrote {out} from {len(samples)} timings of {raw}")
    return 0


def parse_config(text: str) -> Config:
    try:
        block_n, warps, stages = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK_N/WARPS/STAGES, e.g. 64/4/2, got "
                                         f"{text!r}") from None
    return block_n, warps, stages


def parse_bands(text: str) -> tuple[float, ...]:
    try:
        bands = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        bands = ()
    else:
        if all(b > 0 for b in bands) and list(bands) == sorted(set(bands)):
            return tuple(int(b) if b.is_integer() else b for b in bands)
    raise argparse.ArgumentTypeError(f"expected ascending positive programs per SM, e.g. 2,16 "
                                     f"(or nothing for one band), got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_reasoning.tools.tune",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="table to write (default tuning-<arch>.json)")
    parser.add_argument("--raw", type=Path, help="also write every timing as JSON")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per candidate")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default=",".join(map(str, dispatch.HEAD_DIMS)))
    parser.add_argument("--fixed", type=parse_config, metavar="N/W/S",
                        help="write a table pinning this config instead of measuring")
    parser.add_argument("--from-raw", type=Path, metavar="RAW",
                        help="choose again from a --raw file (no GPU needed)")
    parser.add_argument("--only", type=parse_only, default=(), metavar="PART,...",
                        help="time only the rule lists whose key holds one of these parts "
                        "(e.g. /one_run,/two_runs)")
    parser.add_argument("--base", type=Path, metavar="TABLE",
                        help="write this table's rules with the measured lists replaced "
                        "(what --only refits)")
    parser.add_argument("--bands", type=parse_bands, default=PROGRAMS_PER_SM_BANDS,
                        metavar="P1,P2", help="programs per SM where rule lists may split "
                        f"(default {','.join(map(str, PROGRAMS_PER_SM_BANDS))})")
    args = parser.parse_args(argv)
    if args.from_raw:
        return rechoose(args.from_raw, args.out, args.bands)
    device = runtime.require_cuda()
    arch = runtime.arch_of(device.index)
    out = args.out or Path(f"tuning-{arch}.json")
    measured_on = {"arch": arch, "device": torch.cuda.get_device_name(device),
                   "date": datetime.date.today().isoformat(), "flash_reasoning": __version__,
                   "torch": torch.__version__, "num_sms": runtime.num_sms(device.index)}
    if args.fixed:
        tuning_table.write(out, arch, fixed_rules(arch, args.fixed, runtime.load_manifest(arch)),
                           {**measured_on, "fixed": list(args.fixed)})
        print(f"wrote {out} (pinned {args.fixed})")
        return 0
    tuner = Tuner(device, args.runs, args.only)
    grid = list(workloads(args.dtypes.split(","), [int(d) for d in args.head_dims.split(",")]))
    for i, (method, margs) in enumerate(grid):
        getattr(tuner, method)(*margs)
        print(f"\r{i + 1}/{len(grid)} workloads, {len(tuner.samples)} timings", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rules = choose(tuner.samples, tuner.num_sms, args.bands)
    measured_on.update(runs=args.runs, workloads=len(grid), timings=len(tuner.samples))
    if args.raw:  # before the table's band choice: --from-raw may choose again
        args.raw.write_text(json.dumps({"measured_on": measured_on, "samples": [
            {**s.__dict__, "bucket": s.bucket} for s in tuner.samples]}) + "\n")
        print(f"wrote {args.raw}")
    measured_on["bands"] = list(args.bands)
    if args.base:
        rules, measured_on = refit(tuning_table.read(args.base), rules, measured_on)
    tuning_table.write(out, arch, rules, measured_on)
    for key, rule_list in sorted(rules.items()):
        print(f"{key}: " + ", ".join(describe(rule) for rule in rule_list))
    print(f"wrote {out}")
    return 0


def parse_only(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def refit(base: tuning_table.Table, measured: dict[str, Rules],
          measured_on: dict) -> tuple[dict[str, Rules], dict]:
    """``base``'s rules with the ``measured`` lists in place of (or beside) its own, and its
    provenance with this run's under ``refits`` (which lists, measured where and when)."""
    refits = [*base.measured_on.get("refits", []), {**measured_on, "keys": sorted(measured)}]
    return {**base.rules, **measured}, {**base.measured_on, "refits": refits}


def describe(rule: tuning_table.Rule) -> str:
    """``programs <= 2/SM, tokens <= 90: 32/4/2``."""
    per_sm, tokens, config = rule
    bounds = [f"programs <= {per_sm:g}/SM" if per_sm is not None else "",
              f"tokens <= {tokens}" if tokens is not None else ""]
    return f"{', '.join(b for b in bounds if b) or 'else'}: {'/'.join(map(str, config))}"


if __name__ == "__main__":
    sys.exit(main())
