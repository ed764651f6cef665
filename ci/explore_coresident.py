"""Can the leaves' final launch run beside a compute-bound root (issue 4, docs/perf.md session
20)? seed_b256/q32kv8 is ~29 us of root partials then ~30 us of leaves: the root's 64-row
programs (4 warps, ~206 registers, 112 KB of shared memory) fill every SM two at a time, so no
final program fits beside them and the two launches run one after the other. A root tile of
128 rows at 8 warps does the same work in one program per SM, which would leave registers and
shared memory for final programs. Measured per case (JIT, us, L2 flushed, interleaved):
- the shipped plan whole, its partial launch alone and its final launch alone;
- the root's items re-cut into 128-row tiles (``tree_partial`` JIT at BLOCK_M 128, each
  config) alone, with its registers, spills and shared memory;
- the 64-row root unchunked (one program per tile) alone;
- each root and the shipped final launch on two streams, root first (the final's merge then
  reads partials that may still be written: timing only), against the same two one after the
  other; and the shipped partial launch beside the final the same way.
Run on a GPU: PYTHONPATH=.:python python3 ci/explore_coresident.py [CASE...]"""
import sys

import numpy as np
import torch

from aot.interpret import triton_args
from aot.kernels import JIT_FUNCTIONS
from flash_reasoning import TreeAttentionPlan, bench, runtime, timing
from flash_reasoning.specializations import TREE_ITEM_FIELDS, TREE_PARTIAL

sys.path.insert(0, "ci")
from explore_overlap import case_queries, report, try_compile  # noqa: E402

RUNS = 30
CASES = ("seed_b256/q32kv8", "seed_b128/q32kv8", "ft_1,256/q32kv8", "ft_1,1024/q32kv8")
WIDE = 128
#: (BLOCK_N, warps, stages, register cap): a final program (2 warps x 240 registers) fits
#: beside an 8-warp root only at <= 190 registers a thread.
CONFIGS = ((64, 8, 2, None), (64, 8, 3, None), (32, 8, 3, None), (64, 8, 2, 184),
           (64, 8, 2, 168), (64, 4, 2, None))


def recut(records: np.ndarray, group: int, block_m: int) -> np.ndarray:
    """The same chunks in ``block_m``-row tiles: one record per (chunk, tile)."""
    first = TREE_ITEM_FIELDS.index("first_flat_row")
    rows = TREE_ITEM_FIELDS.index("num_rows")
    chunks = np.unique(np.delete(records, first, axis=1), axis=0)
    out = []
    for chunk in chunks:
        for tile in range(0, int(chunk[rows]) * group, block_m):
            out.append(np.insert(chunk, first, tile))
    return np.array(out, np.int32)


def two_streams(first, second, side):
    """``first`` on the current stream, ``second`` on ``side`` right after it, joined."""
    fork, join = torch.cuda.Event(), torch.cuda.Event()

    def run():
        main = torch.cuda.current_stream()
        fork.record(main)
        side.wait_event(fork)
        first()
        with torch.cuda.stream(side):
            second()
        join.record(side)
        main.wait_event(join)
    return run


def explore(name, case):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    group = heads // alloc.num_kv_heads
    out = torch.empty_like(q)
    plan = TreeAttentionPlan(alloc, leaves, heads)
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    if len(launches) != 2 or launches[1].spec.family != "tree_final":
        print(f"{name:22} not one partial launch and a final launch: skipped", flush=True)
        return
    partial, final = launches
    (block_m, records), = plan.arrays.items.items()
    wide_items = torch.from_numpy(recut(records, group, WIDE)).cuda()
    slots = (plan.partial_out, plan.partial_lse)
    args = triton_args(partial)
    args[[name for name, _ in TREE_PARTIAL.params].index("items")] = wide_items
    args[[name for name, _ in TREE_PARTIAL.params].index("heads_first")] = 0  # (items, heads)
    constexprs = dict(partial.spec.constexprs)
    kernel = JIT_FUNCTIONS["tree_partial"]
    fns = {"shipped": lambda: plan.run(q, 0, out),
           "partial": lambda: runtime.run([partial], q.device),
           "final": lambda: runtime.run([final], q.device)}
    side = torch.cuda.Stream()
    fns["partial | final"] = two_streams(fns["partial"], fns["final"], side)
    # The root unchunked: the 64-row tile at one program per tile (one per SM on seed_b256).
    whole = TreeAttentionPlan(alloc, leaves, heads, target_chunk=1 << 16).launches(
        q, alloc.k_pools[0], alloc.v_pools[0], out)[0]
    fns[f"unchunked {whole.grid}"] = lambda: runtime.run([whole], q.device)
    fns["unchunked | final"] = two_streams(fns[f"unchunked {whole.grid}"], fns["final"], side)
    runtime.run([partial], q.device)  # the shipped partials, to compare against
    expected = [s.clone() for s in slots]
    info = []
    for block_n, warps, stages, cap in CONFIGS:
        key = f"root{WIDE} {block_n}/{warps}/{stages}" + (f" cap{cap}" if cap else "")
        options = {"maxnreg": cap} if cap else {}

        def root(block_n=block_n, warps=warps, stages=stages, options=options):
            return kernel[(wide_items.shape[0], alloc.num_kv_heads, 1)](
                *args, **{**constexprs, "BLOCK_M": WIDE, "BLOCK_N": block_n, "PDL": 0},
                num_warps=warps, num_stages=stages, **options)
        for s in slots:
            s.fill_(float("nan"))
        if not try_compile(key, root, info):
            continue
        torch.cuda.synchronize()
        wrong = sum(int((~torch.isclose(s, e, rtol=2e-3, atol=2e-3)).sum())
                    for s, e in zip(slots, expected))
        info[-1] += f", {wrong} wrong"
        fns[key] = root
        fns[key + " ; final"] = lambda root=root: (root(), fns["final"]())
        fns[key + " | final"] = two_streams(root, fns["final"], side)
    report(f"{name} ({records.shape[0]} items of {block_m} rows -> {wide_items.shape[0]} of "
           f"{WIDE}; final grid {final.grid})", info, timing.median_us_each(fns, RUNS))


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
