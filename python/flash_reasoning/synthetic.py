"""Random paged-KV problems for tests, benchmarks and the demo (one generator for all)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    q: torch.Tensor             # [num_seqs, num_qo_heads, head_dim]
    k_pool: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor      # int32 [num_seqs]


def paged_problem(seq_lens: list[int], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int = 16, dtype=torch.float16, device="cpu", seed: int = 0,
                  spare_blocks: int = 3) -> PagedProblem:
    """Independent sequences whose blocks are scattered over the pool in random order.

    Table entries past a sequence's last block point at random blocks too, so a kernel that
    reads past a length reads wrong data rather than zeros.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in seq_lens) if seq_lens else 1)
    num_blocks = len(seq_lens) * max_blocks + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_pool = torch.randn(shape, generator=gen, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = order[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    q = torch.randn(len(seq_lens), num_qo_heads, head_dim, generator=gen, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedProblem(q.to(dtype), k_pool, v_pool, tables, lens)
