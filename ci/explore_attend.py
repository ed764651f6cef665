"""Configs of the shipped paged attention loop (``attention_core.attend``), JIT-compiled on
the GPU and timed on the shapes the tree kernels see (a shared root under wide tiles, short
leaves, one long range): the data behind ``dispatch.heuristic_rules``. The loop variants it
once compared (page ids loaded in the tile's own iteration, V loaded after the softmax) are
recorded in docs/perf.md; the adopted one is the shipped loop. Run on a GPU."""
import sys

import torch
import triton
import triton.language as tl

from aot.kernels.attention_core import attend
from flash_reasoning import timing


@triton.jit
def loop_kernel(q, k_pool, v_pool, tables, ranges, out, lse_out, sm_scale_log2,
                num_kv_heads, page_size, max_blocks, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    m_rows = tl.arange(0, BLOCK_M)
    base = (item * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M
    qt = tl.load(q + (base + m_rows)[:, None] * HEAD_DIM + d[None, :])
    table = tables + tl.load(ranges + item * 3).to(tl.int64) * max_blocks
    m_i, l_i, acc = attend(qt, k_pool, v_pool, table, max_blocks * page_size, kv_head,
                           num_kv_heads, page_size, tl.load(ranges + item * 3 + 1),
                           tl.load(ranges + item * 3 + 2), sm_scale_log2, HEAD_DIM, BLOCK_M,
                           BLOCK_N)
    tl.store(out + (base + m_rows)[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None])
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
        for block_n, warps, stages in CONFIGS[block_m]:
            def call():
                loop_kernel[(items, kv_heads)](
                    q, k, v, tables, ranges, out, lse, 0.1, kv_heads, 16, tables.shape[1],
                    HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                    num_stages=stages)
            call()
            cells.append(f"{block_n}/{warps}/{stages}:{timing.median_us(call, 30):.1f}")
        print(f"{name:30} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
