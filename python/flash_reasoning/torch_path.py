"""The plain PyTorch path: the same operations on CPU tensors (float32 math, vectorised).

Slow and exact enough to use the library without a GPU; checked against ``reference``.
"""
from __future__ import annotations

import torch


def paged_decode(q, k_pool, v_pool, block_tables, seq_lens, sm_scale: float,
                 out: torch.Tensor) -> None:
    num_seqs, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_qo_heads // num_kv_heads
    lengths = seq_lens.long()
    max_len = int(lengths.max()) if num_seqs else 0
    pos = torch.arange(max_len, device=q.device)
    slots = block_tables.long()[:, pos // page_size] * page_size + pos % page_size
    keys = k_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()      # [n, L, kvh, d]
    values = v_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()
    queries = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,nlhd->nhgl", queries, keys) * sm_scale
    padding = pos[None, :] >= lengths[:, None]                            # [n, L]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # An empty sequence's scores are all -inf: zero weights (softmax gives NaN there). NaN read
    # from q or K stays NaN, as in the kernels and tree_attention.
    probs.masked_fill_((lengths == 0)[:, None, None, None], 0.0)
    result = torch.einsum("nhgl,nlhd->nhgd", probs, values)
    out.copy_(result.reshape(num_seqs, num_qo_heads, head_dim))


def tree_attention(arrays, q, k_pool, v_pool, block_tables, seq_lens, sm_scale: float,
                   out: torch.Tensor) -> None:
    """Executes a :class:`~flash_reasoning.planner.PlanArrays` chunk by chunk (partials, open
    chunks to their row's length now; then each branch's final range, its program's shared
    range included, none when the plan merges separately, merged with its partials), as the
    kernels do."""
    num_qo_heads, head_dim = q.shape[1:]
    partial_out = torch.zeros(arrays.num_entries, num_qo_heads, head_dim)
    partial_lse = torch.full((arrays.num_entries, num_qo_heads), float("-inf"))
    order = torch.from_numpy(arrays.order).long()
    for c in range(arrays.chunk_start.size):
        rows = order[arrays.chunk_row_ptr[c]:arrays.chunk_row_ptr[c] + arrays.chunk_rows[c]]
        table_row = int(arrays.chunk_table_row[c])
        end = int(seq_lens[table_row]) if arrays.chunk_open[c] else int(arrays.chunk_end[c])
        first = arrays.chunk_entry0[c]
        slots = torch.from_numpy(arrays.entry_slot[first:first + arrays.chunk_rows[c]]).long()
        partial_out[slots], partial_lse[slots] = _attend(
            q[rows], k_pool, v_pool, block_tables[table_row], int(arrays.chunk_start[c]), end,
            sm_scale)
    starts = arrays.final_range_starts()  # a packed program's shared range included
    for b in range(q.shape[0]):
        final_start = int(seq_lens[b]) if arrays.separate_merge else int(starts[b])
        draft = None
        if arrays.draft_masks.size:  # its last tokens a draft, read as its bits allow
            tokens, allowed = (int(x) for x in arrays.draft_masks[b])
            draft = (int(seq_lens[b]) - tokens, allowed)
        own_out, own_lse = _attend(q[b:b + 1], k_pool, v_pool, block_tables[b], final_start,
                                   int(seq_lens[b]), sm_scale, draft)
        merged = slice(arrays.merge_ptr[b], arrays.merge_ptr[b + 1])
        lse = torch.cat([own_lse, partial_lse[merged]])                    # [parts, heads]
        weight = torch.softmax(lse, dim=0)
        weight.masked_fill_(lse.isneginf().all(0), 0.0)  # only empty parts: zeros, NaN kept
        out[b] = (weight[..., None] * torch.cat([own_out, partial_out[merged]])).sum(0)


def _attend(q, k_pool, v_pool, table, start: int, end: int, sm_scale: float, draft=None):
    """(normalised output, natural-log LSE) of ``q`` ``[rows, heads, dim]`` over tokens
    [start, end) of one paged sequence, in float32; an empty range gives (0, -inf).
    ``draft`` (draft start, allowed bits): the tokens from draft start on are read only where
    their bit (token ``draft start + k``: bit k) is set."""
    rows, num_qo_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    pos = torch.arange(start, max(start, end))
    if draft is not None:
        draft_start, allowed = draft
        k = pos - draft_start
        pos = pos[(k < 0) | (torch.tensor(allowed) >> k.clamp(0, 63) & 1).bool()]
    if not pos.numel():
        return (torch.zeros(rows, num_qo_heads, head_dim),
                torch.full((rows, num_qo_heads), float("-inf")))
    slots = table.long()[pos // page_size] * page_size + pos % page_size
    keys = k_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()      # [L, kvh, d]
    values = v_pool.reshape(-1, num_kv_heads, head_dim)[slots].float()
    queries = q.float().view(rows, num_kv_heads, -1, head_dim)
    scores = torch.einsum("rhgd,lhd->rhgl", queries, keys) * sm_scale
    lse = torch.logsumexp(scores, dim=-1)
    # Normalised by the weights' sum, as the kernels are, not by exp(-lse): where the scores are
    # large (1e8), float32's lse loses log(count) and exp(scores - lse) would not sum to 1.
    result = torch.einsum("rhgl,lhd->rhgd", torch.softmax(scores, dim=-1), values)
    return result.reshape(rows, num_qo_heads, head_dim), lse.reshape(rows, num_qo_heads)
