"""Writes the reference file that examples/cpp/tree_decode.cc checks itself against.

    python examples/cpp/make_reference.py reference.bin [--device cpu|cuda]

The tree: a 2048-token root shared by 64 branches of 64 tokens each (block_size 16, 32 query
heads, 8 KV heads, head_dim 128, float16), built with PhysicalKVAllocator from seeded random
data, then one decode step (one new token per branch). Expected outputs are the float64
reference (flash_reasoning.reference) stored as float32. The same seed gives the same bytes
on either device: the data is drawn on the CPU.

Block layout (tree_decode.cc builds its tables from it; this script asserts the allocator
placed every block there). R = root_tokens / block_size, L = ceil(leaf_tokens / block_size),
n = num_branches, f = first_block (1: block 0 is the allocator's zero block, never listed):
    column j <  R          -> f + j                             (the root, every branch)
    column j <  R + L      -> f + R + b * L + (j - R)           (branch b's own tokens)
    column j >= R + L      -> f + R + n * L + (j - R - L) * n + b   (blocks decoding adds)

File format (little-endian):
    header  HEADER below: magic, version, frDtype (1 = float16), the sizes, first_block and
            the relative-error tolerance (reference.TOLERANCE of the dtype)
    arrays  in this order, C-contiguous, no padding:
            k_pool, v_pool  dtype   [num_blocks, block_size, num_kv_heads, head_dim]
                                    (before the step)
            q               dtype   [num_branches, num_qo_heads, head_dim]
            expected        float32 [num_branches, num_qo_heads, head_dim]
            k_new, v_new    dtype   [num_branches, num_kv_heads, head_dim] (the step's token,
                                    position root_tokens + leaf_tokens of each branch)
            q_next          dtype   [num_branches, num_qo_heads, head_dim]
            expected_next   float32 [num_branches, num_qo_heads, head_dim] (after the step)
"""
from __future__ import annotations

import argparse
import struct

import torch

from flash_reasoning import PhysicalKVAllocator, reference
from flash_reasoning.tools.synthetic import random_kv

MAGIC = b"FRTDREF\0"
VERSION = 1
#: magic, then int32: version, dtype, num_branches, root_tokens, leaf_tokens, block_size,
#: num_qo_heads, num_kv_heads, head_dim, num_blocks, first_block; float32: tolerance.
HEADER = struct.Struct("<8s11if")
FR_FLOAT16 = 1

NUM_BRANCHES, ROOT_TOKENS, LEAF_TOKENS = 64, 2048, 64
BLOCK_SIZE, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 32, 8, 128
DTYPE = torch.float16
FIRST_BLOCK = 1  # the allocator's zero block comes first
SEED = 0


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def layout_block(branch: int, column: int) -> int:
    """The block of `column` in `branch`'s table: the formula of the docstring."""
    root, leaf = ROOT_TOKENS // BLOCK_SIZE, blocks_for(LEAF_TOKENS)
    if column < root:
        return FIRST_BLOCK + column
    if column < root + leaf:
        return FIRST_BLOCK + root + branch * leaf + column - root
    return FIRST_BLOCK + root + NUM_BRANCHES * leaf + (column - root - leaf) * NUM_BRANCHES + branch


def check_layout(allocator: PhysicalKVAllocator, ids: list[int]) -> None:
    tables, lengths = allocator.block_tables(ids)
    tables, lengths = tables.cpu().numpy(), lengths.cpu().numpy()
    for b, length in enumerate(lengths):
        expected = [layout_block(b, j) for j in range(blocks_for(int(length)))]
        actual = tables[b, :len(expected)].tolist()
        assert actual == expected, \
            f"branch {b}: the allocator placed {actual}, the layout says {expected}"


def build_tree(allocator: PhysicalKVAllocator, gen: torch.Generator) -> list[int]:
    """The root's tokens, then each branch's own, written in branch order."""
    root = allocator.alloc_branch(0).branch_id
    allocator.write(root, 0, *random_kv(allocator, gen, ROOT_TOKENS))
    branches = allocator.alloc_branches(NUM_BRANCHES, ROOT_TOKENS, root, ROOT_TOKENS)
    for branch in branches:
        allocator.write(branch.branch_id, 0, *random_kv(allocator, gen, LEAF_TOKENS),
                        start=ROOT_TOKENS)
    return [b.branch_id for b in branches]


def random_q(gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(NUM_BRANCHES, NUM_QO_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(device)


def expected(q: torch.Tensor, allocator: PhysicalKVAllocator, ids: list[int]) -> torch.Tensor:
    return reference.tree_attention(q, allocator, ids).to(torch.float32)


def raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def make(path: str, device: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    path_tokens = ROOT_TOKENS + LEAF_TOKENS
    step_blocks = NUM_BRANCHES * (blocks_for(path_tokens + 1) - blocks_for(path_tokens))
    num_blocks = (FIRST_BLOCK + ROOT_TOKENS // BLOCK_SIZE + NUM_BRANCHES * blocks_for(LEAF_TOKENS)
                  + step_blocks)
    allocator = PhysicalKVAllocator(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                                    device=device)
    ids = build_tree(allocator, gen)
    check_layout(allocator, ids)
    pools = [raw(allocator.k_pools[0]), raw(allocator.v_pools[0])]  # before the step appends
    q = random_q(gen, device)
    before = expected(q, allocator, ids)

    k_new, v_new = random_kv(allocator, gen, NUM_BRANCHES)
    allocator.append(ids, 0, k_new, v_new)
    check_layout(allocator, ids)
    q_next = random_q(gen, device)
    after = expected(q_next, allocator, ids)

    header = HEADER.pack(MAGIC, VERSION, FR_FLOAT16, NUM_BRANCHES, ROOT_TOKENS, LEAF_TOKENS,
                         BLOCK_SIZE, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, num_blocks, FIRST_BLOCK,
                         reference.TOLERANCE[DTYPE])
    arrays = [*pools, raw(q), raw(before), raw(k_new), raw(v_new), raw(q_next), raw(after)]
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            f.write(a)
    print(f"wrote {path}: {NUM_BRANCHES} branches of {ROOT_TOKENS} + {LEAF_TOKENS} tokens, "
          f"{num_blocks} blocks, {HEADER.size + sum(map(len, arrays))} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="the file to write, e.g. reference.bin")
    parser.add_argument("--device", default="cpu",
                        help="where the allocator lives (cpu or cuda); same bytes")
    args = parser.parse_args()
    make(args.output, args.device)


if __name__ == "__main__":
    main()
