// The tree-attention planner: from a segment tree to what each kernel program computes.
//
// Every node of the tree is either *computed* once for all the branches below it (its KV read
// once, one fp32 partial per branch written and merged later) or *folded* into its consumers
// (its children and the branches ending at it), which then read its tokens as part of their
// own range. The cost model folds a node when re-reading its KV costs less than the partials it
// would write; an exclusive leaf always folds into its branch.
//
// A computed node whose rows are whole row tiles of its nearest computed ancestor's range is
// *hosted* there: those tiles read on through its tokens, and it has no items of its own.
//
// Each branch ends with a *final range* (what is left of its path after the computed nodes,
// read through its own block table): the final kernel computes it, merges the branch's partials
// and writes the output. Long ranges are cut into chunks so the grid fills the GPU (a final range
// far longer than the others shorter still); every chunk but a final range's last one becomes a
// partial work item, tiled over its (branch, query head) rows. A final-kernel program walks its
// range's KV tiles, then folds its branch's partials one after another, a dependent round trip
// each, after the partial launch is done.
// Once some program's walk is kSeparateMergeSteps long (kLaunchSteps more if that takes a
// partial launch of one more tile size), and the final launch is too small to fill the GPU
// (kMergeInFinalProgramsPerSm), the plan *merges separately*: every
// chunk of every final range is a partial item too (the last one open: it reads to its
// branch's length on the device), so they run in parallel, and a merge kernel folds each
// (branch, head) row's partials in vectorised blocks, with no final kernel.
//
// A plan that merges separately over both row tiles runs two partial launches; the same plan
// with every item in the wide tile runs one (its narrow items waste MMA rows, not HBM bytes).
// Once the folds are chosen (flat or not), the planner keeps whichever estimated_us() finds
// faster (H100, ft_1,10/q32kv8: 38.5 -> 33.1 us).
//
// Computing shared nodes saves HBM bytes but costs a partial launch and a merge, which a small
// tree cannot repay (one KV head: a token is 512 bytes). So the planner also plans the tree
// *flat* (every node folded: each branch reads its whole path, as a paged decode does) and
// keeps whichever plan estimated_us() finds faster. Python (flash_reasoning.planner) and the
// C ABI both plan through this file.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "planner/segment_tree.h"
#include "util/int_math.h"
#include "util/status.h"

namespace flash_reasoning {

// Re-read KV of a folded node costs this fraction of an HBM byte: its consumers run close
// together in the grid, so most re-reads hit L2.
constexpr double kRereadWeight = 0.5;
// A chunk shorter than this costs more in partials than its parallelism gains; merged
// separately (vectorised), unshared branches' chunks pay down to the second (H100, one
// 2112-token branch: 17.5 us in 256-token chunks, 15.4 in 128).
constexpr int64_t kMinChunkTokens = 256;
constexpr int64_t kMinSeparateChunkTokens = 128;
// The chunk length spreads the computed nodes' work; final ranges are cut at it too, but where
// one is far longer than the others, one final program walks it long after the rest are done
// (H200, random_tree_74/q64kv8d64: the final launch 62.6 us of the plan's 72.7, a 1039-token leaf
// at 1234-token chunks, the mean final range 126). So final ranges are cut at this many times
// their mean where that is shorter, the leading pieces partial items (final_chunk_tokens()).
// H200, 343 family and cases-file trees: 0.990x the time on the family's fit half, 0.987x on the
// held-out half, none more than 2% slower (the bench: random_tree_74 72.1 -> 49.3 us); at 1x or
// 1.5x, or 1.5x down to 128 tokens, up to 2% more won and up to 13% lost
// (tree_of_thought_212/q64kv8d256).
constexpr int64_t kFinalChunkMeanRatio = 2;
// Programs per SM the chunking aims for (partial_programs()): kWaves, but kLoneRootWaves for a
// lone computed node before a final launch. Two root programs (64 rows, ~26K registers and
// 112 KB of shared memory each) fill an SM; one leaves room for two final programs, which the
// early start lets walk the leaves beside it (H100: seed_b64/q32kv8
// 31.2 -> 23.9 us, seed_b256/q32kv32 128.4 -> 118.7; trees of several computed nodes lose).
constexpr int64_t kWaves = 2;
constexpr int64_t kLoneRootWaves = 1;
// ... but kWaves for a lone root whose chunks would be longer than this at kLoneRootWaves: one
// program per SM then walks the root long after the final programs beside it are done, on half
// the SM's tensor cores (lone_root_walks_long()). Only where two of its programs fit an SM, at
// head_dim up to kTwoRootProgramsHeadDim: a 64-row tile of head_dim 256 at its 3-stage config
// takes 224 KB of shared memory. H200, 8192-token prompts under 256 leaves of 128 tokens: 110.9
// -> 90.8 us at q28kv4, 113.1 -> 108.6 at q32kv8; the family's plans it changes 0.91x the time
// (fit half), none slower by more than 3%; cut at 2048 tokens it loses up to 19% (8192 tokens
// under 128 leaves).
constexpr int64_t kLongLoneRootChunkTokens = 4096;
constexpr int64_t kTwoRootProgramsHeadDim = 128;
// ... and a lone root whose leaves outweigh it (leaves_outweigh_root()) one program per this many
// SMs: whole SMs are left to the final programs, which walk the leaves while the root computes
// (H100: seed_b64/q32kv32, 67 MB of leaves under a 2048-token root,
// 48.5 -> 44.5 us in 64 root programs, not 128).
constexpr int64_t kOutweighedRootSmsPerProgram = 2;
// A plan that merges separately with computed nodes runs every range's chunks in its one partial
// launch, with nothing beside it: it cuts them all for this many programs per SM, fewer and longer
// than kWaves, with fewer partials to merge (H100: ft_1,10/q32kv8, a 4000-token root over 10 leaves
// of 400, 29.2 -> 26.1 us in 144 programs, not 288).
constexpr int64_t kSeparateMergeWaves = 1;
// Chunk boundaries fall on multiples of the kernels' KV tile.
constexpr int64_t kChunkAlign = 64;
// Serial steps (KV tiles of kChunkAlign tokens + partials) of a final-kernel program from which
// a separate merge wins, and the steps a partial launch of one more tile size costs (H100: a
// walk of 9 steps takes 13-14 us, the merge launch 6-13 us, a
// launch of narrow leaf items 9 us).
constexpr int64_t kSeparateMergeSteps = 8;
constexpr int64_t kLaunchSteps = 4;
// ... but a final launch of at least this many programs per SM (its rows x final tiles) keeps its
// merge whatever its walk: started early, its programs walk their own ranges beside the partial
// launch and fold their partials side by side, where a separate merge would write and read every
// final chunk's partial and add a launch (H100: over 107 root-and-leaves trees and cases the regret
// against the faster mode fell from 24 trees over 3% to 12; long_1,4/q32kv32 194.8 -> 182.9 us, 16
// leaves of 400 under a 4096-token root at q32kv32 78.7 -> 69.2; below it, 10 such leaves at q32kv8
// keep the separate merge, 28.7 against 34.3).
constexpr double kMergeInFinalProgramsPerSm = 0.75;
// estimated_us()'s model of a launch: a fixed cost, then the longer of its serial steps (a
// program's KV tiles and partials, times its waves) and its HBM traffic. Fitted on the H100
// (the cases file planned both ways: it picks the faster plan on every case but two, each
// kept on the tree plan and 1-2 us slower there).
constexpr double kLaunchUs = 5.0;
constexpr double kStepUs = 1.2;
// ... at this head_dim and above (step_us()).
constexpr int64_t kStepHeadDim = 128;
constexpr double kWideStepFactor = 2.0;  // a 64-row tile's step (4x a 16-row tile's MMA work)
constexpr double kBytesPerUs = 3.0e6;    // HBM copy bandwidth
// Final-kernel programs resident per SM, by registers and shared memory (ncu, H100): 6 of the
// one-branch kernel, 4 of the packed kernel at two warps (240-255 registers, 39-43 KB; the wide
// tile with shared ranges runs 4 warps, 2 programs: the same warps). final_programs_per_sm() picks
// by lanes; a partial launch's waves count kWaves per SM.
constexpr int64_t kFinalProgramsPerSm = 6;
constexpr int64_t kPackedFinalProgramsPerSm = 4;
// Partial slots the merge kernel folds per step (dispatch.MERGE_BLOCK_S; a test checks).
constexpr int64_t kMergeSlotsPerStep = 16;
// Final-kernel lanes: a GQA group of at most half the narrow tile leaves rows free, which the
// groups of further branches fill (a packed program walks their final ranges side by side).
// Fewer, longer programs keep more loads in flight; final_lanes() takes the most lanes, a power
// of two and at least kMinPackedLanes, that leave kMinFinalProgramsPerSm programs per SM. Two
// lanes rarely pay: they were the fastest count on 4 of 73 trees whose tile holds four, by at
// most 3.4%, and at group 8, where the tile holds two, at most 4.6% faster than one lane and
// up to 15% slower (H100, 96 trees of 16-512 leaves at GQA groups 1-8; ft_1,16,64/q32kv32
// 62.0 -> 53.5 us at 8 lanes, not 4; the final launch over 256 leaves of 64 tokens x 8 KV
// heads 40.2 -> 34.0 us at 4 lanes, not 1).
constexpr int64_t kMinFinalProgramsPerSm = 1;
constexpr int64_t kMinPackedLanes = 4;
// Packed final programs (240 registers x 2 warps, 39 KB of shared memory) that fit on an SM
// beside one root program (64 rows: ~26K registers, 112 KB). Beside a lone root cut for one
// program per SM (kLoneRootWaves), a final launch started early walks the leaves of only that
// many programs per SM while the root computes; the rest wait for the root to end. So there a
// packed launch takes more lanes, until its programs fit beside the root or the tile is full
// (H100: seed_b128/q32kv8 37.2 -> 30.3 us at 4 lanes, not 2;
// seed_b64/q32kv32 49.3 -> 47.3 at 8, not 4; an unpacked launch, lighter, is left alone:
// seed_b64/q32kv8 24.0 us at one lane, 24.6 at 2).
constexpr int64_t kPackedFinalsBesideRoot = 2;
// Past the narrow tile, beside such a root, a packed launch takes the wide final tile's lanes
// (PlanShape::wide_final_rows) until its programs fit there, but only where the root's launch
// outlasts the final launch by estimated_us()'s terms: then every leaf can be walked while the
// root computes. Where the leaves outweigh the root, the wider programs' longer walks lose
// (H100: seed_b256/q32kv8 60.4 -> 50.4 us at 8 lanes; ft_1,256/q32kv8
// 28.9 -> 29.5, seed_b256/q32kv32 121.1 -> 128.0, ft_1,256/q32kv32 63.0 -> 72.3).
// ... and whatever the rules above take, a packed program walks its lanes' final ranges side by
// side (kChunkAlign / lanes tokens of each a tile) until its longest is done: lanes are halved
// until the longest final range takes at most this many tiles, and one lane is left below
// kMinPackedLanes. Past it one long leaf among short ones idles the other lanes, and few
// programs of long walks leave HBM idle (H200, 86 family and cases-file trees that pack lanes:
// 1.27x their best lane count's time under the rules above, 1.01x capped at 16 tiles, 12 or 20
// no better; random_tree_4/q32kv32d64 400.1 -> 96.3 us at one lane; seed_b256/q32kv32, 16 tiles
// at 16 lanes, 95.4 us against 105 at 8).
constexpr int64_t kPackedWalkTiles = 16;
// The last launch starts at the (last) partial launch's programs' start, not after their walks,
// where it has work of its own before it waits: a final program walks its branches' final
// ranges while partial programs still run, and waits only before its merge. tree_merge has
// nothing to do before its wait, so plans
// that merge separately keep the late start (H100: the early start is no slower on any of the
// cases file's final-kernel plans, ft_1,2,64/q32kv8 20.2 -> 17.5 us, ft_1,4,256/q32kv8 35.0 ->
// 31.1, seed_b256/q32kv8 65.8 -> 64.9; long_1,4/q16kv1, a merge plan, 28.9 -> 31.6 early).

// A flat plan whose packed final programs group sibling leaves (the wide final tile's lanes,
// kMinPackedLanes at least) walks each program's shared path once: it is kept where
// estimated_us() finds it faster and no program walks more than this many KV tiles (its shared
// range's, its lanes', its partials). Longer walks serialise what a tree plan runs in parallel
// (H100, flat plans with shared ranges at their best config: ft_deep16/q32kv8 80.1 -> 62.0 us at
// a walk of 4 tiles; at 8-9 tiles a tie or a loss, ft_1,256/q32kv8 28.8 -> 30.4,
// ft_1,4,256/q32kv8 32.0 -> 35.5, ft_1,2,64/q32kv8 17.9 -> 20.3). Two lanes halve the programs for
// at most half the reads: at GQA group 16 every tree lost (ft_deep16/q16kv1 22.1 -> 24.0 at a
// walk of 3, ft_1,256/q16kv1 14.7 -> 18.2 at 5).
constexpr int64_t kSharedRangeWalk = 6;
// A node that only one sequence's queries read (a branch's own tokens before its drafts or
// extend) folds into their final ranges, where the plan that does so estimates faster, if it
// is at most this long: no longer than the shortest chunk, so computing it would not split it
// across programs, while folding it saves its partial launch and merge; past it each query
// walks the whole node (unbounded, ft_1,10/q32kv8's 400-token leaves under 2 queries each took
// 1.20-1.26x the time). H200, each plan timed with and without (sequence_folds = 0): drafts of
// 2-32 tokens on every leaf of eight cases-file trees, 19 plans changed, 0.81x, none slower
// (seed_b16/q32kv8 under 4 drafts each 28.6 -> 21.2 us); on the family's held-out trees, 82
// changed, 0.92x, short beams at GQA group 1 up to 1.27x (beam_search_201/q32kv32d64).
constexpr int64_t kSequenceFoldTokens = kMinChunkTokens;

// One tree_partial work item is an int32 record of these fields, in this order; the kernel
// reads them by index (Python's specializations.TREE_ITEM_FIELDS must match: a test checks).
// run_split: where the second run of consecutive slots of the item's range begins, for the
// kernels that read it as two runs (item_runs() writes it; the planner writes kv_end).
constexpr std::array<const char*, 9> kTreeItemFields = {
    "table_row", "kv_start", "kv_end", "row_ptr", "num_rows", "first_flat_row", "entry0", "open_end", "run_split"};

// A packed final program's shared range is an int32 record of these fields (Python's
// specializations.COMMON_FIELDS must match: a test checks): tokens [start, end) that every lane
// of the program reads in the same pages, read once through row lead_row's block table.
constexpr std::array<const char*, 3> kCommonFields = {"lead_row", "start", "end"};

// A query tile is an int32 record of these fields (Python's specializations.QUERY_TILE_FIELDS
// must match: a test checks): rows first_row .. first_row + rows - 1 in lanes of lane_rows
// consecutive queries of one sequence, each lane read through the block table of its longest row
// (a lane's rows list the same blocks), the first `shared` tokens, which every lane reads from the
// same slots, once for all (kQueryTileAllShared in a tile of one lane: all its tokens).
constexpr std::array<const char*, 4> kQueryTileFields = {"first_row", "rows", "lane_rows", "shared"};
constexpr int32_t kQueryTileAllShared = INT32_MAX;

// A query tile record's fields by name.
struct QueryTile {
  int64_t first_row, rows, lane_rows, shared;
  explicit QueryTile(const int32_t* record)
      : first_row(record[0]), rows(record[1]), lane_rows(record[2]), shared(record[3]) {}
  bool has_lanes() const { return lane_rows < rows; }
};

// Query tiles: where the caller names each row's sequence (several queries of a branch, each a
// row), a plan may run as one launch of tree_queries, one program per (tile, KV head), a tile's
// rows its sequence's consecutive queries x the GQA group: each walks the sequence once for all
// of them, to each row's own length, and writes the output (no partials, no merge). A sequence's
// queries fill the tile a shared node's branches fill in a tree plan, so sharing across branches
// is left to L2. query_tiles_win() takes it where the launch has kQueryTileMinProgramsPerSm
// programs per SM (fewer cannot fill the GPU: a tree plan cuts long ranges into chunks) and the
// tiles hold kQueryTileFullRows rows on average, or kQueryTileMinRows where the walks average at
// most kQueryTileShortWalk tokens. Half-full tiles do twice the tree plan's MMA work on long
// shared paths, which full tiles match; on short paths the tree plan's partials and final
// programs cost more than the empty rows. H200, each several-query step planned both ways
// (extends of 4-256 queries on 8-256 branches of a 2048-token prompt, chains of 2-32 draft
// tokens on six trees of the cases file), query tiles' speed over the tree plan's: at 16
// queries x group 4 (full tiles) 0.98-1.01x on 2048-token paths, 2.1-2.9x on ~300-token ones;
// at 8 (half full) 0.52-0.73x on 2048-token paths, 1.5-1.7x on the short ones; at 4 queries
// 0.27-0.94x but on one tree (1.06x); 16 branches of full tiles (128 programs) 0.68-0.71x.
//
// Sequences too short to fill a tile share one as its lanes (query_tile_records(), at most
// kQueryTileMaxLanes a tile), their shared tokens read once for all lanes' rows, each lane's own
// tokens for its rows alone, one lane after another. A plan with lanes is taken only where its
// tiles are full (kQueryTileFullRows) and its walks short (kQueryTileShortWalk): a tree plan reads
// a long shared prefix once for every tile's rows, query tiles once per tile. H200, chains of 2-8
// draft tokens on eight trees of the cases file (q32kv8, q32kv32, q16kv1) and extends of 2-8
// tokens on 16-256 branches of a 2048-token prompt, planned both ways: lanes' speed over the tree
// plan's 1.41-2.15x in full tiles of 2 or 4 lanes on ~300-token walks (ft_1,4,256, ft_1,256,
// ft_deep16; ft_1,2,64 at 256 programs), 1.16x at 128 programs; 0.27-0.87x on 2048-token prompts
// but on one tree (1.17x) and 1.38x on a 1400-token walk; 0.56-1.13x in half-full tiles (32 rows:
// 8 queries of group 1, 2 of group 4). Uncapped, on the same short walks: 8 lanes 0.81-1.24x, 16-32
// lanes (group 1) 0.63-0.90x (measured with the lane loop in the one-lane kernel, 10-13% slower).
constexpr double kQueryTileMinProgramsPerSm = 1.0;
constexpr int64_t kQueryTileFullRows = 48;
constexpr int64_t kQueryTileMinRows = 32;
constexpr int64_t kQueryTileMaxLanes = 4;
constexpr int64_t kQueryTileShortWalk = 1024;

// What the planner needs to know about the attention call and the GPU.
struct PlanShape {
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t dtype_bytes = 2;
  int64_t num_sms = 1;
  // The compiled tree_partial row tiles: nodes of at most block_ms[0] (branch, head) rows
  // take the narrow tile, others the wide one.
  std::array<int64_t, 2> block_ms = {16, 64};
  // The packed final kernel's wide tile (rows; its own compiled kernels): more lanes than the
  // narrow tile holds, taken only beside a lone root that outlasts the leaves (final_lanes()).
  int64_t wide_final_rows = 32;
  // tree_queries' tile (rows): a query tile holds this many rows over the GQA group queries.
  int64_t query_tile_rows = 64;

  int64_t group() const { return num_qo_heads / num_kv_heads; }
  // Branches one final-kernel program can serve: its narrow tile's rows over the group.
  int64_t max_final_lanes() const { return std::max<int64_t>(1, block_ms[0] / group()); }
  // ... and in the wide final tile (packed programs only: at least two lanes).
  int64_t max_wide_final_lanes() const { return std::max(max_final_lanes(), wide_final_rows / group()); }
  // The final tile's rows at `lanes` lanes: the narrow tile's while they fit it (one lane is
  // never packed: a group larger than the narrow tile takes several of them, final_tiles()).
  int64_t final_block_m(int64_t lanes) const {
    return lanes == 1 || lanes * group() <= block_ms[0] ? block_ms[0] : wide_final_rows;
  }
  // Final-kernel programs per branch (per lane when packed): the group's narrow tiles.
  int64_t final_tiles() const { return num_kv_heads * ceil_div(group(), block_ms[0]); }
  // Queries one query tile holds (0: the GQA group does not fit the tile).
  int64_t query_tile_queries() const { return query_tile_rows / group(); }
  // One token's K (or V) across the KV heads: a row of the pool.
  int64_t token_row_bytes() const { return num_kv_heads * head_dim * dtype_bytes; }
  int64_t kv_bytes_per_token() const { return 2 * token_row_bytes(); }
  // One branch's fp32 partial (output and LSE of every head), written then read.
  int64_t partial_bytes_per_row() const { return 2 * num_qo_heads * (head_dim + 1) * 4; }
};

struct PlanOptions {
  int64_t target_chunk = 0;  // 0: from the cost model; else tokens per chunk (tuning)
  double reread_weight = kRereadWeight;
  int separate_merge = -1;  // -1: by kSeparateMergeSteps; 0 or 1: forced (tuning, tests)
  int flat = -1;            // -1: the faster by estimated_us(); 0: the cost model's folds; 1: flat
  int64_t final_lanes = 0;  // 0: by final_lanes(); else forced, 1..PlanShape::max_wide_final_lanes()
  int one_tile = -1;        // -1: by estimated_us() (above); 0: each range's own tile; 1: all wide
  int early_final = -1;     // -1: by final_starts_early(); 0 or 1: forced (tuning, tests)
  int host_nodes = -1;      // -1 or 1: hosted nodes read in their host's tiles; 0: each its own (tests)
  int slot_runs = -1;       // -1 or 1: slot-run kernels where the pages allow (item_runs); 0: never
  // Never a paged decode nor merged separately, whatever separate_merge asks: a plan with draft
  // masks (only tree_final and query tiles apply them).
  bool final_kernel = false;
  int query_tiles = -1;     // -1: by query_tiles_win() where rows name their sequences; 0 or 1: forced
  int sequence_folds = -1;  // -1: the faster by estimated_us() (kSequenceFoldTokens); 0 or 1: forced
};

// The tree_partial records of one row tile (BLOCK_M), kTreeItemFields.size() int32 each.
struct ItemList {
  int64_t block_m = 0;
  std::vector<int32_t> records;
  // The launch's grid is (heads, items), so that each item's KV heads run one after another,
  // not (items, heads), each head's items: heads_first_order().
  bool heads_first = false;

  int64_t count() const { return int64_t(records.size() / kTreeItemFields.size()); }
};

// A plan on the host. Chunk c covers tokens [chunk_start[c], chunk_end[c]) read through
// block-table row chunk_table_row[c], for the rows order[chunk_row_ptr[c]:+chunk_rows[c]],
// whose partials are entries chunk_entry0[c] + j, stored in slot entry_slot[entry]; an open
// chunk (chunk_open[c]) ends at its row's length at run time instead. Row b's final range is
// [final_start[b], its length); it merges slots merge_ptr[b]:merge_ptr[b + 1]. With
// separate_merge, each final range is chunks too (its last one open) and no final kernel runs.
// Final-kernel program p serves rows order[p * final_lanes:(p + 1) * final_lanes] when
// final_lanes > 1 (the packed kernel), row p otherwise. A packed program whose lanes share the
// start of their final ranges (a node folded into all of them: shared_final_prefixes()) reads
// that range once for all its rows: common holds kCommonFields.size() int32 per program (an
// empty range where start == end; no records at all where no program shares a range), and its
// lanes' final_start is moved to the range's end.
struct Plan {
  std::vector<int32_t> order;
  std::vector<int32_t> common;  // per final program where one shares a range, else empty
  std::vector<int64_t> chunk_start, chunk_end, chunk_rows, chunk_row_ptr, chunk_table_row, chunk_entry0, chunk_open;
  std::vector<ItemList> items;  // by increasing block_m, only tiles in use
  std::vector<int32_t> final_start, merge_ptr, entry_slot;
  int64_t num_entries = 0;
  int64_t computed_nodes = 0;  // computed ranges: a node that hosts others, one per piece of its rows
  int64_t chunk_tokens = 0;
  bool separate_merge = false;
  int64_t final_lanes = 1;  // branches per final-kernel program (1 when merging separately)
  // No partials, the final launch a paged decode: runs_as_paged_decode().
  bool as_paged_decode = false;
  // Each partial launch lets the launch after it start at its programs' start, not after their
  // walks (the tree_partial argument early_final): the final (or merge) launch, and on sm90 a
  // two-tile plan's second partial launch, which starts beside the first.
  bool early_final = false;
  // The final launch's grid is (head tiles, programs), each program's KV heads together, not
  // (programs, head tiles): final_heads_first().
  bool final_heads_first = false;
  double estimated_us = 0;  // estimated_us() of this plan
  // A plan of query tiles: kQueryTileFields.size() int32 per tile; every other list is a flat
  // plan's with no partials (each row's final range its whole sequence), and no final kernel runs.
  std::vector<int32_t> query_tiles;

  // Whether some final program reads a shared range (the final launch takes the COMMON kernel).
  bool has_common() const { return !common.empty(); }
  bool as_query_tiles() const { return !query_tiles.empty(); }
};

// The plan's int32 lists as one buffer for a single upload: order, final_start, merge_ptr,
// entry_slot, common, query_tiles, then each ItemList's records, each in a slot of a multiple of 4 words (at
// least 4), so every list's pointer is valid, distinct and 16-byte aligned. offsets[i] is list
// i's first element, the lists in WorkList's order.
enum WorkList {
  kOrder = 0,
  kFinalStart = 1,
  kMergePtr = 2,
  kEntrySlot = 3,
  kCommon = 4,
  kQueryTiles = 5,
  kFirstItems = 6
};
void pack_work_lists(const Plan& plan, std::vector<int32_t>* flat, std::vector<int64_t>* offsets);

// The most runs of consecutive slots tree_partial's SLOT_RUNS kernels read an item's range as
// (Python's dispatch.SLOT_RUN_COUNTS ends at it: a test checks).
constexpr int kMaxItemRuns = 2;

// How tree_partial may read the items of `items`: the runs of consecutive slots the most scattered
// item's range lies in, 1 or 2 (the SLOT_RUNS kernels: a run's first page id read at run time, then
// no page arithmetic per token; H100, seed_b256/q32kv8 64.6 -> 61.7 us; a root folded into its
// children's items, two runs, ft_1,4,16,512/q32kv8 102.3 -> 89.1 us), or 0 where some item takes
// the page kernels: it is open, leaves its table row's shared ranges or the tables (row r's
// `stride` block ids from tables + r * stride; final_start.size() rows), or its pages break more
// than kMaxItemRuns - 1 times (a hosted node's item of three runs reads through its pages as fast:
// H100, ft_1,4,16,512/q32kv8 75.6 us either way). Where it returns 2 it writes each item's
// run_split (where its second run begins; kv_end for an item of one run); otherwise the records are
// left as they were. Shared ranges (before final_start[row]) keep their tokens where they are while
// a plan is valid: frPlanUpdate refuses a changed block there, and the Python allocator copies on
// write only a row's last block, whose shared tokens stay in the original (a holder keeps it and
// writes only past them; tests/test_tree_attention.py runs a plan after such copies).
int item_runs(ItemList* items, const std::vector<int32_t>& final_start, const int32_t* tables, int64_t stride,
              int64_t block_size);
// The same over int64 tables, row r's at tables + rows[r] * stride: the Python allocator's
// table mirror, read in place (segment_tree.h).
int item_runs(ItemList* items, const std::vector<int32_t>& final_start, const int64_t* tables, const int64_t* rows,
              int64_t stride, int64_t block_size);

// A partial launch of at most kHeadsFirstProgramsPerSm programs per SM whose longest item is at
// least kHeadsFirstLengthRatio times its shortest (planned lengths) runs each item's KV heads
// together, so that its first items start first on every head and the last ones fill the tail
// (items follow the ranges' order: shallower nodes and computed roots, the long ones, before
// deeper nodes and final ranges); where items are alike, or the launch runs many waves (the
// scheduler balances those), each head's items together keep the row tiles that share a chunk
// side by side. H100, the bench built both ways: ft_1,4,16,512/q32kv8 (1280- and 128-token
// items, 3.9 programs per SM) 88.5 -> 85.5 us, long_1,4/q32kv8 (2.2) 59.2 -> 57.3;
// ft_1,4,16,512/q32kv32 (7.8) 167.3 -> 169.8; ft_1,1024/q32kv8's equal items 159.0 -> 158.4.
constexpr int64_t kHeadsFirstLengthRatio = 2;
constexpr int64_t kHeadsFirstProgramsPerSm = 4;
// A CUDA grid's second dimension: a heads-first launch's items at most.
constexpr int64_t kMaxGridY = 65535;

// A packed final launch (several branches a program) without shared ranges, over token rows of at
// least kHeadsFirstRowBytes (a token's K across the KV heads), runs each program's KV heads
// together: its heads' programs read the same token rows side by side, where each head's programs
// together walk every branch once per head. Shared ranges (COMMON) read the other way round lose,
// and rows of 2 KB gain nothing. H100 (the bench, built both ways on one machine): 8 KB rows (32 KV
// heads x 128 x fp16) 1-2% faster on every such plan of the cases file (ft_1,1024/q32kv32 292.2 ->
// 285.9 us, ft_1,256/q32kv32 62.1 -> 60.8); 2 KB rows from -1.5% (ft_1,1024/q32kv8) to +1.3%
// (ft_1,4,16,512/q32kv8).
constexpr int64_t kHeadsFirstRowBytes = 4096;
bool final_heads_first(int64_t final_lanes, bool has_common, int64_t final_programs, int64_t kv_row_bytes);

// The cost model, small pure functions.
bool heads_first_order(const std::vector<int64_t>& planned_lengths, int64_t items, int64_t num_kv_heads,
                       int64_t num_sms);
bool fold_into_consumers(int64_t consumers, int64_t eff_len, int64_t rows, const PlanShape& shape,
                         double reread_weight);
int64_t chunk_length(int64_t length, int64_t target);
// The chunk length of the final ranges (`final_tokens` over `final_ranges` of them, the rows'):
// `chunk_tokens`, or kFinalChunkMeanRatio times their mean where that is shorter (kMinChunkTokens
// at least).
int64_t final_chunk_tokens(int64_t chunk_tokens, int64_t final_tokens, int64_t final_ranges);
// Programs the partial launch's chunks aim for: kWaves per SM; kLoneRootWaves for a lone computed
// node before a final launch (kWaves where `long_root`: lone_root_walks_long()), or one per
// kOutweighedRootSmsPerProgram SMs where `leaves_outweigh` (leaves_outweigh_root());
// kSeparateMergeWaves merged separately with computed nodes.
int64_t partial_programs(int64_t num_computed, bool separate_merge, bool leaves_outweigh, bool long_root,
                         const PlanShape& shape);
// Whether a lone root cut into `root_chunk`-token chunks for kLoneRootWaves (its `root_programs`
// row tiles x KV heads each) walks long enough to be cut for kWaves: kLongLoneRootChunkTokens.
bool lone_root_walks_long(int64_t root_chunk, int64_t root_programs, const PlanShape& shape);
// Whether a lone root's leaves (`leaf_tokens`, their final ranges) take longer to read from HBM
// than the root takes by estimated_us()'s terms: its programs' `root_tiles` KV tiles each (their
// waves, the wide tile's factor) or its own bytes, cut for kLoneRootWaves.
bool leaves_outweigh_root(int64_t root_tokens, int64_t root_tiles, int64_t root_programs, bool wide_tile,
                          int64_t leaf_tokens, const PlanShape& shape);
// estimated_us()'s serial step at `head_dim`: kStepUs, scaled down in proportion below
// kStepHeadDim, where a step's loads and MMAs shrink with the head. Priced alike, a head_dim 64
// tree plan read at 0.45x its estimate against 0.70x for flat plans, so the planner ran flat 15
// family trees whose tree plans were faster (H200: random_tree_9/q12kv2d64 72.2 us flat, 29.1 as a
// tree). Above it no scale held: head_dim 256 tree plans were priced low on some trees and
// high on others (H200: doubled, random_tree_249/q8kv1d256 went flat, 40.8 -> 64.7 us).
double step_us(int64_t head_dim);
// `final_programs`: the final launch's programs at one lane (rows x PlanShape::final_tiles()).
bool merge_separately(int64_t longest_final_walk, bool adds_launch, int64_t final_programs, int64_t num_sms);
// Branches per final-kernel program; `longest_final`: the longest final range's tokens
// (kPackedWalkTiles); `beside_root`: the plan's partial launch is a lone root of at most one
// program per SM (kPackedFinalsBesideRoot); `root_outlasts_leaves`: that launch is estimated to
// take longer than the final launch at the narrow tile's lanes (the wide tile).
int64_t final_lanes(int64_t rows, int64_t longest_final, const PlanShape& shape, bool beside_root,
                    bool root_outlasts_leaves);
// Final-kernel programs resident per SM at `final_lanes` lanes (the packed kernel from 2).
int64_t final_programs_per_sm(int64_t final_lanes);
bool final_starts_early(bool separate_merge);
// Whether a plan's final launch is a paged decode: it computes no node and splits no range (no
// partial entries), so each final range is a whole branch with nothing to merge, and the lanes
// are the planner's (`lanes_forced`: a caller asked for the final kernel at some lanes). Such a
// plan runs paged_decode's kernel unsplit, one program per (branch, query tile), by
// paged_decode's rules over the plan's tables: tree_final's merge bookkeeping (a final_start
// load ahead of the first page) costs a dependent load, and packing lanes gains nothing
// over whole branches (H100: ft_1,4,256/q16kv1 14.6 -> 13.1 us,
// ft_1,2,64/q16kv1 13.2 -> 11.0; flat_64x2048/q32kv32 713.2 -> 709.8, paged_decode's own launch).
bool runs_as_paged_decode(bool separate_merge, int64_t num_entries, bool lanes_forced);
// The query tiles of `tree`'s rows, whose sequences are `row_sequence` (rows of one sequence
// consecutive), at most `queries` rows a tile: consecutive sequences of the same number of queries,
// where two or more fit a tile, packed as its lanes (at most kQueryTileMaxLanes; as few tiles as
// they fill, as even as they come), the tokens they read from the same slots the tile's shared ones; any other
// sequence's rows cut into the fewest tiles of one lane, as even as they come.
std::vector<int32_t> query_tile_records(const SegmentTree& tree, const int32_t* row_sequence, int64_t queries);
// Whether some of these query tiles (records) hold several lanes: they run the lane kernels
// (tree_queries with LANES; a tile of one lane walks faster without).
bool query_tiles_have_lanes(const std::vector<int32_t>& tiles);
// Whether a plan of `tiles` query tiles over `rows` rows, whose tiles walk `mean_walk` tokens on
// average, some of them in lanes (`lanes`), runs as query tiles (kQueryTileMinProgramsPerSm,
// kQueryTileFullRows, kQueryTileMinRows, kQueryTileShortWalk).
bool query_tiles_win(int64_t rows, int64_t tiles, int64_t mean_walk, bool lanes, const PlanShape& shape);
// The GPU time the launches of `plan` over `tree` should take, by the kLaunchUs model.
double estimated_us(const Plan& plan, const SegmentTree& tree, const PlanShape& shape);

// The work of one decode step over `tree`. `row_sequence` (may be null): row i's sequence, rows
// of one sequence consecutive (several queries of a branch): query tiles may group them.
// kInvalidArgument for a bad shape or a plan whose partials would overflow the kernels' int32
// indexing.
Status make_plan(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options, Plan* out,
                 const int32_t* row_sequence = nullptr);

}  // namespace flash_reasoning
