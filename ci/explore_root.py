"""Where the compute-bound root partials lose (issue 4): the shipped loop (``attend``, the page
size compiled in) on a shared root's shape (BLOCK_M-row tiles of 512-4096 rows per KV head
over one 2000-4096 token range), paged (``page16``) and addressing the range as one run of
slots (``contig``: exact here, where the table is the identity), against the loop with each
difference from the dense Triton tutorial's shape switched (``attend_variant``: masks, a
separate tail, TMA) and dense attention of the same FLOPs (torch SDPA's cuDNN and flash
backends) as the bar; every variant's output is checked against torch (``expected_out``).
The variants measured once and dropped (the next tile's QK^T first, pages as a 3-D tile, a
register cap) are in docs/perf.md session 14; this script's sweep is session 26's.
Run on a GPU: PYTHONPATH=.:python python3 ci/explore_root.py [VARIANT ...] [--shape=PREFIX]"""
import math
import sys

import torch
import triton
import triton.language as tl

from aot.kernels.attention_core import attend, attend_runs, load_kv
from flash_reasoning import timing


@triton.jit
def variant_tile(m_i, l_i, acc, page, qt, k_src, v_src, table, slot0, n0, end, kv_head,
                 num_kv_heads, page_size, sm_scale_log2, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGED: tl.constexpr, LOAD_MASK: tl.constexpr,
                 SELECT: tl.constexpr, TMA: tl.constexpr, PREFETCH: tl.constexpr):
    """One KV tile from ``n0``: K/V through tensor descriptors (``TMA``: ``k_src``/``v_src``
    are descriptors, else the pools), per-token page ids (``PAGED``; with ``PREFETCH`` the
    next tile's are loaded between the loads and the scores, as ``attend`` does) or one run of
    slots; then the tutorial's online-softmax step (the scale after the row max, P.V
    accumulated in the dot; ``SELECT``: keys past ``end`` -inf). Returns the state and
    ``page``."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    if TMA:
        k = k_src.load([(slot0 + n0).to(tl.int32), kv_head * HEAD_DIM])
        v = v_src.load([(slot0 + n0).to(tl.int32), kv_head * HEAD_DIM])
    else:
        if PAGED:
            rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv_head
        else:
            rows = (slot0 + n) * num_kv_heads + kv_head
        k, v = load_kv(k_src, v_src, rows, n_ok, HEAD_DIM, LOAD_MASK)
    if PREFETCH:
        page = tl.load(table + (n + BLOCK_N) // page_size, mask=n + BLOCK_N < end, other=0)
    qk = tl.dot(qt, tl.trans(k))
    if SELECT:
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * sm_scale_log2)
    p = tl.math.exp2(qk * sm_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    acc = acc * alpha[:, None]
    return m_new, l_i * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc), page


@triton.jit
def attend_variant(qt, k_pool, v_pool, table, total, kv_head, num_kv_heads, page_size, start,
                   end, sm_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGED: tl.constexpr, MASK: tl.constexpr, TAIL: tl.constexpr,
                   TMA: tl.constexpr):
    """The loop in the dense Triton tutorial's shape with each difference from ours as a
    switch: ``PAGED`` page ids per token (one tile ahead, as ``attend``) or one run of slots;
    ``MASK`` in the main loop, 1 masked loads, 2 scores past ``end`` selected -inf, 3 both;
    ``TAIL`` 0 the main loop runs to ``end`` (with MASK 0 the range must be whole tiles),
    1 it stops at the last whole tile and a second loop (0 or 1 steps) takes the rest with
    both masks, 2 the rest is one masked step under an ``if``; ``TMA`` K and V through tensor
    descriptors over the pool viewed as [``total`` slots, kv heads x HEAD_DIM] (contiguous
    only). Scale positive."""
    m_i = tl.full([qt.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([qt.shape[0]], tl.float32)
    acc = tl.zeros([qt.shape[0], HEAD_DIM], tl.float32)
    slot0 = tl.load(table).to(tl.int64) * page_size
    page = tl.load(table + (start + tl.arange(0, BLOCK_N)) // page_size)
    if TMA:
        k_src = tl.make_tensor_descriptor(k_pool, [total, num_kv_heads * HEAD_DIM],
                                          [num_kv_heads * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_pool, [total, num_kv_heads * HEAD_DIM],
                                          [num_kv_heads * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    else:
        k_src, v_src = k_pool, v_pool
    full_end = end
    if TAIL:
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N):
        m_i, l_i, acc, page = variant_tile(
            m_i, l_i, acc, page, qt, k_src, v_src, table, slot0, n0, end, kv_head,
            num_kv_heads, page_size, sm_scale_log2, HEAD_DIM, BLOCK_N, PAGED, MASK % 2 == 1,
            MASK >= 2, TMA, PAGED)
    if TAIL == 1:
        for n0 in tl.range(full_end, end, BLOCK_N):
            m_i, l_i, acc, page = variant_tile(
                m_i, l_i, acc, page, qt, k_src, v_src, table, slot0, n0, end, kv_head,
                num_kv_heads, page_size, sm_scale_log2, HEAD_DIM, BLOCK_N, PAGED, True, True,
                TMA, False)
    if TAIL == 2:
        if full_end < end:
            m_i, l_i, acc, page = variant_tile(
                m_i, l_i, acc, page, qt, k_src, v_src, table, slot0, full_end, end, kv_head,
                num_kv_heads, page_size, sm_scale_log2, HEAD_DIM, BLOCK_N, PAGED, True, True,
                TMA, False)
    return m_i, l_i, acc


@triton.jit
def root_kernel(q, k_pool, v_pool, tables, ranges, out, lse_out, sm_scale_log2,
                num_kv_heads, page_size, max_blocks, SHIPPED: tl.constexpr,
                CONTIGUOUS: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr,
                TAIL: tl.constexpr, TMA: tl.constexpr,
                PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
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
    if SHIPPED and CONTIGUOUS:
        m_i, l_i, acc = attend_runs(qt, k_pool, v_pool, table, max_blocks * PAGE, kv_head,
                                    num_kv_heads, PAGE, start, end, end, sm_scale_log2,
                                    HEAD_DIM, BLOCK_M, BLOCK_N, 1, 0)
    elif SHIPPED:
        m_i, l_i, acc = attend(qt, k_pool, v_pool, table, max_blocks * PAGE, kv_head,
                               num_kv_heads, PAGE, start, end, sm_scale_log2, HEAD_DIM, BLOCK_M,
                               BLOCK_N)
    else:
        m_i, l_i, acc = attend_variant(qt, k_pool, v_pool, table, max_blocks * PAGE, kv_head,
                                       num_kv_heads, PAGE, start, end, sm_scale_log2, HEAD_DIM,
                                       BLOCK_N, PAGED, MASK, TAIL, TMA)
    base = (item * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M
    tl.store(out + (base + m_rows)[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None])
    tl.store(lse_out + base + m_rows, m_i + tl.log2(l_i))


_OFF = dict(SHIPPED=0, CONTIGUOUS=0, PAGED=0, MASK=3, TAIL=0, TMA=0)
VARIANTS = {  # name -> root_kernel's switches (pages in random order: the paged ones only)
    "page16": {**_OFF, "SHIPPED": 1},
    "contig": {**_OFF, "SHIPPED": 1, "CONTIGUOUS": 1},
    "p_masked": {**_OFF, "PAGED": 1},
    "p_tail_loop": {**_OFF, "PAGED": 1, "MASK": 0, "TAIL": 1},
    "p_tail_if": {**_OFF, "PAGED": 1, "MASK": 0, "TAIL": 2},
    "c_masked": {**_OFF},
    "c_load_mask": {**_OFF, "MASK": 1},
    "c_select": {**_OFF, "MASK": 2},
    "c_tail_loop": {**_OFF, "MASK": 0, "TAIL": 1},
    "c_tail_if": {**_OFF, "MASK": 0, "TAIL": 2},
    "fa": {**_OFF, "MASK": 0},
    "fa_tma": {**_OFF, "MASK": 0, "TMA": 1},
    "tma_tail_loop": {**_OFF, "MASK": 0, "TAIL": 1, "TMA": 1},
}
SHAPES = [  # name, rows per KV head, tokens, chunks, pages in random order
    ("seed_b256 root: 1024 rows x 2048, 2 chunks", 1024, 2048, 2, False),
    ("the same, pages in random order", 1024, 2048, 2, True),
    ("seed_b128 root: 512 rows x 2048, 4 chunks", 512, 2048, 4, False),
    ("ft_1,1024 root: 4096 rows x 2048", 4096, 2048, 1, False),
    ("the same, pages in random order", 4096, 2048, 1, True),
    ("4096 rows x 4096", 4096, 4096, 1, False),
    ("4096 rows x 2000 (a 16-token tail)", 4096, 2000, 1, False),
]
CONFIGS = {  # block_m -> (block_n, warps, stages)
    64: ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2), (128, 4, 3)),
    128: ((64, 8, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3)),
}
KV_HEADS, PAGE, DIM = 8, 16, 128


def problem(rows, tokens, chunks, block_m, shuffled):
    tiles = rows // block_m
    blocks = tokens // PAGE
    k = torch.randn(blocks, PAGE, KV_HEADS, DIM, device="cuda").half()
    v = torch.randn_like(k)
    order = (torch.randperm(blocks, device="cuda") if shuffled
             else torch.arange(blocks, device="cuda"))
    tables = order.to(torch.int32).view(1, blocks)
    step = tokens // chunks
    ranges = torch.tensor([[0, c * step, (c + 1) * step, t] for t in range(tiles)
                           for c in range(chunks)], dtype=torch.int32, device="cuda")
    q = torch.randn(tiles * KV_HEADS * block_m, DIM, device="cuda").half()
    items = tiles * chunks
    out = torch.empty(items * KV_HEADS * block_m, DIM, device="cuda")
    lse = torch.empty(items * KV_HEADS * block_m, device="cuda")
    return q, k, v, tables, ranges, out, lse, items


def expected_out(q, k, v, tables, ranges, block_m, scale_log2):
    """Each item's output, float32 torch over the pages in table order: what every variant
    must write (the scores' base-2 scale is a natural one of scale_log2 x ln 2)."""
    order = tables[0].long()
    keys = k[order].reshape(-1, KV_HEADS, DIM).transpose(0, 1).float()
    values = v[order].reshape(-1, KV_HEADS, DIM).transpose(0, 1).float()
    rows = q.view(-1, KV_HEADS, block_m, DIM).float()
    outs = []
    for _, start, end, tile in ranges.tolist():
        scores = rows[tile] @ keys[:, start:end].transpose(1, 2) * (scale_log2 * math.log(2))
        outs.append(torch.softmax(scores, -1) @ values[:, start:end])
    return torch.stack(outs).reshape(-1, DIM)


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


def run_shape(name, rows, tokens, chunks, shuffled, chosen):
    flops = 4.0 * rows * tokens * DIM * KV_HEADS
    print(f"{name}: {flops / 1e9:.1f} GFLOP; dense bar {dense_bar(rows, tokens)}", flush=True)
    for block_m, configs in CONFIGS.items():
        q, k, v, tables, ranges, out, lse, items = problem(rows, tokens, chunks, block_m, shuffled)
        expected = expected_out(q, k, v, tables, ranges, block_m, 0.1)
        for variant, switches in VARIANTS.items():
            paged = switches["PAGED"] or (switches["SHIPPED"] and not switches["CONTIGUOUS"])
            if variant not in chosen or (shuffled and not paged):
                continue
            cells = []
            for block_n, warps, stages in configs:
                unmasked_to_end = switches["MASK"] != 3 and not switches["TAIL"]
                if unmasked_to_end and (tokens // chunks) % block_n:
                    cells.append(f"{block_n}/{warps}/{stages}:n/a (a tail)")
                    continue

                def call():
                    root_kernel[(items, KV_HEADS)](
                        q, k, v, tables, ranges, out, lse, 0.1, KV_HEADS, PAGE,
                        tables.shape[1], **switches, PAGE=PAGE, HEAD_DIM=DIM, BLOCK_M=block_m,
                        BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                out.fill_(float("nan"))
                try:
                    call()
                except Exception as error:  # a variant the compiler refuses: say so, go on
                    cells.append(f"{block_n}/{warps}/{stages}:fail "
                                 f"({type(error).__name__})")
                    continue
                wrong = ~torch.isclose(out, expected, rtol=1e-2, atol=1e-2)
                us = timing.median_us(call, 30)
                tflops = flops / (us * 1e-6) / 1e12
                flag = f" WRONG {int(wrong.sum())}" if bool(wrong.any()) else ""
                cells.append(f"{block_n}/{warps}/{stages}:{us:.1f}({tflops:.0f}){flag}")
            print(f"  BM{block_m} {variant:8} " + " ".join(cells), flush=True)


def main(argv: list[str]) -> None:
    """Optional arguments: the variants to run (default all); ``--shape=TEXT`` (repeatable)
    keeps the shapes whose name starts with TEXT."""
    chosen = [a for a in argv if not a.startswith("--")] or list(VARIANTS)
    prefixes = [a.split("=", 1)[1] for a in argv if a.startswith("--shape=")]
    # Device-side tensor descriptors take their scratch memory from this allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    for shape in SHAPES:
        if prefixes and not any(shape[0].startswith(p) for p in prefixes):
            continue
        run_shape(*shape, chosen)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
