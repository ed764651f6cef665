"""The float64 reference: what every kernel and the PyTorch path are checked against.

Deliberately simple (one sequence at a time, float64 throughout). Tests and benchmarks import
it; nothing else computes attention this way.
"""
from __future__ import annotations

import math

import torch


def gather_sequence(pool: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0..length-1`` of one sequence from a paged pool -> ``[length, kv_heads, dim]``."""
    page_size, num_kv_heads, head_dim = pool.shape[1:]
    pos = torch.arange(length, device=pool.device)
    slots = table_row.to(pool.device).long()[pos // page_size] * page_size + pos % page_size
    return pool.reshape(-1, num_kv_heads, head_dim)[slots]


def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     sm_scale: float | None = None) -> torch.Tensor:
    """Softmax attention of one query token per sequence, in float64.

    ``q`` is ``[n, qo_heads, dim]``; ``keys[i]``/``values[i]`` are ``[len_i, kv_heads, dim]``.
    Query head h reads KV head ``h // (qo_heads // kv_heads)`` (GQA). A sequence of length 0
    gives a zero row.
    """
    num_qo_heads, head_dim = q.shape[1:]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.shape[0] == 0:
            continue
        group = num_qo_heads // k.shape[1]
        k = k.cpu().double().repeat_interleave(group, dim=1)
        v = v.cpu().double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].cpu().double(), k) * scale
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def query_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    q_lens: list[int], sm_scale: float | None = None,
                    masks: list | None = None) -> torch.Tensor:
    """Attention of several query tokens per sequence, in float64: sequence ``i``'s last
    ``q_lens[i]`` positions are its new tokens, and its query ``j`` (row
    ``sum(q_lens[:i]) + j`` of ``q``) attends to its positions below
    ``len_i - q_lens[i] + j + 1`` (causal), or, with ``masks[i]`` (bool ``[q_lens[i],
    q_lens[i]]``, None: causal), to the positions before the new tokens and to new token ``k``
    where ``masks[i][j, k]``. A query with nothing to attend gives zeros. One query per
    sequence is :func:`decode_attention`."""
    num_qo_heads, head_dim = q.shape[1:]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    first = 0
    for i, (k, v, n) in enumerate(zip(keys, values, q_lens)):
        rows, first = slice(first, first + n), first + n
        if n == 0:
            continue
        length, group = k.shape[0], num_qo_heads // k.shape[1]
        k = k.cpu().double().repeat_interleave(group, dim=1)
        v = v.cpu().double().repeat_interleave(group, dim=1)
        allowed = torch.arange(length) < length - n  # [n, length]: the tokens before the new
        allowed = allowed.expand(n, length).clone()
        new = torch.ones(n, n, dtype=torch.bool).tril() if masks is None or masks[i] is None \
            else torch.as_tensor(masks[i]).cpu().bool()
        allowed[:, length - n:] = new
        scores = torch.einsum("jhd,lhd->hjl", q[rows].cpu().double(), k) * scale
        scores.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill(~allowed.any(1)[:, None], 0.0)
        out[rows] = torch.einsum("hjl,lhd->jhd", probs, v)
    return out


def paged_decode(q, k_pool, v_pool, block_tables, seq_lens, sm_scale=None) -> torch.Tensor:
    """Reference for :func:`flash_reasoning.paged_decode`."""
    return decode_attention(q, *gather_paths(k_pool, v_pool, block_tables, seq_lens), sm_scale)


def gather_paths(k_pool, v_pool, block_tables, seq_lens):
    """Each sequence's keys and values (:func:`gather_sequence`) -> two lists."""
    lengths = [int(n) for n in seq_lens.cpu()]
    return ([gather_sequence(k_pool, block_tables[i], n) for i, n in enumerate(lengths)],
            [gather_sequence(v_pool, block_tables[i], n) for i, n in enumerate(lengths)])


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf (never passes)."""
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


#: Tolerances of DESIGN.md: relative error allowed per dtype.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2,
             torch.float32: 2e-3}  # the CPU path's float32: held to fp16's bound


def tree_attention(q, allocator, branch_ids, layer: int = 0, sm_scale=None,
                   q_lens=None, mask=None) -> torch.Tensor:
    """Reference for :func:`flash_reasoning.tree_attention`: each branch's whole path read
    through its own block table, as if nothing were shared (``q_lens`` and ``mask``:
    :func:`query_attention`)."""
    tables, lengths = allocator.block_tables(branch_ids)
    keys, values = gather_paths(allocator.k_pools[layer], allocator.v_pools[layer], tables,
                                lengths)
    if q_lens is None:
        return decode_attention(q, keys, values, sm_scale)
    return query_attention(q, keys, values, [int(n) for n in q_lens], sm_scale, mask)
