"""Paged GQA decode attention: one query token per sequence, K/V read through block tables.

One program handles BLOCK_M query heads of one KV head (the GQA group, padded to a tensor-core
tile) over one split of the sequence, so each K/V tile is loaded once for the whole group.
"""
import triton
import triton.language as tl

from .attention_core import attend, group_rows, normalise


@triton.jit
def paged_decode(q, k_pool, v_pool, block_tables, seq_lens, out, partial_out, partial_lse,
                 sm_scale_log2, num_qo_heads, num_kv_heads, page_size, max_blocks,
                 tokens_per_split,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT: tl.constexpr, PAGE: tl.constexpr):
    if PAGE:  # a compiled page size (attention_core.attend)
        page_size = PAGE
    seq = tl.program_id(0)
    split = tl.program_id(2)
    kv_head, head, row_ok = group_rows(tl.program_id(1), num_qo_heads, num_kv_heads, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)

    q_rows = seq.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)

    start = split * tokens_per_split
    # Lengths past the table's capacity are clamped: never read outside the table.
    table_tokens = max_blocks * page_size
    seq_len = tl.minimum(tl.load(seq_lens + seq), table_tokens)
    end = tl.minimum(seq_len, start + tokens_per_split)
    table = block_tables + seq.to(tl.int64) * max_blocks
    m_i, l_i, acc = attend(qt, k_pool, v_pool, table, table_tokens, kv_head, num_kv_heads,
                           page_size, start, end, sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N)
    o, lse = normalise(m_i, l_i, acc)
    if SPLIT:
        part = (q_rows * tl.num_programs(2) + split)
        tl.store(partial_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
        tl.store(partial_lse + part, lse, mask=row_ok)
    else:
        tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None])
