"""tree_attention and TreeAttentionPlan: the kernels (interpreter on CPU, real on the GPU)
and the PyTorch path against the float64 reference; plan reuse, staleness, bad input."""
import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpu, interpreter, poisoned_like
from flash_reasoning import (
    PhysicalKVAllocator,
    StalePlan,
    TreeAttentionPlan,
    UnknownBranch,
    reference,
    runtime,
    tree_attention,
)
from flash_reasoning._core import CoreError
from flash_reasoning.ops.tree_attention import MAX_DRAFT_TOKENS
from flash_reasoning.planner import PlanOptions
from flash_reasoning.runtime import TensorMap
from flash_reasoning.specializations import (
    TREE_FINAL,
    TREE_ITEM_FIELDS,
    TREE_PARTIAL,
    TREE_QUERIES,
)
from flash_reasoning.tools.bench import case_allocator, load_cases
from flash_reasoning.tools.synthetic import (
    LONG_NODE_TOKENS,
    draft_tree_mask,
    long_narrow_node,
    random_branches,
    random_kv,
)
from flash_reasoning.tools.trees import build_branches, from_levels

DTYPES = [torch.float16, torch.bfloat16]


def forest(device, num_kv_heads=2, head_dim=64, dtype=torch.float16, branches=12, depth=4,
           tokens=40, seed=0, block_size=8, layers=1, roots=1):
    alloc = PhysicalKVAllocator(branches * (tokens // block_size + 3) + 8, block_size,
                                num_kv_heads, head_dim, num_layers=layers, dtype=dtype,
                                device=device)
    ids = random_branches(alloc, branches, depth, tokens, seed=seed, roots=roots)
    return alloc, ids


def queries(alloc, ids, num_qo_heads, seed=0, rows=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(ids) if rows is None else rows, num_qo_heads, alloc.head_dim,
                    generator=gen)
    return q.to(alloc.dtype).to(alloc.device)


def check(out, q, alloc, ids, layer=0, sm_scale=None, q_lens=None, mask=None):
    ref = reference.tree_attention(q, alloc, ids, layer, sm_scale, q_lens, mask)
    err = reference.relative_error(out, ref)
    assert err < reference.TOLERANCE[q.dtype], f"relative error {err}"


def interpret(alloc, ids, q, sm_scale=None, q_lens=None, mask=None, **plan_kw):
    from aot.interpret import run_interpreted
    plan = TreeAttentionPlan(alloc, ids, q.shape[1], sm_scale, q_lens, mask,
                             _options=PlanOptions(num_sms=4, arch="sm90", **plan_kw))
    out = poisoned_like(q)
    run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    return plan, out


# ---- the kernels in Triton's interpreter ------------------------------------------------------

@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (16, 1)])   # groups 1, 2, 4, 16
@pytest.mark.parametrize("separate", [False, True])
def test_kernels_interpreted(dtype, heads, separate):
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, tokens=200, seed=heads[0])
    q = queries(alloc, ids, heads[0])
    plan, out = interpret(alloc, ids, q, target_chunk=64, separate_merge=separate)
    assert plan.arrays.num_entries > 0           # partials and merges were exercised
    assert plan.arrays.separate_merge == separate
    check(out, q, alloc, ids)


@interpreter
@pytest.mark.parametrize("lanes", [1, 4])
def test_final_merges_many_partials_interpreted(lanes):
    """Final programs folding 2-7 partials a row (one after another, rows of unequal counts),
    in the one-branch and the packed kernel."""
    alloc = PhysicalKVAllocator(200, 8, 2, 64, device="cpu")
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(400).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, 400))
    ids = []
    for length, fork in ((440, 400), (410, 400), (300, 300), (120, 120)):
        ids.append(alloc.alloc_branch(length, parent_branch_id=root,
                                      fork_position=fork).branch_id)
        alloc.write(ids[-1], 0, *random_kv(alloc, gen, length - fork), start=fork)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=32, separate_merge=False,
                          final_lanes=lanes)
    counts = plan.arrays.merge_ptr[1:] - plan.arrays.merge_ptr[:-1]
    assert counts.max() > 4 and counts.min() < counts.max() and plan.arrays.final_lanes == lanes
    check(out, q, alloc, ids)


@interpreter
@pytest.mark.parametrize("separate", [False, True])
def test_flat_plan_interpreted(separate):
    """Every node folded: each branch reads its whole path through its own table."""
    alloc, ids = forest("cpu", num_kv_heads=2, tokens=200, seed=11)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, separate_merge=separate, flat=True)
    assert plan.arrays.stats["computed_nodes"] == 0
    assert plan.arrays.separate_merge == separate
    check(out, q, alloc, ids)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (16, 1)])
def test_decode_plan_interpreted(dtype, heads):
    """A flat plan with no split range has no partials: one launch of paged_decode's kernel
    over the plan's tables, each branch's whole path; after the branches grow too."""
    from aot.interpret import run_interpreted
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, tokens=40, seed=12)
    q = queries(alloc, ids, heads[0])
    plan, out = interpret(alloc, ids, q, flat=True)
    assert plan.arrays.as_paged_decode and plan.arrays.num_entries == 0
    assert [launch.spec.family for launch in plan.launches(q, None, None, None)] == [
        "paged_decode"]
    check(out, q, alloc, ids)
    alloc.append(ids, 0, *random_kv(alloc, torch.Generator().manual_seed(2), len(ids)))
    plan.refresh()
    out = poisoned_like(q)
    run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    check(out, q, alloc, ids)


@interpreter
def test_one_tile_plan_interpreted():
    """Every item in the wide tile: narrow final ranges fill a few of its rows."""
    alloc, ids = forest("cpu", num_kv_heads=2, tokens=200, seed=12)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, separate_merge=True, flat=False,
                          one_tile=True)
    assert set(plan.arrays.items) == {64} and plan.arrays.stats["computed_nodes"] > 0
    check(out, q, alloc, ids)


def shared_root(device, scattered=False, root_tokens=200, leaves=6, leaf_tokens=5,
                block_size=8, piece_blocks=3, num_kv_heads=2, head_dim=64):
    """A root of ``root_tokens`` under ``leaves`` leaves of ``leaf_tokens`` each, in a fresh
    pool: the root's pages are consecutive, or (``scattered``) interleaved with another
    branch's, written ``piece_blocks`` blocks at a time."""
    alloc = PhysicalKVAllocator(2 * (root_tokens // block_size) + leaves * 4 + 8, block_size,
                                num_kv_heads, head_dim, device=device)
    gen = torch.Generator().manual_seed(root_tokens + scattered)
    root = alloc.alloc_branch(0).branch_id
    other = alloc.alloc_branch(0).branch_id
    piece = piece_blocks * block_size if scattered else root_tokens
    for start in range(0, root_tokens, piece):
        alloc.write(root, 0, *random_kv(alloc, gen, min(piece, root_tokens - start)), start=start)
        if scattered:
            alloc.write(other, 0, *random_kv(alloc, gen, block_size), start=alloc.length(other))
    ids = [b.branch_id for b in alloc.alloc_branches(leaves, root_tokens, root)]
    for leaf in ids:
        alloc.write(leaf, 0, *random_kv(alloc, gen, leaf_tokens), start=root_tokens)
    return alloc, ids


@interpreter
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_contiguous_partials_interpreted(scattered, separate):
    """A shared root in consecutive pages runs the contiguous partial kernel (one run of
    slots, any page size), one whose pages are scattered the paged kernel; both match the
    reference. Final ranges (separate merge: their chunks) stay paged."""
    alloc, ids = shared_root("cpu", scattered)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False, separate_merge=separate)
    check(out, q, alloc, ids)
    partial = [spec.key for spec in launch_specs(plan) if spec.family == "tree_partial"]
    assert len(partial) == 1  # the root's chunks (and the final ranges' when separate)
    assert partial[0]["SLOT_RUNS"] == (not scattered and not separate)
    assert partial[0]["PAGE"] == 0  # 8-token pages are not compiled as a constant
    assert plan.slot_runs == {next(iter(plan.arrays.items)): partial[0]["SLOT_RUNS"]}


@interpreter
@pytest.mark.parametrize("num_qo_heads,block_m,block_n", [(8, 64, 64), (2, 16, 128)])
@pytest.mark.parametrize("root_tokens,lengths", [(33, [32]), (64, [64]), (100, [64, 32]),
                                                 (150, [128, 16])])
def test_contiguous_partials_whole_tiles_and_tails_interpreted(root_tokens, lengths,
                                                               num_qo_heads, block_m, block_n):
    """The contiguous kernel's wide tile walks whole KV tiles unmasked and the rest as one
    masked step, its narrow tile every tile masked: items of a tail alone, whole tiles alone,
    and both (from a chunk start past 0) match the reference."""
    alloc, ids = shared_root("cpu", root_tokens=root_tokens)
    q = queries(alloc, ids, num_qo_heads)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False)
    check(out, q, alloc, ids)
    (partial,) = [spec.key for spec in launch_specs(plan) if spec.family == "tree_partial"]
    assert (partial["SLOT_RUNS"], partial["BLOCK_M"], partial["BLOCK_N"]) == (1, block_m, block_n)
    (records,) = plan.arrays.items.values()
    start, end = TREE_ITEM_FIELDS.index("kv_start"), TREE_ITEM_FIELDS.index("kv_end")
    assert list(records[:, end] - records[:, start]) == lengths


@interpreter
@pytest.mark.parametrize("num_qo_heads,block_m", [(8, 64), (2, 16)])
@pytest.mark.parametrize("piece_blocks,root_tokens,splits", [(5, 100, [40, 80]),
                                                             (10, 100, [64, 80]),
                                                             (3, 40, [24])])
def test_two_run_partials_interpreted(piece_blocks, root_tokens, splits, num_qo_heads,
                                      block_m):
    """A root whose pages break once inside some item runs the two-run partial kernel: the
    items' run_split is where each second run begins (an item of one run: its end), and the
    output matches the reference in both row tiles, with whole tiles and tails in either run."""
    alloc, ids = shared_root("cpu", True, root_tokens=root_tokens, piece_blocks=piece_blocks)
    q = queries(alloc, ids, num_qo_heads)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False)
    check(out, q, alloc, ids)
    (partial,) = [spec.key for spec in launch_specs(plan) if spec.family == "tree_partial"]
    assert (partial["SLOT_RUNS"], partial["BLOCK_M"]) == (2, block_m)
    assert plan.slot_runs == {block_m: 2}
    (records,) = plan.arrays.items.values()
    split = TREE_ITEM_FIELDS.index("run_split")
    assert sorted(set(records[:, split].tolist())) == splits
    # The kernels read the splits from the uploaded records.
    launch = next(launch for launch in plan.launches(q, None, None, None)
                  if launch.spec.family == "tree_partial")
    uploaded = launch.args[TREE_PARTIAL.param_names.index("items")][:records.size]
    assert torch.equal(uploaded.view(-1, len(TREE_ITEM_FIELDS)), torch.from_numpy(records))


def poison_unread_slots(alloc, ids):
    """NaN in every pool slot (the zero block aside) that holds no token of ``ids`` below its
    length, as uninitialised device memory may."""
    tables, lengths = alloc.block_tables(ids)
    read = torch.zeros(alloc.num_blocks * alloc.block_size, dtype=torch.bool)
    for table, length in zip(tables.long(), lengths.tolist()):
        tokens = torch.arange(length)
        read[table[tokens // alloc.block_size] * alloc.block_size
             + tokens % alloc.block_size] = True
    read[:alloc.block_size] = True
    for pool in alloc.k_pools + alloc.v_pools:
        pool.view(-1, alloc.num_kv_heads, alloc.head_dim)[~read] = float("nan")


@interpreter
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_tensor_map_partials_interpreted(scattered, head_dim):
    """sm90's wide contiguous walk at head_dim 128 and 256 reads K/V through TMA descriptors
    (Triton's tensor descriptors in the interpreter), over one run and over two: whole tiles,
    and a tail tile whose slots past its range hold NaN (the pool poisoned before the tree was
    written), match the reference."""
    alloc, ids = shared_root("cpu", scattered, root_tokens=100, piece_blocks=5, head_dim=head_dim)
    poison_unread_slots(alloc, ids)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False)
    check(out, q, alloc, ids)
    launch = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)[0]
    assert launch.spec.family == "tree_partial" and launch.spec.key["TMA"] == 1
    assert launch.spec.key["SLOT_RUNS"] == 1 + scattered and launch.spec.key["BLOCK_M"] == 64
    slots, row = alloc.num_blocks * alloc.block_size, alloc.num_kv_heads * alloc.head_dim
    assert launch.args[1:3] == (TensorMap(alloc.k_pools[0], slots, row),
                                TensorMap(alloc.v_pools[0], slots, row))


@interpreter
@pytest.mark.parametrize("root_tokens, heads_first", [(300, False), (280, True)])
def test_partial_launch_orders_interpreted(root_tokens, heads_first):
    """Items of alike lengths (4 x 64 and 40 tokens) run each KV head's items together, on a grid
    of (items, heads); of unequal ones (2 x 128 and 24), each item's heads, on (heads, items):
    either order covers every (item, head) pair once and matches the reference (more items than
    the 2 KV heads, so a grid read the wrong way round fails)."""
    alloc, ids = shared_root("cpu", root_tokens=root_tokens)
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False)
    check(out, q, alloc, ids)
    (launch,) = [x for x in plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
                 if x.spec.family == "tree_partial"]
    (block_m, records), = plan.arrays.items.items()
    assert plan.arrays.heads_first == {block_m: heads_first}
    items, heads = records.shape[0], alloc.num_kv_heads
    assert launch.grid == ((heads, items, 1) if heads_first else (items, heads, 1))
    assert launch.args[[n for n, _ in TREE_PARTIAL.params].index("heads_first")] == heads_first


@interpreter
@pytest.mark.parametrize("final_lanes, kv_heads, head_dim, heads_first", [
    (1, 8, 256, False),   # one-branch programs
    (4, 2, 64, False),    # token rows of 256 bytes: below the planner's 4 KB
    (2, 8, 256, True)])   # rows of 4 KB
def test_final_launch_orders_interpreted(final_lanes, kv_heads, head_dim, heads_first):
    """Packed final programs over wide token rows run each program's KV heads together, on a
    grid of (head tiles, programs); other final launches each head's programs, on (programs,
    head tiles): either order covers every (program, head) pair once and matches the reference
    (more programs than KV heads, so a grid read the wrong way round fails)."""
    alloc, ids = shared_root("cpu", root_tokens=200, leaves=20, num_kv_heads=kv_heads,
                             head_dim=head_dim)
    q = queries(alloc, ids, 2 * kv_heads)
    plan, out = interpret(alloc, ids, q, target_chunk=64, flat=False, separate_merge=False,
                          final_lanes=final_lanes)
    check(out, q, alloc, ids)
    final = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)[-1]
    assert final.spec.family == "tree_final" and not plan.arrays.has_common
    assert plan.arrays.final_heads_first == heads_first
    programs, tiles = -(-len(ids) // final_lanes), alloc.num_kv_heads
    assert programs > tiles
    assert final.grid == ((tiles, programs, 1) if heads_first else (programs, tiles, 1))
    assert final.args[[n for n, _ in TREE_FINAL.params].index("heads_first")] == heads_first


@interpreter
@pytest.mark.parametrize("free_root", [False, True])
def test_contiguous_partials_survive_copy_on_write_interpreted(free_root):
    """The plan reads the shared root as one run from its first page; a decode step then
    copies the root's last (shared, partly filled) block into the leaves' tables (into every
    leaf's while the root branch holds it; with the root freed, the first leaf keeps it). The
    root's tokens stay in the original block, so the planned run still addresses them: the plan
    stays valid and correct after refresh."""
    alloc, ids = shared_root("cpu", root_tokens=203, leaf_tokens=0)
    if free_root:
        alloc.free_branch(ids[0] - 2)  # shared_root's root: two ids before the first leaf
    q = queries(alloc, ids, 8)
    plan = TreeAttentionPlan(alloc, ids, 8,
                             _options=PlanOptions(num_sms=4, arch="sm90", target_chunk=64,
                                                  flat=False))
    assert plan.slot_runs == {block_m: 1 for block_m in plan.arrays.items}
    before, _ = alloc.block_tables(ids)
    step = alloc.reserve(ids)
    alloc.append(step, 0, *random_kv(alloc, torch.Generator().manual_seed(9), len(ids)))
    after, _ = alloc.block_tables(ids)
    assert (after[int(free_root):, 25] != before[int(free_root):, 25]).all()
    assert torch.equal(after[:, :25], before[:, :25])
    from aot.interpret import run_interpreted
    out = poisoned_like(q)
    plan.refresh()
    run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    check(out, q, alloc, ids)


def test_slot_runs_can_be_turned_off():
    """``slot_runs=False`` keeps every partial launch on the page kernels; ``True`` is the
    default (slot runs where the pages allow)."""
    alloc, ids = shared_root("cpu")
    default = TreeAttentionPlan(alloc, ids, 8, _options=PlanOptions(num_sms=4, arch="sm90",
                                                                    flat=False))
    forced = TreeAttentionPlan(alloc, ids, 8, _options=PlanOptions(num_sms=4, arch="sm90",
                                                                   flat=False, slot_runs=True))
    assert forced.kernels == default.kernels and set(default.slot_runs.values()) == {1}
    plan = TreeAttentionPlan(alloc, ids, 8,
                             _options=PlanOptions(num_sms=4, arch="sm90", flat=False,
                                                  slot_runs=False))
    assert set(plan.slot_runs.values()) == {0} and all(
        spec.key["SLOT_RUNS"] == 0 for spec in launch_specs(plan)
        if spec.family == "tree_partial")


@interpreter
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_early_final_interpreted(separate, early):
    """``early_final`` reaches every partial launch (on sm90 the first one's signal starts the
    second partial launch, the last one's the final or merge launch), and either start gives
    the same output."""
    alloc, ids = forest("cpu", num_kv_heads=2, tokens=200, seed=10)  # both row tiles
    q = queries(alloc, ids, 8)
    plan, out = interpret(alloc, ids, q, target_chunk=64, separate_merge=separate, flat=False,
                          one_tile=False, early_final=early)
    at = TREE_PARTIAL.param_names.index("early_final")
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    flags = [launch.args[at] for launch in launches if launch.spec.family == "tree_partial"]
    assert flags == [int(early)] * 2
    assert plan.arrays.early_final == early
    check(out, q, alloc, ids)


@interpreter
def test_separate_merge_follows_growth_interpreted():
    """A plan that merges separately reads each branch's last chunk to its length at run
    time: after decode steps (and one branch left behind, shorter than the rest) it still
    matches the reference."""
    from aot.interpret import run_interpreted
    alloc, ids = forest("cpu", tokens=120, seed=5)
    plan = TreeAttentionPlan(alloc, ids, 4,
                             _options=PlanOptions(num_sms=4, arch="sm90", target_chunk=64,
                                                  separate_merge=True))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        step = alloc.reserve(ids[1:])
        alloc.append(step, 0, *random_kv(alloc, gen, len(ids) - 1))
        plan.refresh()
        q = queries(alloc, ids, 4)
        out = poisoned_like(q)
        run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
        check(out, q, alloc, ids)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, lanes", [((2, 2), 16), ((6, 2), 3), ((8, 2), 2), ((8, 2), 4),
                                          ((8, 2), 8), ((2, 2), 32), ((6, 2), 6)])
def test_packed_final_interpreted(dtype, heads, lanes):
    """Final programs that serve several branches (groups 1, 3, 4: one with a lane count
    that leaves tile rows and tokens over), in the narrow tile or, past its rows, the wide
    one; their final ranges of unequal length (one left behind by decode steps), a last
    program with lanes but no branch."""
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, branches=13, tokens=60,
                        seed=lanes)
    plan = TreeAttentionPlan(alloc, ids, heads[0],
                             _options=PlanOptions(num_sms=4, arch="sm90", separate_merge=False,
                                                  final_lanes=lanes))
    assert plan.arrays.final_lanes == lanes and packed_final(plan, heads, lanes)["PACKED"] == 1
    check_packed_over_decode_steps(plan, alloc, ids, heads[0], seed=lanes)


def packed_final(plan, heads, lanes) -> dict:
    """The plan's final launch's specialization keys, checked to hold its lanes' rows in the
    narrow final tile or, past it, the wide one."""
    final = launch_specs(plan)[-1].key
    assert final["BLOCK_M"] == (16 if lanes * heads[0] // heads[1] <= 16 else 32)
    return final


def check_packed_over_decode_steps(plan, alloc, ids, num_qo_heads, seed):
    """The plan's launches through the interpreter against the reference, poisoned first, before
    and after a decode step that leaves the first branch behind."""
    from aot.interpret import run_interpreted
    gen = torch.Generator().manual_seed(seed)
    for step in range(2):
        q = queries(alloc, ids, num_qo_heads, seed=step)
        out = poisoned_like(q)
        run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
        check(out, q, alloc, ids)
        grown = alloc.reserve(ids[1:])
        alloc.append(grown, 0, *random_kv(alloc, gen, len(ids) - 1))
        plan.refresh()


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, lanes", [((8, 2), 4), ((8, 2), 8), ((2, 2), 16), ((32, 2), 2)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_shared_ranges_interpreted(dtype, heads, lanes, block_size):
    """Packed programs that read their lanes' shared range once (the COMMON final kernel), in
    the narrow final tile and the wide one (groups 4, 1 and 16), over a deep tree whose nodes
    end inside blocks: 13 leaves, so the last program has one lane; matches the reference before
    and after decode steps (one lane left behind)."""
    from flash_reasoning.tools.bench import level_case
    case = level_case("deep", (1, 2, 4, 13), (19, 16, 24, 9), num_qo_heads=heads[0],
                      num_kv_heads=heads[1], head_dim=64, dtype=str(dtype).split(".")[-1])
    alloc, ids = case_allocator(case, device="cpu", block_size=block_size)
    plan = TreeAttentionPlan(alloc, ids, heads[0],
                             _options=PlanOptions(num_sms=4, arch="sm90", flat=True,
                                                  final_lanes=lanes))
    final = packed_final(plan, heads, lanes)
    assert plan.arrays.has_common and (final["PACKED"], final["COMMON"]) == (1, 1)
    assert final["PAGE"] == (16 if block_size == 16 else 0)
    check_packed_over_decode_steps(plan, alloc, ids, heads[0], seed=lanes)


@interpreter
@pytest.mark.parametrize("block_size, page", [(16, 16), (8, 0), (5, 0)])
@pytest.mark.parametrize("separate, lanes", [(False, 1), (False, 4), (True, 1)])
def test_compiled_page_size_interpreted(block_size, page, separate, lanes):
    """A pool of a compiled page size runs kernels with it as a constant, any other size the
    kernels that read it at run time (nodes and forks off block boundaries in both); the
    contiguous partial kernels take any page size at run time. Every launch of the plan, each
    merge mode and packed finals, matches the reference."""
    alloc, ids = forest("cpu", num_kv_heads=2, tokens=150, seed=block_size + lanes,
                        block_size=block_size)
    q = queries(alloc, ids, 8)
    extra = {} if separate else {"final_lanes": lanes}
    plan, out = interpret(alloc, ids, q, target_chunk=64, separate_merge=separate, **extra)
    attention = [spec for spec in launch_specs(plan) if spec.family != "tree_merge"]
    paged = [spec for spec in attention if not spec.key.get("SLOT_RUNS")]
    assert paged and all(spec.key["PAGE"] == page for spec in paged)
    assert all(spec.key["PAGE"] == 0 for spec in attention if spec.key.get("SLOT_RUNS"))
    check(out, q, alloc, ids)


@interpreter
@pytest.mark.parametrize("head_dim", [128, 256])
def test_kernels_interpreted_head_dims(head_dim):
    alloc, ids = forest("cpu", head_dim=head_dim, branches=5, tokens=30, seed=head_dim)
    q = queries(alloc, ids, 8)
    check(interpret(alloc, ids, q)[1], q, alloc, ids)


@interpreter
def test_kernels_interpreted_wide_tiles_and_group_32():
    """A node under 40 branches x group 4 takes the 64-row tile; group 32 needs two final
    tiles per KV head."""
    alloc = PhysicalKVAllocator(160, 8, 1, 64, device="cpu")
    spec = from_levels([1, 40], [300, 3])
    gen = torch.Generator().manual_seed(0)
    leaves = build_branches(alloc, spec, lambda node, layer, n: random_kv(alloc, gen, n))
    for heads in (4, 32):
        q = queries(alloc, leaves, heads)
        plan, out = interpret(alloc, leaves, q, flat=False)
        assert 64 in plan.arrays.items
        check(out, q, alloc, leaves)


@interpreter
@pytest.mark.parametrize("sm_scale", [-0.7, 0.0])
def test_wide_tiles_interpreted_with_any_scale(sm_scale):
    """Wide tiles over a shared root with a negative scale and a zero one (uniform weights)
    match the reference."""
    alloc = PhysicalKVAllocator(160, 8, 1, 64, device="cpu")
    gen = torch.Generator().manual_seed(1)
    leaves = build_branches(alloc, from_levels([1, 40], [300, 3]),
                            lambda node, layer, n: random_kv(alloc, gen, n))
    q = queries(alloc, leaves, 4)
    plan, out = interpret(alloc, leaves, q, flat=False, sm_scale=sm_scale)
    assert 64 in plan.arrays.items
    check(out, q, alloc, leaves, sm_scale=sm_scale)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_hosted_nodes_interpreted(dtype):
    """A computed root over two computed children whose 8 branches x GQA group 8 fill one wide
    tile each: the root's tiles read on through their child's tokens (one item per tile, one
    partial per branch), and the output matches the reference."""
    alloc = PhysicalKVAllocator(160, 8, 1, 64, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(4)
    leaves = build_branches(alloc, from_levels([1, 2, 16], [530, 45, 3]),
                            lambda node, layer, n: random_kv(alloc, gen, n))
    q = queries(alloc, leaves, 8)
    plan, out = interpret(alloc, leaves, q, flat=False, target_chunk=1024)
    records = plan.arrays.items[64]
    start, end = TREE_ITEM_FIELDS.index("kv_start"), TREE_ITEM_FIELDS.index("kv_end")
    assert (records[:, start] == 0).all() and (records[:, end] == records[0, end]).all()
    assert len(records) == 2 and plan.arrays.num_entries == len(leaves)
    check(out, q, alloc, leaves)


# ---- the PyTorch path (the same plan, on CPU) -------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(branches=st.integers(1, 30), depth=st.integers(1, 10), tokens=st.integers(0, 50),
       group=st.sampled_from([1, 2, 4, 8, 16]), dtype=st.sampled_from(DTYPES),
       chunk=st.sampled_from([None, 64]), merge=st.sampled_from([None, False, True]),
       flat=st.sampled_from([None, False, True]), one_tile=st.sampled_from([None, True]),
       seed=st.integers(0, 2**16))
def test_torch_path_random_trees(branches, depth, tokens, group, dtype, chunk, merge, flat,
                                 one_tile, seed):
    alloc, ids = forest("cpu", num_kv_heads=1, head_dim=16, dtype=dtype, branches=branches,
                        depth=depth, tokens=tokens, seed=seed, block_size=4,
                        roots=1 + seed % 3)
    q = queries(alloc, ids, group, seed)
    plan = TreeAttentionPlan(alloc, ids, group,
                             _options=PlanOptions(target_chunk=chunk, separate_merge=merge,
                                                  flat=flat, one_tile=one_tile))
    check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids)


@pytest.mark.parametrize("separate", [False, True])
def test_plan_follows_decode_steps_and_rejects_a_changed_tree(separate):
    alloc, ids = forest("cpu", layers=2, seed=3)
    plan = TreeAttentionPlan(alloc, ids, 4, _options=PlanOptions(separate_merge=separate))
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):                     # steps only grow the branches: the plan holds
        step = alloc.reserve(ids)
        for layer in range(2):
            alloc.append(step, layer, *random_kv(alloc, gen, len(ids)))
            q = queries(alloc, ids, 4, seed=layer)
            check(plan.run(q, layer), q, alloc, ids, layer)
    alloc.alloc_branch(alloc.length(ids[0]), parent_branch_id=ids[0])
    with pytest.raises(StalePlan, match="fork"):
        plan.run(queries(alloc, ids, 4))


def test_overwrite_makes_plans_stale():
    alloc, ids = forest("cpu", seed=4)
    plan = TreeAttentionPlan(alloc, ids, 4)
    alloc.write(ids[0], 0, *random_kv(alloc, torch.Generator(), 1), start=0)
    with pytest.raises(StalePlan):
        plan.run(queries(alloc, ids, 4))


def test_tree_attention_reuses_its_plan_across_layers():
    from flash_reasoning.ops.tree_attention import _plans
    alloc, ids = forest("cpu", layers=2, seed=5)
    q = queries(alloc, ids, 4)
    for layer in (0, 1):
        check(tree_attention(q, alloc, ids, layer=layer), q, alloc, ids, layer)
    first = _plans[alloc][1]
    tree_attention(q, alloc, ids, layer=1)
    assert _plans[alloc][1] is first


def test_sm_scale_and_out():
    alloc, ids = forest("cpu", seed=6)
    q = queries(alloc, ids, 4)
    out = poisoned_like(q)
    assert tree_attention(q, alloc, ids, out=out, sm_scale=0.3) is out
    check(out, q, alloc, ids, sm_scale=0.3)


@pytest.mark.parametrize("bad, error, match", [
    (lambda a, ids, q: (q.float(), ids, 0), TypeError, "q must be torch.float16, got"),
    (lambda a, ids, q: (q[:-1], ids, 0), ValueError, "q must be"),
    (lambda a, ids, q: (q[:, :3], ids, 0), ValueError, "multiple of"),
    (lambda a, ids, q: (q, ids, 1), ValueError, "layer"),
    (lambda a, ids, q: (q, ids[:-1] + [999], 0), UnknownBranch, "999"),
    (lambda a, ids, q: (q, ids[:-1] + ids[:1], 0), ValueError, "distinct"),
    (lambda a, ids, q: (q.transpose(1, 2).contiguous().transpose(1, 2), ids, 0), ValueError,
     "contiguous"),
])
def test_bad_input_is_rejected_without_state_change(bad, error, match):
    alloc, ids = forest("cpu", seed=7)
    q = queries(alloc, ids, 4)
    before = (alloc.tree_version, alloc.table_version, alloc.memory_report())
    args = bad(alloc, ids, q)
    with pytest.raises(error, match=match):
        tree_attention(args[0], alloc, args[1], layer=args[2])
    assert (alloc.tree_version, alloc.table_version, alloc.memory_report()) == before


def test_a_planner_refusal_is_a_value_error_without_state_change():
    """The C++ planner's refusals reach Python as ValueError (``_core.InvalidArgument``), as
    ``planner.plan`` gives them, naming what it refused."""
    alloc, ids = forest("cpu", seed=7)
    before = (alloc.tree_version, alloc.table_version, alloc.memory_report())
    with pytest.raises(ValueError, match="final_lanes must be 0 .chosen. or 1..16") as info:
        TreeAttentionPlan(alloc, ids, 4, _options=PlanOptions(final_lanes=99))
    assert info.value.code == 1  # FR_INVALID_ARGUMENT
    assert (alloc.tree_version, alloc.table_version, alloc.memory_report()) == before


def test_out_sharing_memory_with_q_is_rejected():
    """In place, or a row apart: the kernels read q while they write out."""
    alloc, ids = forest("cpu", seed=7)
    q = queries(alloc, ids, 4)
    rows = torch.cat([q, q[:1]])  # q's rows and one more: views one row apart
    for q_view, out in ((q, q), (rows[:-1], rows[1:]), (rows[1:], rows[:-1])):
        with pytest.raises(ValueError, match="out overlaps q"):
            tree_attention(q_view, alloc, ids, out=out)
    check(tree_attention(rows[1:], alloc, ids, out=rows[:-1].clone()), rows[1:], alloc, ids)


# ---- several queries per branch (q_lens) -------------------------------------------------------

def random_q_lens(alloc, ids, seed, most=64):
    """0 to ``most`` queries per branch (at most its length), its first and last branches
    at the extremes: none, and its whole length where that is at most ``most``."""
    gen = np.random.default_rng(seed)
    counts = [int(gen.integers(0, min(n, most) + 1)) for n in alloc.lengths(ids)]
    counts[0] = 0
    counts[-1] = min(int(alloc.lengths(ids[-1:])[0]), most)
    return counts


def random_masks(q_lens, seed):
    """A draft mask per branch: a random draft tree, random bits (rows that allow nothing
    among them), or None (causal), in turn; branches of more than 64 queries stay causal."""
    gen = torch.Generator().manual_seed(seed)
    kinds = (lambda n: draft_tree_mask(n, gen), lambda n: torch.rand(n, n, generator=gen) < 0.3,
             lambda n: None)
    return [kinds[(i + seed) % 3](n) if n <= MAX_DRAFT_TOKENS else None
            for i, n in enumerate(q_lens)]


def test_query_reference_is_causal_attention():
    """The float64 reference against PyTorch's SDPA with the causal mask written out."""
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(n, 2, 16, generator=gen, dtype=torch.float64) for n in (9, 5)]
    values = [torch.randn(n, 2, 16, generator=gen, dtype=torch.float64) for n in (9, 5)]
    q_lens = [4, 5]
    q = torch.randn(9, 4, 16, generator=gen, dtype=torch.float64)
    got = reference.query_attention(q, keys, values, q_lens, sm_scale=0.3)
    first = 0
    for k, v, n in zip(keys, values, q_lens):
        ends = k.shape[0] - n + torch.arange(1, n + 1)      # query j attends below its end
        allowed = torch.arange(k.shape[0])[None, :] < ends[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[first:first + n].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=allowed, scale=0.3)
        assert torch.allclose(got[first:first + n], expected.transpose(0, 1), atol=1e-12)
        first += n
    one = q[:2]  # one query per sequence: decode attention
    assert torch.allclose(reference.query_attention(one, keys, values, [1, 1], 0.3),
                          reference.decode_attention(one, keys, values, 0.3), atol=1e-12)


@interpreter
@pytest.mark.parametrize("masked", [False, True])
def test_branch_own_nodes_folded_into_their_queries_interpreted(masked):
    """A several-query plan whose branches' own short nodes fold into their queries' final
    ranges (``sequence_folds``): fewer computed nodes, the same attention."""
    alloc, ids = forest("cpu", tokens=120, seed=5, branches=8)
    q_lens = random_q_lens(alloc, ids, 5, most=12)
    mask = random_masks(q_lens, 5) if masked else None
    q = queries(alloc, ids, 8, rows=sum(q_lens))
    plan, out = interpret(alloc, ids, q, q_lens=q_lens, mask=mask, sequence_folds=True,
                          query_tiles=False, target_chunk=16)
    kept = TreeAttentionPlan(alloc, ids, 8, q_lens=q_lens, mask=mask, _options=PlanOptions(
        num_sms=4, arch="sm90", sequence_folds=False, query_tiles=False, target_chunk=16))
    assert plan.arrays.stats["computed_nodes"] < kept.arrays.stats["computed_nodes"]
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, query_block", [((2, 2), 1), ((8, 2), 4), ((16, 1), None)])
@pytest.mark.parametrize("separate", [False, True])
def test_q_lens_interpreted(dtype, heads, separate, query_block):
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, tokens=120, seed=heads[0],
                        branches=8)
    q_lens = random_q_lens(alloc, ids, heads[0], most=24)
    q = queries(alloc, ids, heads[0], rows=sum(q_lens))
    plan, out = interpret(alloc, ids, q, q_lens=q_lens, target_chunk=16, separate_merge=separate,
                          query_block=query_block)
    assert plan.arrays.num_entries > 0 and plan.num_rows == sum(q_lens)
    check(out, q, alloc, ids, q_lens=q_lens)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (14, 2), (16, 1)])  # groups 1, 4, 7, 16
@pytest.mark.parametrize("masked", [False, True])
def test_query_tiles_interpreted(dtype, heads, masked):
    """One tree_queries launch: each tile's queries (x the group: 64 rows, 9 queries of 7
    heads with a row to spare) walk their branch from its first token, each to its own causal
    end or mask; branches of more queries than a tile holds take several tiles. Each row's
    table holds only its own blocks (as a C ABI plan's): a tile reads its longest row's."""
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, tokens=120, seed=heads[0],
                        branches=8)
    q_lens = random_q_lens(alloc, ids, heads[0], most=40)
    mask = random_masks(q_lens, heads[0]) if masked else None
    q = queries(alloc, ids, heads[0], rows=sum(q_lens))
    plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens, mask=mask,
                             _options=PlanOptions(num_sms=4, arch="sm90", query_tiles=True))
    plan.refresh()
    own_blocks = -(-plan.lengths.long() // alloc.block_size)  # each row's own, as the C ABI's
    plan.tables[torch.arange(plan.tables.shape[1]) >= own_blocks[:, None]] = 0
    out = poisoned_like(q)
    from aot.interpret import run_interpreted
    run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    tiles = plan.arrays.query_tiles
    assert plan.kernels == [plan.kernels[0]] and plan.kernels[0].startswith("tree_queries_")
    assert (f"_draft{int(masked)}_" in plan.kernels[0]) and plan.arrays.num_entries == 0
    assert tiles[:, 1].sum() == sum(q_lens) and tiles[:, 1].max() <= 64 // (heads[0] // heads[1])
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)


@interpreter
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (14, 2)])  # groups 1, 4, 7
@pytest.mark.parametrize("masked", [False, True])
def test_query_tile_lanes_interpreted(heads, masked):
    """Short sequences packed as a tile's lanes: the tokens the lanes read from the same slots
    once for all rows, then each lane's own tokens for its rows only, each row to its causal
    end or mask. A random tree (forks inside blocks among them); each row's table holds only
    its own blocks, as a C ABI plan's."""
    alloc, ids = forest("cpu", num_kv_heads=heads[1], tokens=120, seed=heads[0], branches=12)
    q_lens = [min(3, n) for n in alloc.lengths(ids)]
    q_lens[5] = min(2, q_lens[5])  # a different count ends a run of lanes
    mask = random_masks(q_lens, heads[0]) if masked else None
    q = queries(alloc, ids, heads[0], rows=sum(q_lens))
    plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens, mask=mask,
                             _options=PlanOptions(num_sms=4, arch="sm90", query_tiles=True))
    plan.refresh()
    own_blocks = -(-plan.lengths.long() // alloc.block_size)
    plan.tables[torch.arange(plan.tables.shape[1]) >= own_blocks[:, None]] = 0
    tiles = plan.arrays.query_tiles
    assert (tiles[:, 1] > tiles[:, 2]).any() and (tiles[:, 3] > 0).any()  # lanes, shared tokens
    out = poisoned_like(q)
    from aot.interpret import run_interpreted
    run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)


@interpreter
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_query_tiles_read_a_run_through_tensor_maps_interpreted(scattered, masked):
    """sm90's query tiles at head_dim 128 read the tokens all their rows read, where the
    table's first pages follow one another, as one run of slots through TMA descriptors, the
    rest paged: a 100-token root in consecutive pages (or interleaved with another branch's: a
    run of 3 pages), 6 leaves of 20 queries each (x group 4: two tiles a leaf), causal or under
    draft masks; the pool's unread slots hold NaN."""
    alloc, ids = shared_root("cpu", scattered, root_tokens=100, leaves=6, leaf_tokens=20,
                             head_dim=128)
    poison_unread_slots(alloc, ids)
    q_lens = [20] * len(ids)
    mask = random_masks(q_lens, 3) if masked else None
    q = queries(alloc, ids, 8, rows=sum(q_lens))
    plan, out = interpret(alloc, ids, q, q_lens=q_lens, mask=mask, query_tiles=True)
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)
    (launch,) = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out)
    assert launch.spec.family == "tree_queries" and launch.spec.key["TMA"] == 1
    slots, row = alloc.num_blocks * alloc.block_size, alloc.num_kv_heads * alloc.head_dim
    tiles = TREE_QUERIES.param_names.index("k_tiles")
    assert launch.args[tiles:tiles + 2] == (TensorMap(alloc.k_pools[0], slots, row),
                                            TensorMap(alloc.v_pools[0], slots, row))


@interpreter
def test_query_tiles_follow_growth_interpreted():
    """A held query-tile plan reads each branch's last q_lens tokens as the branches grow
    (its rows' lengths refreshed on the device, its tiles' tables the branches')."""
    alloc, ids = forest("cpu", num_kv_heads=2, seed=13, tokens=40, branches=4)
    from aot.interpret import run_interpreted
    gen = torch.Generator().manual_seed(2)
    plan = None
    for step in range(3):
        alloc.append(alloc.reserve(ids, 20), 0, *random_kv(alloc, gen, 20 * len(ids)))
        plan = plan or TreeAttentionPlan(alloc, ids, 8, q_lens=[20] * len(ids),
                                         _options=PlanOptions(arch="sm90", num_sms=4))
        assert plan.arrays.query_tiles.shape == (len(ids) * 2, 4)  # 20 queries: 2 tiles of 10
        plan.refresh()
        q = queries(alloc, ids, 8, seed=step, rows=20 * len(ids))
        out = poisoned_like(q)
        run_interpreted(plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], out))
        check(out, q, alloc, ids, q_lens=[20] * len(ids))


def test_query_tiles_are_chosen_where_they_fill_the_tile():
    """Query tiles where a tile holds 32 rows on average (planner.h's kQueryTileMinRows), a
    tree plan below, or where a tree plan's choice is forced; never for one query a branch.
    Tiles with lanes (branches of the same few queries) only where they are full."""
    alloc, ids = forest("cpu", num_kv_heads=2, seed=14, tokens=60)
    alloc.append(alloc.reserve(ids, 16), 0, *random_kv(alloc, torch.Generator(), 16 * len(ids)))

    def tiles(q_lens, heads, **options):
        plan = TreeAttentionPlan(alloc, ids, heads, q_lens=q_lens,
                                 _options=PlanOptions(**options))
        return plan.arrays.query_tiles.shape[0]

    n = len(ids)
    assert tiles([8, 9] * (n // 2), 8) == n           # 8-9 queries x 4 heads: 32-36 rows a tile
    assert tiles([4, 5] * (n // 2), 8) == 0           # 16-20 rows
    assert tiles([4, 5] * (n // 2), 8, query_tiles=True) == n
    assert tiles([4] * n, 8) == n // 4                # lanes: 4 branches of 4 queries a full tile
    assert tiles([2] * n, 8) == 0                     # 4 lanes of 2 queries: half full
    assert tiles([16] * len(ids), 8, flat=False) == 0
    assert tiles([16] * len(ids), 8, query_tiles=False) == 0
    assert tiles(None, 8, query_tiles=True) == 0      # decode rows name no sequences
    assert tiles([16] * len(ids), 64, query_tiles=True) == 8 * len(ids)  # group 32: 2 a tile
    assert tiles([16] * len(ids), 256, query_tiles=True) == 0  # a group the tile cannot hold


def test_query_blocks_are_planned_as_shared_nodes():
    """Rows planned with their new tokens rounded down to blocks of queries: a block's
    queries share the blocks before it, so the tree has a node per block (and the rows are
    the same causal rows at run time)."""
    from flash_reasoning.segment_tree import query_rows
    branch, exact = query_rows(np.array([5, 0, 3]))
    assert branch.tolist() == [0, 0, 0, 0, 0, 2, 2, 2]
    assert exact.tolist() == [-4, -3, -2, -1, 0, -2, -1, 0]
    assert query_rows(np.array([5, 0, 3]), block=2)[1].tolist() == [-5, -3, -3, -1, -1,
                                                                    -3, -1, -1]
    alloc, ids = forest("cpu", seed=15, tokens=40)
    alloc.append(alloc.reserve(ids, 16), 0, *random_kv(alloc, torch.Generator(), 16 * len(ids)))
    q_lens = [16] * len(ids)
    blocks = alloc.segment_tree(ids, q_lens, query_block=4)
    chain = alloc.segment_tree(ids, q_lens)
    assert blocks.num_nodes < chain.num_nodes and (blocks.lengths <= chain.lengths).all()
    q = queries(alloc, ids, 4, rows=16 * len(ids))
    for block in (1, 4, 16, 64):
        plan = TreeAttentionPlan(alloc, ids, 4, q_lens=q_lens,
                                 _options=PlanOptions(query_block=block))
        assert plan.lengths.tolist() == chain.lengths.tolist()  # the rows' causal lengths
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids, q_lens=q_lens)


@settings(max_examples=40, deadline=None)
@given(branches=st.integers(1, 20), depth=st.integers(1, 8), tokens=st.integers(0, 40),
       group=st.sampled_from([1, 4, 16]), merge=st.sampled_from([None, False, True]),
       lanes=st.sampled_from([None, 1, 4]), block=st.sampled_from([None, 1, 3, 8]),
       masked=st.booleans(), tiles=st.sampled_from([None, False, True]),
       seed=st.integers(0, 2**16))
def test_q_lens_torch_path_random_trees(branches, depth, tokens, group, merge, lanes, block,
                                        masked, tiles, seed):
    """Causal queries, or draft masks (read in final programs whatever the options ask),
    under the planner's choices."""
    alloc, ids = forest("cpu", num_kv_heads=1, head_dim=16, branches=branches, depth=depth,
                        tokens=tokens, seed=seed, block_size=4, roots=1 + seed % 3)
    q_lens = random_q_lens(alloc, ids, seed)
    mask = random_masks(q_lens, seed) if masked else None
    q = queries(alloc, ids, group, seed, rows=sum(q_lens))
    lanes = None if merge or lanes is None else min(lanes, 32 // group)  # the wide tile's
    plan = TreeAttentionPlan(alloc, ids, group, q_lens=q_lens, mask=mask,
                             _options=PlanOptions(separate_merge=merge, final_lanes=lanes,
                                                  query_block=block, query_tiles=tiles))
    if plan.draft_masks is not None:
        assert not plan.arrays.separate_merge and not plan.arrays.as_paged_decode
    check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids, q_lens=q_lens, mask=mask)


def test_one_query_per_branch_is_decode():
    alloc, ids = forest("cpu", seed=11)
    q = queries(alloc, ids, 4)
    decode = TreeAttentionPlan(alloc, ids, 4).run(q)
    assert torch.equal(TreeAttentionPlan(alloc, ids, 4, q_lens=[1] * len(ids)).run(q), decode)


@pytest.mark.parametrize("masked", [False, True])
def test_q_lens_plan_follows_growth(masked):
    """A held plan's queries (and drafts) are each branch's last q_lens tokens as the
    branches grow."""
    alloc, ids = forest("cpu", layers=2, seed=12, tokens=30)
    q_lens = [4] * len(ids)
    mask = random_masks(q_lens, 17) if masked else None
    gen = torch.Generator().manual_seed(1)
    plan = None
    for step in range(3):
        reserved = alloc.reserve(ids, 4)
        for layer in range(2):
            alloc.append(reserved, layer, *random_kv(alloc, gen, 4 * len(ids)))
        plan = plan or TreeAttentionPlan(alloc, ids, 4, q_lens=q_lens, mask=mask)
        for layer in range(2):
            q = queries(alloc, ids, 4, seed=step, rows=4 * len(ids))
            check(plan.run(q, layer, poisoned_like(q)), q, alloc, ids, layer, q_lens=q_lens,
                  mask=mask)


def test_tree_attention_plans_again_for_other_q_lens():
    from flash_reasoning.ops.tree_attention import _plans
    alloc, ids = forest("cpu", seed=13)
    lengths = alloc.lengths(ids).tolist()
    for q_lens in ([min(2, n) for n in lengths], None, [1] * len(ids), [n // 2 for n in lengths]):
        rows = len(ids) if q_lens is None else sum(q_lens)
        q = queries(alloc, ids, 4, rows=rows)
        check(tree_attention(q, alloc, ids, q_lens=q_lens), q, alloc, ids, q_lens=q_lens)
        assert _plans[alloc][1].num_rows == rows


@pytest.mark.parametrize("q_lens, error, match", [
    (lambda ids: [1] * (len(ids) - 1), ValueError, "one count per branch"),
    (lambda ids: [1] * (len(ids) - 1) + [-1], ValueError, r"q_lens\[\d+\] must be >= 0"),
    (lambda ids: [1] * (len(ids) - 1) + [10**6], ValueError, "exceeds its branch's length"),
    (lambda ids: [1.0] * len(ids), TypeError, r"q_lens\[0\] must be an int"),
    (lambda ids: np.ones(len(ids)), TypeError, r"q_lens\[0\] must be an int"),
    (lambda ids: np.array([True] * len(ids)), TypeError, r"q_lens\[0\] must be an int"),
    (lambda ids: np.array([1] * (len(ids) - 1) + [-1]), ValueError, r"q_lens\[\d+\] must be >= 0"),
    (lambda ids: 3, TypeError, "q_lens must be a sequence"),
    (lambda ids: [2] * len(ids), ValueError, r"q must be \[sum\(q_lens\)"),
])
def test_bad_q_lens_are_rejected_without_state_change(q_lens, error, match):
    alloc, ids = forest("cpu", seed=14)
    q = queries(alloc, ids, 4)
    before = (alloc.tree_version, alloc.table_version, alloc.memory_report())
    with pytest.raises(error, match=match):
        tree_attention(q, alloc, ids, q_lens=q_lens(ids))
    assert (alloc.tree_version, alloc.table_version, alloc.memory_report()) == before


# ---- draft masks (speculative-tree verification) ------------------------------------------------

def test_draft_reference_is_masked_attention():
    """The float64 reference against PyTorch's SDPA with each branch's mask written out; a
    lower-triangular mask is the causal reference, a query that may attend nothing gives zeros."""
    gen = torch.Generator().manual_seed(1)
    keys = [torch.randn(n, 2, 16, generator=gen, dtype=torch.float64) for n in (9, 4)]
    values = [torch.randn(n, 2, 16, generator=gen, dtype=torch.float64) for n in (9, 4)]
    q = torch.randn(8, 4, 16, generator=gen, dtype=torch.float64)
    masks = [draft_tree_mask(4, gen), torch.zeros(4, 4, dtype=torch.bool)]
    got = reference.query_attention(q, keys, values, [4, 4], 0.3, masks)
    allowed = torch.ones(4, 9, dtype=torch.bool)
    allowed[:, 5:] = masks[0]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:4].transpose(0, 1), keys[0].repeat_interleave(2, 1).transpose(0, 1),
        values[0].repeat_interleave(2, 1).transpose(0, 1), attn_mask=allowed, scale=0.3)
    assert torch.allclose(got[:4], expected.transpose(0, 1), atol=1e-12)
    assert torch.equal(got[4:], torch.zeros(4, 4, 16, dtype=torch.float64))
    causal = [torch.ones(4, 4, dtype=torch.bool).tril()] * 2
    assert torch.allclose(reference.query_attention(q, keys, values, [4, 4], 0.3, causal),
                          reference.query_attention(q, keys, values, [4, 4], 0.3), atol=1e-12)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, lanes", [((2, 2), 1), ((8, 2), 2), ((16, 1), None),
                                          ((2, 2), 8)])  # 8 lanes of group 1: the wide tile
@pytest.mark.parametrize("separate", [False, True])
def test_draft_masks_interpreted(dtype, heads, lanes, separate):
    alloc, ids = forest("cpu", num_kv_heads=heads[1], dtype=dtype, tokens=120, seed=heads[0],
                        branches=8)
    q_lens = random_q_lens(alloc, ids, heads[0], most=40)
    mask = random_masks(q_lens, heads[0])
    q = queries(alloc, ids, heads[0], rows=sum(q_lens))
    plan, out = interpret(alloc, ids, q, q_lens=q_lens, mask=mask, target_chunk=16,
                          separate_merge=separate,  # drafts merge in the final kernel anyway
                          final_lanes=lanes)
    assert plan.arrays.num_entries > 0 and "_draft1_" in plan.kernels[-1]
    assert plan.arrays.final_lanes == (lanes or plan.arrays.final_lanes)
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)


@interpreter
def test_draft_masks_with_shared_ranges_interpreted():
    """Packed programs whose lanes share a folded range (sibling leaves in a flat plan), each
    lane a masked branch's query."""
    alloc, ids = forest("cpu", num_kv_heads=2, tokens=60, seed=5, branches=6)
    q_lens = [min(6, n) for n in alloc.lengths(ids).tolist()]
    mask = random_masks(q_lens, 5)
    q = queries(alloc, ids, 4, rows=sum(q_lens))
    plan, out = interpret(alloc, ids, q, q_lens=q_lens, mask=mask, flat=True, final_lanes=4)
    assert plan.arrays.has_common and "_common1_" in plan.kernels[-1] \
        and "_draft1_" in plan.kernels[-1]
    check(out, q, alloc, ids, q_lens=q_lens, mask=mask)


def test_causal_masks_are_the_causal_plan():
    alloc, ids = forest("cpu", seed=16, tokens=50)
    q_lens = random_q_lens(alloc, ids, 16, most=20)
    q = queries(alloc, ids, 4, rows=sum(q_lens))
    causal = [np.tril(np.ones((n, n), bool)) for n in q_lens]
    masked = TreeAttentionPlan(alloc, ids, 4, q_lens=q_lens, mask=causal).run(q)
    plain = TreeAttentionPlan(alloc, ids, 4, q_lens=q_lens).run(q)
    assert torch.allclose(masked.float(), plain.float(), atol=2e-3)
    assert TreeAttentionPlan(alloc, ids, 4, q_lens=q_lens, mask=[None] * len(ids)).draft_masks \
        is None  # no branch masked: the causal plan


def test_draft_masks_are_rows_of_bits():
    from flash_reasoning.ops.tree_attention import draft_masks
    from flash_reasoning.segment_tree import query_rows
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]])
    rows = draft_masks({1: tree.astype(bool)}, np.array([2, 3, 1]))
    # Each row ends at its last allowed draft token.
    assert rows.tolist() == [[0, 0], [0, 0], [1, 1], [2, 3], [3, 5], [0, 0]]
    assert draft_masks({0: np.zeros((2, 2), bool)}, np.array([2])).tolist() == [[0, 0], [0, 0]]
    full = draft_masks({0: np.ones((64, 64), bool)}, np.array([64]))
    assert (full[:, 1] == -1).all()  # all 64 bits
    branch, offset = query_rows(np.array([2, 3, 1]), 64, np.array([False, True, False]))
    assert offset.tolist() == [-2, -2, -3, -3, -3, -1]  # a draft's rows: its context


def test_tree_attention_plans_again_for_other_masks():
    from flash_reasoning.ops.tree_attention import _plans
    alloc, ids = forest("cpu", seed=18)
    q_lens = [min(3, n) for n in alloc.lengths(ids).tolist()]
    q = queries(alloc, ids, 4, rows=sum(q_lens))
    plans = []
    for seed in (0, 0, 1):
        mask = random_masks(q_lens, seed)
        check(tree_attention(q, alloc, ids, q_lens=q_lens, mask=mask), q, alloc, ids,
              q_lens=q_lens, mask=mask)
        plans.append(_plans[alloc][1])
    assert plans[0] is plans[1] and plans[1] is not plans[2]


@pytest.mark.parametrize("mask, q_lens, error, match", [
    (lambda n: [None] * n, None, ValueError, "mask needs q_lens"),
    (lambda n: [None] * (n - 1), 2, ValueError, "one entry per branch"),
    (lambda n: np.ones((n, 2, 2), bool), 2, TypeError, "mask must be a sequence"),
    (lambda n: [np.ones((2, 2), np.int32)] * n, 2, TypeError, r"mask\[0\] must be a bool"),
    (lambda n: [np.ones((2, 3), bool)] * n, 2, ValueError, r"mask\[0\] must be \[q_lens"),
    (lambda n: [np.ones((65, 65), bool)] * n, 65, ValueError, "at most 64"),
])
def test_bad_masks_are_rejected_without_state_change(mask, q_lens, error, match):
    alloc, ids = forest("cpu", seed=19, tokens=120)
    alloc.append(alloc.reserve(ids, 65), 0, *random_kv(alloc, torch.Generator(), 65 * len(ids)))
    lens = None if q_lens is None else [q_lens] * len(ids)
    q = queries(alloc, ids, 4, rows=len(ids) if lens is None else sum(lens))
    before = (alloc.tree_version, alloc.table_version, alloc.memory_report())
    with pytest.raises(error, match=match):
        tree_attention(q, alloc, ids, q_lens=lens, mask=mask(len(ids)))
    assert (alloc.tree_version, alloc.table_version, alloc.memory_report()) == before


@pytest.mark.parametrize("chunk, separate, last", [(None, False, "tree_final"),
                                                   (8, False, "tree_final"),
                                                   (8, True, "tree_merge")])
def test_plan_launches_bind_against_the_manifest(chunk, separate, last):
    """On CPU, with the sm90 manifest: the plan's launches bound to a workspace pass every
    launcher check (argument names, count and types, the workspace's regions aligned, each
    per-call pointer on a pointer parameter); a bad pointer is refused by name before the
    driver is reached."""
    if "sm90" not in runtime.available_archs():  # a GPU machine builds its own arch only
        pytest.skip("the sm90 artifacts are not built here")
    alloc, ids = forest("cpu", num_kv_heads=8, head_dim=128, tokens=200)
    plan = TreeAttentionPlan(alloc, ids, 32,
                             _options=PlanOptions(num_sms=4, arch="sm90", target_chunk=chunk,
                                                  separate_merge=separate, flat=False))
    assert len(plan.kernels) >= 2 and plan.kernels[-1].startswith(last)
    plan._core.bind(1 << 20)
    with pytest.raises(CoreError, match=r"out must be a non-NULL, 16-byte aligned"):
        plan._core.run(16, 32, 48, 72, 0)
    with pytest.raises(CoreError, match=r"k_pool must be a non-NULL"):
        plan._core.run(16, 0, 48, 64, 0)
    with pytest.raises(CoreError, match="workspace must be a non-NULL, 16-byte aligned"):
        plan._core.bind(8)


def test_a_refilled_id_buffer_names_the_new_branches():
    """Engines refill their id buffers in place every step: the one-shot call answers for the
    buffer's ids now, and a plan keeps the ids it was made for."""
    alloc, ids = forest("cpu", branches=8, seed=4)
    q = queries(alloc, ids[:2], 4)
    buffer = np.array(ids[:2])
    tree_attention(q, alloc, buffer)
    buffer[:] = ids[2:4]
    check(tree_attention(q, alloc, buffer), q, alloc, ids[2:4])
    held = np.array(ids[:2])
    plan = TreeAttentionPlan(alloc, held, 4)
    held[:] = ids[2:4]
    assert plan.branch_ids.tolist() == ids[:2] and not plan.branch_ids.flags.writeable
    check(plan.run(q), q, alloc, ids[:2])


def test_the_one_shot_cache_keeps_no_allocator_alive():
    """tree_attention's cached plan holds its allocator weakly: an allocator (and its pools)
    is freed once the caller drops it."""
    dropped = []
    for seed in range(5):
        alloc, ids = forest("cpu", seed=seed)
        tree_attention(queries(alloc, ids, 4), alloc, ids)
        dropped.append(weakref.ref(alloc))
        del alloc
    gc.collect()
    assert [ref() for ref in dropped] == [None] * 5


def test_forced_options_are_checked():
    """The planner's options are checked by name before any planning."""
    alloc, ids = forest("cpu", seed=8)
    with pytest.raises(TypeError, match="flat must be True, False or None, got 'yes'"):
        TreeAttentionPlan(alloc, ids, 4, _options=PlanOptions(flat="yes"))
    with pytest.raises(TypeError, match="_options must be a planner.PlanOptions"):
        TreeAttentionPlan(alloc, ids, 4, _options={"flat": True})


def test_non_finite_scale_is_rejected():
    alloc, ids = forest("cpu", seed=8)
    with pytest.raises(ValueError, match="sm_scale"):
        TreeAttentionPlan(alloc, ids, 4, sm_scale=float("nan"))


# ---- on the GPU -------------------------------------------------------------------------------

def gpu_forest(branches, depth, tokens, head_dim, dtype, seed):
    """A random forest on the GPU, 4 KV heads (2 at head_dim 256)."""
    return forest("cuda", num_kv_heads=2 if head_dim == 256 else 4, head_dim=head_dim,
                  dtype=dtype, branches=branches, depth=depth, tokens=tokens, seed=seed,
                  block_size=16, roots=1 + seed % 2)


@gpu
@settings(max_examples=40, deadline=None)
@given(branches=st.integers(1, 300), depth=st.integers(1, 10), tokens=st.integers(0, 300),
       group=st.sampled_from([1, 2, 4, 8, 16]), head_dim=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_gpu_random_trees(branches, depth, tokens, group, head_dim, dtype, seed):
    alloc, ids = gpu_forest(branches, depth, tokens, head_dim, dtype, seed)
    q = queries(alloc, ids, group * alloc.num_kv_heads, seed)
    auto = TreeAttentionPlan(alloc, ids, q.shape[1]).arrays
    most_lanes = max(1, 16 // group)  # the narrow final tile's; the wide one holds twice
    for separate, flat, lanes, one_tile in (
            (None, None, None, None), (not auto.separate_merge, None, None, None),
            (None, False, None, None), (None, True, None, None), (False, None, most_lanes, None),
            (False, None, seed % most_lanes + 1, None), (False, None, 2 * most_lanes, None),
            (True, False, None, True)):
        plan = TreeAttentionPlan(alloc, ids, q.shape[1],
                                 _options=PlanOptions(separate_merge=separate, flat=flat,
                                                      final_lanes=lanes, one_tile=one_tile))
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids)


@gpu
@settings(max_examples=30, deadline=None)
@given(branches=st.integers(1, 200), depth=st.integers(1, 8), tokens=st.integers(0, 300),
       group=st.sampled_from([1, 4, 8, 16]), head_dim=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_gpu_q_lens_random_trees(branches, depth, tokens, group, head_dim, dtype, seed):
    """Causal queries under the planner's choices, then the same queries under draft masks;
    then 1-4 queries a branch as query tiles (lanes where branches have the same count)."""
    alloc, ids = gpu_forest(branches, depth, tokens, head_dim, dtype, seed)
    q_lens = random_q_lens(alloc, ids, seed)
    q = queries(alloc, ids, group * alloc.num_kv_heads, seed, rows=sum(q_lens))
    for separate, block, tiles in ((None, None, None), (True, 8, False), (False, 1, False),
                                   (None, 16, False), (None, None, True)):
        plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens,
                                 _options=PlanOptions(separate_merge=separate,
                                                      query_block=block, query_tiles=tiles))
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids, q_lens=q_lens)
    mask = random_masks(q_lens, seed)
    for tiles in (False, True):
        plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=q_lens, mask=mask,
                                 _options=PlanOptions(query_tiles=tiles))
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids, q_lens=q_lens, mask=mask)
    short = [min(1 + seed % 4, n) for n in alloc.lengths(ids)]  # lanes: the same few queries
    q = queries(alloc, ids, group * alloc.num_kv_heads, seed, rows=sum(short))
    for mask in (None, random_masks(short, seed)):
        plan = TreeAttentionPlan(alloc, ids, q.shape[1], q_lens=short, mask=mask,
                                 _options=PlanOptions(query_tiles=True))
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids, q_lens=short, mask=mask)


@gpu
@pytest.mark.parametrize("name", ["seed_b256/q32kv8", "seed_b1/q16kv1", "ft_deep16/q32kv32",
                                  "ft_1,4,16,512/q32kv8", "long_1,4/q32kv8",
                                  "flat_64x2048/q16kv1", "flat_64x2048/q32kv8",
                                  "seed_b64/q32kv32", "ft_1,10/q32kv8"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_cases(name, dtype):
    case = dict(next(c for c in load_cases()["cases"] if c["name"] == name), dtype=dtype)
    alloc, leaves = case_allocator(case)
    q = queries(alloc, leaves, case["num_qo_heads"])
    check(tree_attention(q, alloc, leaves, out=poisoned_like(q)), q, alloc, leaves)


@gpu
def test_gpu_1024_branches_and_edge_lengths():
    """1024 branches: empty ones, length 1, exact block multiples, forks at 0."""
    alloc = PhysicalKVAllocator(6000, 16, 8, 128, device="cuda")
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, 64))
    ids = []
    for i in range(1024):
        position = (0, 1, 16, 64, 37)[i % 5]
        child = alloc.alloc_branch(position, parent_branch_id=root,
                                   fork_position=position).branch_id
        alloc.write(child, 0, *random_kv(alloc, gen, (0, 1, 16, 32, 5)[i % 5]),
                    start=position)
        ids.append(child)
    q = queries(alloc, ids, 32)
    check(tree_attention(q, alloc, ids, out=poisoned_like(q)), q, alloc, ids)


@gpu
def test_gpu_prepared_run_equals_the_per_launch_path():
    """``run`` launches its prepared launches: bit for bit what launching ``launches()`` one
    by one writes, in every layer; a misaligned pointer handed to them launches nothing."""
    alloc, ids = forest("cuda", num_kv_heads=8, head_dim=128, branches=64, tokens=200,
                        block_size=16, layers=2)
    q = queries(alloc, ids, 32)
    plan = TreeAttentionPlan(alloc, ids, 32, _options=PlanOptions(target_chunk=64, flat=False))
    for layer in range(alloc.num_layers):
        pools = alloc.k_pools[layer], alloc.v_pools[layer]
        per_launch = poisoned_like(q)
        runtime.run(plan.launches(q, *pools, per_launch), q.device)
        prepared = plan.run(q, layer, poisoned_like(q))
        torch.cuda.synchronize()
        assert torch.equal(prepared, per_launch), f"layer {layer}"
        check(prepared, q, alloc, ids, layer)
    assert len(plan.kernels) >= 2
    out = poisoned_like(q)
    pointers = (q.data_ptr(), *(p.data_ptr() for p in pools), out.data_ptr() + 2)
    with pytest.raises(CoreError, match=r"out must be a non-NULL, 16-byte aligned"):
        plan._core.run(*pointers, runtime.current_raw_stream(q.device.index))
    torch.cuda.synchronize()
    assert out.isnan().all()


@gpu
@pytest.mark.parametrize("name, separate, early", [
    ("seed_b256/q32kv8", False, False), ("seed_b256/q32kv8", True, False),
    ("seed_b256/q32kv8", False, True), ("seed_b256/q32kv8", True, True),
    ("ft_1,4,16,512/q32kv8", False, True),  # the widest window: many short partial programs
])                                          # (each node its own items)
def test_gpu_last_launch_waits_for_the_partials(name, separate, early):
    """On sm90 the final (or merge) launch starts while the partial launch ends (or, with
    ``early_final``, once its programs start), and waits for it only before merging: partials
    poisoned before every run never reach the output."""
    alloc, leaves = case_allocator(next(c for c in load_cases()["cases"] if c["name"] == name))
    q = queries(alloc, leaves, 32)
    plan = TreeAttentionPlan(alloc, leaves, 32,
                             _options=PlanOptions(separate_merge=separate, flat=False,
                                                  early_final=early, host_nodes=False))
    last = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], q)[-1].spec
    assert last.family == ("tree_merge" if separate else "tree_final")
    assert last.overlaps_previous == (plan.arch == "sm90")
    ref = reference.tree_attention(q, alloc, leaves)  # float64: once, not per run
    for _ in range(5):
        plan.partial_out.fill_(float("nan"))
        plan.partial_lse.fill_(float("nan"))
        err = reference.relative_error(plan.run(q, 0, poisoned_like(q)), ref)
        assert err < reference.TOLERANCE[q.dtype], f"relative error {err}"


def long_narrow_plan(device, **plan_kw):
    """``synthetic.long_narrow_node``'s tree planned as its docstring says; checks the plan is
    the one described: one narrow item, then four wide ones, then the final launch."""
    alloc, leaves = long_narrow_node(device)
    q = queries(alloc, leaves, 32)
    plan = TreeAttentionPlan(alloc, leaves, 32,
                             _options=PlanOptions(target_chunk=LONG_NODE_TOKENS, flat=False,
                                                  **plan_kw))
    launches = plan.launches(q, alloc.k_pools[0], alloc.v_pools[0], q)
    assert [(x.spec.family, dict(x.spec.constexprs).get("BLOCK_M")) for x in launches] == [
        ("tree_partial", 16), ("tree_partial", 64), ("tree_final", 16)]
    assert [x.grid[0] for x in launches[:2]] == [1, 4]
    return alloc, leaves, q, plan, launches


def test_second_partial_launch_overlaps_the_first_on_sm90_only():
    """Every launch of the plan is an overlapping kernel on sm90 (the launcher overlaps none
    that comes first in its sequence: tests/test_launcher.py), none elsewhere."""
    for arch in ("sm80", "sm89", "sm90"):
        *_, launches = long_narrow_plan("cpu", num_sms=132, arch=arch)
        assert [x.spec.overlaps_previous for x in launches] == [arch == "sm90"] * 3


@gpu
def test_gpu_second_partial_launch_waits_for_the_first():
    """On sm90 the wide tile's partial launch overlaps the narrow tile's, and the final launch
    waits for the wide one, which waits for the narrow one before it ends: the narrow launch's
    long partials, poisoned before every run, never reach the output."""
    alloc, leaves, q, plan, _ = long_narrow_plan("cuda")
    ref = reference.tree_attention(q, alloc, leaves)  # float64: once, not per run
    for _ in range(5):
        plan.partial_out.fill_(float("nan"))
        plan.partial_lse.fill_(float("nan"))
        err = reference.relative_error(plan.run(q, 0, poisoned_like(q)), ref)
        assert err < reference.TOLERANCE[q.dtype], f"relative error {err}"


@gpu
@pytest.mark.parametrize("scattered", [False, True])
def test_gpu_contiguous_partials_before_and_after_copy_on_write(scattered):
    """A 2003-token root read as one run of slots (or, its pages scattered, paged) matches the
    reference, and still does after a decode step copies its last block into every leaf."""
    alloc, ids = shared_root("cuda", scattered, root_tokens=2003, leaf_tokens=0)
    plan = TreeAttentionPlan(alloc, ids, 8, _options=PlanOptions(flat=False))
    assert plan.slot_runs == {block_m: int(not scattered) for block_m in plan.arrays.items}
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        q = queries(alloc, ids, 8, seed=step)
        for _ in range(3):
            check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids)
        alloc.append(alloc.reserve(ids), 0, *random_kv(alloc, gen, len(ids)))


@gpu
def test_gpu_decode_plan_follows_growth():
    """A plan with no partials is one launch of paged_decode's kernel over the plan's tables:
    right on the tree, and after every branch grew (it reads the lengths on the device)."""
    alloc, ids = forest("cuda", num_kv_heads=8, head_dim=128, branches=300, tokens=100,
                        block_size=16)
    plan = TreeAttentionPlan(alloc, ids, 32, _options=PlanOptions(flat=True))
    assert plan.arrays.as_paged_decode
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        q = queries(alloc, ids, 32, seed=step)
        check(plan.run(q, 0, poisoned_like(q)), q, alloc, ids)
        alloc.append(ids, 0, *random_kv(alloc, gen, len(ids)))


@gpu
def test_gpu_matches_paged_decode_without_sharing():
    alloc = PhysicalKVAllocator(600, 16, 8, 128, device="cuda")
    gen = torch.Generator().manual_seed(2)
    ids = []
    for length in (1, 15, 16, 17, 300, 2000, 0, 4096):
        branch = alloc.alloc_branch(0).branch_id
        alloc.write(branch, 0, *random_kv(alloc, gen, length))
        ids.append(branch)
    q = queries(alloc, ids, 32)
    out = tree_attention(q, alloc, ids)
    check(out, q, alloc, ids)
    assert torch.equal(out[6], torch.zeros_like(out[6]))


def launch_specs(plan):
    """The Spec of each of a plan's launches (its kernels by manifest name)."""
    return [runtime.spec_of(plan.arch, name) for name in plan.kernels]
