"""Beam search's decode steps through flash_reasoning.hf: its own paged cache, whose steps
replay one CUDA graph across the regroups, against a tree cache (a new plan after every
reshuffle, run eagerly), beside parallel sampling's graph steps on the same model.

For each model shape, prompt length and beam count ``k``: each path runs once to warm up,
then once timed (wall clock, the GPU synchronised after); a step's time is the run's time
less a prefill-only run's, over its decode steps. Random weights in bf16 (``generation.py``'s
shapes, plus a Qwen2.5-1.5B shape); beams run to ``--new-tokens`` (``early_stopping="never"``).

``python benchmarks/beam_search.py [--models qwen2.5-1.5b,llama3-8b] [--cases 2048x4,8192x16]
[--new-tokens 65] [--json out.json]``; ``--smoke`` runs a tiny model on CPU end to end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import SHAPES, SMOKE_SHAPES, meta, random_model, sync  # noqa: E402

from flash_reasoning.hf import TreeCache, beam_search, sample  # noqa: E402
from flash_reasoning.hf.generate import BLOCK_SIZE, blocks_for  # noqa: E402

MODELS = {**SHAPES, "qwen2.5-1.5b": {
    "arch": "qwen2", "num_qo_heads": 12, "num_kv_heads": 2, "head_dim": 128, "num_layers": 28,
    "hidden_size": 1536, "intermediate_size": 8960, "vocab_size": 151936,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else {name: MODELS[name] for name in args.models}
    report = {"meta": meta(device, args), "results": []}
    for name, shape in shapes.items():
        model = random_model(**shape, dtype=args.dtype, device=device, init_std=args.init_std)
        for prompt_len, k in args.cases:
            prompt = torch.randint(0, shape["vocab_size"], (prompt_len,),
                                   generator=torch.Generator().manual_seed(prompt_len))
            row = {"model": name, "prompt": prompt_len, "k": k,
                   **step_ms(model, prompt.to(device), k, args.new_tokens)}
            report["results"].append(row)
            print(json.dumps(row), flush=True)
        del model
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def step_ms(model, prompt, k: int, new_tokens: int) -> dict:
    """ms per decode step of each path (its run less a prefill-only run, over its steps)."""
    def tree_cache():
        return TreeCache(model, blocks_for(prompt.numel(), k, new_tokens), BLOCK_SIZE,
                         attention="tree")
    runs = {"prefill": lambda: sample(model, prompt, k, 1),
            "sample_graphs": lambda: sample(model, prompt, k, new_tokens),
            "beam_paged_graphs": lambda: beam_search(model, prompt, k, new_tokens,
                                                     early_stopping="never"),
            "beam_tree": lambda: beam_search(model, prompt, k, new_tokens,
                                             early_stopping="never", cache=tree_cache())}
    total = {path: timed_ms(run, prompt.device) for path, run in runs.items()}
    return {f"{path}_ms_per_step": (ms - total["prefill"]) / (new_tokens - 1)
            for path, ms in total.items() if path != "prefill"}


def timed_ms(run, device) -> float:
    run()  # warm: kernels loaded, graphs' memory pool grown
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","),
                        default=["qwen2.5-1.5b", "llama3-8b"])
    parser.add_argument("--cases", type=lambda s: [tuple(map(int, c.split("x")))
                                                   for c in s.split(",")],
                        default=[(2048, 4), (2048, 8), (8192, 8), (8192, 16)],
                        help="PROMPTxBEAMS,...")
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on CPU, float32, short runs: the pipeline end to end")
    args = parser.parse_args(argv)
    args.dtype, args.init_std = torch.bfloat16, 0.02
    if args.smoke:
        args.cases, args.new_tokens = [(24, 3)], 6
        args.dtype, args.init_std = torch.float32, 0.4
    return args


if __name__ == "__main__":
    raise SystemExit(main())
