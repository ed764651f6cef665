"""Warm-up of a fresh process: the AOT kernels against the same kernels through Triton's JIT.

Each measurement runs in a new Python process (nothing imported, nothing loaded) on the
seed's headline tree: a 2048-token root, 256 leaves of 64 tokens, 32 query / 8 KV heads,
head_dim 128, fp16. Per process, in order, each step ended by torch.cuda.synchronize():

- ``torch import`` and ``CUDA init`` (torch's CUDA context creation): paid by any CUDA
  program, so reported apart and *not* included in the target figure;
- ``import``: ``import flash_reasoning`` with its lazy exports resolved (torch already
  imported); for the JIT rows also ``import triton`` and the kernel sources;
- ``launcher`` (AOT only): the C++ launcher and the arch's manifest, loaded on first use;
- ``tree build``: allocator, forks and K/V writes (not part of either figure);
- ``first call``: the first ``tree_attention`` (plan + cubin loads + launches), or for
  the JIT the same plan and the same launches through the ``@triton.jit`` functions;
- ``2nd call``: the next call, for scale.

JIT rows: cold = a fresh empty TRITON_CACHE_DIR (compiles everything, launcher stubs
included), warm = the same directory again in a new process. Target: AOT import + launcher +
first call < 300 ms (no JIT warm-up for a first call). The AOT process also checks that triton
was never imported. ``python benchmarks/warmup.py [--json out.json] [--repeats 3]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_MS = 300.0
#: The JIT runs the same kernels on the same plan: its output must match the AOT one.
JIT_MAX_DIFF = 1e-3
CASE = dict(batch=256, prefix=2048, leaf=64)
MODES = ("aot", "jit_cold", "jit_warm")
STEPS = ("torch_import", "cuda_init", "import", "launcher", "tree_build", "first_call",
         "second_call")


class Steps:
    """Wall time of consecutive steps in ms, each ended by a device sync."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str, sync: bool = True) -> None:
        if sync:
            import torch
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.ms[name] = (now - self._last) * 1e3
        self._last = now


# ---- in the child process ---------------------------------------------------------------------

def child(mode: str) -> dict:
    steps = Steps()
    import torch
    steps.done("torch_import", sync=False)
    torch.empty(1, device="cuda")  # creates the CUDA context
    steps.done("cuda_init")
    from flash_reasoning import TreeAttentionPlan, tree_attention  # noqa: F401 (lazy exports)
    jit_functions = import_jit_kernels() if mode != "aot" else None
    steps.done("import")
    if mode == "aot":
        from flash_reasoning import runtime
        runtime.context(torch.cuda.current_device())  # what the first launch loads
        steps.done("launcher")
    alloc, leaves, q = seed_tree()
    steps.done("tree_build")
    call = aot_call if mode == "aot" else lambda *a: jit_call(jit_functions, *a)
    out = call(q, alloc, leaves)
    steps.done("first_call")
    call(q, alloc, leaves)
    steps.done("second_call")
    reference = tree_attention(q, alloc, leaves) if mode != "aot" else out
    return {"ms": steps.ms, "triton_imported": any(m.split(".")[0] == "triton"
                                                  for m in sys.modules),
            "max_abs_diff_vs_aot": float((out.float() - reference.float()).abs().max()),
            "device": torch.cuda.get_device_name()}


def import_jit_kernels() -> dict:
    sys.path.insert(0, str(REPO))  # aot/ (the kernel sources) lives at the repository root
    import triton  # noqa: F401  (timed as part of the JIT's import)

    from aot.kernels import JIT_FUNCTIONS
    return JIT_FUNCTIONS


def seed_tree():
    import torch

    from flash_reasoning.tools.bench import case_allocator, seed_case
    alloc, leaves = case_allocator(seed_case(CASE["batch"], CASE["prefix"], CASE["leaf"]))
    q = torch.randn(len(leaves), 32, 128, dtype=torch.float16, device="cuda")
    return alloc, leaves, q


def aot_call(q, alloc, leaves):
    import flash_reasoning
    return flash_reasoning.tree_attention(q, alloc, leaves)


def jit_call(jit_functions: dict, q, alloc, leaves):
    """What ``tree_attention`` does on its first call (a plan, its launches), with each
    launch run by the ``@triton.jit`` function instead of the cubin: same spec (constexprs,
    warps, stages), grid and arguments, a pool read through TMA as a Triton tensor descriptor
    (``aot.interpret.triton_args``, which the interpreter uses too)."""
    import torch

    from aot.interpret import triton_args
    from flash_reasoning import TreeAttentionPlan
    plan = TreeAttentionPlan(alloc, leaves, q.shape[1])
    out = torch.empty_like(q)
    for launch in plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out):
        jit_functions[launch.spec.family][launch.grid](
            *triton_args(launch, q.device), num_warps=launch.spec.num_warps,
            num_stages=launch.spec.num_stages, **dict(launch.spec.constexprs))
    return out


# ---- in the parent ----------------------------------------------------------------------------

def run_child(mode: str, cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLASH_REASONING_LOG")}
    env["TRITON_CACHE_DIR"] = cache_dir
    result = subprocess.run([sys.executable, __file__, "--child", mode], env=env,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{mode} process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            for mode in MODES:  # jit_warm reuses the cache jit_cold just filled
                runs[mode].append(run_child(mode, cache))
    return runs


def medians(runs: list[dict]) -> dict[str, float]:
    return {step: statistics.median(r["ms"][step] for r in runs)
            for step in STEPS if step in runs[0]["ms"]}


def figure(ms: dict[str, float]) -> float:
    """The target's figure: import (+ launcher) + first call; CUDA context excluded."""
    return ms["import"] + ms.get("launcher", 0.0) + ms["first_call"]


def report(runs: dict[str, list[dict]], repeats: int) -> dict:
    rows = {mode: medians(runs[mode]) for mode in MODES}
    aot = figure(rows["aot"])
    triton_in_aot = any(r["triton_imported"] for r in runs["aot"])
    head = f"{'ms (median of ' + str(repeats) + ')':<22}" + "".join(f"{s:>13}" for s in STEPS)
    print(f"{runs['aot'][0]['device']}; fresh process per row; seed_b{CASE['batch']} "
          f"({CASE['prefix']} + {CASE['batch']} x {CASE['leaf']} tokens, 32/8 heads, d128, fp16)")
    print(head + f"{'import+first':>14}\n" + "-" * (len(head) + 14))
    for mode, ms in rows.items():
        print(f"{mode:<22}" + "".join(f"{ms[s]:13.1f}" if s in ms else f"{'-':>13}"
                                      for s in STEPS) + f"{figure(ms):14.1f}")
    print(f"AOT import + launcher + first call: {aot:.1f} ms (CUDA context creation excluded, "
          f"{rows['aot']['cuda_init']:.0f} ms; torch import excluded) -> target < "
          f"{TARGET_MS:.0f} ms {'met' if aot < TARGET_MS else 'MISSED'}; triton imported by "
          f"the AOT process: {'YES' if triton_in_aot else 'no'}; JIT output vs AOT max |diff| "
          f"{max(r['max_abs_diff_vs_aot'] for r in runs['jit_cold']):.2e}")
    return {"case": CASE, "device": runs["aot"][0]["device"], "repeats": repeats,
            "median_ms": rows, "aot_import_plus_first_call_ms": aot, "target_ms": TARGET_MS,
            "meets_target": aot < TARGET_MS, "triton_imported_by_aot": triton_in_aot,
            "cuda_context_included": False, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the figures and every run here")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per row")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    summary = report(measure(args.repeats), args.repeats)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    diffs = [r["max_abs_diff_vs_aot"] for mode in MODES[1:] for r in summary["runs"][mode]]
    if summary["triton_imported_by_aot"] or not all(d <= JIT_MAX_DIFF for d in diffs):
        print(f"FAILED: triton imported by the AOT process, or a JIT output off by more than "
              f"{JIT_MAX_DIFF} (NaN included): {diffs}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
