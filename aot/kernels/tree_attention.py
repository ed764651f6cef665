"""Tree attention: shared-prefix partials, then each branch's own suffix merged with them.

``tree_partial`` runs the planner's work items (``flash_reasoning.planner``): item ``i`` is a
token range of one tree node, read through one block table row, against a BLOCK_M-row tile of
the (branch, query head) pairs below the node, so a shared range is loaded once for all of
them. A launch has one program per (item, KV head): its grid is (items, heads), each head's
items together, or with ``heads_first`` (few waves of items of unequal lengths) (heads, items),
each item's heads together. Row ``f`` of a node's flattened rows is branch
``order[row_ptr + f // group]``, head ``kv_head * group + f % group``. Each writes fp32 outputs
and natural-log LSEs to partial slot ``entry_slot[entry0 + f // group]``: the planner numbers
slots so that each branch's partials are contiguous. ``SLOT_RUNS`` (1 or 2): the plan found
every item of the launch in that many runs of consecutive pages at most
(``planner.item_runs``), so each range is read as runs of slots from their first pages, the
second from the item's ``run_split`` (``attention_core.attend_runs``). ``TMA`` (slot runs
only, ``dispatch.reads_through_tensor_maps``): ``k_pool`` and ``v_pool`` are TMA descriptors of
the pools as [slots, KV heads x HEAD_DIM], encoded by the launcher (``runtime.TensorMap``).

``tree_final`` runs one program per (branch, query-head tile), its grid (branches, tiles) or,
packed with ``heads_first``, (tiles, branches): attention over the branch's
final range ``[final_start, seq_len)``, then the log-sum-exp merge with the branch's partial
slots ``[merge_ptr[b], merge_ptr[b + 1])`` (addressed directly, no index load in the
chain), then the output. The final range's end is read on the device, so a plan
stays valid while the branches only grow. ``PACKED``: a GQA group of at most BLOCK_M // 2
heads leaves tile rows free, so each program serves ``lanes`` branches (``order[p * lanes:
(p + 1) * lanes]``), one group of rows each, and walks their final ranges side by side
(``attention_core.attend_lanes``): fewer, longer programs, more loads in flight. ``COMMON``
(packed): the planner found a range all of a program's lanes share (the same pages, folded
into their final ranges, not computed: ``planner.PlanArrays.common``), so the program first
walks it once as a dense tile of all its rows, through its lead lane's table, then each
lane's own rest side by side; the lanes' final ranges begin where it ends.

``DRAFT``: each row's last ``draft_masks[row, 0]`` tokens are a draft it reads where its bits
``draft_masks[row, 1]`` allow (``attention_core.draft_allows``), a packed program each lane's;
a plan with draft masks reads every draft token here, in its rows' final ranges.

``PDL`` (sm90, ``dispatch.grid_dependency``): the partial launch lets the final (or merge)
launch start once its programs are past their walks (or, with the plan's ``early_final``, once
they have started), and that launch waits for it only before it reads the partials: its
queries, lengths and own range are loaded and walked meanwhile. A plan with items in both row
tiles makes two partial launches; the second starts the same way beside the first (it reads
nothing the first writes) and waits for it at its end, so that waiting for the second is
waiting for both.

A plan that merges separately (``Plan.separate_merge``: a final program would walk a long
range or fold many partials one after another) has no final launch: every chunk of every
final range is a ``tree_partial`` item, the last one *open* (it reads to its branch's current
length), and ``tree_merge`` folds each (branch, head) row's slots, ``BLOCK_S`` at a time.
"""
import triton
import triton.language as tl

from flash_reasoning.specializations import COMMON_FIELDS as _COMMON_FIELDS
from flash_reasoning.specializations import TREE_ITEM_FIELDS

from .attention_core import (
    attend,
    attend_lanes,
    attend_runs,
    draft_window,
    fold_partials,
    group_rows,
    let_next_launch_start,
    merge_partial,
    no_keys,
    normalise,
    wait_for_previous_launch,
)

ITEM_STRIDE = tl.constexpr(len(TREE_ITEM_FIELDS))
TABLE_ROW = tl.constexpr(TREE_ITEM_FIELDS.index("table_row"))
KV_START = tl.constexpr(TREE_ITEM_FIELDS.index("kv_start"))
KV_END = tl.constexpr(TREE_ITEM_FIELDS.index("kv_end"))
ROW_PTR = tl.constexpr(TREE_ITEM_FIELDS.index("row_ptr"))
NUM_ROWS = tl.constexpr(TREE_ITEM_FIELDS.index("num_rows"))
FIRST_ROW = tl.constexpr(TREE_ITEM_FIELDS.index("first_flat_row"))
ENTRY0 = tl.constexpr(TREE_ITEM_FIELDS.index("entry0"))
OPEN_END = tl.constexpr(TREE_ITEM_FIELDS.index("open_end"))
RUN_SPLIT = tl.constexpr(TREE_ITEM_FIELDS.index("run_split"))
COMMON_FIELDS = tl.constexpr(len(_COMMON_FIELDS))
COMMON_LEAD = tl.constexpr(_COMMON_FIELDS.index("lead_row"))
COMMON_START = tl.constexpr(_COMMON_FIELDS.index("start"))
COMMON_END = tl.constexpr(_COMMON_FIELDS.index("end"))


@triton.jit
def item_and_head(heads_first):
    """This program's (item, KV head), or a final program's (branches, head tile): the grid is
    (items, heads), or with ``heads_first`` (heads, items), so that an item's heads run one after
    another."""
    first = heads_first != 0
    return (tl.where(first, tl.program_id(1), tl.program_id(0)),
            tl.where(first, tl.program_id(0), tl.program_id(1)))


@triton.jit
def tree_partial(q, k_pool, v_pool, block_tables, seq_lens, order, items, entry_slot,
                 partial_out, partial_lse,
                 sm_scale_log2, num_qo_heads, num_kv_heads, page_size, max_blocks, early_final,
                 heads_first,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr, SLOT_RUNS: tl.constexpr, TMA: tl.constexpr,
                 PDL: tl.constexpr):
    if PAGE:  # a compiled page size (attention_core.attend)
        page_size = PAGE
    # early_final (the plan's choice, every plan with a final kernel): final programs walk their
    # own ranges while this launch runs, and a two-tile plan's second partial launch runs
    # beside the first. Only a launch made to overlap this one reacts.
    if early_final:
        let_next_launch_start(PDL)
    item_index, kv_head = item_and_head(heads_first)
    item = items + item_index.to(tl.int64) * ITEM_STRIDE
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
    table_tokens = max_blocks * page_size
    is_open = tl.load(item + OPEN_END) != 0
    seq_len = tl.minimum(tl.load(seq_lens + table_row, mask=is_open, other=0), table_tokens)
    kv_end = tl.where(is_open, seq_len, tl.load(item + KV_END))
    if SLOT_RUNS:  # closed items (planner.item_runs): kv_end is the record's
        m_i, l_i, acc = attend_runs(qt, k_pool, v_pool, table, table_tokens, kv_head,
                                    num_kv_heads, page_size, tl.load(item + KV_START),
                                    tl.load(item + RUN_SPLIT), kv_end, sm_scale_log2, HEAD_DIM,
                                    BLOCK_M, BLOCK_N, SLOT_RUNS, TMA)
    else:
        m_i, l_i, acc = attend(qt, k_pool, v_pool, table, table_tokens, kv_head,
                               num_kv_heads, page_size, tl.load(item + KV_START), kv_end,
                               sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N)
    if early_final == 0:  # past the walk: the final launch may take the SMs this one frees
        let_next_launch_start(PDL)
    o, lse = normalise(m_i, l_i, acc)
    slot = tl.load(entry_slot + tl.load(item + ENTRY0) + local, mask=row_ok, other=0)
    part = slot.to(tl.int64) * num_qo_heads + head
    tl.store(partial_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
    tl.store(partial_lse + part, lse, mask=row_ok)
    # A second partial launch overlaps the first: it reads nothing the first writes, but the
    # launch after both waits for it alone, so it must not end before the first has.
    wait_for_previous_launch(PDL)


@triton.jit
def tree_final(q, k_pool, v_pool, block_tables, seq_lens, order, final_start, merge_ptr, common,
               draft_masks, partial_out, partial_lse, out, sm_scale_log2, num_qo_heads,
               num_kv_heads, page_size, max_blocks, num_rows, lanes, heads_first,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PACKED: tl.constexpr, COMMON: tl.constexpr, DRAFT: tl.constexpr,
               PAGE: tl.constexpr, PDL: tl.constexpr):
    if PAGE:  # a compiled page size (attention_core.attend)
        page_size = PAGE
    d = tl.arange(0, HEAD_DIM)
    if PACKED:  # only packed launches run heads first: the one-branch kernel's program ids stay
        # constant: a run-time select there cost up to 13% (H100)
        program, tile = item_and_head(heads_first)
        lane, head, row_ok = lane_rows(tile, num_qo_heads, num_kv_heads, lanes, BLOCK_M)
        kv_head = tile
        first = program * lanes
        row_ok = row_ok & (first + lane < num_rows)
        seq = tl.load(order + first + lane, mask=row_ok, other=0)
    else:
        seq = tl.program_id(0)
        kv_head, head, row_ok = group_rows(tl.program_id(1), num_qo_heads, num_kv_heads, BLOCK_M)
    q_rows = seq.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    if PACKED:
        tokens_per_lane = BLOCK_N // lanes
        tok_lane = tl.arange(0, BLOCK_N) // tokens_per_lane
        tok_ok = (tok_lane < lanes) & (first + tok_lane < num_rows)
        tok_seq = tl.load(order + first + tok_lane, mask=tok_ok, other=0)
        if COMMON:  # the range every lane shares, once for all rows
            shared = common + program * COMMON_FIELDS
            lead = tl.load(shared + COMMON_LEAD)
            m_i, l_i, acc = attend(qt, k_pool, v_pool,
                                   block_tables + lead.to(tl.int64) * max_blocks,
                                   max_blocks * page_size, kv_head, num_kv_heads, page_size,
                                   tl.load(shared + COMMON_START), tl.load(shared + COMMON_END),
                                   sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N)
        else:
            m_i, l_i, acc = no_keys(BLOCK_M, HEAD_DIM)
        start, end = final_range(tok_seq, tok_ok, seq_lens, final_start, page_size, max_blocks)
        draft_start, draft_allowed = draft_window(draft_masks, tok_seq, tok_ok, end, DRAFT)
        m_i, l_i, acc = attend_lanes(m_i, l_i, acc, qt, lane, k_pool, v_pool,
                                     block_tables + tok_seq.to(tl.int64) * max_blocks, start, end,
                                     tokens_per_lane, kv_head, num_kv_heads, page_size,
                                     sm_scale_log2, HEAD_DIM, BLOCK_N, draft_start, draft_allowed,
                                     DRAFT)
        lo = tl.load(merge_ptr + seq, mask=row_ok, other=0)
        count = tl.load(merge_ptr + seq + 1, mask=row_ok, other=0) - lo
        steps = tl.max(count, 0)
    else:
        start, end = final_range(seq, True, seq_lens, final_start, page_size, max_blocks)
        draft_start, draft_allowed = draft_window(draft_masks, seq, True, end, DRAFT)
        m_i, l_i, acc = attend(qt, k_pool, v_pool, block_tables + seq.to(tl.int64) * max_blocks,
                               max_blocks * page_size, kv_head, num_kv_heads, page_size, start,
                               end, sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N, draft_start,
                               draft_allowed, DRAFT)
        lo = tl.load(merge_ptr + seq)
        count = tl.load(merge_ptr + seq + 1) - lo
        steps = count
    o, m = normalise(m_i, l_i, acc)
    wait_for_previous_launch(PDL)  # the partials are the partial launch's output
    denom = tl.where(m == float("-inf"), 0.0, 1.0)
    for j in range(0, steps):
        part = head.to(tl.int64) + (lo + j) * num_qo_heads  # entries x heads < 2**31
        ok = row_ok & (j < count)
        lse = tl.load(partial_lse + part, mask=ok, other=float("-inf"))
        o_part = tl.load(partial_out + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None],
                         other=0.0)
        m, denom, o = merge_partial(m, denom, o, lse, o_part)
    o = o / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def lane_rows(kv_head, num_qo_heads, num_kv_heads, lanes, BLOCK_M: tl.constexpr):
    """A packed tile's rows: row ``f`` is head ``f % group`` of the group of ``kv_head`` in lane
    ``f // group`` (the group is at most BLOCK_M // 2 here). Returns (lane, query head, row in
    a lane)."""
    group = num_qo_heads // num_kv_heads
    f = tl.arange(0, BLOCK_M)
    lane = f // group
    return lane, kv_head * group + f % group, lane < lanes


@triton.jit
def final_range(seq, ok, seq_lens, final_start, page_size, max_blocks):
    """Row ``seq``'s final range [start, end): its end is its length now, clamped to the
    table's capacity (never read outside the table); empty where not ``ok``."""
    start = tl.load(final_start + seq, mask=ok, other=0)
    end = tl.minimum(tl.load(seq_lens + seq, mask=ok, other=0), max_blocks * page_size)
    return start, tl.maximum(end, start)


@triton.jit
def tree_merge(merge_ptr, partial_out, partial_lse, out, num_qo_heads,
               HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    lo = tl.load(merge_ptr + seq)  # the plan's, not the partial launch's: read before waiting
    hi = tl.load(merge_ptr + seq + 1)
    wait_for_previous_launch(PDL)
    o = fold_partials(partial_out, partial_lse, head.to(tl.int64), num_qo_heads, lo, hi,
                      HEAD_DIM, BLOCK_S)
    row = seq.to(tl.int64) * num_qo_heads + head
    tl.store(out + row * HEAD_DIM + tl.arange(0, HEAD_DIM), o.to(out.dtype.element_ty))
