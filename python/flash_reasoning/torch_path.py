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
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # empty sequence: all -inf -> 0
    result = torch.einsum("nhgl,nlhd->nhgd", probs, values)
    out.copy_(result.reshape(num_seqs, num_qo_heads, head_dim))
