"""Combine split-K partials of each (sequence, head) row by log-sum-exp (natural log)."""
import triton
import triton.language as tl

from .attention_core import fold_partials


@triton.jit
def merge_splits(partial_out, partial_lse, out, num_splits,
                 HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = fold_partials(partial_out, partial_lse, row * num_splits, 1, 0, num_splits,
                      HEAD_DIM, BLOCK_S)
    tl.store(out + row * HEAD_DIM + tl.arange(0, HEAD_DIM), o.to(out.dtype.element_ty))
