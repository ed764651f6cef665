"""The planner on CPU: every branch's path is covered exactly once, tiles cover every row,
and the cost model folds and computes the nodes it should."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_reasoning import PhysicalKVAllocator, _core, dispatch, planner
from flash_reasoning.ops.tree_attention import QUERY_BLOCK
from flash_reasoning.segment_tree import SegmentTree
from flash_reasoning.specializations import COMMON_FIELDS, QUERY_TILE_FIELDS, TREE_ITEM_FIELDS
from flash_reasoning.tools.bench import case_allocator, load_cases, seed_case, table_cases
from flash_reasoning.tools.synthetic import random_branches, random_kv

H100 = dict(num_sms=132, dtype_bytes=2)


def plan_for(alloc, ids, num_qo_heads, **kw):
    tree = alloc.segment_tree(ids)
    shape = planner.Shape(num_qo_heads, alloc.num_kv_heads, alloc.head_dim, **H100)
    return tree, planner.plan(tree, shape, planner.PlanOptions(**kw))


def coverage(tree, arrays):
    """Per row: a count of how often each token position is read (chunks + final range, or
    the open chunks when the plan merges separately)."""
    count = np.zeros((tree.branch_ids.size, int(tree.lengths.max(initial=0)) + 1), np.int64)
    for c in range(arrays.chunk_start.size):
        rows = arrays.order[arrays.chunk_row_ptr[c]:arrays.chunk_row_ptr[c]
                            + arrays.chunk_rows[c]]
        count[rows, arrays.chunk_start[c]:arrays.chunk_end[c]] += 1
    starts = arrays.final_range_starts()  # a packed program's shared range included
    for b, length in enumerate(tree.lengths):
        if not arrays.separate_merge:
            count[b, starts[b]:length] += 1
    return count


def check_open_chunks(tree, arrays):
    """Separate merge: each row's last chunk, from final_start, is its one open chunk (it
    follows the row's growth); otherwise no chunk is open."""
    opened = np.flatnonzero(arrays.chunk_open)
    if not arrays.separate_merge:
        assert opened.size == 0
        return
    assert arrays.chunk_table_row[opened].tolist() == list(range(tree.branch_ids.size))
    assert (arrays.chunk_rows[opened] == 1).all()
    assert (arrays.chunk_start[opened] == arrays.final_start).all()
    assert (arrays.chunk_end[opened] == tree.lengths).all()


def check_plan(tree, arrays, group):
    count = coverage(tree, arrays)
    for b, length in enumerate(tree.lengths):
        assert (count[b, :length] == 1).all(), f"row {b}: positions read {count[b, :length]}"
        assert (count[b, length:] == 0).all()
    # Each branch merges exactly the slots its chunks' partials were stored in.
    check_open_chunks(tree, arrays)
    assert sorted(arrays.entry_slot.tolist()) == list(range(arrays.num_entries))
    for b in range(tree.branch_ids.size):
        slots = np.arange(arrays.merge_ptr[b], arrays.merge_ptr[b + 1])
        entries = np.flatnonzero(np.isin(arrays.entry_slot, slots))
        chunk = np.searchsorted(arrays.chunk_entry0, entries, side="right") - 1
        rows = [arrays.order[arrays.chunk_row_ptr[c] + e - arrays.chunk_entry0[c]]
                for c, e in zip(chunk, entries)]
        assert rows == [b] * len(slots)
    # Tiles cover each chunk's (row, head) pairs exactly once.
    seen = {}
    for block_m, records in arrays.items.items():
        for rec in records:
            fields = dict(zip(TREE_ITEM_FIELDS, rec.tolist()))
            start, end, is_open = fields["kv_start"], fields["kv_end"], fields["open_end"]
            rows, first, entry0 = fields["num_rows"], fields["first_flat_row"], fields["entry0"]
            assert fields["run_split"] == end  # one run until item_runs finds two
            for f in range(first, min(first + block_m, rows * group)):
                key = (entry0 + f // group, f % group)
                assert key not in seen
                seen[key] = (start, end, is_open)
    assert len(seen) == arrays.num_entries * group
    start, end = TREE_ITEM_FIELDS.index("kv_start"), TREE_ITEM_FIELDS.index("kv_end")
    assert set(arrays.heads_first) == set(arrays.items)
    for block_m, records in arrays.items.items():  # heads first: items of unequal lengths
        length = records[:, end] - records[:, start]
        assert not arrays.heads_first[block_m] or length.max() >= 2 * max(length.min(), 1)


@settings(max_examples=60, deadline=None)
@given(branches=st.integers(1, 40), depth=st.integers(1, 10), tokens=st.integers(0, 70),
       group=st.sampled_from([1, 2, 4, 8, 16]), chunk=st.sampled_from([None, 64, 128]),
       merge=st.sampled_from([None, False, True]), one_tile=st.sampled_from([None, False, True]),
       host_nodes=st.sampled_from([None, False]), seed=st.integers(0, 2**16))
def test_plan_covers_every_path_once(branches, depth, tokens, group, chunk, merge, one_tile,
                                     host_nodes, seed):
    alloc = PhysicalKVAllocator(400, 8, 2, 8, device="cpu")
    ids = random_branches(alloc, branches, depth, tokens, seed=seed, roots=1 + seed % 2)
    tree, arrays = plan_for(alloc, ids, 2 * group, target_chunk=chunk, separate_merge=merge,
                            one_tile=one_tile, host_nodes=host_nodes)
    check_plan(tree, arrays, group)
    if merge is not None:
        assert arrays.separate_merge == merge
    if one_tile:
        assert set(arrays.items) <= {64}


def test_seed_b256_root_is_computed_once_and_leaves_fold():
    case = next(c for c in load_cases()["cases"] if c["name"] == "seed_b256/q32kv8")
    alloc, leaves = case_allocator(case, device="cpu")
    tree, arrays = plan_for(alloc, leaves, 32)
    assert arrays.stats["computed_nodes"] == 1
    assert (arrays.final_start == 2048).all()          # each leaf's 64 tokens, own kernel
    assert set(arrays.items) == {64}                   # 256 branches x 4 heads: wide tiles
    check_plan(tree, arrays, 4)


def test_deep_tree_folds_short_upper_levels():
    case = next(c for c in load_cases()["cases"] if c["name"] == "ft_deep16/q32kv8")
    alloc, leaves = case_allocator(case, device="cpu")
    tree, arrays = plan_for(alloc, leaves, 32)
    # 16-token nodes over up to 1024 branches: a partial per branch costs more than
    # re-reading 16 tokens, so the upper levels fold into their children.
    assert arrays.stats["computed_nodes"] < tree.num_nodes - len(leaves)
    assert arrays.merge_ptr[-1] <= 2 * len(leaves)
    check_plan(tree, arrays, 4)


def test_no_sharing_splits_a_lone_long_branch():
    alloc = PhysicalKVAllocator(2100, 16, 8, 128, device="cpu")
    root = alloc.alloc_branch(32768).branch_id
    tree, arrays = plan_for(alloc, [root], 32)
    assert arrays.chunk_start.size > 16      # split so the 8 KV heads fill 132 SMs
    assert arrays.separate_merge             # too many partials to fold one by one
    check_plan(tree, arrays, 4)


@pytest.mark.parametrize("name, separate", [
    ("seed_b256/q32kv8", False),   # 64 leaf tokens + the root's 2 partials: a short walk
    ("ft_deep16/q32kv8", False),
    ("long_1,4/q16kv1", True),     # a 32768-token root in 128 chunks: 128 partials to fold
    ("seed_b1/q32kv8", True),      # one branch: its last 192 tokens, then 6 partials
    ("flat_64x2048/q32kv8", False),  # no partials: the final kernel does everything
    ("ft_1,10/q32kv8", True),      # 80 final programs fold 17 partials: too few to fill the GPU
    ("long_1,4/q32kv32", False),   # 128 final programs: enough to fold their partials side by side
])
def test_merges_separately_when_a_final_walk_is_long(name, separate):
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    tree, arrays = plan_for(alloc, leaves, case["num_qo_heads"])
    assert arrays.separate_merge == separate
    forced = plan_for(alloc, leaves, case["num_qo_heads"], separate_merge=not separate)[1]
    assert forced.separate_merge != separate
    check_plan(tree, forced, case["num_qo_heads"] // case["num_kv_heads"])


@pytest.mark.parametrize("name, flat", [
    ("ft_1,2,64/q16kv1", True),    # 512-byte tokens: re-reading beats a partial launch
    ("ft_1,10/q16kv1", True),
    ("long_1,4/q16kv1", True),
    ("ft_1,16,64/q16kv1", False),  # 64 branches under 1280 shared tokens: sharing pays
    ("seed_b256/q32kv8", False),
    ("seed_b16/q32kv8", False),
])
def test_plans_flat_when_sharing_does_not_pay(name, flat):
    """The planner keeps the plan estimated faster: the cost model's folds or every node
    folded (flat); either can be forced and covers every path once."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    heads = case["num_qo_heads"]
    tree, arrays = plan_for(alloc, leaves, heads)
    folded = plan_for(alloc, leaves, heads, flat=False, one_tile=False)[1]  # tiles come after
    flat_plan = plan_for(alloc, leaves, heads, flat=True)[1]
    assert folded.stats["computed_nodes"] > 0 and flat_plan.stats["computed_nodes"] == 0
    assert (arrays.stats["computed_nodes"] == 0) == flat
    estimates = (folded.stats["estimated_us"], flat_plan.stats["estimated_us"])
    assert arrays.stats["estimated_us"] == min(estimates) and estimates[0] != estimates[1]
    for each in (folded, flat_plan):
        check_plan(tree, each, heads // case["num_kv_heads"])


@pytest.mark.parametrize("name, one_tile", [
    ("ft_1,10/q32kv8", True),      # the root's chunks and 10 leaves' chunks: one launch
    ("long_1,4/q16kv1", False),    # flat plans: one tile already
    ("ft_1,10/q16kv1", False),
    ("seed_b256/q32kv8", False),   # a final-kernel plan: its leaves are not partial items
])
def test_separate_merge_over_both_tiles_may_take_the_wide_one_alone(name, one_tile):
    """A separate merge over narrow and wide items is also planned with every item in the
    wide tile (one partial launch fewer), its folds unchanged; the plan estimated faster is
    kept."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    heads, group = case["num_qo_heads"], case["num_qo_heads"] // case["num_kv_heads"]
    tree, arrays = plan_for(alloc, leaves, heads)
    flat = arrays.stats["computed_nodes"] == 0
    own = plan_for(alloc, leaves, heads, flat=flat, one_tile=False)[1]
    assert (set(arrays.items) != set(own.items)) == one_tile
    if one_tile:
        assert arrays.separate_merge and set(own.items) == {16, 64} and set(arrays.items) == {64}
        assert arrays.stats["estimated_us"] < own.stats["estimated_us"]
    wide = plan_for(alloc, leaves, heads, flat=flat, one_tile=True)[1]
    assert set(wide.items) <= {64}
    for each in (arrays, own, wide):
        check_plan(tree, each, group)


def test_estimated_time_counts_launches_and_steps():
    """One unshared branch, one final launch: a fixed cost, then the longer of its serial
    steps and its bytes (here the steps)."""
    alloc = PhysicalKVAllocator(300, 16, 8, 128, device="cpu")
    short = [alloc.alloc_branch(64).branch_id]
    long = [alloc.alloc_branch(4096).branch_id]
    # One program per KV head walks one 64-token tile (its 256 KB take 0.09 us).
    assert plan_for(alloc, short, 32)[1].stats["estimated_us"] == pytest.approx(5.0 + 1.2)
    # Unsplit, 64 tiles one after another (16 MB: 5.6 us of bytes).
    walk = plan_for(alloc, long, 32, separate_merge=False, target_chunk=4096)[1]
    assert walk.stats["estimated_us"] == pytest.approx(5.0 + 64 * 1.2)
    # Split and merged separately: two short launches estimate far less.
    assert plan_for(alloc, long, 32)[1].stats["estimated_us"] < 30


@pytest.mark.parametrize("branches, heads, kv_heads, lanes", [
    (256, 32, 8, 4),    # group 4: four branches fill the 16-row tile; 512 programs remain
    (128, 32, 8, 4),    # 256 programs: still one per SM
    (64, 32, 8, 1),     # four lanes would leave 128 programs, under one per SM; two are never taken
    (64, 32, 32, 8),    # group 1: 256 programs at eight lanes; sixteen would leave 128
    (256, 32, 32, 16),  # sixteen fill the tile
    (512, 32, 4, 1),    # group 8: the tile holds two lanes, which are never taken
    (256, 16, 1, 1),    # group 16 fills the tile alone
    (256, 24, 8, 4),    # group 3: five fit, the power of two below is taken
])
def test_final_lanes_pack_branches_while_programs_remain(branches, heads, kv_heads, lanes):
    """Final-kernel programs serve as many branches as the narrow tile's rows hold over the
    GQA group (a power of two, at least kMinPackedLanes = 4), while at least one program per SM
    remains. (Two computed roots: a lone one takes lanes by its own rule, below.)"""
    alloc = PhysicalKVAllocator(2 * branches + 16, 16, kv_heads, 64, device="cpu")
    roots = [alloc.alloc_branch(256).branch_id for _ in range(2)]
    ids = [alloc.alloc_branch(272, parent_branch_id=roots[i % 2], fork_position=256).branch_id
           for i in range(branches)]
    tree, arrays = plan_for(alloc, ids, heads, separate_merge=False, flat=False)
    assert arrays.stats["computed_nodes"] == 2
    assert arrays.final_lanes == lanes
    most = max(1, 32 // (heads // kv_heads))  # the wide final tile's rows over the group
    for forced in (1, most):
        assert plan_for(alloc, ids, heads, flat=False, final_lanes=forced)[1].final_lanes in (
            forced, 1)  # 1: a plan that merges separately has no final kernel
    for bad, error in ((0, ValueError), (most + 1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="final_lanes"):
            plan_for(alloc, ids, heads, final_lanes=bad)


@pytest.mark.parametrize("longest, lanes", [
    (16, 16),   # sixteen lanes of 16 tokens: a walk of 4 tiles
    (64, 16),   # one leaf of 64 tokens: 16 tiles, the most a packed walk may take
    (80, 8),    # 20 tiles at sixteen lanes: halved
    (250, 4),   # 16 tiles at four lanes
    (300, 1),   # 19 tiles at four: two lanes are never taken
])
def test_final_lanes_stop_where_the_longest_final_range_walks_too_far(longest, lanes):
    """A packed program walks its lanes' final ranges side by side: lanes are halved until the
    longest final range takes at most kPackedWalkTiles (16) KV tiles, one lane below four."""
    alloc = PhysicalKVAllocator(1024, 16, 32, 64, device="cpu")
    roots = [alloc.alloc_branch(256).branch_id for _ in range(2)]
    ids = [alloc.alloc_branch(256 + (longest if i == 0 else 16), parent_branch_id=roots[i % 2],
                              fork_position=256).branch_id for i in range(256)]
    arrays = plan_for(alloc, ids, 32, separate_merge=False, flat=False)[1]
    assert arrays.stats["computed_nodes"] == 2
    assert arrays.final_lanes == lanes


@pytest.mark.parametrize("other_leaves, final_tokens", [
    (32, 256),     # 32x the mean: cut at kMinChunkTokens (twice the mean, 95, is shorter)
    (1024, 1024),  # even leaves: none is cut, however long
])
def test_a_final_range_far_longer_than_the_mean_is_cut(other_leaves, final_tokens):
    """Final ranges are cut at the chunk length, or at kFinalChunkMeanRatio (2) times their
    mean where that is shorter (kMinChunkTokens = 256 at least): one long leaf among short ones
    becomes partial items and a short final range, not one final program's long walk."""
    alloc = PhysicalKVAllocator(5300, 16, 8, 128, device="cpu")
    root = alloc.alloc_branch(16384).branch_id
    ids = [alloc.alloc_branch(16384 + (1024 if i == 0 else other_leaves), parent_branch_id=root,
                              fork_position=16384).branch_id for i in range(64)]
    tree, arrays = plan_for(alloc, ids, 32, separate_merge=False, flat=False)
    assert arrays.stats["chunk_tokens"] > 1536  # the root's chunks would leave 1024 whole
    assert (tree.lengths - arrays.final_start).max() == final_tokens
    check_plan(tree, arrays, 4)


def test_a_step_costs_less_below_head_dim_128():
    """The cost model prices a KV tile's step in proportion to head_dim below 128, alike above."""
    assert [_core.step_us(d) for d in (64, 128, 256)] == pytest.approx([0.6, 1.2, 1.2])


@pytest.mark.parametrize("name, lanes, programs", [
    ("seed_b128/q32kv8", 4, 256),   # 2 lanes (by programs per SM) would leave 512
    ("seed_b64/q32kv32", 8, 256),   # not 4
    ("seed_b256/q32kv8", 8, 256),   # past the narrow tile: the root outlasts the leaves
    ("ft_1,256/q32kv8", 4, 512),    # the narrow tile is full, the leaves outlast the root
    ("seed_b64/q32kv8", 1, 512),    # unpacked programs are lighter: left alone
    ("ft_1,1024/q32kv8", 4, 2048),  # a root of 512 programs: none run beside it
])
def test_a_lone_root_packs_its_final_programs_to_fit_beside_it(name, lanes, programs):
    """Beside a lone root of at most one program per SM, a packed final launch takes more lanes
    until its programs fit kPackedFinalsBesideRoot (2) per SM beside the root, or the narrow
    tile is full (the wide one where the root outlasts the leaves, below); an unpacked launch,
    or one beside a root of more programs, keeps its lanes."""
    case = next(c for c in table_cases(load_cases(), cpu=False) if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    arrays = plan_for(alloc, leaves, case["num_qo_heads"])[1]
    assert (arrays.final_lanes, arrays.stats["computed_nodes"]) == (lanes, 1)
    tiles = case["num_kv_heads"]  # final programs per lane group: one tile per KV head here
    assert -(-len(leaves) // lanes) * tiles == programs
    root_programs = sum(arrays.stats["partial_programs"].values())
    assert (root_programs <= H100["num_sms"]) == (name != "ft_1,1024/q32kv8")


@pytest.mark.parametrize("root, leaf, kv_heads, lanes", [
    (512, 24, 8, 8),      # H100, whole step: 30.4 us at 4 lanes, 27.6 at 8
    (512, 64, 8, 4),      # 41.4 against 43.9
    (1024, 64, 8, 8),     # 47.2 against 45.1
    (1024, 128, 8, 4),    # 65.8 against 69.4
    (2048, 64, 8, 8),     # seed_b256/q32kv8: 59.6 against 49.2
    (4096, 128, 8, 8),    # 97.3 against 82.6
    (2048, 24, 32, 32),   # group 1, 16 lanes against 32: 70.5 against 61.8
    (2048, 64, 32, 16),   # seed_b256/q32kv32: 118.1 against 124.8
])
def test_a_lone_root_that_outlasts_the_leaves_takes_the_wide_final_tile(root, leaf, kv_heads,
                                                                       lanes):
    """Past the narrow tile, a packed final launch beside a lone root takes the wide final
    tile's lanes (until its programs fit beside the root) where the root's launch is estimated
    to take longer than the final launch; each row is a tree measured whole on the H100 at both
    tiles' lanes, and the rule picks the faster on each."""
    case = seed_case(256, root, leaf, num_kv_heads=kv_heads)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    arrays = plan_for(alloc, leaves, case["num_qo_heads"])[1]
    assert (arrays.final_lanes, arrays.stats["computed_nodes"]) == (lanes, 1)
    assert sum(arrays.stats["partial_programs"].values()) <= H100["num_sms"]
    group = case["num_qo_heads"] // kv_heads
    assert arrays.final_block_m == (32 if lanes * group > 16 else 16)


@pytest.mark.parametrize("heads, lanes, block_m", [(32, 1, 16), (32, None, 16), (16, 2, 32),
                                                   (4, 8, 32), (4, 4, 16)])
def test_the_final_tile_holds_packed_lanes_only(heads, lanes, block_m):
    """The planner names the final tile's rows: the wide tile's only where packed lanes (more
    than one) overflow the narrow one; a GQA group of 32 at one lane takes two narrow tiles per
    KV head, never the wide one."""
    alloc = PhysicalKVAllocator(64, 16, 1, 64, device="cpu")
    root = alloc.alloc_branch(256).branch_id
    ids = [alloc.alloc_branch(300, parent_branch_id=root, fork_position=256).branch_id
           for _ in range(8)]
    arrays = plan_for(alloc, ids, heads, separate_merge=False, final_lanes=lanes)[1]
    assert (arrays.final_lanes, arrays.final_block_m) == (lanes or 1, block_m)


@pytest.mark.parametrize("name, early", [
    ("ft_1,4,16,512/q32kv8", True),   # 256 partial programs of 1408 tokens
    ("ft_1,1024/q32kv8", True),
    ("seed_b256/q32kv8", True),       # 256: one wave of compute-bound root programs
    ("ft_1,2,64/q32kv8", True),       # 32: SMs left free beside them
    ("ft_1,16,64/q32kv8", True),      # two partial launches: the wide one signals
    ("ft_1,10/q32kv8", False),        # merges separately: tree_merge has nothing to do early
    ("seed_b1/q16kv1", False),        # merges separately
    ("flat_64x2048/q32kv8", False),   # no partial launch
])
def test_final_starts_early_where_the_plan_has_a_final_kernel(name, early):
    """The last launch starts at the last partial launch's start where it is a final kernel (it
    walks its own ranges before it waits) and after the walks where it is tree_merge; forced
    either way it follows the option wherever a partial launch exists."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    tree, arrays = plan_for(alloc, leaves, case["num_qo_heads"])
    assert arrays.early_final == early
    assert early == (not arrays.separate_merge and bool(arrays.items))
    for forced in (False, True):
        again = plan_for(alloc, leaves, case["num_qo_heads"], early_final=forced)[1]
        assert again.early_final == (forced and bool(again.items))


@pytest.mark.parametrize("name, chunk_tokens", [
    # A lone root before a final launch, for one program per SM: 16 row tiles x 8 KV heads x
    # 2048 tokens over 132 SMs.
    ("seed_b256/q32kv8", 1986),
    ("seed_b64/q32kv8", 497),     # 4 x 8 x 2048 / 132: its 17 MB of leaves do not outweigh it
    ("seed_b64/q32kv32", 993),    # 1 x 32 x 2048 / 66: its 67 MB of leaves do
    ("ft_1,16,64/q32kv32", 621),  # 17 computed nodes: two programs per SM
    ("long_1,4/q32kv32", 3972),   # 32 x 32768 / 264: at one per SM its chunks would be 7944
    # Merged separately with a computed root: every range's chunks, one program per SM
    # ((8 x 4000 + 10 leaves x 8 x 400) / 132).
    ("ft_1,10/q32kv8", 485),
    ("seed_b1/q32kv8", 128),      # unshared: two per SM, down to kMinSeparateChunkTokens
])
def test_chunks_aim_for_programs_per_sm_by_what_runs_beside_them(name, chunk_tokens):
    """The chunk length spreads the partial launch's work over ``partial_programs()``: a lone
    computed node before a final launch one program per SM (room for final programs beside
    it), or one per two SMs where its leaves outweigh it (``leaves_outweigh_root``); a separate
    merge with computed nodes every range at one per SM; anything else two per SM."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    arrays = plan_for(alloc, leaves, case["num_qo_heads"])[1]
    assert arrays.stats["chunk_tokens"] == chunk_tokens


@pytest.mark.parametrize("root, head_dim, chunk_tokens", [
    (8192, 128, 3476),  # 28 row tiles x 4 KV heads x 8192 / 264: 6951 at one program per SM
    (8192, 256, 6951),  # two 64-row programs of head_dim 256 do not fit one SM
    (4096, 128, 3476),  # 112 x 4096 / 132: the whole 4096-token root a program, kept
])
def test_a_lone_root_that_would_walk_long_is_cut_for_two_programs_per_sm(root, head_dim,
                                                                         chunk_tokens):
    """``lone_root_walks_long``: a lone root whose chunks at one program per SM would pass
    kLongLoneRootChunkTokens is cut for two per SM (256 leaves of 128 tokens at 28 query and 4
    KV heads: 1792 rows a KV head, 28 tiles of 64), where two of its programs fit an SM."""
    alloc = PhysicalKVAllocator(root // 4 + 256 * 33 + 1, 4, 1, 8, device="cpu")
    base = alloc.alloc_branch(root).branch_id
    ids = [alloc.alloc_branch(root + 128, parent_branch_id=base, fork_position=root).branch_id
           for _ in range(256)]
    tree = alloc.segment_tree(ids)
    arrays = planner.plan(tree, planner.Shape(28, 4, head_dim, **H100))
    assert arrays.stats["computed_nodes"] == 1
    assert arrays.stats["chunk_tokens"] == chunk_tokens


def test_a_lone_root_outweighed_by_its_leaves_leaves_whole_sms_to_them():
    """``leaves_outweigh_root``: the leaves' HBM time against the root's estimated time (its
    programs' KV tiles, 2.4 us each in the wide tile, or its own bytes)."""
    from flash_reasoning import _core
    root = dict(root_tokens=2048, root_tiles=8, root_programs=128, wide_tile=True,
                num_kv_heads=32, head_dim=128, **H100)  # 16 KB of K and V a token
    # seed_b64/q32kv32's 64 leaves of 64 tokens: 22.4 us of HBM against 8 x 2.4 = 19.2 us.
    assert _core.leaves_outweigh_root(**root, leaf_tokens=64 * 64)
    assert not _core.leaves_outweigh_root(**root, leaf_tokens=16 * 64)
    # A root read at the narrow tile is bound by its own 33.5 MB (11.2 us), not its tiles.
    narrow = {**root, "wide_tile": False}
    assert not _core.leaves_outweigh_root(**narrow, leaf_tokens=32 * 64)
    assert _core.leaves_outweigh_root(**narrow, leaf_tokens=36 * 64)
    # Two waves of root programs double its tiles' time.
    assert not _core.leaves_outweigh_root(**{**root, "root_programs": 300},
                                              leaf_tokens=64 * 64)


@pytest.mark.parametrize("lanes, resident", [(1, 6), (2, 4), (4, 4), (8, 4)])
def test_final_waves_count_the_programs_each_kernel_fits(lanes, resident):
    """The final launch's waves in the cost model: the one-branch kernel fits 6 programs per SM,
    the packed kernel (two lanes or more: 240 registers, 39 KB of shared memory) 4 (ncu,
    H100)."""
    from flash_reasoning import _core
    assert _core.final_programs_per_sm(lanes) == resident


def test_lanes_do_not_apply_to_separate_merges():
    alloc = PhysicalKVAllocator(1100, 16, 8, 64, device="cpu")
    root = alloc.alloc_branch(512).branch_id
    ids = [alloc.alloc_branch(556, parent_branch_id=root, fork_position=512).branch_id
           for _ in range(256)]
    assert plan_for(alloc, ids, 32, separate_merge=True, flat=False)[1].final_lanes == 1
    # A 512-token root estimated to outlast its leaves of 44 tokens: the wide final tile's 8.
    assert plan_for(alloc, ids, 32, separate_merge=False, flat=False)[1].final_lanes == 8


def test_a_plan_without_partials_runs_as_a_paged_decode():
    """Unshared branches short enough not to split: no partials, so the plan is a paged decode
    (one branch per program), unless the caller forces the final kernel's lanes; a computed node
    or a split range makes partials, and the final kernel merges them."""
    alloc = PhysicalKVAllocator(1200, 16, 8, 64, device="cpu")
    ids = [alloc.alloc_branch(100).branch_id for _ in range(256)]
    decode = plan_for(alloc, ids, 32)[1]
    assert (decode.as_paged_decode, decode.final_lanes, decode.num_entries) == (True, 1, 0)
    forced = plan_for(alloc, ids, 32, final_lanes=4)[1]
    assert (forced.as_paged_decode, forced.final_lanes) == (False, 4)
    split = plan_for(alloc, ids, 32, separate_merge=False, target_chunk=64)[1]
    assert split.num_entries and not split.as_paged_decode
    root = alloc.alloc_branch(256).branch_id
    shared = [alloc.alloc_branch(300, parent_branch_id=root, fork_position=256).branch_id
              for _ in range(64)]
    assert not plan_for(alloc, shared, 32, flat=False)[1].as_paged_decode


def forked_sequences(alloc, forks, new_tokens):
    """A 96-token root and a branch forked from it at each of ``forks`` (in order), each then
    holding ``new_tokens`` tokens of its own, all written (a fork inside a block copies it)."""
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, 96))
    ids = [alloc.alloc_branch(at, root, at).branch_id for at in forks]
    alloc.append(alloc.reserve(ids, new_tokens), 0, *random_kv(alloc, gen, len(ids) * new_tokens))
    return ids


def sequences_with_own_leaves(alloc, leaf_tokens, queries):
    """Four branches forked at the end of a 512-token root, each then holding ``leaf_tokens``
    tokens of its own and ``queries`` new ones: their tree with a row per query, and the
    rows' sequences."""
    gen = torch.Generator().manual_seed(0)
    root = alloc.alloc_branch(0).branch_id
    alloc.write(root, 0, *random_kv(alloc, gen, 512))
    ids = [b.branch_id for b in alloc.alloc_branches(4, 512, root)]
    for tokens in (leaf_tokens, queries):
        alloc.append(alloc.reserve(ids, tokens), 0, *random_kv(alloc, gen, 4 * tokens))
    q_lens = [queries] * 4
    rows = np.repeat(np.arange(4, dtype=np.int32), q_lens)
    return alloc.segment_tree(ids, q_lens, QUERY_BLOCK), rows


@pytest.mark.parametrize("leaf_tokens, folds", [(64, True), (256, True), (300, False)])
def test_a_branch_own_short_node_folds_into_its_queries(leaf_tokens, folds):
    """The node that only one branch's queries read (its own tokens before the new ones) is
    one reader for the cost model, not one per query, where it is at most kSequenceFoldTokens
    (256) long: it folds into their final ranges (``sequence_folds``; by default where that
    plan estimates faster). Longer ones stay computed; rows without sequences (decode rows)
    keep the plan they had."""
    tree, rows = sequences_with_own_leaves(PhysicalKVAllocator(128, 16, 2, 64, device="cpu"),
                                           leaf_tokens, 4)
    shape = planner.Shape(8, 2, 64, **H100)

    def computed(rows=rows, **kw):
        options = planner.PlanOptions(query_tiles=False, flat=False, **kw)
        return planner.plan(tree, shape, options, rows).stats["computed_nodes"]
    assert computed(sequence_folds=False) == 5  # the root and each branch's own node
    assert computed(sequence_folds=True) == (1 if folds else 5)
    assert computed() in (computed(sequence_folds=False), computed(sequence_folds=True))
    assert computed(rows=None, sequence_folds=True) == 5


def test_query_tiles_pack_short_sequences_as_lanes():
    """Consecutive sequences of the same query count, two or more to a tile, share tiles as
    lanes (at most kQueryTileMaxLanes, 4; as few tiles as they fill, as even as they come): 12
    sequences of 2 queries take 3 tiles of 4 lanes. A tile's shared tokens are those
    all its lanes read from the same slots: up to the fork, or up to the block a fork inside a
    block copied. A lone sequence of its count is a tile of one lane."""
    alloc = PhysicalKVAllocator(64, 16, 2, 64, device="cpu")
    ids = forked_sequences(alloc, [96] * 6 + [90] * 6 + [96, 96], 20)
    q_lens = [2] * 12 + [3, 2]
    shape = planner.Shape(8, 2, 64, **H100)  # group 4: 16 queries a tile
    rows = np.repeat(np.arange(len(ids), dtype=np.int32), q_lens)
    tiles = planner.plan(alloc.segment_tree(ids, q_lens), shape,
                         planner.PlanOptions(query_tiles=True), rows).query_tiles
    assert tiles.tolist() == [[0, 8, 2, 96], [8, 8, 2, 80], [16, 8, 2, 80],
                              [24, 3, 3, 2**31 - 1], [27, 2, 2, 2**31 - 1]]


def test_query_tiles_cut_each_sequence_evenly():
    """Rows of one sequence (consecutive) cut into the fewest tiles of at most the tile's
    queries (64 rows over the group), as even as they come, unless sequences of its length
    pack a tile (test_query_tiles_pack_short_sequences_as_lanes); the plan is then flat, with
    no partials and each row's range its whole sequence. Rows of no sequence: no tiles."""
    alloc = PhysicalKVAllocator(200, 16, 2, 64, device="cpu")
    ids = [alloc.alloc_branch(100).branch_id for _ in range(4)]
    tree = alloc.segment_tree(ids)
    shape = planner.Shape(8, 2, 64, **H100)  # group 4: 16 queries a tile
    sequence = np.array([0, 0, 1, 1], np.int32)
    tiles = planner.plan(tree, shape, planner.PlanOptions(query_tiles=True), sequence)
    assert tiles.query_tiles.tolist() == [[0, 4, 2, 0]]  # two lanes, no tokens in common
    assert tiles.num_entries == 0 and (tiles.final_start == 0).all() and not tiles.items
    assert planner.plan(tree, shape, planner.PlanOptions(query_tiles=True)).query_tiles.size == 0
    rows = np.repeat(np.arange(4, dtype=np.int32), [17, 16, 1, 40])
    lengths = np.full(rows.size, 100)
    keys = np.stack([rows, np.full(rows.size, -1, np.int32)], axis=1)
    many = SegmentTree.from_keys(rows, lengths, np.array([0, 100]), keys)
    arrays = planner.plan(many, shape, planner.PlanOptions(query_tiles=True), rows)
    one_lane = 2**31 - 1  # a tile of one lane: all its tokens are the lanes' shared ones
    assert arrays.query_tiles.tolist() == [
        [0, 9, 9, one_lane], [9, 8, 8, one_lane], [17, 16, 16, one_lane], [33, 1, 1, one_lane],
        [34, 14, 14, one_lane], [48, 14, 14, one_lane], [62, 12, 12, one_lane]]
    # By default: full tiles (48 rows of 64 on average), or half-full ones over short walks,
    # with a program per SM; tiles with lanes only full ones over short walks.
    many_sms = dataclasses.replace(shape, num_sms=8)
    def sequences(queries, length):  # 4 sequences of `queries` rows, each `length` tokens
        rows = np.repeat(np.arange(4, dtype=np.int32), queries)
        keys = np.stack([rows, np.full(rows.size, -1, np.int32)], axis=1)
        return SegmentTree.from_keys(rows, np.full(rows.size, length), np.array([0, length]),
                                     keys), rows

    for queries, length, expected in ((12, 2000, True), (10, 2000, False), (10, 1000, True),
                                      (4, 1000, False)):  # 4: 4 lanes in 1 tile, 2 programs
        tree, rows = sequences(queries, length)
        arrays = planner.plan(tree, many_sms, planner.PlanOptions(), rows)
        assert (arrays.query_tiles.size > 0) == expected, (queries, length)
    lanes_sms = dataclasses.replace(shape, num_sms=4)
    # 2 tiles of 2 lanes (4 programs) walking 2 x length tokens (nothing shared); 5 queries: 40
    # rows a tile.
    for queries, length, expected in ((8, 500, True), (8, 1100, False), (5, 500, False)):
        tree, rows = sequences(queries, length)
        arrays = planner.plan(tree, lanes_sms, planner.PlanOptions(), rows)
        lanes = arrays.query_tiles[:, 2] < arrays.query_tiles[:, 1]
        assert lanes.size == 2 * expected and lanes.all(), (queries, length)
    few_programs = dataclasses.replace(shape, num_sms=9)  # 4 tiles x 2 KV heads
    tree, rows = sequences(12, 2000)
    assert planner.plan(tree, few_programs, planner.PlanOptions(), rows).query_tiles.size == 0
    dispatch_rows = dispatch.dispatch_rules("sm90")["constants"]["tree_queries_block_m"]
    assert dispatch_rows == dict(dispatch.tree_queries_spec("float16", 128, "sm90").constexprs)[
        "BLOCK_M"] == 64


def test_merge_steps_match_the_merge_kernel():
    from flash_reasoning import _core, dispatch
    assert _core.MERGE_SLOTS_PER_STEP == dispatch.MERGE_BLOCK_S


def test_final_kernel_rows_are_the_planner_narrow_tile():
    """The planner's lanes and final grid (PlanShape::final_tiles, also the C ABI's final
    launch) count the narrow tile's rows; tree_final is compiled with BLOCK_M rows, and its
    wide packed form with the rows the planner is given for it (the C ABI: the manifest's)."""
    from flash_reasoning import dispatch
    assert dict(dispatch.tree_final_spec("float16", 128, "sm90").constexprs)["BLOCK_M"] \
        == dispatch.TREE_BLOCK_MS[0]
    wide = dispatch.tree_final_spec("float16", 128, "sm90", packed=True, wide=True)
    assert dict(wide.constexprs)["BLOCK_M"] == dispatch.FINAL_WIDE_BLOCK_M \
        == dispatch.dispatch_rules("sm90")["constants"]["tree_final_block_m_wide"]


def test_empty_branches_plan_to_empty_ranges():
    alloc = PhysicalKVAllocator(10, 4, 1, 8, device="cpu")
    ids = [alloc.alloc_branch(0).branch_id for _ in range(3)]
    tree, arrays = plan_for(alloc, ids, 4)
    assert arrays.num_entries == 0 and (arrays.final_start == 0).all()


@pytest.mark.parametrize("lengths, items, heads_first", [
    ([], 1, False), ([256], 1, False), ([256, 256, 256], 3, False), ([256, 144], 2, False),
    ([1280, 128], 64, True), ([1024, 256, 1024], 3, True), ([128, 64], 2, True),
    ([0, 64], 2, True), ([1280, 128], 66, True), ([1280, 128], 67, False)])
def test_few_waves_of_unequal_items_run_each_items_heads_together(lengths, items, heads_first):
    """``heads_first_order`` at 8 KV heads on 132 SMs: a longest item at least twice the
    shortest, at most 4 programs per SM (66 items); never more items than a grid's second
    dimension holds."""
    from flash_reasoning import _core
    assert (_core.HEADS_FIRST_LENGTH_RATIO, _core.HEADS_FIRST_PROGRAMS_PER_SM) == (2, 4)
    assert _core.heads_first_order(lengths, items, 8, 132) == heads_first
    assert _core.heads_first_order([1280, 128], 65535, 1, 20000)
    assert not _core.heads_first_order([1280, 128], 65536, 1, 20000)


def test_plans_order_their_launches_by_item_lengths():
    """Each node with items of its own (``host_nodes=False``), ft_1,4,16,512/q32kv8's partial launch
    (a folded root's 1280-token items, then 128-token ones, 3.9 programs per SM) runs each item's
    heads together; /q32kv32's (7.8 programs per SM) and seed_b256's root (equal chunks), each
    head's items."""
    for name, expected in (("ft_1,4,16,512/q32kv8", {64: True}),
                           ("ft_1,4,16,512/q32kv32", {64: False}),
                           ("seed_b256/q32kv8", {64: False})):
        case = next(c for c in load_cases()["cases"] if c["name"] == name)
        alloc, leaves = case_allocator(case, device="cpu")
        tree, arrays = plan_for(alloc, leaves, 32, host_nodes=False)
        assert arrays.heads_first == expected, name


@pytest.mark.parametrize("name, lengths, entries", [
    ("ft_1,4,16,512/q32kv8", {1408}, 512),               # level 2: two tiles of level 1's rows
    ("ft_1,4,16,512/q32kv32", {1280, 128}, 1024)])       # level 1 in the root's; level 2: half
def test_nodes_whose_rows_are_whole_tiles_are_read_in_their_host_items(name, lengths, entries):
    """A computed node whose (branch, head) rows are whole wide tiles of its nearest computed
    ancestor's has no items: those tiles read on through its tokens, and its branches merge one
    partial fewer; a node of half a tile keeps its own (``host_nodes=False``: every node its
    own)."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu")
    start, end = TREE_ITEM_FIELDS.index("kv_start"), TREE_ITEM_FIELDS.index("kv_end")
    for host_nodes in (None, False):
        tree, arrays = plan_for(alloc, leaves, 32, host_nodes=host_nodes)
        check_plan(tree, arrays, 32 // case["num_kv_heads"])
        records = arrays.items[64]
        if host_nodes is None:
            assert set((records[:, end] - records[:, start]).tolist()) == lengths
            assert arrays.num_entries == entries
        else:
            assert arrays.num_entries > entries


@pytest.mark.parametrize("lanes, common, programs, row_bytes, heads_first", [
    (4, False, 256, 8192, True), (8, False, 32, 4096, True), (4, False, 256, 2048, False),
    (1, False, 64, 8192, False), (8, True, 128, 8192, False), (2, False, 65535, 8192, True),
    (2, False, 65536, 8192, False)])
def test_packed_final_launches_run_each_programs_heads_together(lanes, common, programs,
                                                                row_bytes, heads_first):
    """``final_heads_first``: packed final launches without shared ranges, over token rows of
    at least 4 KB (a token's K across the KV heads), of no more programs than a grid's second
    dimension holds."""
    from flash_reasoning import _core
    assert _core.final_heads_first(lanes, common, programs, row_bytes) == heads_first


def test_plans_order_their_final_launches():
    """The leaf-heavy cases' packed final launches over 8 KB token rows (32 KV heads) run each
    program's heads together; over 2 KB rows (8 KV heads) they do not, nor do the deep tree's
    shared-range programs or one-branch programs; a plan that merges separately has no final
    launch to order."""
    for name, expected in (("ft_1,1024/q32kv32", True), ("seed_b256/q32kv32", True),
                           ("ft_1,1024/q32kv8", False), ("ft_deep16/q32kv32", True),
                           ("ft_deep16/q32kv8", False), ("ft_1,16,64/q32kv8", False),
                           ("ft_1,10/q32kv8", False)):
        case = next(c for c in load_cases()["cases"] if c["name"] == name)
        alloc, leaves = case_allocator(case, device="cpu", random=False)
        tree, arrays = plan_for(alloc, leaves, 32)
        packed = arrays.final_lanes > 1 and not arrays.separate_merge and not arrays.as_paged_decode
        wide_rows = alloc.num_kv_heads * alloc.head_dim * 2 >= 4096
        assert arrays.final_heads_first == expected == (packed and not arrays.has_common
                                                        and wide_rows), name


def test_item_fields_match_the_core():
    """The C++ planner writes the records the kernels read by TREE_ITEM_FIELDS,
    COMMON_FIELDS and QUERY_TILE_FIELDS."""
    from flash_reasoning import _core
    assert tuple(_core.TREE_ITEM_FIELDS) == TREE_ITEM_FIELDS
    assert tuple(_core.COMMON_FIELDS) == COMMON_FIELDS
    assert tuple(_core.QUERY_TILE_FIELDS) == QUERY_TILE_FIELDS
    assert dispatch.SLOT_RUN_COUNTS == tuple(range(1, _core.MAX_ITEM_RUNS + 1))


def check_shared_ranges(alloc, ids, arrays):
    """Each packed program's shared range lies in the same pages of every lane's table, below
    every lane's length, from where the lanes' final ranges begin; the lanes' final_start is its
    end. Returns the number of programs with a range."""
    tables, rows = alloc.host_tables(alloc.segment_tree(ids).branch_ids)
    lengths = alloc.segment_tree(ids).lengths
    starts = arrays.final_range_starts()
    shared = 0
    for p, (lead, start, end) in enumerate(arrays.common.tolist()):
        lanes = arrays.order[p * arrays.final_lanes:(p + 1) * arrays.final_lanes]
        assert lead == lanes[0] and starts[lead] == start and start <= end
        if start == end:
            continue
        shared += 1
        assert len(lanes) > 1 and (starts[lanes] == start).all()
        assert (arrays.final_start[lanes] == end).all() and (lengths[lanes] >= end).all()
        pages = slice(start // alloc.block_size, -(-end // alloc.block_size))
        assert (tables[rows[lanes], pages] == tables[rows[lead], pages]).all()
    return shared


@settings(max_examples=40, deadline=None)
@given(branches=st.integers(2, 40), depth=st.integers(1, 8), tokens=st.integers(1, 60),
       group=st.sampled_from([1, 2, 4, 8]), lanes=st.sampled_from([2, 3, 4, 8]),
       flat=st.sampled_from([None, True]), seed=st.integers(0, 2**16))
def test_packed_programs_share_the_ranges_their_lanes_share(branches, depth, tokens, group, lanes,
                                                            flat, seed):
    """Random trees packed at any lane count: every path is still read once (the shared range
    once for each of its lanes), and the shared ranges are shared; a plan where no program
    shares a range keeps no records."""
    if lanes * group > 32:
        lanes = 32 // group
    alloc = PhysicalKVAllocator(400, 8, 2, 8, device="cpu")
    ids = random_branches(alloc, branches, depth, tokens, seed=seed, roots=1 + seed % 2)
    tree, arrays = plan_for(alloc, ids, 2 * group, flat=flat, final_lanes=lanes,
                            separate_merge=False)
    check_plan(tree, arrays, group)
    shared = check_shared_ranges(alloc, ids, arrays)  # a record per program, where one shares
    assert arrays.common.shape == ((-(-branches // lanes), 3) if shared else (0, 3))


def test_sibling_leaves_read_their_shared_path_once():
    """A flat plan of four sibling leaves per program (nodes of 32, 16, 16 tokens, then 5 own
    each): each program reads the 64-token path once; eight lanes span two parents and share
    the 48 tokens above them. Unpacked plans have no shared ranges."""
    from flash_reasoning.tools.bench import level_case
    case = level_case("deep", (1, 2, 8, 32), (32, 16, 16, 5), num_kv_heads=4, num_qo_heads=16,
                      head_dim=8)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    for lanes, shared in ((4, 64), (8, 48)):
        tree, arrays = plan_for(alloc, leaves, 16, flat=True, final_lanes=lanes)
        assert arrays.has_common and check_shared_ranges(alloc, leaves, arrays) == 32 // lanes
        assert (arrays.common[:, 1:] == [0, shared]).all() and (arrays.final_start == shared).all()
        assert (arrays.final_range_starts() == 0).all()
        check_plan(tree, arrays, 4)
    unpacked = plan_for(alloc, leaves, 16, flat=True, final_lanes=1)[1]
    assert unpacked.common.size == 0 and not unpacked.has_common


@pytest.mark.parametrize("name, shared", [
    ("ft_deep16/q32kv8", True),    # 8 sibling leaves of 16 tokens under a 128-token path
    ("ft_deep16/q16kv1", False),   # 2 lanes (the wide tile at group 16): too few
    ("ft_1,256/q16kv1", False),
    ("ft_deep16/q32kv32", False),  # 32 lanes: 32 leaves' own 64 tokens each, a long walk
    ("ft_1,16,64/q32kv8", False),  # the shared path is 1280 tokens: too long a walk
    ("ft_1,2,64/q32kv8", False),
    ("seed_b256/q32kv8", False),
])
def test_deep_trees_plan_flat_with_shared_ranges(name, shared):
    """Where a flat plan's programs of sibling leaves (the wide final tile's lanes, four at
    least) walk at most kSharedRangeWalk tiles and are estimated faster, the planner keeps it:
    one launch, no partials, each program's shared path read once."""
    case = next(c for c in load_cases()["cases"] if c["name"] == name)
    alloc, leaves = case_allocator(case, device="cpu", random=False)
    tree, arrays = plan_for(alloc, leaves, case["num_qo_heads"])
    assert arrays.has_common == shared
    if shared:
        assert arrays.stats["computed_nodes"] == 0 and arrays.num_entries == 0
        assert arrays.final_lanes == 32 // (case["num_qo_heads"] // case["num_kv_heads"])
        assert (arrays.common[:, 2] - arrays.common[:, 1] == 128).all()
        check_shared_ranges(alloc, leaves, arrays)
        check_plan(tree, arrays, case["num_qo_heads"] // case["num_kv_heads"])
        forced = plan_for(alloc, leaves, case["num_qo_heads"], flat=False)[1]
        assert not forced.has_common  # the knob that forces the tree plan


def test_heads_not_a_multiple_is_a_value_error():
    alloc = PhysicalKVAllocator(10, 4, 1, 8, device="cpu")
    ids = [alloc.alloc_branch(4).branch_id]
    tree = alloc.segment_tree(ids)
    with pytest.raises(ValueError, match="num_qo_heads"):
        planner.plan(tree, planner.Shape(3, 2, 8, 2, 132))


def test_partials_past_int32_indexing_are_a_value_error():
    """A computed root's two partials of 2**30 heads each: one past the kernels' int32 index
    (2**29 heads still plans)."""
    alloc = PhysicalKVAllocator(40, 4, 1, 8, device="cpu")
    root = alloc.alloc_branch(64).branch_id
    ids = [alloc.alloc_branch(65, parent_branch_id=root, fork_position=64).branch_id
           for _ in range(2)]
    tree = alloc.segment_tree(ids)
    assert planner.plan(tree, planner.Shape(2**29, 2**29, 8, 2, 132),
                                            planner.PlanOptions(flat=False)).num_entries == 2
    with pytest.raises(ValueError, match="the plan needs 2 partials of 1073741824 heads"):
        planner.plan(tree, planner.Shape(2**30, 2**30, 8, 2, 132))


def item(table_row, kv_start, kv_end, open_end=0):
    """A record as the planner writes it (run_split at kv_end: one run)."""
    record = dict.fromkeys(TREE_ITEM_FIELDS, 0)
    record.update(table_row=table_row, kv_start=kv_start, kv_end=kv_end, open_end=open_end,
                  run_split=kv_end)
    return list(record.values())


@pytest.mark.parametrize("records, runs, splits", [
    ([item(0, 0, 32)], 1, None),         # pages 10, 11, 12, 13
    ([item(0, 5, 27), item(1, 3, 8)], 1, None),  # inside pages; one page (any id) is a run
    ([item(1, 0, 16)], 2, [8]),          # pages 40, 7: two runs, the second from token 8
    ([item(1, 3, 12)], 2, [8]),          # from inside a page
    ([item(0, 0, 32), item(1, 0, 16)], 2, [32, 8]),  # one run: its split is its end
    ([item(2, 16, 40)], 2, [24]),        # pages 9 | 5, 6
    ([item(2, 0, 16)], 1, None),         # pages 3, 4
    ([item(2, 0, 40)], 0, None),         # pages 3, 4 | 9 | 5, 6: three runs
    ([item(2, 9, 33), item(0, 0, 32)], 0, None),  # pages 4 | 9 | 5, 6: one item spoils the launch
    ([item(0, 0, 32, open_end=1)], 0, None),  # reads to its row's length: not the planned range
    ([item(0, 0, 33)], 0, None),         # past final_start[0] (32): a final range's chunk
    ([item(3, 0, 8)], 0, None),          # no such row
    ([item(0, 8, 8)], 0, None),          # empty
    ([], 1, None),
])
def test_item_runs_need_closed_shared_ranges_broken_once_at_most(records, runs, splits):
    """The core's ``item_runs`` (which every plan runs): rows read the allocator's mirror in
    place through their row index; where two runs, each item's run_split is written in its
    record, else no record changes."""
    mirror = np.array([[0] * 6, [40, 7, 0, 0, 0, 0], [10, 11, 12, 13, 14, 0],
                       [3, 4, 9, 5, 6, 0]], np.int64)
    rows = np.array([2, 1, 3])  # branch 0's table is mirror row 2
    work = np.array(records, np.int32).reshape(-1, len(TREE_ITEM_FIELDS))
    final_start = np.array([32, 16, 40], np.int32)
    assert _core.item_runs(work, final_start, mirror, rows, 8) == runs
    split = TREE_ITEM_FIELDS.index("run_split")
    written = np.array(records, np.int32).reshape(-1, len(TREE_ITEM_FIELDS))
    if splits is not None:
        written[:, split] = splits
    assert np.array_equal(work, written)


def test_item_runs_reject_bad_tables_and_records_it_cannot_write():
    from flash_reasoning import _core
    records = np.array([item(0, 0, 8)], np.int32)
    starts = np.array([8], np.int32)
    for tables, rows, match in [(np.zeros(4, np.int64), np.array([0]), "2-D"),
                                (np.zeros((1, 4), np.int64), np.array([1]), "index tables"),
                                (np.zeros((1, 4), np.int64), np.array([0, 0]), "rows must be")]:
        with pytest.raises(ValueError, match=match):
            _core.item_runs(records, starts, tables, rows, 8)
    read_only = records.copy()
    read_only.flags.writeable = False
    # A converted copy would take the splits and drop them: only the array itself is written.
    for bad in (records[:, :4], records.astype(np.int64), read_only,
                np.asfortranarray(np.repeat(records, 2, axis=0))):
        with pytest.raises(ValueError, match="records must be"):
            _core.item_runs(bad, starts, np.zeros((1, 4), np.int64), np.array([0]), 8)


@pytest.mark.parametrize("field, value, match", [
    ("node_parent", [5, -1, 0], "node_parent\\[0\\] must be -1 or an earlier node"),
    ("node_end", [9, 10, 11], "starts at 8, its parent ends at 9"),
    ("order", [0, 0, 1], "order is not a permutation"),
    ("end_node", [0, 1, 7], "end_node\\[2\\] is not a node"),
])
def test_an_inconsistent_tree_is_refused_before_planning(field, value, match):
    """The planner indexes by the tree's arrays: a SegmentTree made by hand and broken is a
    ValueError naming what is wrong (it aborted the process in the C++ core before)."""
    alloc = PhysicalKVAllocator(16, 4, 2, 8, device="cpu")
    root = alloc.alloc_branch(8).branch_id
    ids = [root] + [alloc.alloc_branch(8 + k, parent_branch_id=root).branch_id for k in (2, 3)]
    tree = alloc.segment_tree(ids)
    planner.plan(tree, planner.Shape(4, 2, 8, 2, 132))  # as built: fine
    broken = dataclasses.replace(tree, **{field: np.array(value, np.int64)})
    with pytest.raises(ValueError, match=match):
        planner.plan(broken, planner.Shape(4, 2, 8, 2, 132))
