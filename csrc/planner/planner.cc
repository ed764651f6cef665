#include "planner/planner.h"

#include <algorithm>
#include <set>
#include <string>

#include "util/int_math.h"

namespace flash_reasoning {
namespace {

// Round half to even of x >= 0, as numpy's rint (no libm: the C library links only libc).
int64_t round_half_even(double x) {
  int64_t whole = int64_t(x);
  double frac = x - double(whole);
  return whole + (frac > 0.5 || (frac == 0.5 && (whole & 1)));
}

// The row tile of a range read by `rows` branches: the narrow tile while their (branch, head)
// rows fit it, else the wide one; the wide one for every range where `one_tile`.
int64_t range_tile(int64_t rows, bool one_tile, const PlanShape& shape) {
  int64_t flat_rows = rows * shape.group();
  return one_tile || flat_rows > shape.block_ms[0] ? shape.block_ms[1] : shape.block_ms[0];
}

// Tokens per program that spread the work of the first `counted` ranges (computed nodes come
// first) over `target_programs` programs.
int64_t chunk_tokens(const std::vector<int64_t>& programs, const std::vector<int64_t>& lengths, size_t counted,
                     int64_t target_programs, int64_t min_tokens) {
  int64_t work = 0;
  for (size_t r = 0; r < counted; ++r) work += programs[r] * lengths[r];
  return std::max(min_tokens, ceil_div(work, std::max<int64_t>(1, target_programs)));
}

// Each range's chunk length and number of pieces at `target` tokens per chunk, the final ranges
// (from `num_computed` on) at final_chunk_tokens().
void cut_ranges(const std::vector<int64_t>& length, size_t num_computed, int64_t target, std::vector<int64_t>* step,
                std::vector<int64_t>* pieces) {
  step->resize(length.size()), pieces->resize(length.size());
  int64_t final_tokens = 0;
  for (size_t k = num_computed; k < length.size(); ++k) final_tokens += length[k];
  int64_t final_target = final_chunk_tokens(target, final_tokens, int64_t(length.size() - num_computed));
  for (size_t k = 0; k < length.size(); ++k) {
    (*step)[k] = chunk_length(length[k], k < num_computed ? target : final_target);
    (*pieces)[k] = std::max<int64_t>(1, ceil_div(length[k], (*step)[k]));
  }
}

Status check_shape(const PlanShape& s) {
  if (s.num_qo_heads < 1 || s.num_kv_heads < 1 || s.num_qo_heads % s.num_kv_heads)
    return Status::Error(Code::kInvalidArgument, "num_qo_heads (" + std::to_string(s.num_qo_heads) +
                                                     ") must be a positive multiple of num_kv_heads (" +
                                                     std::to_string(s.num_kv_heads) + ")");
  if (s.head_dim < 1 || s.dtype_bytes < 1 || s.num_sms < 1 || s.block_ms[0] < 1 || s.block_ms[1] < s.block_ms[0])
    return Status::Error(Code::kInvalidArgument, "head_dim, dtype_bytes, num_sms and block_ms must be positive");
  if (s.wide_final_rows && s.wide_final_rows < s.block_ms[0])
    return Status::Error(Code::kInvalidArgument, "wide_final_rows must be 0 (none) or at least block_ms[0]");
  return Status::Ok();
}

// The readers of each node: its child nodes and the rows that end there; with `sequences` (each
// row's sequence; may be null), one reader for a short node (kSequenceFoldTokens) that only one
// sequence's rows read, below it or ending at it: that sequence's queries read it side by side
// (lanes of one program, or neighbours in the grid, from L2), so folding it re-reads nothing.
std::vector<int64_t> node_consumers(const SegmentTree& t, const int32_t* sequences) {
  constexpr int64_t kNoRows = -1, kSeveral = -2;
  auto join = [](int64_t a, int64_t b) { return a == kNoRows ? b : b == kNoRows || a == b ? a : kSeveral; };
  size_t count = size_t(t.num_nodes());
  std::vector<int64_t> consumers(count, 0), reader(count, kNoRows);
  for (int64_t b = 0; b < t.num_rows(); ++b) {
    if (t.end_node[b] < 0) continue;
    ++consumers[size_t(t.end_node[b])];
    if (sequences) reader[size_t(t.end_node[b])] = join(reader[size_t(t.end_node[b])], sequences[b]);
  }
  for (int64_t v = int64_t(count) - 1; v >= 0; --v) {  // pre-order: children after their parent
    int64_t up = t.node_parent[v];
    if (up < 0) continue;
    ++consumers[size_t(up)];
    reader[size_t(up)] = join(reader[size_t(up)], reader[size_t(v)]);
  }
  for (size_t v = 0; v < count; ++v)
    if (reader[v] >= 0 && t.node_end[v] - t.node_start[v] <= kSequenceFoldTokens) consumers[v] = 1;
  return consumers;
}

// Top-down: whether each node folds, and where its range starts once its folded ancestors are
// prepended. Nodes are in pre-order, so a parent is decided before its children.
// A flat plan folds every node.
void fold_decisions(const SegmentTree& t, const PlanShape& shape, double reread_weight, bool flat,
                    const int32_t* sequences, std::vector<char>* fold, std::vector<int64_t>* eff_start) {
  int64_t count = t.num_nodes();
  std::vector<int64_t> consumers = node_consumers(t, sequences);
  fold->assign(count, 0);
  eff_start->assign(t.node_start.begin(), t.node_start.end());
  for (int64_t v = 0; v < count; ++v) {
    int64_t up = t.node_parent[v];
    if (up >= 0 && (*fold)[up]) (*eff_start)[v] = (*eff_start)[up];
    (*fold)[v] = flat || fold_into_consumers(consumers[v], t.node_end[v] - (*eff_start)[v], t.node_hi[v] - t.node_lo[v],
                                             shape, reread_weight);
  }
}

// The ranges a plan reads: computed nodes first, then each row's final range. A range is read
// by the rows order[row_ptr:+rows], in the row tile of `basis` rows (range_tile(): the tile of
// the node it was cut from).
struct Ranges {
  std::vector<int64_t> lo, hi, rows, row_ptr, table_row, basis;
  int64_t num_computed = 0;

  void add(int64_t l, int64_t h, int64_t r, int64_t ptr, int64_t table, int64_t tile_basis) {
    lo.push_back(l), hi.push_back(h), rows.push_back(r), row_ptr.push_back(ptr), table_row.push_back(table);
    basis.push_back(tile_basis);
  }
};

// Per computed node, the computed node whose range its tokens are read in: itself, or, where
// `host_nodes`, the nearest computed ancestor's where the node's rows are whole row tiles of that
// ancestor's range (their first and last tile boundaries fall on the node's). Those tiles then
// read on through the node's tokens (their range ends at its end), so the node needs no items
// and its rows one partial fewer. H100: ft_1,4,16,512/q32kv8, whose level-2 nodes are two tiles
// each of their level-1 items' rows, 81.2 -> 75.9 us: no 128-token items left to run after the
// 1280-token ones.
std::vector<int64_t> range_hosts(const SegmentTree& t, const std::vector<char>& fold, const PlanShape& shape,
                                 bool one_tile, bool host_nodes) {
  std::vector<int64_t> host(t.num_nodes(), -1), above(t.num_nodes(), -1);  // above: nearest computed ancestor
  for (int64_t v = 0; v < t.num_nodes(); ++v) {
    int64_t up = t.node_parent[v];
    if (up >= 0) above[v] = fold[up] ? above[up] : up;
    if (fold[v]) continue;
    host[v] = v;
    int64_t h = above[v] >= 0 ? host[above[v]] : -1;
    if (!host_nodes || h < 0) continue;
    int64_t rows = t.node_hi[h] - t.node_lo[h];
    int64_t tile = range_tile(rows, one_tile, shape);
    bool first_aligned = (t.node_lo[v] - t.node_lo[h]) * shape.group() % tile == 0;
    bool last_aligned = t.node_hi[v] == t.node_hi[h] || (t.node_hi[v] - t.node_lo[h]) * shape.group() % tile == 0;
    if (first_aligned && last_aligned) host[v] = h;
  }
  return host;
}

// The ranges of computed node `h` and the nodes it hosts (`hosted`, pre-order): its rows cut
// where a hosted node's rows begin or end, each piece read from h's start to the end of the
// deepest hosted node above its rows.
void add_host_ranges(const SegmentTree& t, const std::vector<int64_t>& eff_start, int64_t h,
                     const std::vector<int64_t>& hosted, Ranges* r) {
  int64_t rows = t.node_hi[h] - t.node_lo[h];
  auto piece = [&](int64_t node, int64_t from, int64_t to) {
    if (from < to) r->add(eff_start[h], t.node_end[node], to - from, from, t.order[from], rows);
  };
  std::vector<int64_t> open = {h};  // the hosted nodes whose rows the sweep is inside
  int64_t at = t.node_lo[h];
  for (int64_t v : hosted) {
    for (; t.node_hi[open.back()] <= t.node_lo[v]; open.pop_back()) {
      piece(open.back(), at, t.node_hi[open.back()]);
      at = t.node_hi[open.back()];
    }
    piece(open.back(), at, t.node_lo[v]);
    at = t.node_lo[v];
    open.push_back(v);
  }
  for (; !open.empty(); open.pop_back()) {
    piece(open.back(), at, t.node_hi[open.back()]);
    at = t.node_hi[open.back()];
  }
}

Ranges collect_ranges(const SegmentTree& t, const std::vector<char>& fold, const std::vector<int64_t>& eff_start,
                      const PlanShape& shape, bool one_tile, bool host_nodes) {
  Ranges r;
  std::vector<int64_t> host = range_hosts(t, fold, shape, one_tile, host_nodes);
  std::vector<std::vector<int64_t>> hosted(t.num_nodes());
  for (int64_t v = 0; v < t.num_nodes(); ++v)
    if (host[v] >= 0 && host[v] != v) hosted[host[v]].push_back(v);
  for (int64_t v = 0; v < t.num_nodes(); ++v)
    if (host[v] == v) add_host_ranges(t, eff_start, v, hosted[v], &r);
  r.num_computed = int64_t(r.lo.size());
  std::vector<int64_t> position(t.num_rows());
  for (int64_t i = 0; i < t.num_rows(); ++i) position[t.order[i]] = i;
  for (int64_t b = 0; b < t.num_rows(); ++b) {
    // A row's final range: its end node's folded range, or nothing when that node is computed.
    int64_t end = t.end_node[b];
    int64_t start = end < 0 ? 0 : fold[end] ? eff_start[end] : t.lengths[b];
    r.add(start, t.lengths[b], 1, position[b], b, 1);
  }
  return r;
}

// Slots that make each row's partials contiguous; fills merge_ptr and entry_slot.
void merge_slots(const SegmentTree& t, Plan* p) {
  int64_t n = t.num_rows();
  std::vector<int64_t> owner(p->num_entries);
  for (size_t c = 0; c < p->chunk_rows.size(); ++c)
    for (int64_t j = 0; j < p->chunk_rows[c]; ++j) owner[p->chunk_entry0[c] + j] = t.order[p->chunk_row_ptr[c] + j];
  p->merge_ptr.assign(n + 1, 0);
  for (int64_t o : owner) ++p->merge_ptr[o + 1];
  for (int64_t b = 0; b < n; ++b) p->merge_ptr[b + 1] += p->merge_ptr[b];
  std::vector<int32_t> next(p->merge_ptr.begin(), p->merge_ptr.end() - 1);
  p->entry_slot.resize(p->num_entries);
  for (int64_t e = 0; e < p->num_entries; ++e) p->entry_slot[e] = next[owner[e]]++;
}

// The longest serial walk of a final-kernel program that merges partials: the KV tiles of its
// row's last piece, then one step per partial (every piece of the computed ranges above the
// row, and all but the last of its final range's). 0 when no row has partials.
int64_t longest_final_walk(const SegmentTree& t, const Ranges& r, const std::vector<int64_t>& step,
                           const std::vector<int64_t>& pieces) {
  std::vector<int64_t> partials(t.num_rows(), 0), tiles(t.num_rows(), 0);
  for (size_t k = 0; k < pieces.size(); ++k) {
    bool is_final = int64_t(k) >= r.num_computed;
    for (int64_t j = 0; j < r.rows[k]; ++j) partials[t.order[r.row_ptr[k] + j]] += pieces[k] - is_final;
    if (is_final) tiles[t.order[r.row_ptr[k]]] = ceil_div(r.hi[k] - r.lo[k] - (pieces[k] - 1) * step[k], kChunkAlign);
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < t.num_rows(); ++b)
    if (partials[b]) longest = std::max(longest, tiles[b] + partials[b]);
  return longest;
}

// Whether merging separately needs a partial launch of a tile size the final-kernel plan
// has no item of (its final ranges' last pieces are items then).
bool separate_merge_adds_launch(const Ranges& r, const std::vector<int64_t>& block_m,
                                const std::vector<int64_t>& pieces) {
  std::set<int64_t> sizes;
  for (size_t k = 0; k < pieces.size(); ++k)
    if (int64_t(k) < r.num_computed || pieces[k] > 1) sizes.insert(block_m[k]);
  for (size_t k = size_t(r.num_computed); k < pieces.size(); ++k)
    if (!sizes.count(block_m[k])) return true;
  return false;
}

// Positions of kTreeItemFields in a record.
enum ItemField {
  kTableRow,
  kKvStart,
  kKvEnd,
  kRowPtr,
  kNumRows,
  kFirstFlatRow,
  kEntry0,
  kOpenEnd,
  kRunSplit,
  kItemFields
};
static_assert(kItemFields == kTreeItemFields.size(), "ItemField follows kTreeItemFields");
static_assert(kMaxItemRuns == 2, "an item record holds one run_split: two runs at most");

double launch_us(double steps, double bytes, const PlanShape& shape) {
  return kLaunchUs + std::max(steps * step_us(shape.head_dim), bytes / kBytesPerUs);
}

// A partial launch's serial steps: its longest program's KV tiles times its waves (kWaves
// programs per SM), each step of the wide tile kWideStepFactor.
double partial_steps(int64_t longest_tiles, int64_t programs, bool wide_tile, const PlanShape& shape) {
  return double(longest_tiles * ceil_div(programs, kWaves * shape.num_sms)) * (wide_tile ? kWideStepFactor : 1.0);
}

// A partial launch: its longest item's KV tiles times its waves; every chunk read once.
double partial_launch_us(const ItemList& list, const SegmentTree& t, const PlanShape& shape) {
  int64_t longest = 0, tokens = 0;
  for (size_t i = 0; i < list.records.size(); i += kItemFields) {
    const int32_t* r = &list.records[i];
    int64_t end = r[kOpenEnd] ? t.lengths[r[kTableRow]] : r[kKvEnd];
    int64_t length = std::max<int64_t>(0, end - r[kKvStart]);
    longest = std::max(longest, ceil_div(length, kChunkAlign));
    if (r[kFirstFlatRow] == 0) tokens += length;  // a chunk's first tile
  }
  return launch_us(partial_steps(longest, list.count() * shape.num_kv_heads, list.block_m > shape.block_ms[0], shape),
                   double(tokens * shape.kv_bytes_per_token()), shape);
}

// The longest serial walk of a last-launch program, and the KV tokens the launch reads
// (`tokens`, may be null): a final program walks its shared range's tiles, its lanes' final
// ranges side by side (a packed tile holds kChunkAlign / final_lanes tokens of each), then its
// partials one by one; a merge program its partials kMergeSlotsPerStep at a time.
int64_t last_launch_walk(const Plan& p, const SegmentTree& t, int64_t* tokens) {
  std::vector<int64_t> shared_tiles(t.num_rows(), 0);  // of the row's program's shared range
  int64_t walk = 0, read = 0;
  for (size_t i = 0; i < p.order.size() && !p.common.empty(); ++i) {  // a record per program
    const int32_t* range = &p.common[i / size_t(p.final_lanes) * kCommonFields.size()];
    shared_tiles[p.order[i]] = ceil_div(range[2] - range[1], kChunkAlign);
    if (i % size_t(p.final_lanes) == 0) read += range[2] - range[1];  // once per program
  }
  for (int64_t b = 0; b < t.num_rows(); ++b) {
    int64_t partials = p.merge_ptr[b + 1] - p.merge_ptr[b];
    if (p.separate_merge) {
      walk = std::max(walk, ceil_div(partials, kMergeSlotsPerStep));
      continue;
    }
    int64_t length = t.lengths[b] - p.final_start[b];
    walk = std::max(walk, shared_tiles[b] + ceil_div(length * p.final_lanes, kChunkAlign) + partials);
    read += length;
  }
  if (tokens) *tokens = read;
  return walk;
}

// The final launch (each program's shared range, each row's final range, then its partials
// one by one) or the merge launch.
double last_launch_us(const Plan& p, const SegmentTree& t, const PlanShape& shape) {
  double partial_bytes = double(p.num_entries) * double(shape.partial_bytes_per_row()) / 2;  // read once
  int64_t tokens = 0;
  int64_t walk = last_launch_walk(p, t, &tokens);
  if (p.separate_merge) return launch_us(double(walk), partial_bytes, shape);
  int64_t programs = ceil_div(t.num_rows(), p.final_lanes) * shape.final_tiles();
  int64_t waves = ceil_div(programs, final_programs_per_sm(p.final_lanes) * shape.num_sms);
  return launch_us(double(walk * waves), double(tokens * shape.kv_bytes_per_token()) + partial_bytes, shape);
}

// The tokens query tile `tile` (a record) walks: its lanes' shared tokens once, then each lane's
// own up to its longest row's length.
int64_t query_tile_walk(const SegmentTree& t, const int32_t* record) {
  QueryTile tile(record);
  int64_t walk = tile.shared;
  for (int64_t lane = tile.first_row; lane < tile.first_row + tile.rows; lane += tile.lane_rows)
    walk += *std::max_element(t.lengths.begin() + lane, t.lengths.begin() + lane + tile.lane_rows) - tile.shared;
  return walk;
}

// A query-tile launch: its longest tile's walk (a wide tile's KV tiles) times its waves (kWaves
// programs per SM); the tree's tokens read once.
double query_tiles_us(const Plan& p, const SegmentTree& t, const PlanShape& shape) {
  int64_t longest = 0, tiles = int64_t(p.query_tiles.size() / kQueryTileFields.size());
  for (size_t i = 0; i < p.query_tiles.size(); i += kQueryTileFields.size())
    longest = std::max(longest, query_tile_walk(t, &p.query_tiles[i]));
  return launch_us(partial_steps(ceil_div(longest, kChunkAlign), tiles * shape.num_kv_heads, true, shape),
                   double(t.unique_tokens()) * double(shape.kv_bytes_per_token()), shape);
}

// Whether a flat plan could beat `estimate`: it reads every branch's whole path, in one launch
// at least.
bool flat_may_win(const SegmentTree& t, const PlanShape& shape, double estimate) {
  return launch_us(0, double(t.logical_tokens()) * double(shape.kv_bytes_per_token()), shape) < estimate;
}

// The tree_partial records of each row tile: one per (chunk, tile).
void make_items(const Plan& p, const std::vector<int64_t>& chunk_block_m, const PlanShape& shape,
                std::vector<ItemList>* out) {
  int64_t group = shape.group();
  out->clear();
  std::vector<int64_t> sizes(chunk_block_m);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int64_t block_m : sizes) {
    ItemList list{block_m, {}};
    std::vector<int64_t> planned_lengths;
    for (size_t c = 0; c < chunk_block_m.size(); ++c) {
      if (chunk_block_m[c] != block_m) continue;
      planned_lengths.push_back(p.chunk_end[c] - p.chunk_start[c]);
      for (int64_t tile = 0; tile < ceil_div(p.chunk_rows[c] * group, block_m); ++tile) {
        int64_t record[] = {p.chunk_table_row[c], p.chunk_start[c], p.chunk_end[c],
                            p.chunk_row_ptr[c],   p.chunk_rows[c],  tile * block_m,
                            p.chunk_entry0[c],    p.chunk_open[c],  p.chunk_end[c]};
        list.records.insert(list.records.end(), std::begin(record), std::end(record));
      }
    }
    list.heads_first = heads_first_order(planned_lengths, list.count(), shape.num_kv_heads, shape.num_sms);
    out->push_back(std::move(list));
  }
}

}  // namespace

bool fold_into_consumers(int64_t consumers, int64_t eff_len, int64_t rows, const PlanShape& shape,
                         double reread_weight) {
  double reread = double(consumers - 1) * double(eff_len) * (double(shape.kv_bytes_per_token()) * reread_weight);
  return reread < double(rows * shape.partial_bytes_per_row());
}

bool heads_first_order(const std::vector<int64_t>& planned_lengths, int64_t items, int64_t num_kv_heads,
                       int64_t num_sms) {
  if (planned_lengths.empty() || items > kMaxGridY || items * num_kv_heads > kHeadsFirstProgramsPerSm * num_sms)
    return false;
  auto [shortest, longest] = std::minmax_element(planned_lengths.begin(), planned_lengths.end());
  return *longest >= kHeadsFirstLengthRatio * std::max<int64_t>(*shortest, 1);
}

bool final_heads_first(int64_t final_lanes, bool has_common, int64_t final_programs, int64_t kv_row_bytes) {
  return final_lanes > 1 && !has_common && final_programs <= kMaxGridY && kv_row_bytes >= kHeadsFirstRowBytes;
}

int64_t chunk_length(int64_t length, int64_t target) {
  int64_t pieces = std::max<int64_t>(1, round_half_even(double(length) / double(target)));
  int64_t per_piece = ceil_div(length, pieces);
  return std::max(kChunkAlign, ceil_div(per_piece, kChunkAlign) * kChunkAlign);
}

int64_t final_chunk_tokens(int64_t chunk_tokens, int64_t final_tokens, int64_t final_ranges) {
  if (final_ranges < 1) return chunk_tokens;
  return std::min(chunk_tokens, std::max(kMinChunkTokens, kFinalChunkMeanRatio * final_tokens / final_ranges));
}

bool merge_separately(int64_t longest_final_walk, bool adds_launch, int64_t final_programs, int64_t num_sms) {
  if (double(final_programs) >= kMergeInFinalProgramsPerSm * double(num_sms)) return false;
  return longest_final_walk >= kSeparateMergeSteps + (adds_launch ? kLaunchSteps : 0);
}

int64_t final_lanes(int64_t rows, int64_t longest_final, const PlanShape& shape, bool beside_root,
                    bool root_outlasts_leaves) {
  auto programs = [&](int64_t lanes) { return ceil_div(rows, lanes) * shape.final_tiles(); };
  int64_t lanes = 1;
  for (int64_t packed = kMinPackedLanes;
       packed <= shape.max_final_lanes() && programs(packed) >= kMinFinalProgramsPerSm * shape.num_sms; packed *= 2)
    lanes = packed;
  if (beside_root && lanes > 1) {
    int64_t most = root_outlasts_leaves ? shape.max_wide_final_lanes() : shape.max_final_lanes();
    while (lanes * 2 <= most && programs(lanes) > kPackedFinalsBesideRoot * shape.num_sms) lanes *= 2;
  }
  while (lanes > 1 && ceil_div(longest_final * lanes, kChunkAlign) > kPackedWalkTiles) lanes /= 2;
  return lanes < kMinPackedLanes ? 1 : lanes;
}

int64_t final_programs_per_sm(int64_t final_lanes) {
  return final_lanes > 1 ? kPackedFinalProgramsPerSm : kFinalProgramsPerSm;
}

double step_us(int64_t head_dim) { return kStepUs * std::min(1.0, double(head_dim) / double(kStepHeadDim)); }

bool final_starts_early(bool separate_merge) { return !separate_merge; }

bool runs_as_paged_decode(bool separate_merge, int64_t num_entries, bool lanes_forced) {
  return !separate_merge && num_entries == 0 && !lanes_forced;
}

int64_t partial_programs(int64_t num_computed, bool separate_merge, bool leaves_outweigh, bool long_root,
                         const PlanShape& shape) {
  if (separate_merge) return (num_computed ? kSeparateMergeWaves : kWaves) * shape.num_sms;
  if (num_computed != 1 || long_root) return kWaves * shape.num_sms;
  return leaves_outweigh ? std::max<int64_t>(1, shape.num_sms / kOutweighedRootSmsPerProgram)
                         : kLoneRootWaves * shape.num_sms;
}

bool lone_root_walks_long(int64_t root_chunk, int64_t root_programs, const PlanShape& shape) {
  return root_chunk > kLongLoneRootChunkTokens && root_programs < kWaves * shape.num_sms &&
         shape.head_dim <= kTwoRootProgramsHeadDim;
}

bool leaves_outweigh_root(int64_t root_tokens, int64_t root_tiles, int64_t root_programs, bool wide_tile,
                          int64_t leaf_tokens, const PlanShape& shape) {
  double bytes_per_token = double(shape.kv_bytes_per_token());
  return launch_us(0, double(leaf_tokens) * bytes_per_token, shape) >
         launch_us(partial_steps(root_tiles, root_programs, wide_tile, shape), double(root_tokens) * bytes_per_token,
                   shape);
}

namespace {

// Rows first .. first + count - 1: one sequence's queries.
struct SequenceRows {
  int64_t first = 0, count = 0;
};

std::vector<SequenceRows> sequence_rows(int64_t rows, const int32_t* row_sequence) {
  std::vector<SequenceRows> sequences;
  for (int64_t first = 0, last = 0; first < rows; first = last) {
    while (last < rows && row_sequence[last] == row_sequence[first]) ++last;
    sequences.push_back({first, last - first});
  }
  return sequences;
}

// The tokens rows a and b of `t` read from the same slots: the end of their paths' last common
// node.
int64_t common_tokens(const SegmentTree& t, int64_t a, int64_t b) {
  const int64_t* path_a = t.path_nodes.data() + t.path_ptr[a];
  const int64_t* path_b = t.path_nodes.data() + t.path_ptr[b];
  int64_t depth = std::min(t.path_ptr[a + 1] - t.path_ptr[a], t.path_ptr[b + 1] - t.path_ptr[b]), shared = 0;
  for (int64_t i = 0; i < depth && path_a[i] == path_b[i]; ++i) shared = t.node_end[path_a[i]];
  return shared;
}

// One sequence's rows cut into the fewest tiles of at most `queries` rows, as even as they come.
void add_sequence_tiles(const SequenceRows& seq, int64_t queries, std::vector<int32_t>* records) {
  int64_t tiles = ceil_div(seq.count, queries), per_tile = ceil_div(seq.count, tiles);
  for (int64_t at = seq.first; at < seq.first + seq.count; at += per_tile) {
    int32_t rows = int32_t(std::min(per_tile, seq.first + seq.count - at));
    records->insert(records->end(), {int32_t(at), rows, rows, kQueryTileAllShared});
  }
}

// Sequences of `count` queries each packed `lanes` (at most) to a tile, as even as they come,
// each tile's shared tokens those all its lanes read from the same slots.
void add_lane_tiles(const SegmentTree& t, const SequenceRows* seqs, int64_t n, int64_t lanes,
                    std::vector<int32_t>* records) {
  int64_t tiles = ceil_div(n, lanes), per_tile = ceil_div(n, tiles), count = seqs[0].count;
  for (int64_t at = 0; at < n; at += per_tile) {
    int64_t taken = std::min(per_tile, n - at), first = seqs[at].first, shared = t.lengths[first];
    for (int64_t lane = 1; lane < taken; ++lane)
      shared = std::min(shared, common_tokens(t, first, seqs[at + lane].first));
    records->insert(records->end(), {int32_t(first), int32_t(taken * count), int32_t(count),
                                     taken > 1 ? int32_t(shared) : kQueryTileAllShared});
  }
}

}  // namespace

std::vector<int32_t> query_tile_records(const SegmentTree& tree, const int32_t* row_sequence, int64_t queries) {
  std::vector<SequenceRows> seqs = sequence_rows(tree.num_rows(), row_sequence);
  std::vector<int32_t> records;
  for (size_t s = 0, next = 0; s < seqs.size(); s = next) {
    int64_t lanes = std::min(queries / seqs[s].count, kQueryTileMaxLanes);
    for (next = s + 1; lanes >= 2 && next < seqs.size() && seqs[next].count == seqs[s].count;) ++next;
    if (lanes >= 2)
      add_lane_tiles(tree, &seqs[s], int64_t(next - s), lanes, &records);
    else
      add_sequence_tiles(seqs[s], queries, &records);
  }
  return records;
}

bool query_tiles_have_lanes(const std::vector<int32_t>& tiles) {
  for (size_t t = 0; t < tiles.size(); t += kQueryTileFields.size())
    if (QueryTile(&tiles[t]).has_lanes()) return true;
  return false;
}

bool query_tiles_win(int64_t rows, int64_t tiles, int64_t mean_walk, bool lanes, const PlanShape& shape) {
  if (tiles == 0 || double(tiles * shape.num_kv_heads) < kQueryTileMinProgramsPerSm * double(shape.num_sms))
    return false;
  int64_t tile_rows = rows * shape.group();
  bool full = tile_rows >= kQueryTileFullRows * tiles, short_walks = mean_walk <= kQueryTileShortWalk;
  if (lanes) return full && short_walks;
  return full || (tile_rows >= kQueryTileMinRows * tiles && short_walks);
}

double estimated_us(const Plan& plan, const SegmentTree& tree, const PlanShape& shape) {
  if (plan.as_query_tiles()) return query_tiles_us(plan, tree, shape);
  double total = last_launch_us(plan, tree, shape);
  for (const ItemList& list : plan.items) total += partial_launch_us(list, tree, shape);
  return total;
}

void pack_work_lists(const Plan& plan, std::vector<int32_t>* flat, std::vector<int64_t>* offsets) {
  std::vector<const std::vector<int32_t>*> lists = {&plan.order,      &plan.final_start, &plan.merge_ptr,
                                                    &plan.entry_slot, &plan.common,      &plan.query_tiles};
  for (const ItemList& items : plan.items) lists.push_back(&items.records);
  flat->clear();
  offsets->clear();
  for (const auto* list : lists) {
    int64_t at = int64_t(flat->size());
    offsets->push_back(at);
    flat->insert(flat->end(), list->begin(), list->end());
    flat->resize(size_t(at) + std::max<size_t>(4, align_up(list->size(), 4)), 0);
  }
}

namespace {

// item_runs() over the tables of `rows` rows, row_table(r) pointing at row r's `stride` block ids.
template <typename RowTable>
int runs_of_consecutive_slots(ItemList* items, const std::vector<int32_t>& final_start, RowTable row_table,
                              int64_t stride, int64_t block_size) {
  int64_t rows = int64_t(final_start.size());
  int most = 1;
  std::vector<int32_t> splits;
  for (size_t i = 0; i < items->records.size(); i += kItemFields) {
    const int32_t* item = items->records.data() + i;
    int64_t row = item[kTableRow], start = item[kKvStart], end = item[kKvEnd];
    if (item[kOpenEnd] || row < 0 || row >= rows || start < 0 || end <= start || end > final_start[row] ||
        end > stride * block_size)
      return 0;
    auto pages = row_table(row);
    int runs = 1;
    int64_t split = end;
    for (int64_t c = start / block_size; c < (end - 1) / block_size; ++c) {
      if (int64_t(pages[c + 1]) == int64_t(pages[c]) + 1) continue;
      if (++runs > kMaxItemRuns) return 0;
      split = (c + 1) * block_size;
    }
    most = std::max(most, runs);
    splits.push_back(int32_t(split));
  }
  if (most > 1)
    for (size_t k = 0; k < splits.size(); ++k) items->records[k * kItemFields + kRunSplit] = splits[k];
  return most;
}

}  // namespace

int item_runs(ItemList* items, const std::vector<int32_t>& final_start, const int32_t* tables, int64_t stride,
              int64_t block_size) {
  return runs_of_consecutive_slots(
      items, final_start, [&](int64_t r) { return tables + r * stride; }, stride, block_size);
}

int item_runs(ItemList* items, const std::vector<int32_t>& final_start, const int64_t* tables, const int64_t* rows,
              int64_t stride, int64_t block_size) {
  return runs_of_consecutive_slots(
      items, final_start, [&](int64_t r) { return tables + rows[r] * stride; }, stride, block_size);
}

namespace {

// Whether the plan's partial launch is a lone root of at most one program per SM: final programs
// started early share its SMs (kPackedFinalsBesideRoot).
bool lone_root_beside(const Plan& plan, int64_t num_computed, const PlanShape& shape) {
  if (num_computed != 1 || plan.separate_merge) return false;
  int64_t programs = 0;
  for (const ItemList& list : plan.items) programs += list.count() * shape.num_kv_heads;
  return programs <= shape.num_sms;
}

// Whether the plan's partial launches are estimated to take longer than its final launch at its
// lanes now (partial_launch_us(), last_launch_us()).
bool root_outlasts_leaves(const Plan& plan, const SegmentTree& tree, const PlanShape& shape) {
  double partial = 0;
  for (const ItemList& list : plan.items) partial += partial_launch_us(list, tree, shape);
  return partial > last_launch_us(plan, tree, shape);
}

// final_lanes() for `plan` (its lists made): at the narrow tile's lanes first (set in
// plan.final_lanes, which last_launch_us() reads), whose final launch the lone root must
// outlast for the wide tile.
int64_t planned_lanes(Plan& plan, const SegmentTree& tree, const PlanShape& shape, int64_t num_computed) {
  bool beside = lone_root_beside(plan, num_computed, shape);
  int64_t longest = 0;
  for (int64_t b = 0; b < tree.num_rows(); ++b)
    longest = std::max<int64_t>(longest, tree.lengths[b] - plan.final_start[b]);
  plan.final_lanes = final_lanes(tree.num_rows(), longest, shape, beside, false);
  bool outlasts = beside && plan.final_lanes == shape.max_final_lanes() && root_outlasts_leaves(plan, tree, shape);
  return outlasts ? final_lanes(tree.num_rows(), longest, shape, true, true) : plan.final_lanes;
}

// The range each packed final program's lanes share at the start of their final ranges: from
// their common final start to the end of the deepest node above all of them (a folded node:
// its tokens lie in the same pages for every lane), read once for all their rows; the lanes'
// final ranges then start at its end. Lanes whose final ranges start apart share nothing here;
// a plan where no program shares anything keeps no records.
// Every node is folded in a flat plan, so there a program of sibling leaves walks their path
// once, not once per lane (H100, ft_deep16/q32kv8 flat: 80.1 -> 62.3 us at 8 lanes).
void shared_final_prefixes(const SegmentTree& t, Plan* p) {
  p->common.clear();
  if (p->separate_merge || p->as_paged_decode || p->final_lanes < 2) return;
  int64_t rows = t.num_rows();
  bool shared = false;
  for (int64_t first = 0; first < rows; first += p->final_lanes) {
    int64_t last = std::min(rows, first + p->final_lanes);
    int64_t lead = t.order[first], start = p->final_start[lead], end = start;
    bool aligned = last - first > 1;
    for (int64_t i = first; i < last; ++i) aligned = aligned && p->final_start[t.order[i]] == start;
    int64_t v = aligned ? t.end_node[lead] : -1;
    while (v >= 0 && (t.node_lo[v] > first || t.node_hi[v] < last)) v = t.node_parent[v];
    if (v >= 0) end = std::max(start, t.node_end[v]);
    p->common.insert(p->common.end(), {int32_t(lead), int32_t(start), int32_t(end)});
    if (end > start) {
      shared = true;
      for (int64_t i = first; i < last; ++i) p->final_start[t.order[i]] = int32_t(end);
    }
  }
  if (!shared) p->common.clear();
}

// The chunk length once the merge mode is known: for partial_programs() programs, over the
// computed nodes' work (before a final launch) or every range's (merged separately: all of them
// are the one partial launch). Unshared branches merged separately pay down to the shorter
// kMinSeparateChunkTokens: their chunks are all the work, and cheap to merge.
int64_t merge_mode_chunk_tokens(const Ranges& r, const std::vector<int64_t>& programs,
                                const std::vector<int64_t>& length, const std::vector<int64_t>& block_m,
                                bool separate_merge, const PlanShape& shape) {
  size_t counted = separate_merge || !r.num_computed ? length.size() : size_t(r.num_computed);
  int64_t min_tokens = separate_merge && !r.num_computed ? kMinSeparateChunkTokens : kMinChunkTokens;
  bool outweighed = false, long_root = false;
  if (r.num_computed == 1 && !separate_merge) {  // a lone root: do its leaves outweigh it, or does it walk long?
    int64_t step =
        chunk_length(length[0], chunk_tokens(programs, length, 1, kLoneRootWaves * shape.num_sms, min_tokens));
    int64_t pieces = std::max<int64_t>(1, ceil_div(length[0], step));
    int64_t leaf_tokens = 0;
    for (size_t k = 1; k < length.size(); ++k) leaf_tokens += length[k];
    outweighed = leaves_outweigh_root(length[0], ceil_div(step, kChunkAlign), pieces * programs[0],
                                      block_m[0] > shape.block_ms[0], leaf_tokens, shape);
    long_root = !outweighed && lone_root_walks_long(step, programs[0], shape);
  }
  return chunk_tokens(programs, length, counted,
                      partial_programs(r.num_computed, separate_merge, outweighed, long_root, shape), min_tokens);
}

// One plan of `tree`: the cost model's folds (one sequence's queries one reader where
// `sequences`, node_consumers()), or every node folded (`flat`); each range in its own row
// tile, or every range in the wide one (`one_tile`).
Status build_plan(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options, bool flat, bool one_tile,
                  const int32_t* sequences, Plan* out) {
  std::vector<char> fold;
  std::vector<int64_t> eff_start;
  fold_decisions(tree, shape, options.reread_weight, flat, sequences, &fold, &eff_start);
  Ranges r = collect_ranges(tree, fold, eff_start, shape, one_tile, options.host_nodes != 0);
  size_t num_ranges = r.lo.size();
  std::vector<int64_t> length(num_ranges), block_m(num_ranges), programs(num_ranges);
  for (size_t k = 0; k < num_ranges; ++k) {
    length[k] = r.hi[k] - r.lo[k];
    block_m[k] = range_tile(r.basis[k], one_tile, shape);
    programs[k] = ceil_div(r.rows[k] * shape.group(), block_m[k]) * shape.num_kv_heads;
  }
  Plan p;
  // Before the merge mode is known: kWaves per SM over the computed nodes' work, or over every
  // range's where nothing is computed (their chunks are the partial launch). With computed
  // nodes, their work alone: the final kernel runs after them, so they must fill the GPU by
  // themselves (H200, seed_b256: the root in two chunks 81.7 us, whole 90.9).
  size_t computed_work = r.num_computed ? size_t(r.num_computed) : num_ranges;
  p.chunk_tokens = options.target_chunk
                       ? options.target_chunk
                       : chunk_tokens(programs, length, computed_work, kWaves * shape.num_sms, kMinChunkTokens);
  p.computed_nodes = r.num_computed;
  std::vector<int64_t> step, pieces;
  cut_ranges(length, size_t(r.num_computed), p.chunk_tokens, &step, &pieces);
  p.separate_merge =
      !options.final_kernel &&
      (options.separate_merge >= 0
           ? options.separate_merge != 0
           : merge_separately(longest_final_walk(tree, r, step, pieces), separate_merge_adds_launch(r, block_m, pieces),
                              tree.num_rows() * shape.final_tiles(), shape.num_sms));
  if (!options.target_chunk) {  // the chunk length the merge mode asks for, now it is known
    int64_t tokens = merge_mode_chunk_tokens(r, programs, length, block_m, p.separate_merge, shape);
    if (tokens != p.chunk_tokens) {
      p.chunk_tokens = tokens;
      cut_ranges(length, size_t(r.num_computed), p.chunk_tokens, &step, &pieces);
    }
  }
  std::vector<int64_t> chunk_block_m;
  for (size_t k = 0; k < num_ranges; ++k) {
    bool is_final = int64_t(k) >= r.num_computed;
    int64_t last = pieces[k] - 1;
    if (is_final) p.final_start.push_back(int32_t(r.lo[k] + last * step[k]));
    // A final range's last chunk is the final kernel's, or an open partial when merging separately.
    for (int64_t within = 0; within < pieces[k] - (is_final && !p.separate_merge); ++within) {
      int64_t start = r.lo[k] + within * step[k];
      p.chunk_start.push_back(start);
      p.chunk_end.push_back(std::min(start + step[k], r.hi[k]));
      p.chunk_open.push_back(is_final && within == last);
      p.chunk_rows.push_back(r.rows[k]);
      p.chunk_row_ptr.push_back(r.row_ptr[k]);
      p.chunk_table_row.push_back(r.table_row[k]);
      p.chunk_entry0.push_back(p.num_entries);
      chunk_block_m.push_back(block_m[k]);
      p.num_entries += r.rows[k];
    }
  }
  if (p.num_entries * shape.num_qo_heads >= (int64_t(1) << 31))  // the kernels index partials in int32
    return Status::Error(Code::kInvalidArgument, "the plan needs " + std::to_string(p.num_entries) + " partials of " +
                                                     std::to_string(shape.num_qo_heads) +
                                                     " heads: too many for one step; split the branches over calls");
  p.order.assign(tree.order.begin(), tree.order.end());
  merge_slots(tree, &p);
  make_items(p, chunk_block_m, shape, &p.items);
  p.as_paged_decode =
      runs_as_paged_decode(p.separate_merge, p.num_entries, options.final_lanes != 0 || options.final_kernel);
  if (!p.separate_merge && !p.as_paged_decode)
    p.final_lanes = options.final_lanes ? options.final_lanes : planned_lanes(p, tree, shape, r.num_computed);
  shared_final_prefixes(tree, &p);
  p.final_heads_first = !p.separate_merge && !p.as_paged_decode &&
                        final_heads_first(p.final_lanes, p.has_common(), ceil_div(tree.num_rows(), p.final_lanes),
                                          shape.token_row_bytes());
  p.early_final =
      !p.items.empty() && (options.early_final >= 0 ? options.early_final != 0 : final_starts_early(p.separate_merge));
  p.estimated_us = estimated_us(p, tree, shape);
  *out = std::move(p);
  return Status::Ok();
}

// The flat plan whose final programs pack the wide final tile's lanes (kMinPackedLanes at
// least), siblings in the tree order, so that each walks the path its lanes share once
// (shared_final_prefixes()), where its programs' walks stay short (kSharedRangeWalk) and
// estimated_us() finds it faster than `plan`.
void prefer_shared_ranges(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options,
                          const int32_t* sequences, Plan* plan) {
  if (options.flat >= 0 || options.final_lanes || shape.max_wide_final_lanes() < kMinPackedLanes) return;
  PlanOptions packed = options;
  packed.final_lanes = shape.max_wide_final_lanes();
  Plan shared;
  if (build_plan(tree, shape, packed, true, options.one_tile == 1, sequences, &shared).ok() && shared.has_common() &&
      last_launch_walk(shared, tree, nullptr) <= kSharedRangeWalk && shared.estimated_us < plan->estimated_us)
    *plan = std::move(shared);
}

// `plan` again with every item in the wide tile, where it merges separately over both row tiles
// (one partial launch fewer) and estimated_us() finds that faster.
void prefer_one_tile(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options,
                     const int32_t* sequences, Plan* plan) {
  if (options.one_tile >= 0 || !plan->separate_merge || plan->items.size() < 2) return;
  Plan wide;
  if (build_plan(tree, shape, options, plan->computed_nodes == 0, true, sequences, &wide).ok() &&
      wide.estimated_us < plan->estimated_us)
    *plan = std::move(wide);
}

// The plan of `tree`'s rows as query tiles (query_tile_records()), a flat plan with no partials,
// where rows name their sequences and query_tiles_win() (or the options) say so. Forcing a tree
// plan's choices asks for a tree plan (tests, the tuner).
bool plan_query_tiles(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options,
                      const int32_t* row_sequence, Plan* out) {
  if (!row_sequence || options.query_tiles == 0 || shape.query_tile_queries() == 0) return false;
  std::vector<int32_t> tiles = query_tile_records(tree, row_sequence, shape.query_tile_queries());
  int64_t count = int64_t(tiles.size() / kQueryTileFields.size()), walked = 0;
  for (size_t i = 0; i < tiles.size(); i += kQueryTileFields.size()) walked += query_tile_walk(tree, &tiles[i]);
  bool tree_forced = options.flat >= 0 || options.separate_merge >= 0 || options.final_lanes || options.one_tile >= 0 ||
                     options.target_chunk;
  if (options.query_tiles != 1 &&
      (tree_forced || !query_tiles_win(tree.num_rows(), count, walked / std::max<int64_t>(count, 1),
                                       query_tiles_have_lanes(tiles), shape)))
    return false;
  Plan p;
  p.order.assign(tree.order.begin(), tree.order.end());
  p.final_start.assign(size_t(tree.num_rows()), 0);
  p.merge_ptr.assign(size_t(tree.num_rows()) + 1, 0);
  p.query_tiles = std::move(tiles);
  p.estimated_us = estimated_us(p, tree, shape);
  *out = std::move(p);
  return true;
}

// A tree plan: the cost model's folds (or the forced ones), then the alternatives it prefers;
// with `sequences`, one sequence's queries count as one reader of their short own nodes.
Status tree_plan(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options, const int32_t* sequences,
                 Plan* out) {
  Status st = build_plan(tree, shape, options, options.flat == 1, options.one_tile == 1, sequences, out);
  if (!st.ok()) return st;
  if (options.flat < 0 && out->computed_nodes && flat_may_win(tree, shape, out->estimated_us)) {
    Plan flat;
    if (build_plan(tree, shape, options, true, options.one_tile == 1, sequences, &flat).ok() &&
        flat.estimated_us < out->estimated_us)
      *out = std::move(flat);
  }
  prefer_shared_ranges(tree, shape, options, sequences, out);
  prefer_one_tile(tree, shape, options, sequences, out);
  return Status::Ok();
}

}  // namespace

Status make_plan(const SegmentTree& tree, const PlanShape& shape, const PlanOptions& options, Plan* out,
                 const int32_t* row_sequence) {
  Status st = check_shape(shape);
  if (st.ok()) st = check_segment_tree(tree);
  if (!st.ok()) return st;
  if (options.target_chunk < 0) return Status::Error(Code::kInvalidArgument, "target_chunk must be >= 0");
  if (options.final_lanes < 0 || options.final_lanes > shape.max_wide_final_lanes())
    return Status::Error(Code::kInvalidArgument, "final_lanes must be 0 (chosen) or 1.." +
                                                     std::to_string(shape.max_wide_final_lanes()) +
                                                     " (the wide final tile's rows over the GQA group), got " +
                                                     std::to_string(options.final_lanes));
  if (plan_query_tiles(tree, shape, options, row_sequence, out)) return Status::Ok();
  Plan plan;
  // A sequence's own short nodes folded (kSequenceFoldTokens), or not, or the faster estimate.
  bool repeats = row_sequence && int64_t(sequence_rows(tree.num_rows(), row_sequence).size()) < tree.num_rows();
  const int32_t* sequences = repeats ? row_sequence : nullptr;  // some sequence has several rows
  if (!(st = tree_plan(tree, shape, options, options.sequence_folds == 1 ? sequences : nullptr, &plan)).ok()) return st;
  Plan folded;
  if (sequences && options.sequence_folds < 0 && tree_plan(tree, shape, options, sequences, &folded).ok() &&
      folded.estimated_us < plan.estimated_us)
    plan = std::move(folded);
  *out = std::move(plan);
  return Status::Ok();
}

}  // namespace flash_reasoning
