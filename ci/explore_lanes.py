"""Final-kernel lanes (``Plan.final_lanes``): each case planned at every lane count, timed
whole and interleaved, and the packed final launch JIT-compiled at each decode-tile config:
the data behind kMinFinalProgramsPerSm (csrc/core/planner.h) and
``dispatch.PACKED_FINAL_CONFIG``; ``--whole``: the whole plans only; ``--roots``: the whole
plans of seed-like trees (one root, then leaves) of several root and leaf lengths, the data
behind the wide final tile's rule (a lone root that outlasts the leaves, session 23). Lane
counts go up to the wide final tile's rows over the GQA group. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_lanes.py [--whole | --roots] [CASE...]"""
import sys

import torch

from aot.grid import DECODE_TILE_CANDIDATES, fits_shared_memory
from flash_reasoning import TreeAttentionPlan, bench, dispatch, runtime, timing

sys.path.insert(0, "ci")
from explore_overlap import jit_launch  # noqa: E402

RUNS = 30
#: Cases beyond the cases file: the seed's 128-branch row and other head dims.
EXTRA = [bench.seed_case(128), bench.seed_case(256, head_dim=64), bench.seed_case(256, head_dim=256)]
#: --roots: (branches, root tokens, leaf tokens) of the seed-like trees.
ROOTS = [(256, root, leaf, 8) for root in (512, 1024, 2048, 4096) for leaf in (24, 64, 128)] + \
    [(256, root, leaf, 32) for root in (2048, 4096) for leaf in (24, 64)]


def root_cases():
    for branches, root, leaf, kv_heads in ROOTS:
        case = bench.seed_case(branches, root, leaf, num_kv_heads=kv_heads)
        yield {**case, "name": f"b{branches}_root{root}_leaf{leaf}/q32kv{kv_heads}"}


def explore(case, configs=True):
    alloc, leaves = bench.case_allocator(case, random=False)
    heads, dim = case["num_qo_heads"], case["head_dim"]
    q = torch.randn(len(leaves), heads, dim, device="cuda").to(alloc.dtype)
    out = torch.empty_like(q)
    auto = TreeAttentionPlan(alloc, leaves, heads)
    name = f"{case['name']}/d{dim}"
    if auto.arrays.separate_merge:
        print(f"{name:28} merges separately: no final launch", flush=True)
        return
    group = heads // case["num_kv_heads"]
    narrow, most = (max(1, rows // group) for rows in (dispatch.BLOCK_M,
                                                        dispatch.FINAL_WIDE_BLOCK_M))
    plans = {lanes: TreeAttentionPlan(alloc, leaves, heads, final_lanes=lanes)
             for lanes in (1, 2, 4, 8, 16, 32) if lanes <= most}
    whole = timing.median_us_each({lanes: (lambda p=p: p.run(q, 0, out))
                                   for lanes, p in plans.items()}, RUNS)
    finals = {lanes: p.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)[-1]
              for lanes, p in plans.items()}
    final_us = timing.median_us_each({lanes: (lambda l=l: runtime.run([l], q.device))
                                      for lanes, l in finals.items()}, RUNS)
    print(f"{name:28} auto L{auto.arrays.final_lanes} | whole "
          + " ".join(f"L{k}:{v:.1f}" for k, v in whole.items()) + " | final "
          + " ".join(f"L{k}:{v:.1f}" for k, v in final_us.items()), flush=True)
    lanes = max((k for k in plans if 1 < k <= narrow), default=None)  # the narrow tile's
    if lanes is None or not configs:
        return
    launch = finals[lanes]
    configs = {c: jit_launch(launch, c) for c in DECODE_TILE_CANDIDATES
               if fits_shared_memory(runtime.arch_of(q.device.index), dim, 16, c)}
    for fn in configs.values():
        fn()
    times = timing.median_us_each(configs, RUNS)
    print(f"{'':28} L{lanes} packed configs (JIT): "
          + " ".join(f"{'/'.join(map(str, c))}:{t:.1f}" for c, t in sorted(times.items(),
                                                                           key=lambda x: x[1])),
          flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    cases = {c["name"]: c for c in bench.load_cases()["cases"]}
    for case in EXTRA:
        cases[f"{case['name']}/d{case['head_dim']}"] = case
    args = sys.argv[1:]
    if "--roots" in args:
        for case in root_cases():
            explore(case, configs=False)
        return
    whole = "--whole" in args
    for name in [a for a in args if a != "--whole"] or cases:
        explore(cases[name], configs=not whole)


if __name__ == "__main__":
    sys.exit(main())
