"""The final (or merge) launch overlapping the partial launch (``dispatch.grid_dependency``):
each tree plan of the cases file run as shipped (AOT), then JIT-compiled without overlap and
with the partial launch letting its dependents start at its beginning instead of after its walk;
and final kernels that do not wait: how many outputs poisoned partials reach (the check of
``test_gpu_last_launch_waits_for_the_partials``), at either start. sm90 only. Run on a GPU:
PYTHONPATH=.:python python3 ci/explore_overlap.py [CASE...]"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from flash_reasoning import TreeAttentionPlan, bench

RUNS = 30
TRIGGER = "    # Past the walk: the final launch's programs may take the SMs this launch frees.\n" \
          "    let_next_launch_start(PDL)\n"
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
EARLY = variant("early", (TRIGGER, ""), ("    item = items", "    let_next_launch_start(PDL)\n"
                                                         "    item = items"))
NO_WAIT = variant("no_wait", (WAIT, ""))
EARLY_NO_WAIT = variant("early_no_wait", (WAIT, ""), (TRIGGER, ""),
                        ("    item = items", "    let_next_launch_start(PDL)\n    item = items"))


def jit_runs(launches, module, pdl):
    """The launches through ``module``'s JIT kernels, the last one overlapping when ``pdl``."""
    def run(launch, last):
        fn = getattr(module, launch.spec.family)
        constexprs = {**dict(launch.spec.constexprs), "PDL": int(pdl)}
        return lambda: fn[launch.grid](*launch.args, **constexprs, num_warps=launch.spec.num_warps,
                                       num_stages=launch.spec.num_stages, launch_pdl=pdl and last)
    runs = [run(launch, i == len(launches) - 1) for i, launch in enumerate(launches)]
    return lambda: [r() for r in runs]


def poisoned_run(plan, fn, out):
    plan.partial_out.fill_(float("nan"))
    plan.partial_lse.fill_(float("nan"))
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return out.clone()


def explore(name, case):
    alloc, leaves = bench.case_allocator(case)
    q = torch.randn(len(leaves), case["num_qo_heads"], case["head_dim"], device="cuda")
    q = q.to(alloc.dtype)
    plan = TreeAttentionPlan(alloc, leaves, case["num_qo_heads"])
    out = torch.empty_like(q)
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    if len(launches) < 2:
        print(f"{name:24} one launch: nothing to overlap", flush=True)
        return
    fns = {"shipped": lambda: plan.run(q, 0, out), "no overlap": jit_runs(launches, SHIPPED, False),
           "early start": jit_runs(launches, EARLY, True)}
    times = bench.check_and_time(name, fns, lambda fn: poisoned_run(plan, fn, out), RUNS)
    exposed = [max(poisoned_run(plan, jit_runs(launches, module, True), out).isnan().sum().item()
                   for _ in range(5)) for module in (NO_WAIT, EARLY_NO_WAIT)]
    print(f"{name:24} " + " ".join(f"{k} {t:6.1f}" for k, t in times.items())
          + f" | no wait: {exposed[0]} NaN outputs, early start: {exposed[1]}", flush=True)


if __name__ == "__main__":
    bench.explore_cases(explore, sys.argv[1:])
