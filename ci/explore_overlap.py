"""The final (or merge) launch overlapping the partial launch (``dispatch.grid_dependency``):
each tree plan of the cases file run as shipped (AOT, the planner's ``early_final``), with the
last launch started after the partial programs' walks and at their start (AOT, forced), and
JIT-compiled without overlap; and final kernels that do not wait: how many outputs poisoned
partials reach (the check of ``test_gpu_last_launch_waits_for_the_partials``), at either
start. The data behind ``final_starts_early`` (csrc/core/planner.h). sm90 only. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_overlap.py [CASE...]"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from aot.interpret import triton_args
from aot.kernels import JIT_FUNCTIONS
from flash_reasoning import TreeAttentionPlan, bench

RUNS = 30
WAIT = "    wait_for_previous_launch(PDL)  # the partials are the partial launch's output\n"


def variant(name, *edits):
    """The tree kernels' module with ``edits`` (old, new) applied to its source."""
    src = Path("aot/kernels/tree_attention.py").read_text()
    src = src.replace("from .attention_core", "from aot.kernels.attention_core")
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new, 1)
    path = Path(tempfile.mkdtemp()) / f"tree_attention_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHIPPED = variant("shipped")
NO_WAIT = variant("no_wait", (WAIT, ""))


def jit_runs(launches, module, pdl):
    """The launches through ``module``'s JIT kernels, the last one overlapping when ``pdl``."""
    def run(launch, last):
        fn = getattr(module, launch.spec.family)
        constexprs = {**dict(launch.spec.constexprs), "PDL": int(pdl)}
        args = triton_args(launch)
        return lambda: fn[launch.grid](*args, **constexprs, num_warps=launch.spec.num_warps,
                                       num_stages=launch.spec.num_stages, launch_pdl=pdl and last)
    runs = [run(launch, i == len(launches) - 1) for i, launch in enumerate(launches)]
    return lambda: [r() for r in runs]


def case_queries(case):
    """A case's pool (on the GPU), its leaves and random queries in the pool's dtype: what each
    explore of whole plans starts from."""
    alloc, leaves = bench.case_allocator(case)
    q = torch.randn(len(leaves), case["num_qo_heads"], alloc.head_dim, device="cuda")
    return alloc, leaves, q.to(alloc.dtype)


def time_plans(name, plans, q, runs):
    """Each of ``plans`` (by key) run on ``q``, checked against the first, then timed
    interleaved (``bench.check_and_time``): us by key."""
    out = torch.empty_like(q)
    fns = {key: (lambda p=p: p.run(q, 0, out)) for key, p in plans.items()}
    return bench.check_and_time(name, fns, lambda fn: poisoned_run(plans.values(), fn, out),
                                runs)


def jit_launch(launch, config, module=None, **constexprs):
    """``launch`` through Triton's JIT at (BLOCK_N, warps, stages) ``config``: the explores'
    config sweeps of one shipped launch (its items, addressing and grid unchanged), through the
    shipped kernels or ``module``'s (a :func:`variant`), with ``constexprs`` overridden."""
    block_n, warps, stages = config
    constexprs = {**dict(launch.spec.constexprs), "BLOCK_N": block_n, **constexprs}
    kernels = JIT_FUNCTIONS[launch.spec.family] if module is None else \
        getattr(module, launch.spec.family)
    kernel = kernels[launch.grid]
    return lambda: kernel(*triton_args(launch), **constexprs, num_warps=warps, num_stages=stages)


def try_compile(key, run, info):
    """``run()``, a JIT launch, once: its registers, spills and shared memory appended to
    ``info`` under ``key``, or why the compiler refused it. Returns whether it compiled."""
    try:
        compiled = run()
    except Exception as error:  # a config the compiler refuses: say so, go on
        info.append(f"{key}: fail ({type(error).__name__})")
        return False
    info.append(f"{key}: {compiled.n_regs} regs, {compiled.n_spills} spills, "
                f"{compiled.metadata.shared // 1024} KB smem")
    return True


def report(title, info, times):
    """A case's title line, its variants' compile notes, then their times (us)."""
    print(title, flush=True)
    for line in info:
        print("   ", line, flush=True)
    for key, us in times.items():
        print(f"    {key:30} {us:7.1f}", flush=True)


def poisoned_run(plans, fn, out):
    for plan in plans:
        plan.partial_out.fill_(float("nan"))
        plan.partial_lse.fill_(float("nan"))
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return out.clone()


def explore(name, case):
    alloc, leaves, q = case_queries(case)
    plans = {early: TreeAttentionPlan(alloc, leaves, case["num_qo_heads"], early_final=early)
             for early in (None, False, True)}
    out = torch.empty_like(q)
    launches = {early: p.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
                for early, p in plans.items()}
    if len(launches[None]) < 2:
        print(f"{name:24} one launch: nothing to overlap", flush=True)
        return
    shipped = "early" if plans[None].arrays.early_final else "after walk"
    fns = {f"shipped ({shipped})": lambda: plans[None].run(q, 0, out),
           "no overlap": jit_runs(launches[False], SHIPPED, False),
           "after walk": lambda: plans[False].run(q, 0, out),
           "early": lambda: plans[True].run(q, 0, out)}
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run(plans.values(), fn, out),
                                 RUNS)
    exposed = [max(poisoned_run(plans.values(), jit_runs(launches[early], NO_WAIT, True), out)
                   .isnan().sum().item() for _ in range(5)) for early in (False, True)]
    print(f"{name:24} " + " ".join(f"{k} {t:6.1f}" for k, t in times.items())
          + f" | no wait: {exposed[0]} NaN outputs, early start: {exposed[1]}", flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
