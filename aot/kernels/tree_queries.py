"""Several queries per program: a step's query rows grouped into *query tiles*.

``tree_queries`` runs one program per (query tile, KV head). Tile ``t`` is the int32 record
``query_tiles[t]`` (fields ``specializations.QUERY_TILE_FIELDS``): rows ``first_row`` to
``first_row + rows - 1`` of the plan, consecutive queries of one sequence (the planner groups
only rows its caller names as one sequence, so they list the same blocks). The tile's M
rows are its queries x the GQA group (row ``f``: query ``f // group``, head ``f % group`` of
the KV head's group), so one K/V load serves every query of the tile, as a shared node's tile
serves the branches below it. The program walks the sequence from its first token through
the table of its longest row (a row's table need hold only its own tokens' blocks: the C
ABI's plans hold no more), each row up to its own length (read on the device: a plan follows
its rows as they grow), and writes the normalised output: no partials, no merge, one launch.

``LANES``: a tile's rows are *lanes* of ``lane_rows`` queries of one sequence each, every
lane holding its first ``shared`` tokens in the same slots (a tile of one lane: all its
tokens). The program reads the shared tokens once for all rows (through the longest row's
table), then each lane's own tokens for its rows alone, through the lane's longest row's
table. Its own kernels: the extra lane loop slows the walk of a tile of one lane (H200,
extends of 16-256 queries on a 2048-token prompt: 10-13%).

``TMA`` (a tile of one lane): the tokens every row reads whole that lie in the first run of
consecutive pages of the table (found on the device: a shared prompt stored at once) are read as
one run of slots through TMA descriptors of the pools (``k_tiles``, ``v_tiles``), the rest as
above (every KV tile masked). H200, extends of 16-256 queries on a 2048-token prompt: 0.72-0.78x
the paged walk's time.

``DRAFT``: each row's last ``draft_masks[row, 0]`` tokens are a draft it reads where its bits
``draft_masks[row, 1]`` allow (``attention_core.draft_allows``), its other tokens as usual.
"""
import triton
import triton.language as tl

from flash_reasoning.specializations import QUERY_TILE_FIELDS

from .attention_core import (
    attend_rows,
    attend_run,
    draft_window,
    no_keys,
    normalise,
    read_by_every_row,
)

TILE_FIELDS = tl.constexpr(len(QUERY_TILE_FIELDS))
FIRST_ROW = tl.constexpr(QUERY_TILE_FIELDS.index("first_row"))
ROWS = tl.constexpr(QUERY_TILE_FIELDS.index("rows"))
LANE_ROWS = tl.constexpr(QUERY_TILE_FIELDS.index("lane_rows"))
SHARED = tl.constexpr(QUERY_TILE_FIELDS.index("shared"))
#: Page ids compared per step when looking for the table's first run (first_run_tokens).
RUN_SCAN = tl.constexpr(64)


@triton.jit
def tree_queries(q, k_pool, v_pool, block_tables, seq_lens, k_tiles, v_tiles, query_tiles,
                 draft_masks, out, sm_scale_log2, num_qo_heads, num_kv_heads, page_size,
                 max_blocks, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DRAFT: tl.constexpr, LANES: tl.constexpr,
                 TMA: tl.constexpr, PAGE: tl.constexpr):
    if PAGE:  # a compiled page size (attention_core.attend)
        page_size = PAGE
    tile = query_tiles + tl.program_id(0).to(tl.int64) * TILE_FIELDS
    kv_head = tl.program_id(1)
    group = num_qo_heads // num_kv_heads
    f = tl.arange(0, BLOCK_M)
    query = f // group
    first = tl.load(tile + FIRST_ROW)
    row_ok = (query < tl.load(tile + ROWS)) & (query < BLOCK_M // group)
    row = first + query
    head = kv_head * group + f % group
    d = tl.arange(0, HEAD_DIM)
    q_rows = row.to(tl.int64) * num_qo_heads + head
    qt = tl.load(q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    # Lengths past the table's capacity are clamped: never read outside the table.
    table_tokens = max_blocks * page_size
    row_end = tl.minimum(tl.load(seq_lens + row, mask=row_ok, other=0), table_tokens)
    draft_start, draft_allowed = draft_window(draft_masks, row, row_ok, row_end, DRAFT)
    longest = first + tl.argmax(tl.where(row_ok, row_end, -1), 0) // group
    table = block_tables + longest.to(tl.int64) * max_blocks
    if LANES:
        shared = tl.minimum(tl.load(tile + SHARED), table_tokens)  # a lone lane's: all
        m_i, l_i, acc = attend_rows(qt, k_pool, v_pool, table, table_tokens, kv_head,
                                    num_kv_heads, page_size, row_ok, tl.minimum(row_end, shared),
                                    draft_start, draft_allowed, sm_scale_log2, HEAD_DIM,
                                    BLOCK_M, BLOCK_N, DRAFT)
        lane_rows = tl.load(tile + LANE_ROWS)
        for lane in range(0, tl.cdiv(tl.load(tile + ROWS), lane_rows)):
            walks = row_ok & (query // lane_rows == lane)
            longest = first + tl.argmax(tl.where(walks, row_end, -1), 0) // group
            m_i, l_i, acc = attend_rows(qt, k_pool, v_pool,
                                        block_tables + longest.to(tl.int64) * max_blocks,
                                        table_tokens, kv_head, num_kv_heads, page_size, row_ok,
                                        row_end, draft_start, draft_allowed, sm_scale_log2,
                                        HEAD_DIM, BLOCK_M, BLOCK_N, DRAFT, True,
                                        (m_i, l_i, acc), walks, shared)
    elif TMA:
        whole = read_by_every_row(row_ok, row_end, draft_start, table_tokens, DRAFT)
        run = tl.minimum(first_run_tokens(table, whole, page_size), whole) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = no_keys(BLOCK_M, HEAD_DIM)
        m_i, l_i, acc = attend_run(m_i, l_i, acc, qt, k_tiles, v_tiles, table, table_tokens,
                                   kv_head, num_kv_heads, page_size, 0, run, sm_scale_log2,
                                   HEAD_DIM, BLOCK_N, True, True)
        m_i, l_i, acc = attend_rows(qt, k_pool, v_pool, table, table_tokens, kv_head,
                                    num_kv_heads, page_size, row_ok, row_end, draft_start,
                                    draft_allowed, sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    DRAFT, True, (m_i, l_i, acc), row_ok, run)
    else:
        m_i, l_i, acc = attend_rows(qt, k_pool, v_pool, table, table_tokens, kv_head,
                                    num_kv_heads, page_size, row_ok, row_end, draft_start,
                                    draft_allowed, sm_scale_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
                                    DRAFT)
    o, _ = normalise(m_i, l_i, acc)
    tl.store(out + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def first_run_tokens(table, tokens, page_size):
    """How many of the first ``tokens`` tokens of ``table``'s sequence lie in its first run of
    consecutive pages (page ``p``'s id the first's plus ``p``), in whole pages."""
    pages = tl.cdiv(tokens, page_size)
    first = tl.load(table)
    run = pages
    for p0 in tl.range(0, pages, RUN_SCAN):
        p = p0 + tl.arange(0, RUN_SCAN)
        ids = tl.load(table + p, mask=p < pages, other=0)
        run = tl.minimum(run, tl.min(tl.where((p < pages) & (ids != first + p), p, pages), 0))
    return run * page_size
