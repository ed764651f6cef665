"""The two partial launches of a two-tile plan side by side, and the loads at the end of each
program's dependent chain (issue 4, docs/perf.md session 18). Each case's shipped plan (AOT),
its launches JIT-compiled from the shipped kernels and from variants:
- ``one after other``: ``tree_partial`` without the wait at its end, each partial launch
  launched plainly (the kernels before session 18; the final launch overlaps as shipped);
- ``two tiles`` (plans the planner put in one tile, merging separately): the plan in both
  tiles, whose partial launches now run side by side;
- ``final hoist``: ``tree_final`` loads its branch's partial-slot range (``merge_ptr``, plan
  data) before its walk, not after it: one DRAM round trip fewer after the walk;
- ``both hoist``: and ``tree_partial`` loads its rows' partial slots (``entry_slot``) before
  its walk.
Every variant's output is checked against the AOT run's (outputs and partials poisoned first).
On plans with two partial launches, the second overlapping the first without the wait at its
end: how many outputs the first launch's poisoned partials reach (``no end wait``), on the
cases and on the GPU test's tree (``long_narrow``, ``synthetic.long_narrow_node``). Run on a
GPU: PYTHONPATH=.:python python3 ci/explore_tail.py [CASE...]"""
import sys

import torch

from aot.interpret import triton_args
from flash_reasoning import TreeAttentionPlan, bench

from flash_reasoning.synthetic import LONG_NODE_TOKENS, long_narrow_node

sys.path.insert(0, "ci")
from explore_overlap import poisoned_run, variant  # noqa: E402

RUNS = 40

FINAL_WALK = """        start, end = final_range(seq, True, seq_lens, final_start, page_size, max_blocks)
        m_i, l_i, acc = attend("""
FINAL_SLOTS = """        lo = tl.load(merge_ptr + seq)
        count = tl.load(merge_ptr + seq + 1) - lo
        steps = count
"""
PACKED_WALK = "        tokens_per_lane = BLOCK_N // lanes\n"
PACKED_SLOTS = """        lo = tl.load(merge_ptr + seq, mask=row_ok, other=0)
        count = tl.load(merge_ptr + seq + 1, mask=row_ok, other=0) - lo
        steps = tl.max(count, 0)
"""
FINAL_HOIST = ((FINAL_SLOTS, ""), (FINAL_WALK, FINAL_SLOTS + FINAL_WALK),
               (PACKED_SLOTS, ""), ("    if PACKED:\n" + PACKED_WALK,
                                    "    if PACKED:\n" + PACKED_SLOTS + PACKED_WALK))
PARTIAL_SLOTS = "    slot = tl.load(entry_slot + tl.load(item + ENTRY0) + local, mask=row_ok, other=0)\n"
PARTIAL_WALK = "    table_row = tl.load(item + TABLE_ROW)\n"
PARTIAL_HOIST = ((PARTIAL_SLOTS, ""), (PARTIAL_WALK, PARTIAL_SLOTS + PARTIAL_WALK))
END_WAIT = "    wait_for_previous_launch(PDL)\n\n\n@triton.jit\ndef tree_final("
NO_END_WAIT = ((END_WAIT, "\n\n@triton.jit\ndef tree_final("),)

SHIPPED = variant("shipped")
NO_WAIT_AT_END = variant("no_end_wait", *NO_END_WAIT)
HOISTS = {"final hoist": variant("final_hoist", *FINAL_HOIST),
          "both hoist": variant("both_hoist", *FINAL_HOIST, *PARTIAL_HOIST)}


def jit_run(launches, module, side_by_side=True):
    """The plan's launches through ``module``'s JIT kernels, each after the first overlapping
    the one before as the launcher does (``side_by_side`` False: the partial launches plainly,
    the last launch overlapping)."""
    def one(launch, i):
        fn = getattr(module, launch.spec.family)
        pdl = i > 0 and (side_by_side or i == len(launches) - 1)
        return lambda: fn[launch.grid](*triton_args(launch), **dict(launch.spec.constexprs),
                                       num_warps=launch.spec.num_warps,
                                       num_stages=launch.spec.num_stages, launch_pdl=pdl)
    runs = [one(launch, i) for i, launch in enumerate(launches)]
    return lambda: [r() for r in runs]


def exposed(plan, launches, out):
    """The most outputs, over five runs, that poisoned partials reach when the second partial
    launch overlaps the first without waiting for it at its end."""
    run = jit_run(launches, NO_WAIT_AT_END)
    return max(poisoned_run([plan], run, out).isnan().sum().item() for _ in range(5))


def explore(name, case):
    if name == "long_narrow":
        alloc, leaves = long_narrow_node("cuda")
        plan_kw = {"target_chunk": LONG_NODE_TOKENS, "flat": False}
    else:
        alloc, leaves = bench.case_allocator(case)
        plan_kw = {}
    heads = case["num_qo_heads"]
    q = torch.randn(len(leaves), heads, alloc.head_dim, device="cuda").to(alloc.dtype)
    plan = TreeAttentionPlan(alloc, leaves, heads, **plan_kw)
    out = torch.empty_like(q)
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    two = sum(launch.spec.family == "tree_partial" for launch in launches) == 2
    fns = {"AOT": lambda: plan.run(q, 0, out), "JIT": jit_run(launches, SHIPPED),
           "one after other": jit_run(launches, NO_WAIT_AT_END, side_by_side=False)}
    fns.update({key: jit_run(launches, module) for key, module in HOISTS.items()})
    # A plan the planner put in one tile (a separate merge), run in two tiles side by side.
    split = TreeAttentionPlan(alloc, leaves, heads, one_tile=False, **plan_kw)
    if len(split.arrays.items) > len(plan.arrays.items):
        fns["two tiles"] = lambda: split.run(q, 0, out)
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run([plan, split], fn, out),
                                 RUNS)
    kinds = "+".join(launch.spec.family.removeprefix("tree_") for launch in launches)
    line = f"{name:24} {kinds:24} " + " ".join(f"{k} {t:6.1f}" for k, t in times.items())
    if two:
        line += f" | no end wait: {exposed(plan, launches, out)} NaN outputs"
    print(line, flush=True)


if __name__ == "__main__":
    names = sys.argv[1:]
    if not names or "long_narrow" in names:
        explore("long_narrow", {"num_qo_heads": 32})
    cases = [n for n in names if n != "long_narrow"]
    if cases or not names:
        bench.explore_cases(explore, cases)
