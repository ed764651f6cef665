"""Random paged-KV problems for tests, benchmarks and the demo (one generator for all)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocator import PhysicalKVAllocator


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


def random_kv(allocator, gen: torch.Generator, num_tokens: int):
    """``num_tokens`` random K and V rows in the allocator's dtype (on its device), drawn on
    the generator's device (a CUDA generator fills a large tree's pools in moments)."""
    shape = (num_tokens, allocator.num_kv_heads, allocator.head_dim)
    k = torch.randn(shape, generator=gen, device=gen.device)
    v = torch.randn(shape, generator=gen, device=gen.device)
    return (k.to(allocator.dtype).to(allocator.device),
            v.to(allocator.dtype).to(allocator.device))


def random_branches(allocator, num_branches: int, max_depth: int, max_tokens: int,
                    seed: int = 0, roots: int = 1) -> list[int]:
    """Grow a random forest of ``num_branches`` live branches in ``allocator`` and return
    their ids (inner ones included: some branches are prefixes of others).

    Each new branch forks a random branch of depth < ``max_depth`` at a random position
    (often inside a block, sometimes 0 or the parent's end) and writes 0..``max_tokens``
    random tokens in every layer; the first ``roots`` branches are roots.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda high: int(torch.randint(0, high + 1, (1,), generator=gen))  # noqa: E731
    depth: dict[int, int] = {}
    for i in range(num_branches):
        parents = [b for b, d in depth.items() if d < max_depth]
        if i < roots or not parents:
            branch, position, level = allocator.alloc_branch(0), 0, 0
        else:
            parent = parents[rand(len(parents) - 1)]
            position = rand(allocator.length(parent))
            branch = allocator.alloc_branch(position, parent_branch_id=parent,
                                            fork_position=position)
            level = depth[parent] + 1
        depth[branch.branch_id] = level
        count = rand(max_tokens)
        for layer in range(allocator.num_layers):
            k, v = random_kv(allocator, gen, count)
            allocator.write(branch.branch_id, layer, k, v, start=position)
    return list(depth)


#: The long node of :func:`long_narrow_node`: planned with ``target_chunk`` of this many
#: tokens, it is one work item per KV head.
LONG_NODE_TOKENS = 8192


def long_narrow_node(device) -> tuple:
    """A tree whose narrow-tile partial launch runs far longer than its wide-tile one (when
    planned with ``target_chunk=LONG_NODE_TOKENS, flat=False``): a node of LONG_NODE_TOKENS
    under two branches (the first launch: one item per KV head) and a 256-token root under all
    64 (the second). Returns (allocator, leaves): 8 KV heads of 128, 16-token blocks."""
    alloc = PhysicalKVAllocator(700, 16, 8, 128, device=device)
    gen = torch.Generator().manual_seed(3)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, 256))
    node = alloc.alloc_branch(256, root).branch_id
    alloc.write(node, 0, *random_kv(alloc, gen, LONG_NODE_TOKENS), start=256)
    leaves = [b.branch_id for b in alloc.alloc_branches(2, 256 + LONG_NODE_TOKENS, node)]
    leaves += [b.branch_id for b in alloc.alloc_branches(62, 256, root)]
    for leaf in leaves:
        alloc.write(leaf, 0, *random_kv(alloc, gen, 16), start=alloc.length(leaf))
    return alloc, leaves


def draft_tree_mask(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft tree's mask, bool ``[num_tokens, num_tokens]``: token ``j``'s parent is
    an earlier token (or the context, for the roots), and row ``j`` allows its ancestors and
    itself, as speculative-tree verification reads a draft."""
    mask = torch.eye(num_tokens, dtype=torch.bool)
    for j in range(1, num_tokens):
        parent = int(torch.randint(-1, j, (), generator=gen))  # -1: a root under the context
        if parent >= 0:
            mask[j] |= mask[parent]
    return mask
