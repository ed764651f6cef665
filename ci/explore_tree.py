"""Sweep the tree planner's knobs on cases of the cases file: the data behind
the planner's constants (csrc/core/planner.h: kMinChunkTokens, kWaves, kRereadWeight) (the kernels' configs are the tuner's:
python -m flash_reasoning.tune). Run on a GPU."""
import functools
import sys

import torch

from flash_reasoning import TreeAttentionPlan, bench, planner, runtime, timing

CASES = ("seed_b256/q32kv8", "seed_b64/q32kv8", "seed_b1/q16kv1", "ft_1,1024/q32kv8",
         "ft_deep16/q32kv8", "ft_1,4,16,512/q32kv8", "ft_1,16,64/q32kv8", "ft_1,10/q32kv8",
         "long_1,4/q32kv8", "seed_b256/q32kv32", "ft_1,256/q32kv8")
CHUNKS = (64, 128, 256, 512, 1024, 2048)
WEIGHTS = (0.125, 2.0, 8.0)
RUNS = 30


def gpu_us(plan, q, out):
    launches = plan.launches(q, plan.allocator.k_pools[0], plan.allocator.v_pools[0], out)
    return timing.median_us(lambda: runtime.run(launches, q.device), RUNS), launches


def explore(case, bw):
    alloc, leaves = bench.case_allocator(case)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"]).half().cuda()
    out = torch.empty_like(q)
    floor = bench.unique_bytes(case) / (bw * 1e12) * 1e6
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    auto, launches = gpu_us(plan, q, out)
    parts = [timing.median_us(lambda l=l: runtime.run([l], q.device), RUNS) for l in launches]
    host = timing.host_us(lambda: plan.run(q, 0, out))
    planning = timing.host_us(lambda: TreeAttentionPlan(alloc, leaves, case["num_qo_heads"]),
                              runs=20)
    print(f"{case['name']:22} floor {floor:6.1f} auto {auto:6.1f} us  launches "
          + " + ".join(f"{l.spec.family}{l.grid}:{t:.1f}" for l, t in zip(launches, parts))
          + f"  | run host {host:.1f} us, plan {planning:.0f} us, {plan.arrays.stats}")
    chunks = {c: gpu_us(TreeAttentionPlan(alloc, leaves, case["num_qo_heads"],
                                          target_chunk=c), q, out)[0] for c in CHUNKS}
    weights = {}
    for weight in WEIGHTS:
        # The weight is an argument of the C++ planner: plans built here pass it.
        original, planner.plan = planner.plan, functools.partial(planner.plan,
                                                                 reread_weight=weight)
        try:
            weights[weight] = gpu_us(TreeAttentionPlan(alloc, leaves, case["num_qo_heads"]),
                                     q, out)[0]
        finally:
            planner.plan = original
    print("    chunk " + " ".join(f"{c}:{us:.1f}" for c, us in chunks.items())
          + "  | reread weight " + " ".join(f"{w}:{us:.1f}" for w, us in weights.items()))


def main() -> None:
    bw = timing.copy_bandwidth_tbps()
    print(f"{torch.cuda.get_device_name()}, copy {bw:.2f} TB/s")
    cases = {c["name"]: c for c in bench.load_cases()["cases"]}
    for name in CASES:
        explore(cases[name], bw)


if __name__ == "__main__":
    sys.exit(main())
