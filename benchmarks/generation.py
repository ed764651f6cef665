"""End-to-end parallel sampling through flash_reasoning.hf, beside transformers' own
``generate`` and beside our no-sharing loop, on random-weight models of real shapes.

For each model shape, prompt length and number of continuations ``n``: the prompt is
prefilled once and each of ``n`` continuations forced to its own first token, then decoded
greedily for ``--new-tokens`` tokens in total. Three paths:

- ``tree``: TreeCache + TreeAttentionPlan (the prompt stored and read once per step), CUDA
  graphs on CUDA;
- ``no_sharing``: the same loop and graphs, each continuation storing its whole path
  (``fork(share=False)``) read by ``paged_decode``;
- ``transformers``: ``model.generate`` on the ``n`` rows prompt + first token, its default
  attention (sdpa) and cache.

Per path: decode tokens per second and the median time per step (CUDA events between steps:
everything the loop does), the time per step in attention kernels and its share of the step
(torch.profiler, kernels named like attention: for our paths over three of the loop's own
CUDA-graph steps in the middle of the run, the median step's tree, and again at its end, the
longest leaves; for transformers over three eager steps after it), peak GPU memory, and,
with ``--fit-search``, the largest ``n`` that fits (doubling, then bisection). Tokens are
compared path against path (greedy: they should be identical; ``first_mismatch`` says where
they are not). JSON (``--json``) and a figure (``--figure``, with matplotlib).

``python benchmarks/generation.py [--models llama3-8b,qwen2.5-7b] [--prompts 2048,8192]
[--samples 1,8,64,256] [--new-tokens 128] [--fit-search | --fit-only] [--json out.json]
[--figure out.png]``;
``--smoke`` runs a tiny model on CPU end to end (what the test runs).

``torchrun --nproc_per_node W benchmarks/generation.py --tensor-parallel ...``: the model,
made by rank 0 and saved, is loaded on every rank with transformers' tensor-parallel plan
(each rank its share of the heads, its own cache of them); every path runs on every rank and
rank 0 reports (tokens/s at W GPUs against the same command without it).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from flash_reasoning.hf import TreeCache, TreeDecoder
from flash_reasoning.hf.generate import BLOCK_SIZE, blocks_for
from flash_reasoning.hf.models import load_tensor_parallel, random_model

#: Real models' shapes (random weights).
SHAPES = {
    "llama3-8b": {"arch": "llama", "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                  "num_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                  "vocab_size": 128256,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "qwen2.5-7b": {"arch": "qwen2", "num_qo_heads": 28, "num_kv_heads": 4, "head_dim": 128,
                   "num_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
                   "vocab_size": 152064,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
}
SMOKE_SHAPES = {
    "tiny-llama": {"arch": "llama", "num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                   "num_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                   "vocab_size": 256},
}
PATHS = ("tree", "no_sharing", "transformers")
#: Kernel-name fragments of attention: ours (the AOT entry points), then transformers' sdpa
#: backends (flash, memory-efficient, cuDNN).
OUR_ATTENTION_KERNELS = ("tree_partial", "tree_final", "tree_merge", "paged_decode",
                         "merge_splits")
SDPA_KERNELS = ("flash", "fmha", "attention", "attn")
PROFILED_STEPS = 3
NOT_PROFILED = {"attention_ms_per_step": None, "kernel_ms_per_step": None,
                "attention_share_of_kernels": None}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.tensor_parallel:
        join_ranks(device)
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.models}
    report = {"meta": meta(device, args), "results": [], "largest_n": []}
    for name, shape in shapes.items():
        model = (sharded_random_model if args.tensor_parallel else random_model)(
            **shape, dtype=args.dtype, device=device, seed=args.seed, init_std=args.init_std)
        for prompt_len in args.prompts:
            prompt = torch.randint(0, shape["vocab_size"], (prompt_len,),
                                   generator=torch.Generator().manual_seed(prompt_len))
            prompt = prompt.to(device)
            for n in [] if args.fit_only else args.n:
                row = run_config(model, prompt, n, args.new_tokens)
                row.update(model=name, prompt=prompt_len, n=n)
                report["results"].append(row)
                say(summary(row))
                save(report, args.json)
            if args.fit_search:
                fits = {path: largest_n(model, prompt, args.new_tokens, path, args.n)
                        for path in PATHS}
                report["largest_n"].append({"model": name, "prompt": prompt_len, **fits})
                say(f"{name} prompt {prompt_len}: largest n {fits}")
                save(report, args.json)
        del model
        release(device)
    if args.figure and reporting_rank():
        figure(report, args.figure)
    if args.tensor_parallel:
        dist.destroy_process_group()
    return 0


# ---- tensor parallel ------------------------------------------------------------------------

def join_ranks(device) -> None:
    """Join torchrun's process group (NCCL on CUDA, each rank on its local GPU; gloo on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def sharded_random_model(device, **kwargs):
    """:func:`random_model`'s model, made once by rank 0 and saved to a temporary folder, then
    loaded on every rank with transformers' tensor-parallel plan (each rank its heads)."""
    folder = [tempfile.mkdtemp(prefix="flash-reasoning-tp-") if reporting_rank() else None]
    dist.broadcast_object_list(folder)
    if reporting_rank():
        random_model(device=device, **kwargs).save_pretrained(folder[0])
        release(device)
    dist.barrier()
    model = load_tensor_parallel(folder[0], kwargs["dtype"])
    dist.barrier()
    if reporting_rank():
        shutil.rmtree(folder[0])
    return model


def reporting_rank() -> bool:
    """Whether this process prints and writes (the only one, or rank 0 of several)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def say(text: str) -> None:
    if reporting_rank():
        print(text, flush=True)


def save(report: dict, path: str | None) -> None:
    """The report so far (after every configuration: a run cut short keeps what it did)."""
    if path and reporting_rank():
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(SHAPES))
    parser.add_argument("--prompts", type=_ints, default=[2048, 8192])
    parser.add_argument("--samples", dest="n", type=_ints, default=[1, 8, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", type=lambda s: getattr(torch, s), default=torch.bfloat16)
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="weights' std (a trained model's scale; larger makes greedy "
                             "choices less tie-prone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit-search", action="store_true",
                        help="find the largest n each path fits (doubling, then bisection)")
    parser.add_argument("--fit-only", action="store_true",
                        help="the fit search alone, no timed configurations")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="under torchrun: the model sharded over the ranks by "
                             "transformers' tp_plan (rank 0 reports; needs accelerate)")
    parser.add_argument("--json")
    parser.add_argument("--figure")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on CPU, float32, short runs: the pipeline end to end")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.new_tokens = [24], [1, 3], 12  # 12: profile windows too
        args.dtype, args.init_std, args.fit_search = torch.float32, 0.4, False
        torch.set_num_threads(1)  # tiny matmuls: more threads only contend
    args.fit_search = args.fit_search or args.fit_only
    if args.tensor_parallel and args.fit_search:  # a rank out of memory alone would hang the rest
        parser.error("--fit-search and --fit-only run on one process, not --tensor-parallel")
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


# ---- one configuration ---------------------------------------------------------------------

def run_config(model, prompt, n: int, new_tokens: int) -> dict:
    """Every path on one (prompt, n); their tokens compared."""
    first = first_tokens(n, model.config.vocab_size)
    row, tokens = {}, {}
    for path in PATHS:
        result, tokens[path] = guarded(run_path, model, prompt, n, new_tokens, first, path)
        if result.get("attention_ms_per_step") is not None and result.get("step_ms_median"):
            # Attention kernels (profiled at the middle of the run) against the median step.
            result["attention_share_of_step"] = (result["attention_ms_per_step"]
                                                 / result["step_ms_median"])
        row[path] = result
    for a, b in (("tree", "transformers"), ("tree", "no_sharing")):
        row[f"{a}_vs_{b}"] = compare(tokens[a], tokens[b])
    return row


def run_path(model, prompt, n, new_tokens, first, path):
    if path == "transformers":
        return run_transformers(model, prompt, n, new_tokens, first)
    return run_ours(model, prompt, n, new_tokens, first, share=path == "tree")


def run_ours(model, prompt, n, new_tokens, first, share: bool):
    """Prefill once, fork (or copy) n times, decode with CUDA graphs where available."""
    device = prompt.device
    reset_peak(device)
    copies = 0 if share else n
    cache = TreeCache(model, blocks_for(prompt.numel(), n, new_tokens, copies),
                      BLOCK_SIZE, attention="tree" if share else "paged")
    decoder = TreeDecoder(model, cache)
    root = cache.new_branch()
    start = time.perf_counter()
    decoder.extend(root, prompt)
    branches = cache.fork(root, n, share=share)
    cache.free(root)
    cache.set_batch(branches)
    sync(device)
    prefill_s = time.perf_counter() - start
    out, marks, profiles = [torch.tensor(first, device=device)], [event(device)], {}
    windows = profile_windows(new_tokens - 1)

    def decode_steps(count):
        for _ in range(count):
            out.append(decoder.decode(out[-1]).argmax(-1))
    while len(out) < new_tokens:
        window = windows.get(len(out) - 1)
        if window is None:
            decode_steps(1)
            marks.append(event(device))
        else:  # the loop's own graph replays, profiled; left out of the step times
            profiles[window] = kernel_profile(lambda: decode_steps(PROFILED_STEPS),
                                              OUR_ATTENTION_KERNELS, device)
            marks.append(None)
            marks.append(event(device))
    sync(device)
    result = step_stats(marks, n, device)
    result.update(prefill_s=prefill_s, peak_memory_bytes=peak(device),
                  kv_memory=cache.allocator.memory_report().to_dict(),
                  graph_captures=decoder.captures)
    result.update(profiles.get("median", NOT_PROFILED))
    if profiles.get("last", NOT_PROFILED)["attention_ms_per_step"] is not None:
        result["attention_ms_last_steps"] = profiles["last"]["attention_ms_per_step"]
        result["attention_share_last_steps"] = profiles["last"]["attention_share_of_kernels"]
    return result, torch.stack(out, 1).cpu()


def profile_windows(steps: int) -> dict:
    """The decode steps (by index) where :data:`PROFILED_STEPS` profiled steps start: at the
    middle of the run (the median step's tree) and at its end (the longest leaves). Runs of
    fewer than 11 tokens are not profiled."""
    if steps < 2 * PROFILED_STEPS + 4:  # too short to leave steps to time
        return {}
    return {steps // 2 - PROFILED_STEPS // 2: "median", steps - PROFILED_STEPS: "last"}


def run_transformers(model, prompt, n, new_tokens, first):
    """``generate`` over the n rows prompt + first token: transformers' sdpa and cache."""
    device = prompt.device
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        reset_peak(device)
        rows = torch.cat([prompt.expand(n, -1), torch.tensor(first, device=device)[:, None]], 1)
        marks = []
        marker = StepMarker(marks, device)
        start = time.perf_counter()
        out = model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=False,
                             max_new_tokens=new_tokens - 1, min_new_tokens=new_tokens - 1,
                             logits_processor=[marker], pad_token_id=0)
        sync(device)
        total_s = time.perf_counter() - start
        result = step_stats(marks, n, device)
        result.update(total_s=total_s, peak_memory_bytes=peak(device))
        tokens = torch.cat([torch.tensor(first)[:, None], out[:, rows.shape[1]:].cpu()], 1)
        if device.type == "cuda":  # its own prefill again: may not fit where generate did
            try:
                result.update(transformers_attention_profile(model, rows, device))
            except torch.cuda.OutOfMemoryError:
                release(device)
                result["attention_profile"] = "out of memory"
        return result, tokens
    finally:
        model.set_attn_implementation(previous)


class StepMarker:
    """A logits processor that records an event per call: one per decode step (the first
    after the prefill)."""

    def __init__(self, marks: list, device) -> None:
        self.marks, self.device = marks, device

    def __call__(self, input_ids, scores):
        self.marks.append(event(self.device))
        return scores


def transformers_attention_profile(model, rows, device) -> dict:
    """transformers' own decode steps (its DynamicCache) under the profiler, after a prefill
    of ``rows``."""
    from transformers import DynamicCache
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(rows, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        def step(tokens):
            return model(tokens[:, None], past_key_values=cache,
                         use_cache=True).logits[:, -1].argmax(-1)

        return attention_profile(step, logits[:, -1].argmax(-1), SDPA_KERNELS, device)


def attention_profile(step, tokens, names, device) -> dict:
    """:func:`kernel_profile` of :data:`PROFILED_STEPS` steps of ``step`` after a warm one
    (plans and launches made outside the profile)."""
    if device.type != "cuda":
        return NOT_PROFILED
    tokens = [step(tokens)]
    sync(device)

    def steps():
        for _ in range(PROFILED_STEPS):
            tokens[0] = step(tokens[0])
    return kernel_profile(steps, names, device)


def kernel_profile(steps, names, device) -> dict:
    """GPU time per step in attention (kernels whose name holds one of ``names``) and in any
    kernel (overlapping kernels counted once: :func:`covered_us`) while ``steps()`` runs
    :data:`PROFILED_STEPS` steps; the busiest kernels, to check the names. On CPU it runs
    them unprofiled."""
    if device.type != "cuda":
        steps()
        return NOT_PROFILED
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            steps()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = covered_us(kernels) / 1e3 / PROFILED_STEPS
    attention = covered_us([e for e in kernels if any(name in e.name.lower() for name in names)]
                           ) / 1e3 / PROFILED_STEPS
    busiest = {}
    for e in kernels:
        busiest[e.name] = busiest.get(e.name, 0.0) + e.device_time_total / 1e3 / PROFILED_STEPS
    top = sorted(busiest.items(), key=lambda kv: -kv[1])[:8]
    return {"attention_ms_per_step": attention, "kernel_ms_per_step": total,
            "attention_share_of_kernels": attention / total if total else None,
            "top_kernels_ms_per_step": dict(top)}


def covered_us(kernels) -> float:
    """The GPU time during which at least one of ``kernels`` runs: kernels that overlap (a
    plan's final launch starting beside its partial launch's tail) count once."""
    covered, end = 0.0, -math.inf
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        covered += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return covered


def step_stats(marks, n, device) -> dict:
    """Per-step times from consecutive marks (None breaks the chain: profiled steps; the
    first two steps left out: the eager step and the capture of a new tree)."""
    times = [elapsed_ms(a, b, device) for a, b in itertools.pairwise(marks)
             if a is not None and b is not None]
    timed = times[2:] if len(times) > 4 else times
    if not timed:
        return {"steps": 0}
    step_ms = statistics.median(timed)
    return {"steps": len(times), "step_ms_median": step_ms,
            "step_ms_min": min(timed), "step_ms_max": max(timed),
            "decode_tokens_per_s": n * len(timed) / (sum(timed) / 1e3)}


def compare(a: torch.Tensor | None, b: torch.Tensor | None) -> dict:
    if a is None or b is None:
        return {"compared": False}
    equal = a == b
    mismatched = (~equal).any(dim=0).nonzero()
    return {"compared": True, "identical": bool(equal.all()),
            "token_agreement": float(equal.float().mean()),
            "first_mismatch_step": int(mismatched[0]) if mismatched.numel() else None}


def first_tokens(n: int, vocab: int) -> list[int]:
    """A distinct first token per continuation (spread over the vocabulary)."""
    return [(17 + i * 7919) % vocab for i in range(n)]


# ---- the largest n that fits ---------------------------------------------------------------

def largest_n(model, prompt, new_tokens, path, listed) -> int:
    """The largest n whose run fits (our paths: the pool for every token, prefill, fork and
    two decode steps; transformers: the whole generate), by doubling from the largest
    listed n that fits (halving from the smallest where none does), then bisection; 0 when
    not even one continuation fits."""
    def fits(n):
        ok, _ = guarded(probe, model, prompt, n, new_tokens, path)
        return ok.get("ok", False)

    good = next((n for n in sorted(listed, reverse=True) if fits(n)), None)
    if good is None:
        good = min(listed) // 2
        while good and not fits(good):
            good //= 2
        if not good:
            return 0
    bad = good * 2
    while fits(bad):
        good, bad = bad, bad * 2
        if bad > 1 << 20:
            return good
    while bad - good > max(1, good // 16):  # within 1/16
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def probe(model, prompt, n, new_tokens, path):
    first = first_tokens(n, model.config.vocab_size)
    if path == "transformers":
        previous = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            rows = torch.cat([prompt.expand(n, -1),
                              torch.tensor(first, device=prompt.device)[:, None]], 1)
            model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=False,
                           max_new_tokens=new_tokens - 1, min_new_tokens=new_tokens - 1,
                           pad_token_id=0)
        finally:
            model.set_attn_implementation(previous)
        return {"ok": True}, None
    share = path == "tree"
    cache = TreeCache(model, blocks_for(prompt.numel(), n, new_tokens, 0 if share else n),
                      BLOCK_SIZE, attention="tree" if share else "paged")
    decoder = TreeDecoder(model, cache, cuda_graphs=False)
    root = cache.new_branch()
    decoder.extend(root, prompt)
    cache.set_batch(cache.fork(root, n, share=share))
    cache.free(root)
    tokens = torch.tensor(first, device=prompt.device)
    for _ in range(2):
        tokens = decoder.decode(tokens).argmax(-1)
    sync(prompt.device)
    return {"ok": True}, None


# ---- plumbing --------------------------------------------------------------------------

def guarded(fn, *args):
    """``fn(*args)`` -> (result, tokens); out of memory -> ({"ok": False, "error": ...},
    None), everything it held released."""
    try:
        result, tokens = fn(*args)
        result["ok"] = True
        return result, tokens
    except torch.cuda.OutOfMemoryError as error:
        if dist.is_initialized():  # the other ranks wait in a collective: stop them all
            raise
        message = str(error).splitlines()[0]
    release(args[1].device)
    return {"ok": False, "error": f"out of memory: {message}"}, None


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def event(device):
    if device.type == "cuda":
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark
    return time.perf_counter()


def elapsed_ms(a, b, device) -> float:
    return a.elapsed_time(b) if device.type == "cuda" else (b - a) * 1e3


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def meta(device, args) -> dict:
    import transformers
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": str(args.dtype),
            "new_tokens": args.new_tokens, "init_std": args.init_std,
            "tensor_parallel": dist.get_world_size() if dist.is_initialized() else 1}


def summary(row) -> str:
    parts = [f"{row['model']} prompt {row['prompt']} n {row['n']}:"]
    for path in PATHS:
        result = row[path]
        if not result.get("ok"):
            parts.append(f"{path} OOM")
            continue
        share = result.get("attention_share_of_step")
        last = result.get("attention_share_last_steps")
        parts.append(f"{path} {result.get('decode_tokens_per_s', math.nan):.0f} tok/s "
                     f"{result.get('step_ms_median', math.nan):.2f} ms/step"
                     + (f" attn {share:.0%}" if share is not None else "")
                     + (f" ({last:.0%} at the end)" if last is not None else ""))
    parts.append(f"identical: {row['tree_vs_transformers'].get('identical')}"
                 f"/{row['tree_vs_no_sharing'].get('identical')}")
    return " | ".join(parts)


def figure(report, out_path) -> None:
    """Decode tokens/s against n, per model (a panel each), per path and prompt length."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("figure skipped: matplotlib is not installed (pip install .[plot])")
        return
    models = list(dict.fromkeys(row["model"] for row in report["results"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    styles = {"tree": "o-", "no_sharing": "s--", "transformers": "^:"}
    for ax, model in zip(axes[0], models):
        rows = [row for row in report["results"] if row["model"] == model]
        for prompt in sorted({row["prompt"] for row in rows}):
            for path in PATHS:
                points = [(row["n"], row[path]["decode_tokens_per_s"]) for row in rows
                          if row["prompt"] == prompt and row[path].get("ok")
                          and "decode_tokens_per_s" in row[path]]
                if points:
                    ax.plot(*zip(*points), styles[path], label=f"{path}, prompt {prompt}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("parallel samples n")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"{model} ({report['meta']['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
