"""Leaves beside a resident root: persistent partial launches (issue 4, docs/perf.md session 21).
A final program started early walks its leaves beside the root, then waits for the root's
partials holding its slot, so only the first wave of final programs overlaps the root (session
20). Here the leaves are partial items (the plan merged separately) and no program waits in
the middle of its work: the root's items run first, in one program per SM that loops over them
(persistent), and the leaves' items run beside it in R programs per SM that loop over theirs and
wait for the root only at their end; tree_merge then folds each row's root and leaf partials.
Both partial launches are ``tree_partial`` JIT-compiled with its body inside a grid-stride loop
(``num_items`` appended to its arguments). Each case: the shipped plan, the separate-merge plan
as the shipped kernels run it, and the persistent launches at each R and leaf config, outputs
checked (us, interleaved, L2 flushed). Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_resident.py [CASE...]"""
import sys
import textwrap
from pathlib import Path

from aot.interpret import triton_args
from flash_reasoning import TreeAttentionPlan, bench

sys.path.insert(0, "ci")
from explore_overlap import case_queries, poisoned_run, report, try_compile, variant  # noqa: E402

CASES = ("seed_b256/q32kv8", "seed_b128/q32kv8", "seed_b64/q32kv8", "ft_1,1024/q32kv8",
         "ft_1,256/q32kv8", "ft_1,4,16,512/q32kv8", "seed_b256/q32kv32", "ft_1,1024/q32kv32")
LEAF_CONFIGS = ((32, 2, 2), (64, 2, 2), (64, 4, 2))
LEAF_PROGRAMS_PER_SM = (1, 2, 3)


def persistent_module():
    """tree_attention.py with tree_partial's body in a loop over its (item, KV head) pairs, each
    item's heads together: ``program_id(0) + k * num_programs(0) < num_pairs``."""
    src = Path("aot/kernels/tree_attention.py").read_text()
    first = "    item_index, kv_head = item_and_head(heads_first)\n"
    end = "    # A second partial launch overlaps the first"
    body = src[src.index(first):src.index(end)]
    looped = ("    for it in range(tl.program_id(0), num_pairs, tl.num_programs(0)):\n"
              + textwrap.indent(body.replace("item_and_head(heads_first)",
                                             "(it // num_kv_heads, it % num_kv_heads)"),
                                "    "))
    return variant("persistent", ("                 heads_first,\n",
                                  "                 heads_first, num_pairs,\n"),
                   (body, looped))


PERSISTENT = persistent_module()


def jit_launch(launch, programs_per_sm, num_sms, pdl, config=None):
    """``launch`` (tree_partial or tree_merge) through the JIT kernels: tree_partial persistent
    at ``programs_per_sm`` (its items spread over that many programs per SM; ``None``: one
    program per item, as shipped)."""
    fn = getattr(PERSISTENT, launch.spec.family)
    constexprs = dict(launch.spec.constexprs)
    warps, stages = launch.spec.num_warps, launch.spec.num_stages
    if config is not None:
        constexprs["BLOCK_N"], warps, stages = config
    args, grid = triton_args(launch), launch.grid
    if launch.spec.family == "tree_partial":
        pairs = grid[0] * grid[1]
        cap = pairs if programs_per_sm is None else max(1, programs_per_sm * num_sms)
        grid = (min(pairs, cap), 1, 1)
        args.append(pairs)
    return lambda: fn[grid](*args, **constexprs, num_warps=warps, num_stages=stages,
                            launch_pdl=pdl)


def explore(name, case, runs=40):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    shipped = TreeAttentionPlan(alloc, leaves, heads)
    if not shipped.arrays.stats["computed_nodes"]:
        print(f"{name:24} no computed node", flush=True)
        return
    # The root unchunked (a lone root of 2048 tokens: one program per SM or more).
    chunk = max(shipped.arrays.stats["chunk_tokens"], 2048)
    sep = TreeAttentionPlan(alloc, leaves, heads, separate_merge=True, one_tile=False,
                            early_final=True, target_chunk=chunk)
    out = q.new_empty(q.shape)
    launches = sep.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    tiles = [dict(launch.spec.constexprs).get("BLOCK_M") for launch in launches]
    if tiles != [16, 64, None]:
        print(f"{name:24} separate plan is not leaves, root, merge ({tiles}): skipped", flush=True)
        return
    leaf, root, merge = launches
    num_sms = sep.num_sms
    fns = {"shipped": lambda: shipped.run(q, 0, out), "sep (AOT)": lambda: sep.run(q, 0, out)}
    info = [f"leaf items {leaf.grid[:2]} at {leaf.spec.name}", f"root items {root.grid[:2]}"]
    merge_run = jit_launch(merge, None, num_sms, True)
    for root_per_sm in (None, 1):
        root_run = jit_launch(root, root_per_sm, num_sms, False)
        for config in LEAF_CONFIGS:
            for per_sm in LEAF_PROGRAMS_PER_SM:
                key = f"root {root_per_sm or 'all'} leaves {per_sm}/SM {'/'.join(map(str, config))}"
                leaf_run = jit_launch(leaf, per_sm, num_sms, True, config)
                steps = (root_run, leaf_run, merge_run)
                if try_compile(key, lambda s=steps: [f() for f in s][1], info):
                    fns[key] = lambda s=steps: [f() for f in s]
        if root.grid[0] * root.grid[1] <= num_sms:
            break  # the root already runs at most one program per SM
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run([shipped, sep], fn, out),
                                 runs)
    report(f"{name} (separate plan: {sep.arrays.stats['partial_programs']} programs)", info, times)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:] or CASES)
