"""Building blocks shared by the attention kernels (inlined by Triton into each caller).

Softmax runs online in base 2 (``sm_scale_log2`` = sm_scale * log2(e)); every LSE that leaves
a kernel is in the natural log, the convention of the whole package.
"""
import os

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter runs one grid after another and no inline PTX: nothing to order.
    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass
else:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait


@triton.jit
def let_next_launch_start(PDL: tl.constexpr):
    """Grid dependency control (``PDL``, sm90): once every program has passed this point, the
    next launch (if launched to overlap this one) may start; it waits before reading what this
    launch writes (:func:`wait_for_previous_launch`)."""
    if PDL:
        _gdc_launch_dependents()


@triton.jit
def wait_for_previous_launch(PDL: tl.constexpr):
    """Grid dependency control (``PDL``): wait until the launch before this one has finished and
    its writes are visible. Everything above the call must not read what that launch writes.
    A no-op for a launch that was not made to overlap."""
    if PDL:
        _gdc_wait()


@triton.jit
def group_rows(tile, num_qo_heads, num_kv_heads, BLOCK_M: tl.constexpr):
    """The KV head and query heads of ``tile``: the GQA group split into BLOCK_M-row tiles."""
    group = num_qo_heads // num_kv_heads
    tiles_per_group = tl.cdiv(group, BLOCK_M)
    kv_head = tile // tiles_per_group
    rows = (tile % tiles_per_group) * BLOCK_M + tl.arange(0, BLOCK_M)
    return kv_head, kv_head * group + rows, rows < group


@triton.jit
def no_keys(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online-softmax state of rows that have seen no key: (-inf, 0, 0)."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))


@triton.jit
def attend(qt, k_pool, v_pool, table, table_tokens, kv_head, num_kv_heads, page_size, start,
           end, sm_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, draft_start=0, draft_allowed=0, DRAFT: tl.constexpr = False):
    """Online softmax of the query tile ``qt`` over tokens [start, end) of one paged sequence
    (``table`` is its block table row, of ``table_tokens`` tokens' pages). Returns (row max in
    base 2, row sum, unnormalised output); an empty range gives (-inf, 0, 0). With ``DRAFT``
    the tokens from ``draft_start`` are a draft, read where :func:`draft_allows` says (a whole
    tile may be masked: rows may stay empty).

    Each token's K/V row is addressed through its page id, a division and a remainder by
    ``page_size`` per token: the callers' ``PAGE`` constexpr makes it a constant where the page
    size is one the build compiles for, and the divisions shifts (H100: a shared root's
    compute-bound tiles 12-14% faster). A range whose slots are known
    to be consecutive is :func:`attend_runs`'."""
    m_i, l_i, acc = no_keys(BLOCK_M, HEAD_DIM)
    offs = tl.arange(0, BLOCK_N)
    # Each tile's page ids are loaded one iteration ahead: read in the tile's own iteration,
    # the page table is a third dependent DRAM round trip before K and V. The
    # first tile's are bounded by the table, not by ``end``: where ``end`` is a length loaded
    # by the caller, both loads are in flight at once (ids past ``end`` are never used).
    page = tl.load(table + (start + offs) // page_size, mask=start + offs < table_tokens,
                   other=0)
    for n0 in tl.range(start, end, BLOCK_N):
        n = n0 + offs
        n_ok = n < end
        if DRAFT:  # masked draft tokens read as zeros: a NaN there stays out, as in the reference
            n_ok = n_ok & draft_allows(n, draft_start, draft_allowed)
        k, v, page = load_paged_kv(k_pool, v_pool, table, page, n, n_ok, end, kv_head,
                                   num_kv_heads, page_size, HEAD_DIM, BLOCK_N, True)
        s = tile_scores(qt, k, n_ok, sm_scale_log2, True)
        # Without drafts every tile holds at least one valid key (n0 < end): no row is empty.
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DRAFT)
    return m_i, l_i, acc


@triton.jit
def attend_rows(qt, k_pool, v_pool, table, table_tokens, kv_head, num_kv_heads, page_size,
                row_ok, row_end, draft_start, draft_allowed, sm_scale_log2,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DRAFT: tl.constexpr, LANE: tl.constexpr = False, state=None, walks=None,
                start=0):
    """:func:`attend` of a tile whose rows read one paged sequence from its first token, each
    row ``r`` up to its own ``row_end[r]`` (where ``row_ok``; a tile of several queries: causal
    ends), with ``DRAFT`` its tokens from ``draft_start[r]`` where ``draft_allowed[r]`` allows.
    The whole KV tiles every row reads run unmasked; the rest, each row masked at its own end
    (a token one row reads is loaded for all: 0 x a NaN there reaches the others). Rows may be
    left empty (-inf, 0, 0).

    ``LANE``: only the rows that ``walks`` (one lane of several in the tile) read, tokens
    [start, row_end[r]), continuing the online-softmax ``state`` (m_i, l_i, acc); every KV tile
    is masked (the other lanes' rows read none of it)."""
    offs = tl.arange(0, BLOCK_N)
    if LANE:
        m_i, l_i, acc = state
        end = tl.max(tl.where(walks, row_end, start), 0)
        clear = start
    else:
        m_i, l_i, acc = no_keys(BLOCK_M, HEAD_DIM)
        end = tl.max(tl.where(row_ok, row_end, 0), 0)
        clear = tl.minimum(read_by_every_row(row_ok, row_end, draft_start, table_tokens, DRAFT),
                           end) // BLOCK_N * BLOCK_N
    page = tl.load(table + (start + offs) // page_size, mask=start + offs < end, other=0)
    for n0 in tl.range(start, clear, BLOCK_N):  # one step ahead (attend)
        n = n0 + offs
        k, v, page = load_paged_kv(k_pool, v_pool, table, page, n, n, end, kv_head,
                                   num_kv_heads, page_size, HEAD_DIM, BLOCK_N, False)
        s = tile_scores(qt, k, n, sm_scale_log2, False)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, False)
    for n0 in tl.range(clear, end, BLOCK_N):
        n = n0 + offs
        k, v, page = load_paged_kv(k_pool, v_pool, table, page, n, n < end, end, kv_head,
                                   num_kv_heads, page_size, HEAD_DIM, BLOCK_N, True)
        seen = n[None, :] < row_end[:, None]
        if LANE:
            seen = seen & walks[:, None]
        if DRAFT:
            seen = seen & draft_allows(n[None, :], draft_start[:, None], draft_allowed[:, None])
        s = tl.where(seen, tl.dot(qt, tl.trans(k)) * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, True)
    return m_i, l_i, acc


@triton.jit
def read_by_every_row(row_ok, row_end, draft_start, table_tokens, DRAFT: tl.constexpr):
    """How many of a sequence's first tokens every row of a tile reads (:func:`attend_rows`'s
    rows, ``table_tokens`` where none is ``row_ok``): up to its shortest row's end and, with
    ``DRAFT``, its first draft token."""
    ends = row_end
    if DRAFT:
        ends = tl.minimum(ends, draft_start)
    return tl.min(tl.where(row_ok, ends, table_tokens), 0)


@triton.jit
def load_paged_kv(k_pool, v_pool, table, page, n, n_ok, end, kv_head, num_kv_heads, page_size,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The K and V rows of tokens ``n`` of a paged sequence (:func:`load_kv`), ``page`` their
    page ids, and the next tile's page ids (tokens ``n + BLOCK_N`` below ``end``): loaded one
    step ahead, so that the table is not a dependent round trip before each K/V load."""
    kv_rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv_head
    k, v = load_kv(k_pool, v_pool, kv_rows, n_ok, HEAD_DIM, MASKED)
    ahead = n + BLOCK_N
    return k, v, tl.load(table + ahead // page_size, mask=ahead < end, other=0)


@triton.jit
def draft_window(draft_masks, row, ok, end, DRAFT: tl.constexpr):
    """Row ``row``'s draft mask as (first draft token, allowed bits): its last
    ``draft_masks[row, 0]`` tokens before ``end``; none without ``DRAFT`` (unused). ``row``,
    ``ok`` and ``end`` may be a tile's, one per tile row."""
    draft_start = end
    draft_allowed = tl.zeros_like(end).to(tl.int64)
    if DRAFT:
        mask = draft_masks + row.to(tl.int64) * 2
        draft_start = end - tl.load(mask, mask=ok, other=0).to(tl.int32)
        draft_allowed = tl.load(mask + 1, mask=ok, other=0)
    return draft_start, draft_allowed


@triton.jit
def draft_allows(n, draft_start, draft_allowed):
    """Whether tokens ``n`` may be read: before ``draft_start``, or a draft token whose bit of
    ``draft_allowed`` (bit k: token ``draft_start + k``, k < 64) is set."""
    k = n - draft_start
    bit = (draft_allowed >> tl.minimum(tl.maximum(k, 0), 63).to(tl.int64)) & 1
    return (k < 0) | (bit != 0)


@triton.jit
def attend_runs(qt, k_pool, v_pool, table, table_tokens, kv_head, num_kv_heads, page_size, start,
                split, end, sm_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, RUNS: tl.constexpr, TMA: tl.constexpr):
    """:func:`attend` over a range the caller vouches lies in ``RUNS`` runs of consecutive
    slots (its pages follow one another): [start, end) (``split`` unused), or, with ``RUNS``
    2, [start, split) then [split, end) (a root folded into a child: its pages, then the
    child's; H100: ft_1,4,16,512/q32kv8's partial launch). Each run
    is :func:`attend_run`. ``TMA``: the pools are TMA descriptors of [slots, KV heads x
    HEAD_DIM] (:func:`load_kv`)."""
    m_i, l_i, acc = no_keys(BLOCK_M, HEAD_DIM)
    # The narrow tile's loop is faster masked in every step (H100).
    if RUNS == 2:
        m_i, l_i, acc = attend_run(m_i, l_i, acc, qt, k_pool, v_pool, table, table_tokens,
                                   kv_head, num_kv_heads, page_size, start, split,
                                   sm_scale_log2, HEAD_DIM, BLOCK_N, BLOCK_M >= 64, TMA)
        start = split
    return attend_run(m_i, l_i, acc, qt, k_pool, v_pool, table, table_tokens, kv_head,
                      num_kv_heads, page_size, start, end, sm_scale_log2, HEAD_DIM, BLOCK_N,
                      BLOCK_M >= 64, TMA)


@triton.jit
def attend_run(m_i, l_i, acc, qt, k_pool, v_pool, table, table_tokens, kv_head, num_kv_heads,
               page_size, start, end, sm_scale_log2, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, WHOLE_TILES_UNMASKED: tl.constexpr, TMA: tl.constexpr):
    """:func:`attend` over a range whose slots are consecutive in the pool, continuing the
    online-softmax state (m_i, l_i, acc): token ``n`` is slot ``first slot + n - start``, one
    page id for the whole range and no per-token page arithmetic. With
    ``WHOLE_TILES_UNMASKED`` whole tiles run unmasked and the last, partial tile (if any) is
    one masked step after the loop (H100: the 64-row tile's compute-bound roots ~10% faster;
    the 16-row tile's launches 5-12% slower); without, every step is
    masked."""
    offs = tl.arange(0, BLOCK_N)
    first = tl.load(table + start // page_size, mask=start < table_tokens, other=0)
    slot0 = first.to(tl.int64) * page_size + start % page_size - start
    if WHOLE_TILES_UNMASKED:
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in tl.range(start, whole_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(m_i, l_i, acc, qt, k_pool, v_pool, slot0, n0, offs,
                                        end, kv_head, num_kv_heads, sm_scale_log2, HEAD_DIM,
                                        False, TMA)
        if whole_end < end:
            m_i, l_i, acc = attend_tile(m_i, l_i, acc, qt, k_pool, v_pool, slot0, whole_end,
                                        offs, end, kv_head, num_kv_heads, sm_scale_log2,
                                        HEAD_DIM, True, TMA)
    else:
        for n0 in tl.range(start, end, BLOCK_N):
            m_i, l_i, acc = attend_tile(m_i, l_i, acc, qt, k_pool, v_pool, slot0, n0, offs,
                                        end, kv_head, num_kv_heads, sm_scale_log2, HEAD_DIM,
                                        True, TMA)
    return m_i, l_i, acc


@triton.jit
def attend_tile(m_i, l_i, acc, qt, k_pool, v_pool, slot0, n0, offs, end, kv_head,
                num_kv_heads, sm_scale_log2, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                TMA: tl.constexpr):
    """Tokens ``n0 + offs`` of a run of slots (token ``n`` is slot ``slot0 + n``) folded into
    the online-softmax state; ``MASKED``: some may lie past ``end`` (at least the first may
    not: no row is left empty)."""
    n = n0 + offs
    n_ok = n < end
    if TMA:
        k, v = load_kv_tile(k_pool, v_pool, slot0 + n0, kv_head, n_ok, HEAD_DIM, MASKED)
    else:
        k, v = load_kv(k_pool, v_pool, (slot0 + n) * num_kv_heads + kv_head, n_ok, HEAD_DIM,
                       MASKED)
    s = tile_scores(qt, k, n_ok, sm_scale_log2, MASKED)
    return online_softmax_step(m_i, l_i, acc, s, v, False)


@triton.jit
def load_kv(k_pool, v_pool, kv_rows, n_ok, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """The K and V rows ``kv_rows`` of the pools (with ``MASKED``, zeros where not ``n_ok``)."""
    kv_off = kv_rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        return (tl.load(k_pool + kv_off, mask=n_ok[:, None], other=0.0),
                tl.load(v_pool + kv_off, mask=n_ok[:, None], other=0.0))
    return tl.load(k_pool + kv_off), tl.load(v_pool + kv_off)


@triton.jit
def load_kv_tile(k_desc, v_desc, slot, kv_head, n_ok, HEAD_DIM: tl.constexpr,
                 MASKED: tl.constexpr):
    """:func:`load_kv` of the consecutive slots from ``slot`` through TMA descriptors of the
    pools as [slots, KV heads x HEAD_DIM] (one tile of ``k_desc``'s block shape each). The
    rows past the pool read as zeros, but those past ``end`` inside it hold other ranges'
    values, NaN maybe: with ``MASKED`` V's are zeroed, since a zero weight times NaN is NaN (K's
    scores are masked by :func:`tile_scores`)."""
    k = k_desc.load([slot.to(tl.int32), kv_head * HEAD_DIM])
    v = v_desc.load([slot.to(tl.int32), kv_head * HEAD_DIM])
    if MASKED:
        v = tl.where(n_ok[:, None], v, 0.0)
    return k, v


@triton.jit
def tile_scores(qt, k, n_ok, sm_scale_log2, MASKED: tl.constexpr):
    """The base-2 scores of ``qt`` against the key tile ``k`` (with ``MASKED``, -inf where not
    ``n_ok``)."""
    s = tl.dot(qt, tl.trans(k)) * sm_scale_log2
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def attend_lanes(m_i, l_i, acc, qt, row_lane, k_pool, v_pool, tables, start, end,
                 tokens_per_lane, kv_head, num_kv_heads, page_size, sm_scale_log2,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, draft_start=0, draft_allowed=0,
                 DRAFT: tl.constexpr = False):
    """``attend`` for a tile whose rows belong to several sequences (*lanes*), continuing the
    online-softmax state (m_i, l_i, acc) (:func:`no_keys` to start afresh): row ``r`` is lane
    ``row_lane[r]``'s. Token ``t`` of each KV tile is lane ``t // tokens_per_lane``'s;
    ``tables``, ``start`` and ``end`` are per token: its lane's block table row and range (an
    empty range for a lane without a sequence). Each step loads ``tokens_per_lane`` tokens of
    every lane's range, a row sees its own lane's keys only, and the loop runs until the
    longest range ends; a row that has seen no key stays (-inf, 0, 0). With ``DRAFT`` each
    token's lane's draft (``draft_start``, ``draft_allowed``, per token) is read as
    :func:`draft_allows` allows."""
    t = tl.arange(0, BLOCK_N)
    own_lane = row_lane[:, None] == (t // tokens_per_lane)[None, :]
    n = start + t % tokens_per_lane
    page = tl.load(tables + n // page_size, mask=n < end, other=0)  # one step ahead, as attend
    for _ in tl.range(0, tl.cdiv(tl.max(end - start, 0), tokens_per_lane)):
        n_ok = n < end
        if DRAFT:
            n_ok = n_ok & draft_allows(n, draft_start, draft_allowed)
        kv_rows = (page.to(tl.int64) * page_size + n % page_size) * num_kv_heads + kv_head
        k, v = load_kv(k_pool, v_pool, kv_rows, n_ok, HEAD_DIM, True)
        n += tokens_per_lane
        page = tl.load(tables + n // page_size, mask=n < end, other=0)
        s = tl.dot(qt, tl.trans(k)) * sm_scale_log2
        s = tl.where(own_lane & n_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, True)
    return m_i, l_i, acc


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, ROWS_MAY_BE_EMPTY: tl.constexpr):
    """One KV tile folded into the running (row max in base 2, row sum, output): ``s`` its
    scores in base 2 (masked keys -inf), ``v`` its values. With ``ROWS_MAY_BE_EMPTY`` a row
    that has seen only masked keys stays (-inf, 0, 0); without, every row must have a key in
    the first tile (else its max is -inf and exp2 gives NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROWS_MAY_BE_EMPTY:
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        ref = m_new
    alpha = tl.exp2(m_i - ref)
    p = tl.exp2(s - ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def normalise(m_i, l_i, acc):
    """(output, natural-log LSE) of ``attend``'s result; an empty range gives (0, -inf)."""
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
    return acc / safe_l[:, None], lse


@triton.jit
def merge_partial(m, denom, acc, lse, part):
    """Fold one partial (``part`` normalised, weight exp(lse)) into a running log-sum-exp
    merge state: ``m`` the largest LSE so far, ``acc``/``denom`` the output scaled by
    exp(-m). Rows that have seen only empty partials stay (-inf, 0, 0), never NaN."""
    m_new = tl.maximum(m, lse)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - ref)
    w = tl.exp(lse - ref)
    return m_new, denom * scale + w, acc * scale[:, None] + part * w[:, None]


@triton.jit
def fold_partials(partial_out, partial_lse, base, stride, lo, hi,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """The log-sum-exp merge of one row's partials ``lo <= s < hi`` (``partial_lse[base + s *
    stride]``, normalised outputs ``partial_out[base + s * stride, :]``), BLOCK_S per step:
    the merged output ``[HEAD_DIM]``. No partial, or only empty ones (lse -inf), gives zeros,
    never NaN."""
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < hi
        entry = base + s.to(tl.int64) * stride
        lse = tl.load(partial_lse + entry, mask=ok, other=float("-inf"))
        part = tl.load(partial_out + entry[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None],
                       other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: exp() gives 0
        w = tl.exp(lse - ref)
        scale = tl.exp(m - ref)
        denom = denom * scale + tl.sum(w, 0)
        acc = acc * scale + tl.sum(part * w[:, None], 0)
        m = m_new
    return acc / tl.where(denom > 0, denom, 1.0)
