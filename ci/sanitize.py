"""Runs every kernel at least once on edge-shaped trees, for compute-sanitizer (ci/sanitize.sh).

Kernels: append_kv (writes, decode steps, and the zeroing copy-on-write needs), the block
copies of copy-on-write, tree_partial (both tiles, closed and open items, paged and as one or
two runs of slots, through TMA descriptors at head_dim 128 and 256 on sm90), tree_final (one
branch per program, packed, packed heads first over 4 KB token rows, and packed with shared
ranges; under draft masks too) and tree_merge (plans of both merge modes), tree_queries (query
tiles), paged_decode unsplit and split (alone, and as the one launch of a plan with no
partials), merge_splits. Trees: branches of length 0 and 1, exact block multiples, forks at 0
and inside blocks, decode steps over shared partial blocks, 1024 branches, and 0-40 queries per
branch (causal and under draft masks; as tree plans with and without folded leaves, and as
query tiles). Every result is checked against the float64 reference; exits 1 on a wrong one.

Every buffer a kernel may read is initialised, so initcheck reports only real reads of
uninitialised memory: the pools' data blocks are poisoned with NaN first (a read of a slot
no branch wrote would also make the result NaN), outputs are poisoned with NaN; the plans'
partial buffers are left as allocated (the partial kernels must write every entry the final
kernels read).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch

from flash_reasoning import PhysicalKVAllocator, TreeAttentionPlan, reference, runtime
from flash_reasoning.ops.paged_decode import decode_launches
from flash_reasoning.planner import PlanOptions
from flash_reasoning.tools.synthetic import random_kv

BLOCK = 16
DEVICE = "cuda"


def poisoned_allocator(num_blocks, kv_heads, head_dim, dtype, layers=1) -> PhysicalKVAllocator:
    alloc = PhysicalKVAllocator(num_blocks, BLOCK, kv_heads, head_dim, num_layers=layers,
                                dtype=dtype, device=DEVICE)
    for pool in alloc.k_pools + alloc.v_pools:
        pool[1:].fill_(float("nan"))  # block 0 is the zero block
    return alloc


def write(alloc, gen, branch, n, start=0):
    for layer in range(alloc.num_layers):
        alloc.write(branch, layer, *random_kv(alloc, gen, n), start=start)


def decode_step(alloc, gen, ids):
    """reserve + append in every layer: copies each shared partial block first."""
    step = alloc.reserve(ids)
    for layer in range(alloc.num_layers):
        alloc.append(step, layer, *random_kv(alloc, gen, len(ids)))


def edge_tree(dtype, kv_heads, head_dim):
    """Empty branches, length 1, block multiples, forks at 0 and inside blocks, two
    decode steps; the two layers written alike."""
    gen = torch.Generator().manual_seed(0)
    alloc = poisoned_allocator(256, kv_heads, head_dim, dtype, layers=2)
    root = alloc.alloc_branch(0).branch_id
    write(alloc, gen, root, 4 * BLOCK + 5)
    ids = [root, alloc.alloc_branch(0).branch_id]                           # length 0
    one = alloc.alloc_branch(0).branch_id
    write(alloc, gen, one, 1)                                               # length 1
    ids.append(one)
    for position, extra in ((0, 0), (0, 1), (0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, 0),
                            (BLOCK + 3, 20), (4 * BLOCK + 5, 2 * BLOCK - 5)):
        kid = alloc.alloc_branch(position, parent_branch_id=root,
                                 fork_position=position).branch_id           # at 0 / inside
        write(alloc, gen, kid, extra, start=position)
        ids.append(kid)
    decode_step(alloc, gen, ids[2:])     # the empty ones stay empty
    decode_step(alloc, gen, ids[2:])
    return alloc, ids


def wide_tree(count=1024):
    """``count`` branches under a 64-token root: empty, length 1, block multiples, forks at 0
    and inside blocks; then one decode step over all of them."""
    gen = torch.Generator().manual_seed(1)
    alloc = poisoned_allocator(2 * count + 64, 8, 128, torch.float16)
    root = alloc.alloc_branch(0).branch_id
    write(alloc, gen, root, 4 * BLOCK)
    ids = []
    for i in range(count):
        position = (0, 1, BLOCK, 4 * BLOCK, 37)[i % 5]
        kid = alloc.alloc_branch(position, parent_branch_id=root,
                                 fork_position=position).branch_id
        write(alloc, gen, kid, (0, 1, BLOCK, 2 * BLOCK, 5)[i % 5], start=position)
        ids.append(kid)
    decode_step(alloc, gen, ids[1::2])
    return alloc, ids


def deep_tree():
    """Three levels of 2, 4 and 8 nodes of 13 tokens (ending inside blocks, as do the forks),
    then 4 leaves of 9 under each level-3 node; one decode step over all 32 leaves. Its flat
    plans' packed programs read their lanes' shared ranges once (the COMMON final kernel)."""
    gen = torch.Generator().manual_seed(3)
    alloc = poisoned_allocator(160, 8, 128, torch.float16)
    level = [alloc.alloc_branch(0).branch_id]
    write(alloc, gen, level[0], 13)
    for depth, (children, tokens) in enumerate(((2, 13), (2, 13), (2, 13), (4, 9)), start=1):
        below = []
        for parent in level:
            for _ in range(children):
                kid = alloc.alloc_branch(13 * depth, parent_branch_id=parent).branch_id
                write(alloc, gen, kid, tokens, start=13 * depth)
                below.append(kid)
        for parent in level:
            alloc.free_branch(parent)
        level = below
    decode_step(alloc, gen, level)
    return alloc, level


def shared_prefix_tree(leaves, broken=False, head_dim=128):
    """A 600-token root under ``leaves`` leaves of 40 tokens: computed once for all of them, in
    the tile the planner picks (at head_dim 256 with 64-token chunks, 8 leaves take the 64-row
    tile, which sm90 loads through TMA descriptors). ``broken``: another branch takes a block
    while the root is written, so the root's pages break once (at token 304) and the items
    across it take the two-run kernels."""
    gen = torch.Generator().manual_seed(2)
    alloc = poisoned_allocator(64 + 4 * leaves, 8, head_dim, torch.float16)
    root = alloc.alloc_branch(0).branch_id
    write(alloc, gen, root, 300)
    if broken:
        write(alloc, gen, alloc.alloc_branch(0).branch_id, 1)
    write(alloc, gen, root, 300, start=300)
    ids = [alloc.alloc_branch(600, parent_branch_id=root).branch_id for _ in range(leaves)]
    for kid in ids:
        write(alloc, gen, kid, 40, start=600)
    alloc.free_branch(root)
    return alloc, ids


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checks = 0
        self.tiles: set[int] = set()  # tree_partial tiles (BLOCK_M) that ran
        self.runs: set[tuple[int, int]] = set()  # (tile, runs of slots) of contiguous ones
        self.orders: set[bool] = set()  # partial launches' heads_first, of the plans that ran
        self.final_orders: set[bool] = set()  # final launches' heads_first, likewise
        self.lanes: set[int] = set()  # branches per tree_final program, of the plans that ran
        self.decode_plans = 0  # plans with no partials: one paged_decode launch
        self.shared_plans = 0  # plans whose packed programs read a shared range once
        self.tma_head_dims: set[int] = set()  # head_dims of partial launches through TMA
        self.query_tile_plans = 0  # several-query plans run as query tiles (tree_queries)

    def __call__(self, what: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        if out.is_cuda:
            torch.cuda.synchronize()
        err = reference.relative_error(out, ref)
        ok = err < reference.TOLERANCE[out.dtype]
        self.checks += 1
        print(f"{'ok  ' if ok else 'FAIL'} {what}: relative error {err:.2e}", flush=True)
        if not ok:
            self.failures.append(what)


def queries(alloc, rows, group, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, group * alloc.num_kv_heads, alloc.head_dim, generator=gen)
    return q.to(alloc.dtype).to(DEVICE)


def draft_masks(q_lens):
    """Each branch's new tokens as a draft tree: query j sees itself and the earlier tokens of
    its parity (two interleaved chains); every third branch stays causal."""
    def mask(n):
        j, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (k <= j) & ((j - k) % 2 == 0)
    return [None if i % 3 == 2 else mask(n) for i, n in enumerate(q_lens)]


def check_tree(check: Checker, name: str, alloc, ids, group: int, chunks=(None,),
               merges=(None,), lanes=(None,), flat=None, q_lens=None, mask=None,
               tiles=(None,), folds=(None,)) -> None:
    """tree_attention in every layer (one plan per chunking, merge mode, final lanes, query
    tiles and folds; ``q_lens`` and ``mask`` as tree_attention's), then, with one query per
    branch, paged_decode over the same branches unsplit and split in four (the merge kernel)."""
    q = queries(alloc, sum(q_lens) if q_lens else len(ids), group)
    refs = [reference.tree_attention(q, alloc, ids, layer, q_lens=q_lens, mask=mask)
            for layer in range(alloc.num_layers)]
    for chunk, merge, lane, tile, fold in itertools.product(chunks, merges, lanes, tiles, folds):
        options = PlanOptions(target_chunk=chunk, separate_merge=merge, final_lanes=lane,
                              flat=flat, query_tiles=tile, sequence_folds=fold)
        plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens, mask=mask,
                                 _options=options)
        check.query_tile_plans += len(plan.arrays.query_tiles) > 0
        check.tiles.update(plan.arrays.items)
        check.runs.update((tile, runs) for tile, runs in plan.slot_runs.items() if runs)
        check.orders.update(plan.arrays.heads_first.values())
        check.shared_plans += plan.arrays.has_common
        check.tma_head_dims.update(spec.key["HEAD_DIM"] for spec in launch_specs(plan)
                                   if spec.key.get("TMA"))
        if plan.arrays.as_paged_decode:
            check.decode_plans += 1
        elif not plan.arrays.separate_merge:
            check.lanes.add(plan.arrays.final_lanes)
            check.final_orders.add(plan.arrays.final_heads_first)
        for layer in range(alloc.num_layers):
            out = plan.run(q, layer, torch.full_like(q, float("nan")))
            check(f"{name}: tree_attention layer {layer}, chunk {chunk}, separate merge "
                  f"{plan.arrays.separate_merge}, final lanes {plan.arrays.final_lanes}, "
                  f"partial tiles {sorted(plan.arrays.items)}, query tiles "
                  f"{len(plan.arrays.query_tiles)}", out, refs[layer])
    if q_lens is not None or not q.is_cuda:  # paged_decode: one query a branch, on a GPU
        return
    tables, lengths = alloc.block_tables(ids)
    device = q.device
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        runtime.run(decode_launches(q, alloc.k_pools[0], alloc.v_pools[0], tables, lengths, out,
                                    1 / math.sqrt(alloc.head_dim), runtime.arch_of(device.index),
                                    runtime.num_sms(device.index), num_splits=splits), device)
        check(f"{name}: paged_decode, {splits} splits", out, refs[0])


def launch_specs(plan):
    """The Spec of each of a plan's launches (its kernels by manifest name)."""
    return [runtime.spec_of(plan.arch, name) for name in plan.kernels]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, default=1024, help="of the wide tree")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sanitize.py: no CUDA device")
        return 2
    check = Checker()
    for dtype, kv_heads, head_dim, group in ((torch.float16, 8, 128, 4),
                                             (torch.bfloat16, 2, 64, 1),
                                             (torch.float16, 2, 256, 8),
                                             (torch.float16, 16, 128, 2)):  # 4 KB rows
        name = f"edges {str(dtype)[6:]} d{head_dim} kv{kv_heads} group {group}"
        check_tree(check, name, *edge_tree(dtype, kv_heads, head_dim), group, chunks=(None, 16),
                   merges=(False, True), lanes=(None, 16 // group, 32 // group))
    for leaves, broken in itertools.product((4, 8), (False, True)):
        check_tree(check, f"shared prefix x{leaves}{', broken' if broken else ''}",
                   *shared_prefix_tree(leaves, broken), 4, chunks=(None, 64),
                   merges=(False, True))
    for broken in (False, True):
        check_tree(check, f"shared prefix x8 d256{', broken' if broken else ''}",
                   *shared_prefix_tree(8, broken, head_dim=256), 4, chunks=(None, 64))
    check_tree(check, f"{args.branches} branches", *wide_tree(args.branches), 4)
    check_tree(check, "deep, flat", *deep_tree(), 4, lanes=(None, 4, 8), flat=True)
    for head_dim, group in ((128, 4), (64, 7)):
        alloc, ids = shared_prefix_tree(8, broken=True, head_dim=head_dim)
        q_lens = [0, 1, 4, 40, 7, 16, 33, 2]  # 40: every token of its leaf is new
        for mask in (None, draft_masks(q_lens)):
            check_tree(check, f"several queries d{head_dim} group {group}"
                       f"{', draft masks' if mask else ''}", alloc, ids, group, q_lens=q_lens,
                       mask=mask, merges=(False, True), tiles=(False, True), folds=(False, True))
    print(f"sanitize.py: {check.checks} checks, {len(check.failures)} wrong; tree_partial "
          f"tiles run: {sorted(check.tiles)} (contiguous, as (tile, runs): "
          f"{sorted(check.runs)}; heads first: {sorted(check.orders)}); "
          f"tree_final lanes run: {sorted(check.lanes)} (heads first: "
          f"{sorted(check.final_orders)}); plans run as a paged decode: "
          f"{check.decode_plans}; plans with shared ranges: {check.shared_plans}; "
          f"partial launches through TMA at head_dim: {sorted(check.tma_head_dims)}; "
          f"several-query plans as query tiles: {check.query_tile_plans}",
          flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())

