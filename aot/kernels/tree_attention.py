"""Tree attention: shared-prefix partials, then each branch's own suffix merged with them.

``tree_partial`` runs the planner's work items (``flash_reasoning.planner``): item ``i`` is a
token range of one tree node, read through one block table row, against a BLOCK_M-row tile of
the (branch, query head) pairs below the node, so a shared range is loaded once for all of
them. Row ``f`` of a node's flattened rows is branch ``order[row_ptr + f // group]``, head
``kv_head * group + f % group``. Each writes fp32 outputs and natural-log LSEs to partial slot
``entry_slot[entry0 + f // group]``: the planner numbers slots so that each branch's partials
are contiguous.

``tree_final`` runs one program per (branch, query-head tile): attention over the branch's
final range ``[final_start, seq_len)``, then the log-sum-exp merge with the branch's partial
slots ``[merge_ptr[b], merge_ptr[b + 1])`` (addressed directly, no index load in the
chain), then the output. The final range's end is read on the device, so a plan
stays valid while the branches only grow.

A plan that merges separately (``Plan.separate_merge``: a final program would walk a long
range or fold many partials one after another) has no final launch: every chunk of every
final range is a ``tree_partial`` item, the last one *open* (it reads to its branch's current
length), and ``tree_merge`` folds each (branch, head) row's slots, ``BLOCK_S`` at a time.
"""
import triton
import triton.language as tl

from flash_reasoning.specializations import TREE_ITEM_FIELDS

from .attention_core import attend, fold_partials, group_rows, merge_partial, normalise

ITEM_STRIDE = tl.constexpr(len(TREE_ITEM_FIELDS))
TABLE_ROW = tl.constexpr(TREE_ITEM_FIELDS.index("table_row"))
KV_START = tl.constexpr(TREE_ITEM_FIELDS.index("kv_start"))
KV_END = tl.constexpr(TREE_ITEM_FIELDS.index("kv_end"))
ROW_PTR = tl.constexpr(TREE_ITEM_FIELDS.index("row_ptr"))
NUM_ROWS = tl.constexpr(TREE_ITEM_FIELDS.index("num_rows"))
FIRST_ROW = tl.constexpr(TREE_ITEM_FIELDS.index("first_flat_row"))
ENTRY0 = tl.constexpr(TREE_ITEM_FIELDS.index("entry0"))
OPEN_END = tl.constexpr(TREE_ITEM_FIELDS.index("open_end"))


@triton.jit
def tree_partial(q, k_pool, v_pool, block_tables, seq_lens, order, items, entry_slot,
                 partial_out, partial_lse,
                 sm_scale_log2, num_qo_heads, num_kv_heads, page_size, max_blocks,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    item = items + tl.program_id(0).to(tl.int64) * ITEM_STRIDE
    kv_head = tl.program_id(1)
    group = num_qo_heads // num_kv_heads
    f = tl.load(item + FIRST_ROW) + tl.arange(0, BLOCK_M)
    local = f // group
    row_ok = local < tl.load(item + NUM_ROWS)
    branch = tl.load(order + tl.load(item + ROW_PTR) + local, mask=row_ok, other=0)
    head = kv_head * group + f % group
    d = tl.arange(0, HEAD_DIM)

    q_rows = branch.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    table_row = tl.load(item + TABLE_ROW)
    table = block_tables + table_row.to(tl.int64) * max_blocks
    # An open item ends at its row's length now (clamped to the table), not at planning.
    is_open = tl.load(item + OPEN_END) != 0
    seq_len = tl.minimum(tl.load(seq_lens + table_row, mask=is_open, other=0),
                         max_blocks * page_size)
    kv_end = tl.where(is_open, seq_len, tl.load(item + KV_END))
    m_i, l_i, acc = attend(qt, k_pool, v_pool, table, kv_head, num_kv_heads, page_size,
                           tl.load(item + KV_START), kv_end, sm_scale_log2,
                           HEAD_DIM, BLOCK_M, BLOCK_N)
    o, lse = normalise(m_i, l_i, acc)
    slot = tl.load(entry_slot + tl.load(item + ENTRY0) + local, mask=row_ok, other=0)
    part = slot.to(tl.int64) * num_qo_heads + head
    tl.store(partial_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
    tl.store(partial_lse + part, lse, mask=row_ok)


@triton.jit
def tree_final(q, k_pool, v_pool, block_tables, seq_lens, final_start, merge_ptr,
               partial_out, partial_lse, out, sm_scale_log2, num_qo_heads, num_kv_heads,
               page_size, max_blocks,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head, head, row_ok = group_rows(tl.program_id(1), num_qo_heads, num_kv_heads, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)

    q_rows = seq.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    # Lengths past the table's capacity are clamped: never read outside the table.
    seq_len = tl.minimum(tl.load(seq_lens + seq), max_blocks * page_size)
    table = block_tables + seq.to(tl.int64) * max_blocks
    m_i, l_i, acc = attend(qt, k_pool, v_pool, table, kv_head, num_kv_heads, page_size,
                           tl.load(final_start + seq), seq_len, sm_scale_log2,
                           HEAD_DIM, BLOCK_M, BLOCK_N)
    o, m = normalise(m_i, l_i, acc)
    denom = tl.where(m == float("-inf"), 0.0, 1.0)
    for slot in range(tl.load(merge_ptr + seq), tl.load(merge_ptr + seq + 1)):
        part = head.to(tl.int64) + slot * num_qo_heads  # entries x heads < 2**31
        lse = tl.load(partial_lse + part, mask=row_ok, other=float("-inf"))
        o_part = tl.load(partial_out + part[:, None] * HEAD_DIM + d[None, :],
                         mask=row_ok[:, None], other=0.0)
        m, denom, o = merge_partial(m, denom, o, lse, o_part)
    o = o / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def tree_merge(merge_ptr, partial_out, partial_lse, out, num_qo_heads,
               HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    o = fold_partials(partial_out, partial_lse, head.to(tl.int64), num_qo_heads,
                      tl.load(merge_ptr + seq), tl.load(merge_ptr + seq + 1), HEAD_DIM, BLOCK_S)
    row = seq.to(tl.int64) * num_qo_heads + head
    tl.store(out + row * HEAD_DIM + tl.arange(0, HEAD_DIM), o.to(out.dtype.element_ty))
