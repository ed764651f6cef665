"""Paged GQA decode attention: one query token per sequence, K/V read through block tables.

One program handles BLOCK_M query heads of one KV head (the GQA group, padded to a tensor-core
tile) over one split of the sequence, so each K/V tile is loaded once for the whole group.
Softmax runs online in base 2 (``sm_scale_log2`` = sm_scale * log2(e)); the LSE written for
split-K is converted to the natural log, the convention of the whole package.
"""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def paged_decode(q, k_pool, v_pool, block_tables, seq_lens, out, partial_out, partial_lse,
                 sm_scale_log2, num_qo_heads, num_kv_heads, page_size, max_blocks,
                 tokens_per_split,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    group = num_qo_heads // num_kv_heads
    tiles_per_group = tl.cdiv(group, BLOCK_M)
    kv_head = tl.program_id(1) // tiles_per_group
    rows = (tl.program_id(1) % tiles_per_group) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group
    head = kv_head * group + rows
    d = tl.arange(0, HEAD_DIM)

    q_rows = seq.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)

    start = split * tokens_per_split
    # Lengths past the table's capacity are clamped: never read outside the table.
    seq_len = tl.minimum(tl.load(seq_lens + seq), max_blocks * page_size)
    end = tl.minimum(seq_len, start + tokens_per_split)
    table = block_tables + seq.to(tl.int64) * max_blocks
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(table + n // page_size, mask=n_ok, other=0)
        kv_rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv_head
        kv_off = kv_rows[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_pool + kv_off, mask=n_ok[:, None], other=0.0)
        s = tl.dot(qt, tl.trans(k)) * sm_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        # Every tile holds at least one valid key (n0 < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty range (length 0, or a split past the end) gives zeros and LSE = -inf.
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        part = (q_rows * tl.num_programs(2) + split)
        tl.store(partial_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2,
                       float("-inf"))
        tl.store(partial_lse + part, lse, mask=row_ok)
    else:
        tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None])
