"""Decode tiles that pack several KV heads (a block-diagonal score mask) against the shipped
one-KV-head tile, JIT-compiled and timed on decode shapes (paged_decode without splits: the
same loop as tree_final's). Run on a GPU."""
import sys

import torch
import triton
import triton.language as tl

from aot.kernels.paged_decode import paged_decode
from flash_reasoning import timing
from flash_reasoning.synthetic import paged_problem


@triton.jit
def packed_decode(q, k_pool, v_pool, block_tables, seq_lens, out, sm_scale_log2,
                  num_qo_heads, num_kv_heads, page_size, max_blocks,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    group = num_qo_heads // num_kv_heads
    heads = tl.maximum(BLOCK_M // group, 1)
    tiles_per_group = tl.cdiv(group, BLOCK_M)
    tile = tl.program_id(1)
    kv0 = (tile // tiles_per_group) * heads
    local = (tile % tiles_per_group) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = kv0 * group + local
    row_ok = (local < heads * group) & (head < num_qo_heads)
    slot = tl.where(row_ok, local // group, 0)
    d = tl.arange(0, HEAD_DIM)
    q_rows = seq.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    seq_len = tl.minimum(tl.load(seq_lens + seq), max_blocks * page_size)
    table = block_tables + seq.to(tl.int64) * max_blocks

    cols = tl.arange(0, BLOCK_N)
    tok = cols // heads
    col_head = cols % heads
    step = BLOCK_N // heads
    col_ok = (kv0 + col_head < num_kv_heads) & (cols < step * heads)
    same_head = slot[:, None] == col_head[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    page = tl.load(table + tok // page_size, mask=tok < seq_len, other=0)
    for n0 in tl.range(0, seq_len, step):
        n = n0 + tok
        n_ok = (n < seq_len) & col_ok
        kv_rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv0 + col_head
        kv_off = kv_rows[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_pool + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0)
        ahead = n + step
        page = tl.load(table + ahead // page_size, mask=ahead < seq_len, other=0)
        s = tl.dot(qt, tl.trans(k)) * sm_scale_log2
        s = tl.where(same_head & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


SHAPES = [  # name, sequences, tokens, qo heads, kv heads
    ("256 x 64 q32kv8", 256, 64, 32, 8),
    ("1024 x 32 q32kv8", 1024, 32, 32, 8),
    ("2048 x 16 q32kv8", 2048, 16, 32, 8),
    ("16 x 512 q32kv8", 16, 512, 32, 8),
    ("64 x 2048 q32kv8", 64, 2048, 32, 8),
    ("256 x 64 q32kv32", 256, 64, 32, 32),
    ("1024 x 32 q32kv32", 1024, 32, 32, 32),
    ("64 x 2048 q32kv32", 64, 2048, 32, 32),
]
CONFIGS = ((16, 2, 1), (32, 2, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2),
           (256, 8, 2))


def main() -> int:
    failed = False
    for name, seqs, tokens, qo, kv in SHAPES:
        p = paged_problem([tokens] * seqs, qo, kv, 128, device="cuda")
        ref = torch.empty_like(p.q)
        out = torch.empty_like(p.q)
        group = qo // kv
        heads = max(1, 16 // group)
        args = (p.q, p.k_pool, p.v_pool, p.block_tables, p.seq_lens)
        scalars = (0.1, qo, kv, 16, p.block_tables.shape[1])
        cells, fns = {}, {}
        for block_n, warps, stages in CONFIGS:
            opts = dict(num_warps=warps, num_stages=stages)
            tag = f"{block_n}/{warps}/{stages}"
            if block_n <= 128:
                fns["old " + tag] = lambda o=opts, b=block_n: paged_decode[
                    (seqs, kv * -(-group // 16), 1)](
                    *args, ref, None, None, *scalars, 1 << 30, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=b,
                    SPLIT=False, **o)
            fns["new " + tag] = lambda o=opts, b=block_n: packed_decode[
                (seqs, -(-kv // heads) * -(-group // 16), 1)](
                *args, out, *scalars, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=b, **o)
        for key, fn in fns.items():
            fn()
        torch.cuda.synchronize()
        for key, fn in fns.items():  # every variant against the old 64/4/2
            (ref if key.startswith("old") else out).fill_(float("nan"))
            fn()
            if key.startswith("new"):
                fns["old 64/4/2"]()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                if not err < 2e-2:
                    print(f"  {name} {key}: max error {err} vs old", flush=True)
                    failed = True
        cells = timing.median_us_each(fns, runs=30)
        best = {v: min((t, k) for k, t in cells.items() if k.startswith(v)) for v in ("old", "new")}
        print(f"{name:20} best old {best['old'][1]} {best['old'][0]:.1f}  new {best['new'][1]} "
              f"{best['new'][0]:.1f}  | " + " ".join(f"{k}:{t:.1f}" for k, t in cells.items()),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
