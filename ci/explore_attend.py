"""Variants of the paged attention inner loop, JIT-compiled on the GPU and timed on the
shapes the tree kernels see (a shared root under wide tiles, short leaves, one long range).
Exploration only: the shipped kernels are aot/kernels. Run on a GPU."""
import sys

import torch
import triton
import triton.language as tl

from flash_reasoning import timing


@triton.jit
def variant_kernel(q, k_pool, v_pool, tables, ranges, out, lse_out, sm_scale_log2,
                   num_kv_heads, page_size, max_blocks, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    m_rows = tl.arange(0, BLOCK_M)
    base = (item * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M
    qt = tl.load(q + (base + m_rows)[:, None] * HEAD_DIM + d[None, :])
    table = tables + tl.load(ranges + item * 3).to(tl.int64) * max_blocks
    start = tl.load(ranges + item * 3 + 1)
    end = tl.load(ranges + item * 3 + 2)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    page = tl.load(table + (start + offs) // page_size, mask=start + offs < end, other=0)
    for n0 in tl.range(start, end, BLOCK_N):
        n = n0 + offs
        n_ok = n < end
        if VARIANT == 2:
            pass  # pages prefetched by the previous iteration
        else:
            page = tl.load(table + n // page_size, mask=n_ok, other=0)
        kv_rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv_head
        kv_off = kv_rows[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_pool + kv_off, mask=n_ok[:, None], other=0.0)
        if VARIANT >= 1:
            v = tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0)
        if VARIANT == 2:
            nxt = n + BLOCK_N
            page = tl.load(table + nxt // page_size, mask=nxt < end, other=0)
        s = tl.dot(qt, tl.trans(k)) * sm_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if VARIANT == 0:
            v = tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + (base + m_rows)[:, None] * HEAD_DIM + d[None, :], o)
    tl.store(lse_out + base + m_rows, m_i + tl.log2(l_i))


def problem(items, tokens, shared, kv_heads=8, block_m=16, page=16, dim=128):
    """``items`` ranges of ``tokens`` tokens; ``shared``: all read one table row."""
    rows = 1 if shared else items
    blocks_per = -(-tokens // page)
    num_blocks = rows * blocks_per
    k = torch.randn(num_blocks, page, kv_heads, dim, device="cuda").half()
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device="cuda").view(rows, blocks_per).int()
    ranges = torch.tensor([[0 if shared else i, 0, tokens] for i in range(items)],
                          dtype=torch.int32, device="cuda")
    q = torch.randn(items * kv_heads * block_m, dim, device="cuda").half()
    out = torch.empty(items * kv_heads * block_m, dim, device="cuda")
    lse = torch.empty(items * kv_heads * block_m, device="cuda")
    return q, k, v, tables, ranges, out, lse


SHAPES = [  # name, items, tokens, shared, block_m
    ("root 16 tiles x 2048 (BM64)", 16, 2048, True, 64),
    ("root 64 tiles x 512 (BM64)", 64, 512, True, 64),
    ("leaves 256 x 64", 256, 64, False, 16),
    ("leaves 1024 x 32", 1024, 32, False, 16),
    ("leaves 2048 x 8", 2048, 8, False, 16),
    ("one range x 2048, 1 head", 1, 2048, False, 16),
    ("64 x 512", 64, 512, False, 16),
    ("64 x 2048", 64, 2048, False, 16),
]
CONFIGS = {  # block_m -> (block_n, warps, stages)
    16: ((64, 4, 2), (64, 4, 3), (64, 4, 1), (64, 2, 1), (64, 2, 2), (32, 2, 1), (32, 4, 1),
         (32, 2, 2), (16, 2, 1), (128, 4, 2), (128, 4, 1)),
    64: ((64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (32, 4, 3), (128, 8, 2), (64, 4, 4)),
}


def main() -> None:
    for name, items, tokens, shared, block_m in SHAPES:
        kv_heads = 1 if name.endswith("1 head") else 8
        q, k, v, tables, ranges, out, lse = problem(items, tokens, shared, kv_heads, block_m)
        cells = []
        for variant in (0, 2):
            for block_n, warps, stages in CONFIGS[block_m]:
                def call():
                    variant_kernel[(items, kv_heads)](
                        q, k, v, tables, ranges, out, lse, 0.1, kv_heads, 16,
                        tables.shape[1], HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n,
                        VARIANT=variant, num_warps=warps, num_stages=stages)
                call()
                cells.append(f"v{variant} {block_n}/{warps}/{stages}:"
                             f"{timing.median_us(call, 30):.1f}")
        print(f"{name:30} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
