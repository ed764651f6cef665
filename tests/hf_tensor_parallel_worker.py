"""One rank of tests/test_hf_tensor_parallel.py, run under ``torch.distributed.run``: loads
each saved model with transformers' tensor-parallel plan (this rank holds its share of the
heads), decodes through flash_reasoning.hf and saves what it generated for the test to
compare with one process.

``python -m torch.distributed.run --nproc_per_node W hf_tensor_parallel_worker.py OUT DIR...``
"""
import sys

import torch
import torch.distributed as dist

from flash_reasoning.hf import beam_search, sample
from flash_reasoning.hf.models import load_tensor_parallel

#: What every rank decodes (the test decodes the same on one process).
PROMPT = [(5 + 11 * i) % 100 for i in range(13)]
FIRST_TOKENS = [7, 42, 99]
STEPS = 24
BEAMS = 3


def decode(model_dir: str) -> dict:
    model = load_tensor_parallel(model_dir)
    sampled = sample(model, PROMPT, len(FIRST_TOKENS), STEPS, first_tokens=FIRST_TOKENS,
                     return_logits=True)
    beams = beam_search(model, PROMPT, BEAMS, STEPS)
    return {"heads": (sampled.cache.num_qo_heads, sampled.cache.num_kv_heads),
            "tokens": sampled.tokens, "logits": sampled.logits,
            "beam_sequences": beams.sequences, "beam_scores": beams.scores}


def main(out: str, model_dirs: list[str]) -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    results = [decode(d) for d in model_dirs]
    torch.save(results, f"{out}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
