"""Where the compute-bound root partials lose (issue 4): the shipped paged loop, with the page
size read at run time and compiled in (``PAGE``), on a shared root's shape (BLOCK_M-row tiles
of 512-4096 rows per KV head over one 2048-4096 token range), against the same loop addressing
the range as one run of slots (``contig``: exact here, where the table is the identity; the
gather's whole cost) and dense attention of the same FLOPs (torch SDPA's cuDNN and flash
backends) as the bar. The variants measured once and dropped (a TMA descriptor, the next
tile's QK^T first, pages as a 3-D tile, a register cap) are in docs/perf.md session 14.
Run on a GPU: PYTHONPATH=.:python python3 ci/explore_root.py"""
import sys

import torch
import triton
import triton.language as tl

from aot.kernels.attention_core import attend, online_softmax_step
from flash_reasoning import timing


@triton.jit
def attend_contig(qt, k_pool, v_pool, table, kv_head, num_kv_heads, page_size, start, end,
                  sm_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_N)
    m_i = tl.full([qt.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([qt.shape[0]], tl.float32)
    acc = tl.zeros([qt.shape[0], HEAD_DIM], tl.float32)
    slot0 = tl.load(table).to(tl.int64) * page_size
    for n0 in tl.range(start, end, BLOCK_N):
        n = n0 + offs
        n_ok = n < end
        kv_off = ((slot0 + n) * num_kv_heads + kv_head)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_pool + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0)
        s = tl.where(n_ok[None, :], tl.dot(qt, tl.trans(k)) * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, False)
    return m_i, l_i, acc


@triton.jit
def root_kernel(q, k_pool, v_pool, tables, ranges, out, lse_out, sm_scale_log2,
                num_kv_heads, page_size, max_blocks, VARIANT: tl.constexpr, PAGE: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    m_rows = tl.arange(0, BLOCK_M)
    q_tile = tl.load(ranges + item * 4 + 3)
    q_base = (q_tile * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M
    qt = tl.load(q + (q_base + m_rows)[:, None] * HEAD_DIM + d[None, :])
    table = tables + tl.load(ranges + item * 4).to(tl.int64) * max_blocks
    start = tl.load(ranges + item * 4 + 1)
    end = tl.load(ranges + item * 4 + 2)
    if VARIANT == 0:
        m_i, l_i, acc = attend(qt, k_pool, v_pool, table, max_blocks * page_size, kv_head,
                               num_kv_heads, page_size, start, end, sm_scale_log2, HEAD_DIM,
                               BLOCK_M, BLOCK_N)
    elif VARIANT == 1:
        m_i, l_i, acc = attend(qt, k_pool, v_pool, table, max_blocks * PAGE, kv_head,
                               num_kv_heads, PAGE, start, end, sm_scale_log2, HEAD_DIM, BLOCK_M,
                               BLOCK_N)
    else:
        m_i, l_i, acc = attend_contig(qt, k_pool, v_pool, table, kv_head, num_kv_heads,
                                      page_size, start, end, sm_scale_log2, HEAD_DIM, BLOCK_N)
    base = (item * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M
    tl.store(out + (base + m_rows)[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None])
    tl.store(lse_out + base + m_rows, m_i + tl.log2(l_i))


VARIANTS = {"shipped": 0, "page16": 1, "contig": 2}
SHAPES = [  # name, rows per KV head, tokens, chunks, pages in random order
    ("seed_b256 root: 1024 rows x 2048, 2 chunks", 1024, 2048, 2, False),
    ("the same, pages in random order", 1024, 2048, 2, True),
    ("seed_b128 root: 512 rows x 2048, 4 chunks", 512, 2048, 4, False),
    ("ft_1,1024 root: 4096 rows x 2048", 4096, 2048, 1, False),
    ("the same, pages in random order", 4096, 2048, 1, True),
    ("4096 rows x 4096", 4096, 4096, 1, False),
]
CONFIGS = {  # block_m -> (block_n, warps, stages)
    64: ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2)),
    128: ((64, 8, 3), (128, 8, 2)),
}
KV_HEADS, PAGE, DIM = 8, 16, 128


def problem(rows, tokens, chunks, block_m, shuffled):
    tiles = rows // block_m
    blocks = tokens // PAGE
    k = torch.randn(blocks, PAGE, KV_HEADS, DIM, device="cuda").half()
    v = torch.randn_like(k)
    order = torch.randperm(blocks, device="cuda") if shuffled else torch.arange(blocks, device="cuda")
    tables = order.to(torch.int32).view(1, blocks)
    step = tokens // chunks
    ranges = torch.tensor([[0, c * step, (c + 1) * step, t] for t in range(tiles)
                           for c in range(chunks)], dtype=torch.int32, device="cuda")
    q = torch.randn(tiles * KV_HEADS * block_m, DIM, device="cuda").half()
    items = tiles * chunks
    out = torch.empty(items * KV_HEADS * block_m, DIM, device="cuda")
    lse = torch.empty(items * KV_HEADS * block_m, device="cuda")
    return q, k, v, tables, ranges, out, lse, items


def dense_bar(rows, tokens):
    """torch SDPA on the same FLOPs, dense: the best a library kernel does on this GPU."""
    q = torch.randn(1, KV_HEADS, rows, DIM, device="cuda").half()
    k = torch.randn(1, KV_HEADS, tokens, DIM, device="cuda").half()
    v = torch.randn_like(k)
    cells = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
                us = timing.median_us(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 30)
            cells.append(f"{backend.name}:{us:.1f}")
        except RuntimeError as error:
            cells.append(f"{backend.name}:n/a ({str(error)[:40]})")
    return " ".join(cells)


def run_shape(name, rows, tokens, chunks, shuffled):
    flops = 4.0 * rows * tokens * DIM * KV_HEADS
    print(f"{name}: {flops / 1e9:.1f} GFLOP; dense bar {dense_bar(rows, tokens)}", flush=True)
    reference = None
    for block_m, configs in CONFIGS.items():
        q, k, v, tables, ranges, out, lse, items = problem(rows, tokens, chunks, block_m, shuffled)
        for variant, code in VARIANTS.items():
            if shuffled and variant == "contig":
                continue
            cells = []
            for block_n, warps, stages in configs:

                def call():
                    root_kernel[(items, KV_HEADS)](
                        q, k, v, tables, ranges, out, lse, 0.1, KV_HEADS, PAGE,
                        tables.shape[1], VARIANT=code, PAGE=PAGE, HEAD_DIM=DIM, BLOCK_M=block_m,
                        BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                out.fill_(float("nan"))
                try:
                    call()
                except Exception as error:  # a variant the compiler refuses: say so, go on
                    cells.append(f"{block_n}/{warps}/{stages}:fail "
                                 f"({type(error).__name__})")
                    continue
                if reference is None or reference[0] != block_m:
                    reference = (block_m, out.clone())
                wrong = ~torch.isclose(out, reference[1], rtol=1e-2, atol=1e-2)
                us = timing.median_us(call, 30)
                tflops = flops / (us * 1e-6) / 1e12
                flag = f" WRONG {int(wrong.sum())}" if bool(wrong.any()) else ""
                cells.append(f"{block_n}/{warps}/{stages}:{us:.1f}({tflops:.0f}){flag}")
            print(f"  BM{block_m} {variant:8} " + " ".join(cells), flush=True)


def main() -> None:
    for shape in SHAPES:
        run_shape(*shape)


if __name__ == "__main__":
    sys.exit(main())
