"""Combine split-K partials of each (sequence, head) row by log-sum-exp (natural log)."""
import triton
import triton.language as tl

from .attention_core import merge_block


@triton.jit
def merge_splits(partial_out, partial_lse, out, num_splits,
                 HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        lse = tl.load(partial_lse + row * num_splits + s, mask=s_ok, other=float("-inf"))
        part = tl.load(partial_out + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                       mask=s_ok[:, None], other=0.0)
        m, denom, acc = merge_block(m, denom, acc, lse, part)
    o = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out + row * HEAD_DIM + d, o.to(out.dtype.element_ty))
