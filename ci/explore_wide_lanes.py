"""Final programs of more lanes, so that one wave of them covers every leaf beside a lone root
(issue 4, docs/perf.md session 20). A root cut for one program per SM leaves room for two
final programs per SM; started early, they walk their leaves beside it, then wait for the
root's partials holding their slots, so the leaves of programs past the first wave (seed_b256:
512 programs of 4 lanes, 264 slots) still follow the root. A packed program's lanes are
capped by the narrow tile (16 rows / GQA group 4 = 4 lanes); this JIT-compiles ``tree_final``
at BLOCK_M = lanes x group for the shipped lanes and twice as many (at most 64 rows) and runs
it after the plan's (AOT) partial launch, started early as shipped. Each case: the shipped
plan whole, then the partial launch and the final at each lane count and config, outputs
checked (us, interleaved, L2 flushed). Session 22 added the configs of 3 and 4 stages at 2
warps (a program's next KV tile in flight while it computes this one); session 23 the
options: ``--factors 2,4`` (lanes as multiples of the shipped ones; default 1,2) and
``--configs 32/4/2,64/2/2`` (default CONFIGS), the shipped launch timed as well.
Run on a GPU: PYTHONPATH=.:python python3 ci/explore_wide_lanes.py [--factors F,..]
[--configs N/W/S,..] [CASE...]"""
import math
import sys

from aot.interpret import triton_args
from aot.kernels import JIT_FUNCTIONS
from flash_reasoning import TreeAttentionPlan, bench, runtime
from flash_reasoning.specializations import TREE_FINAL

sys.path.insert(0, "ci")
from explore_overlap import case_queries, poisoned_run, report, try_compile  # noqa: E402

CASES = ("seed_b128/q32kv8", "seed_b256/q32kv8", "ft_1,256/q32kv8", "ft_1,4,256/q32kv8",
         "ft_1,1024/q32kv8", "ft_1,4,16,512/q32kv8", "ft_deep16/q32kv8", "seed_b256/q32kv32",
         "ft_1,4,256/q32kv32", "ft_1,16,64/q32kv32")
CONFIGS = ((64, 2, 2), (32, 2, 3), (64, 2, 3), (32, 2, 4), (64, 2, 4), (64, 4, 3), (128, 4, 2))
PARAMS = [name for name, _ in TREE_FINAL.params]


def wide_final(final, lanes, group, config):
    """``final`` (a packed tree_final launch) JIT-compiled for ``lanes`` lanes at ``config``,
    started early after the partial launch (PDL)."""
    block_n, warps, stages = config
    args = triton_args(final)
    args[PARAMS.index("lanes")] = lanes
    tiles = final.grid[0] if args[PARAMS.index("heads_first")] else final.grid[1]
    args[PARAMS.index("heads_first")] = 0
    grid = (math.ceil(args[PARAMS.index("num_rows")] / lanes), tiles, 1)
    constexprs = {**dict(final.spec.constexprs), "BLOCK_M": lanes * group, "BLOCK_N": block_n}
    return lambda: JIT_FUNCTIONS["tree_final"][grid](
        *args, **constexprs, num_warps=warps, num_stages=stages, launch_pdl=True)


def explore(name, case, runs=40, factors=(1, 2), configs=CONFIGS):
    alloc, leaves, q = case_queries(case)
    heads = case["num_qo_heads"]
    group = heads // alloc.num_kv_heads
    plan = TreeAttentionPlan(alloc, leaves, heads)
    out = q.new_empty(q.shape)
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    if len(launches) != 2 or not dict(launches[1].spec.constexprs).get("PACKED"):
        print(f"{name:22} not a partial launch and a packed final launch: skipped", flush=True)
        return
    partial, final = launches
    fns = {f"shipped (L{plan.arrays.final_lanes})": lambda: plan.run(q, 0, out)}
    info = []
    shipped_lanes = plan.arrays.final_lanes
    for lanes in (factor * shipped_lanes for factor in factors):
        if lanes * group > 64:
            continue
        for config in configs:
            key = f"L{lanes} {'/'.join(map(str, config))}"
            run_final = wide_final(final, lanes, group, config)
            if try_compile(key, run_final, info):
                fns[key] = lambda f=run_final: (runtime.run([partial], q.device), f())
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run([plan], fn, out), runs)
    report(f"{name} (final grid {final.grid}, {plan.arrays.stats['partial_programs']} partial "
           f"programs)", info, times)


def parse(argv):
    """(factors, configs, cases) from the command line."""
    options = {"--factors": "1,2", "--configs": ",".join("/".join(map(str, c)) for c in CONFIGS)}
    while argv and argv[0] in options:
        options[argv[0]], argv = argv[1], argv[2:]
    factors = tuple(int(f) for f in options["--factors"].split(","))
    configs = tuple(tuple(int(v) for v in c.split("/")) for c in options["--configs"].split(","))
    return factors, configs, argv or CASES


if __name__ == "__main__":
    FACTORS, SWEEP, NAMES = parse(sys.argv[1:])
    bench.explore_cases(lambda name, case: explore(name, case, 40, FACTORS, SWEEP), NAMES)
