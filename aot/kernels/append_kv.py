"""Write one new token's K and V rows per slot into the paged pools (16-bit words)."""
import triton
import triton.language as tl


@triton.jit
def append_kv(k_pool, v_pool, slots, k_new, v_new, row_elems, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < row_elems
    dst = tl.load(slots + token) * row_elems + offs
    src = token * row_elems + offs
    tl.store(k_pool + dst, tl.load(k_new + src, mask=ok), mask=ok)
    tl.store(v_pool + dst, tl.load(v_new + src, mask=ok), mask=ok)
