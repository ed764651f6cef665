"""Where each case's time goes: the shipped plan timed whole and each of its launches alone,
with the HBM bytes each launch must move (KV read once per distinct range, partials written
and read in fp32, queries and outputs) and the bandwidth that makes; beside them a one-launch
bar (a 4-byte fill timed the same way: a launch's fixed cost in the bench's timing). The data
behind issue 4's per-launch work in docs/perf.md. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_launches.py [CASE...]"""
import functools
import sys

import numpy as np
import torch

from flash_reasoning import TreeAttentionPlan, bench, runtime, timing
from flash_reasoning.specializations import TREE_ITEM_FIELDS

RUNS = 30
FIELD = {name: i for i, name in enumerate(TREE_ITEM_FIELDS)}


def partial_bytes(records, block_m, lengths, group, num_kv_heads, token_bytes, row_bytes):
    """(KV bytes read once per distinct range, partial bytes written) of one partial launch."""
    ends = np.where(records[:, FIELD["open_end"]] != 0, lengths[records[:, FIELD["table_row"]]],
                    records[:, FIELD["kv_end"]])
    ranges = {(int(r[FIELD["table_row"]]), int(r[FIELD["kv_start"]]), int(e))
              for r, e in zip(records, ends)}
    kv = sum(end - start for _, start, end in ranges) * token_bytes
    flat_rows = records[:, FIELD["num_rows"]] * group - records[:, FIELD["first_flat_row"]]
    rows = np.minimum(flat_rows, block_m).sum() * num_kv_heads
    return kv, int(rows) * row_bytes


def launch_bytes(plan, case):
    """HBM bytes of each of ``plan``'s launches, in launch order."""
    arrays, heads, hd = plan.arrays, case["num_qo_heads"], case["head_dim"]
    kv_heads, dtype_bytes = case["num_kv_heads"], 2
    token_bytes = 2 * kv_heads * hd * dtype_bytes
    row_bytes = hd * 4 + 4
    lengths = plan.lengths.cpu().numpy()
    io = 2 * plan.num_branches * heads * hd * dtype_bytes
    out = [sum(partial_bytes(records, block_m, lengths, heads // kv_heads, kv_heads,
                             token_bytes, row_bytes))
           for block_m, records in arrays.items.items()]
    merged = arrays.num_entries * heads * row_bytes
    if arrays.separate_merge:
        out.append(merged + io // 2)
    else:
        out.append(int((lengths - arrays.final_start).sum()) * token_bytes + merged + io)
    return out


@functools.lru_cache(maxsize=None)
def one_launch_bar_us() -> float:
    tiny = torch.empty(1, dtype=torch.int32, device="cuda")
    return timing.median_us(lambda: tiny.fill_(0), RUNS)


def explore(name, case):
    alloc, leaves = bench.case_allocator(case, random=False)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"]).half().cuda()
    out = torch.empty_like(q)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    fns = {"whole": lambda: plan.run(q, 0, out)}
    fns.update({i: (lambda l=l: runtime.run([l], q.device)) for i, l in enumerate(launches)})
    us = timing.median_us_each(fns, RUNS)
    parts = []
    for i, (launch, nbytes) in enumerate(zip(launches, launch_bytes(plan, case))):
        kernel = launch.spec.family.removeprefix("tree_")
        programs = launch.grid[0] * launch.grid[1] * launch.grid[2]
        parts.append(f"{kernel}[{programs}p {nbytes / 1e6:.1f}MB] {us[i]:.1f}us "
                     f"{nbytes / us[i] / 1e6:.2f}TB/s")
    floor = bench.unique_bytes(case) / (bench.load_cases()["h100_copy_bandwidth_TBps"] * 1e6)
    print(f"{name:24} floor {floor:6.1f} whole {us['whole']:6.1f} "
          f"(bar {one_launch_bar_us():.1f}) | " + " | ".join(parts), flush=True)
    print(f"{'':24} " + " ".join(l.spec.name for l in launches), flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
