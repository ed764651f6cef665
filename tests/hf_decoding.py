"""Decoding helpers shared by the Hugging Face tests and their tensor-parallel worker
processes (importable without pytest's conftest, which selects Triton's interpreter)."""
import torch

from flash_reasoning.hf import TreeCache, TreeDecoder
from flash_reasoning.hf.generate import blocks_for

#: Relative tolerance of a step's half-precision logits against a reference's (the dtype's
#: rounding through two layers and a vocabulary projection, or the ranks' all-reduce summing
#: the heads' shares in another order than one GPU's matmul).
HALF_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2}


def teacher_forced_logits(model, prompt, forced):
    """Our logits at each step when fed ``forced`` ``[rows, steps]`` after ``prompt`` (CUDA
    graphs on CUDA): ``[rows, steps - 1, vocab]``, step ``i`` the logits after token ``i``; and
    the graphs captured (on CUDA one: the tree never changes, its graph is replayed)."""
    rows, steps = forced.shape
    cache = TreeCache(model, blocks_for(prompt.numel(), rows, steps), 16)
    decoder = TreeDecoder(model, cache)
    root = cache.new_branch()
    decoder.extend(root, prompt)
    cache.set_batch(cache.fork(root, rows))
    cache.free(root)
    logits = [decoder.decode(forced[:, i]) for i in range(steps - 1)]
    return torch.stack(logits, dim=1), decoder.captures
