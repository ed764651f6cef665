"""One rank of tests/test_hf_tensor_parallel.py, run under ``torch.distributed.run``: loads a
saved model with transformers' tensor-parallel plan (this rank holds its share of the heads),
decodes through flash_reasoning.hf and saves what it generated for the test to compare with
one process.

``python -m torch.distributed.run --nproc_per_node W hf_tensor_parallel_worker.py cpu OUT DIR...``:
CPU ranks over gloo, each model float32: sampling and beam search.
``... hf_tensor_parallel_worker.py cuda OUT FORCED DIR``: a GPU a rank over NCCL, the model
bfloat16, decode steps in CUDA graphs (the collectives captured in them): sampling, and the
logits along the tokens saved in FORCED (``{"prompt", "first", "forced"}``).
"""
import os
import sys

import torch
import torch.distributed as dist

from flash_reasoning.hf import beam_search, sample
from flash_reasoning.hf.models import load_tensor_parallel
from hf_decoding import teacher_forced_logits

#: What every CPU rank decodes (the test decodes the same on one process).
PROMPT = [(5 + 11 * i) % 100 for i in range(13)]
FIRST_TOKENS = [7, 42, 99]
STEPS = 24
BEAMS = 3


def decode_on_cpu(model_dir: str) -> dict:
    model = load_tensor_parallel(model_dir)
    sampled = sample(model, PROMPT, len(FIRST_TOKENS), STEPS, first_tokens=FIRST_TOKENS,
                     return_logits=True)
    beams = beam_search(model, PROMPT, BEAMS, STEPS)
    return {"heads": (sampled.cache.num_qo_heads, sampled.cache.num_kv_heads),
            "tokens": sampled.tokens, "logits": sampled.logits,
            "beam_sequences": beams.sequences, "beam_scores": beams.scores}


def decode_on_gpu(forced_file: str, model_dir: str) -> dict:
    given = torch.load(forced_file)
    model = load_tensor_parallel(model_dir, torch.bfloat16)
    prompt, forced = given["prompt"].cuda(), given["forced"].cuda()
    sampled = sample(model, prompt, len(given["first"]), forced.shape[1],
                     first_tokens=given["first"])
    logits, captures = teacher_forced_logits(model, prompt, forced)
    return {"heads": (sampled.cache.num_qo_heads, sampled.cache.num_kv_heads),
            "device": str(sampled.cache.allocator.device), "tokens": sampled.tokens.cpu(),
            "forced_logits": logits.float().cpu(), "captures": captures}


def main(device: str, out: str, args: list[str]) -> None:
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        results = decode_on_gpu(*args)
    else:
        dist.init_process_group("gloo")
        results = [decode_on_cpu(d) for d in args]
    torch.save(results, f"{out}.rank{dist.get_rank()}")
    if device == "cpu":  # a gloo rank whose peer has gone aborts: none leaves before all are done
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
