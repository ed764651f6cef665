"""Each case of the cases file planned three ways (the planner's choice, forced final-kernel
merge, forced separate merge), timed interleaved, and the separate plans by chunk length: the
data behind kSeparateMergeSteps and kLaunchSteps (csrc/core/planner.h). Run on a GPU: PYTHONPATH=.:python python3 ci/explore_merge.py [CASE...]"""
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench, runtime, timing

RUNS = 30
CHUNKS = (64, 128, 256, 512)


def explore(case, bw):
    alloc, leaves = bench.case_allocator(case, random=False)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"]).half().cuda()
    out = torch.empty_like(q)
    plans = {mode: TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], separate_merge=mode)
             for mode in (None, False, True)}
    us = timing.median_us_each({mode: (lambda p=p: p.run(q, 0, out))
                                for mode, p in plans.items()}, RUNS)
    floor = bench.unique_bytes(case) / (bw * 1e12) * 1e6
    parts = {}
    for mode in (False, True):
        launches = plans[mode].launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
        parts[mode] = "+".join(f"{timing.median_us(lambda l=l: runtime.run([l], q.device), RUNS):.1f}"
                               for l in launches)
    auto = plans[None].arrays.separate_merge
    if auto:  # shorter chunks cost little to merge separately: do they pay?
        chunked = {c: TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], target_chunk=c,
                                        separate_merge=True) for c in CHUNKS}
        times = timing.median_us_each({c: (lambda p=p: p.run(q, 0, out))
                                       for c, p in chunked.items()}, RUNS)
        print(f"{case['name']:22} separate by chunk: "
              + " ".join(f"{c}:{t:.1f}" for c, t in times.items()), flush=True)
    best = min((False, True), key=us.get)
    print(f"{case['name']:22} floor {floor:6.1f} auto({'sep' if auto else 'fin'}) {us[None]:6.1f}"
          f" | final {us[False]:6.1f} ({parts[False]}) | separate {us[True]:6.1f} ({parts[True]})"
          f"{'' if best == auto else '  <- other mode faster by %.1f' % (us[auto] - us[best])}",
          flush=True)


def main() -> None:
    bw = timing.copy_bandwidth_tbps()
    print(f"{torch.cuda.get_device_name()}, copy {bw:.2f} TB/s")
    cases = {c["name"]: c for c in bench.load_cases()["cases"]}
    for name in sys.argv[1:] or cases:
        explore(cases[name], bw)


if __name__ == "__main__":
    sys.exit(main())
