"""What the targets ask against what any kernel can do: each case's unique bytes (the floor's
numerator) read once from one contiguous buffer and summed, nothing else, by the fastest of a
few plain Triton read kernels, timed as the bench times (``timing.median_us``: L2 flushed,
events, median). A kernel that must read those bytes cannot take less than this *read bar*:
it holds the one launch's fixed cost and the bandwidth a read of that size reaches. Prints,
per case, the floor, the bar, the bar over the floor and (with ``--bench``) this package's time
from a bench JSON; then the geometric mean of bar / floor over each target's cases, the least
a plan could score. Run on a GPU:
python benchmarks/read_bar.py [--bench benchmarks/results/bench_h100.json]"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

from flash_reasoning.tools import bench, timing

RUNS = 60
#: (programs per SM, elements per load, warps): the read kernels tried on each case.
CONFIGS = [(p, b, w) for p in (2, 4, 8, 16) for b in (1024, 2048, 8192) for w in (4, 8)]


@triton.jit
def read_sum(x, n, out, per_program, BLOCK: tl.constexpr):
    """One program: elements [pid * per_program, +per_program) of ``x``, BLOCK a load, summed."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    end = tl.minimum(start + per_program, n)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(start, end, BLOCK):
        i = off + tl.arange(0, BLOCK)
        acc += tl.load(x + i, mask=i < end, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, 0))


def read_bar_us(nbytes: int, num_sms: int) -> tuple[float, tuple]:
    """The fastest read of ``nbytes`` (fp16) over CONFIGS: (us, its config)."""
    n = nbytes // 2
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    out = torch.empty(num_sms * max(p for p, _, _ in CONFIGS), device="cuda")

    def launch(programs, block, warps):
        per = triton.cdiv(triton.cdiv(n, programs), block) * block
        return lambda: read_sum[(triton.cdiv(n, per),)](x, n, out, per, BLOCK=block,
                                                        num_warps=warps)
    fns = {cfg: launch(cfg[0] * num_sms, cfg[1], cfg[2]) for cfg in CONFIGS}
    times = timing.median_us_each(fns, runs=RUNS)
    best = min(times, key=times.get)
    return times[best], best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", help="a bench --json file: adds our time beside the bar")
    args = parser.parse_args()
    ours = {}
    if args.bench and not os.path.exists(args.bench):
        print(f"no {args.bench} (bench skipped?): the bars alone")
    elif args.bench:
        rows = json.load(open(args.bench))["rows"]
        ours = {r["case"]: r["us"] for r in rows if r["op"] == "tree_attention"}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    fill = torch.empty(1, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name(0)}: a 4-byte fill {timing.median_us(fill.zero_):.1f} us")
    print(f"{'case':26s} {'MB':>7s} {'floor':>7s} {'bar':>7s} {'bar/fl':>6s} {'ours':>7s} "
          f"{'ours/bar':>8s}  config")
    over_floor = {layout: [] for layout in bench.TARGET_LAYOUTS}  # bar / floor, target cases
    small_bars = []
    cases = bench.load_cases()
    for case in bench.table_cases(cases, cpu=False):
        nbytes = bench.unique_bytes(case)
        floor = bench.floor_us(case, cases["h100_copy_bandwidth_TBps"])  # the cases file's
        bar, cfg = read_bar_us(nbytes, num_sms)
        mine = ours.get(case["name"], float("nan"))
        print(f"{case['name']:26s} {nbytes / 1e6:7.1f} {floor:7.1f} {bar:7.1f} {bar / floor:6.2f} "
              f"{mine:7.1f} {mine / bar:8.2f}  {cfg}", flush=True)
        layout = case["name"].split("/")[-1]
        if floor < bench.SMALL_FLOOR_US:
            small_bars.append(bar)
        elif layout in over_floor:
            over_floor[layout].append(bar / floor)
    limit = f"{bench.SMALL_FLOOR_US:g} us"
    for layout, values in over_floor.items():
        print(f"{layout} (floor >= {limit}): geomean of bar / floor "
              f"{bench.geomean(values):.2f} over {len(values)} cases")
    print(f"small (floor < {limit}): bars " + ", ".join(f"{v:.1f}" for v in small_bars) + " us")


if __name__ == "__main__":
    main()
