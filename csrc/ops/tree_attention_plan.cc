#include "ops/tree_attention_plan.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "ops/paged_decode.h"
#include "util/int_math.h"

namespace flash_reasoning {
namespace {

constexpr size_t kRegionAlign = 256;

Status invalid(const std::string& message) { return Status::Error(Code::kInvalidArgument, message); }

Status mismatch(const std::string& why) {
  return Status::Error(Code::kPlanMismatch, why + ": the plan no longer describes the tree; create a new plan");
}

// Checks the host arrays of `tree`: lengths >= 0, each row's blocks within `columns` table
// columns and the pool. A row needing more than `columns` is kInvalidArgument, or `too_long`
// when given (an update past the plan's room).
Status check_tree(const AttentionShape& shape, const TreeInput& tree, int64_t columns, Code too_long) {
  if (tree.num_branches < 0) return invalid("tree.num_branches must be >= 0, got " + std::to_string(tree.num_branches));
  if (tree.num_branches && (!tree.lengths || !tree.tables))
    return invalid("tree.lengths and tree.block_tables must not be NULL");
  if (tree.stride < 0) return invalid("tree.table_stride must be >= 0");
  for (int64_t i = 0; i < tree.num_branches; ++i) {
    std::string at = "branch " + std::to_string(i);
    if (tree.lengths[i] < 0)
      return invalid("tree.lengths[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(tree.lengths[i]));
    int64_t cols = ceil_div(tree.lengths[i], shape.block_size);
    if (cols > tree.stride)
      return invalid(at + " has " + std::to_string(tree.lengths[i]) + " tokens: " + std::to_string(cols) +
                     " blocks, but tree.table_stride is " + std::to_string(tree.stride));
    if (cols > columns)
      return Status::Error(too_long, at + " needs " + std::to_string(cols) + " blocks, the plan holds " +
                                         std::to_string(columns) + " per branch (extra_blocks at creation)");
    for (int64_t j = 0; j < cols; ++j) {
      int32_t block = tree.tables[i * tree.stride + j];
      if (block < 0 || block >= shape.num_blocks)
        return invalid(at + ": block_tables[" + std::to_string(i) + "][" + std::to_string(j) + "] is " +
                       std::to_string(block) +
                       ", must be in [0, shape.num_blocks = " + std::to_string(shape.num_blocks) + ")");
    }
  }
  return Status::Ok();
}

// The covered columns of each row, `columns` per row, zeros beyond.
std::vector<int32_t> dense_tables(const AttentionShape& shape, const TreeInput& tree, int64_t columns) {
  std::vector<int32_t> out(size_t(tree.num_branches * columns), 0);
  for (int64_t i = 0; i < tree.num_branches; ++i) {
    int64_t cols = ceil_div(tree.lengths[i], shape.block_size);
    std::copy(tree.tables + i * tree.stride, tree.tables + i * tree.stride + cols, out.begin() + i * columns);
  }
  return out;
}

// Draft masks of `rows` rows: tokens in [0, kMaxDraftTokens], and, given the rows' lengths,
// within them.
Status check_drafts(const DraftMask* drafts, int64_t rows, const int32_t* lengths = nullptr) {
  for (int64_t i = 0; i < rows; ++i) {
    int64_t tokens = drafts[i].tokens;
    if (tokens < 0 || tokens > kMaxDraftTokens)
      return invalid("draft_masks[" + std::to_string(i) + "].tokens must be in [0, " + std::to_string(kMaxDraftTokens) +
                     "], got " + std::to_string(tokens));
    if (lengths && tokens > lengths[i])
      return invalid("draft_masks[" + std::to_string(i) + "].tokens is " + std::to_string(tokens) + ", past branch " +
                     std::to_string(i) + "'s " + std::to_string(lengths[i]) + " tokens");
  }
  return Status::Ok();
}

// Whether rows a and b of `tree` list the same blocks for their first `tokens` tokens.
bool same_first_blocks(const AttentionShape& shape, const TreeInput& tree, int64_t a, int64_t b, int64_t tokens) {
  int64_t cols = ceil_div(tokens, shape.block_size);
  return std::equal(tree.tables + a * tree.stride, tree.tables + a * tree.stride + cols, tree.tables + b * tree.stride);
}

// Whether rows a and b of `tree` list the same blocks over the longer one's tokens.
bool same_blocks(const AttentionShape& shape, const TreeInput& tree, int64_t a, int64_t b) {
  return same_first_blocks(shape, tree, a, b, std::max(tree.lengths[a], tree.lengths[b]));
}

// Each row's sequence for query tiles: consecutive rows listing the same blocks (the C ABI's
// several queries of a branch, each a row with the branch's table) are one sequence.
std::vector<int32_t> sequences_from_tables(const AttentionShape& shape, const TreeInput& tree) {
  std::vector<int32_t> sequence(size_t(tree.num_branches), 0);
  for (int64_t i = 1; i < tree.num_branches; ++i) sequence[i] = sequence[i - 1] + !same_blocks(shape, tree, i - 1, i);
  return sequence;
}

// A plan with draft masks reads every draft token in the final kernel or in query tiles, the only
// ones that apply them: never merged separately (which would read the draft tokens in open partial
// items), never a paged decode (PlanOptions::final_kernel).
PlanOptions draft_options(PlanOptions options) {
  options.final_kernel = true;
  return options;
}

int64_t longest_item(const ItemList& items) {
  int64_t longest = 0;
  for (int64_t k = 0; k < items.count(); ++k)
    longest = std::max<int64_t>(
        longest, items.records[k * kTreeItemFields.size() + 2] - items.records[k * kTreeItemFields.size() + 1]);
  return longest;
}

// A tree launch's grid: (programs, heads), or (heads, programs) where each program's heads run
// together (partial items by ItemList::heads_first, packed final programs by
// Plan::final_heads_first; the kernels' item_and_head).
void ordered_grid(int64_t programs, int64_t heads, bool heads_first, int64_t grid[3]) {
  grid[0] = heads_first ? heads : programs;
  grid[1] = heads_first ? programs : heads;
  grid[2] = 1;
}

LaunchArg call(size_t index) { return LaunchArg::Call(kPlanPointers[index], int64_t(index)); }

// The PlanShape of `shape`: the compiled row tiles from the context's manifest, else the
// planner's defaults (the same tiles: a test checks).
Status plan_shape_of(const Context* ctx, const AttentionShape& shape, int64_t num_sms, PlanShape* out) {
  out->num_qo_heads = shape.num_qo_heads;
  out->num_kv_heads = shape.num_kv_heads;
  out->head_dim = shape.head_dim;
  out->dtype_bytes = shape.dtype_bytes();
  out->num_sms = num_sms ? num_sms : ctx ? ctx->num_sms() : 1;
  if (!ctx) return Status::Ok();
  Status st = ctx->rules().constant("tree_block_m_narrow", &out->block_ms[0]);
  if (st.ok()) st = ctx->rules().constant("tree_block_m_wide", &out->block_ms[1]);
  if (st.ok()) st = ctx->rules().constant("tree_final_block_m_wide", &out->wide_final_rows);
  if (st.ok()) st = ctx->rules().constant("tree_queries_block_m", &out->query_tile_rows);
  return st;
}

}  // namespace

Status TreeAttentionPlan::create(Context* ctx, const AttentionShape& shape, const TreeInput& tree, int64_t extra_blocks,
                                 const PlanOptions& options, std::unique_ptr<TreeAttentionPlan>* out,
                                 const DraftMask* drafts) {
  Status st = ctx ? check_shape(*ctx, shape, "tree_final") : check_shape_fields(shape);
  if (st.ok()) st = check_tree(shape, tree, tree.stride, Code::kInvalidArgument);
  if (st.ok() && drafts) st = check_drafts(drafts, tree.num_branches, tree.lengths);
  if (!st.ok()) return st;
  // Rows are planned without their draft tokens (create's `drafts`).
  std::vector<int64_t> lengths(tree.lengths, tree.lengths + tree.num_branches);
  for (size_t i = 0; drafts && i < lengths.size(); ++i) lengths[i] -= drafts[i].tokens;
  SegmentTree segments;
  st = segment_tree_from_tables(tree.num_branches, lengths.data(), tree.tables, tree.stride, shape.block_size,
                                &segments);
  if (!st.ok()) return st;
  std::vector<int32_t> sequences = sequences_from_tables(shape, tree);
  return create(ctx, shape, std::move(segments), tree.tables, tree.stride, extra_blocks, options, out, 0, drafts,
                sequences.data());
}

Status TreeAttentionPlan::create(Context* ctx, const AttentionShape& shape, SegmentTree tree, const int32_t* tables,
                                 int64_t stride, int64_t extra_blocks, const PlanOptions& options,
                                 std::unique_ptr<TreeAttentionPlan>* out, int64_t num_sms, const DraftMask* drafts,
                                 const int32_t* row_sequence) {
  Status st = ctx ? check_shape(*ctx, shape, "tree_final") : check_shape_fields(shape, false);
  if (!st.ok()) return st;
  if (extra_blocks < 0) return invalid("extra_blocks must be >= 0, got " + std::to_string(extra_blocks));
  if (num_sms < 0) return invalid("num_sms must be >= 0 (0: the context's), got " + std::to_string(num_sms));
  if (!tables && ctx) return invalid("a plan with kernels needs the branches' block tables");
  if (drafts && !(st = check_drafts(drafts, tree.num_rows())).ok()) return st;
  std::vector<int32_t> lengths(tree.lengths.size());  // with the draft tokens: what runs read
  for (size_t i = 0; i < lengths.size(); ++i) {
    int64_t length = tree.lengths[i] + (drafts ? drafts[i].tokens : 0);
    if (length > INT_MAX)
      return invalid("branch " + std::to_string(i) + " has " + std::to_string(length) +
                     " tokens: the kernels index tokens in int32 (at most 2^31 - 1)");
    lengths[i] = int32_t(length);
  }
  TreeInput input{tree.num_rows(), lengths.data(), tables, stride};
  if (tables && !(st = check_tree(shape, input, stride, Code::kInvalidArgument)).ok()) return st;

  std::unique_ptr<TreeAttentionPlan> p(new TreeAttentionPlan(ctx, shape));
  if (!(st = plan_shape_of(ctx, shape, num_sms, &p->plan_shape_)).ok()) return st;
  if (!(st = make_plan(tree, p->plan_shape_, drafts ? draft_options(options) : options, &p->plan_, row_sequence)).ok())
    return st;
  if (drafts) p->drafts_.assign(drafts, drafts + tree.num_rows());
  if (tables && !(st = p->take_tables(input, extra_blocks)).ok()) return st;
  p->lengths_ = std::move(lengths);
  p->tree_ = std::move(tree);
  // Before packing: two-run items carry their run split in their records.
  for (ItemList& items : p->plan_.items)
    p->slot_runs_.push_back(
        !tables || options.slot_runs == 0
            ? 0
            : item_runs(&items, p->plan_.final_start, p->tables_.data(), p->max_blocks_, shape.block_size));
  pack_work_lists(p->plan_, &p->work_, &p->work_offset_);
  p->layout_workspace();
  if (ctx && !(st = p->build_launches()).ok()) return st;
  *out = std::move(p);
  return Status::Ok();
}

TreeAttentionPlan::~TreeAttentionPlan() {
  if (owns_workspace_) ctx_->free(workspace_);  // an error here has no one to report to
}

// The plan's own dense copy of `input`'s tables, extra_blocks columns beyond the longest branch.
Status TreeAttentionPlan::take_tables(const TreeInput& input, int64_t extra_blocks) {
  int64_t longest = 0;
  for (int64_t i = 0; i < input.num_branches; ++i)
    longest = std::max(longest, ceil_div(input.lengths[i], shape_.block_size));
  max_blocks_ = std::max<int64_t>(1, longest + extra_blocks);
  if (max_blocks_ > INT_MAX || max_blocks_ * input.num_branches > INT_MAX)
    return invalid("block tables of " + std::to_string(input.num_branches) + " x " + std::to_string(max_blocks_) +
                   " entries overflow int32 indexing");
  tables_ = dense_tables(shape_, input, max_blocks_);
  return Status::Ok();
}

int64_t TreeAttentionPlan::unique_tokens() const { return tree_.unique_tokens(); }

int64_t TreeAttentionPlan::logical_tokens() const {
  int64_t total = 0;
  for (int32_t len : lengths_) total += len;
  return total;
}

void TreeAttentionPlan::layout_workspace() {
  size_t n = size_t(num_branches()), partial_values = size_t(plan_.num_entries * shape_.num_qo_heads);
  size_t sizes[kNumRegions] = {work_.size() * 4,
                               n * size_t(max_blocks_) * 4,
                               n * 4,
                               drafts_.size() * sizeof(DraftMask),
                               partial_values * size_t(shape_.head_dim) * 4,
                               partial_values * 4};
  workspace_bytes_ = 0;
  for (int r = 0; r < kNumRegions; ++r) {
    regions_[r] = {workspace_bytes_, sizes[r]};
    workspace_bytes_ += align_up(std::max<size_t>(sizes[r], 16), kRegionAlign);
  }
  image_.assign(regions_[int(Region::kPartialOut)].offset, 0);
  std::memcpy(image_.data(), work_.data(), sizes[0]);
  std::memcpy(image_.data() + regions_[int(Region::kTables)].offset, tables_.data(), sizes[1]);
  std::memcpy(image_.data() + regions_[int(Region::kLengths)].offset, lengths_.data(), sizes[2]);
  if (!drafts_.empty())
    std::memcpy(image_.data() + regions_[int(Region::kDraftMasks)].offset, drafts_.data(), sizes[3]);
}

LaunchArg TreeAttentionPlan::work_list(const char* name, size_t list) const {
  return LaunchArg::Workspace(name, int64_t(regions_[int(Region::kWork)].offset) + 4 * work_offset_[list]);
}

LaunchArg TreeAttentionPlan::region_arg(const char* name, Region r) const {
  return LaunchArg::Workspace(name, int64_t(regions_[int(r)].offset));
}

// The pointers every tree kernel takes first (specializations._TREE_PAGED); with `pool_maps`,
// the pools as pool_map()s, for kernels that may read them through TMA descriptors.
std::vector<LaunchArg> TreeAttentionPlan::paged_args(bool pool_maps) const {
  return {call(0), pool_maps ? pool_map("k_pool", 1) : call(1), pool_maps ? pool_map("v_pool", 2) : call(2),
          region_arg("block_tables", Region::kTables), region_arg("seq_lens", Region::kLengths)};
}

// The run's pool `pointer` (1: K, 2: V) as parameter `name`, viewed as [slots, KV heads x
// head_dim]: what a kernel reading it through a TMA descriptor tiles.
LaunchArg TreeAttentionPlan::pool_map(const char* name, size_t pointer) const {
  return LaunchArg::Call(name, int64_t(pointer), shape_.num_blocks * shape_.block_size,
                         shape_.num_kv_heads * shape_.head_dim);
}

// The scalars every tree kernel takes after its pointers (specializations._TREE_SCALARS), then
// `more`, the kernel's own.
void TreeAttentionPlan::add_tree_scalars(std::vector<LaunchArg>* args, std::initializer_list<LaunchArg> more) const {
  args->insert(args->end(), {LaunchArg::Value("sm_scale_log2", Arg::Float(shape_.scale_log2())),
                             LaunchArg::Value("num_qo_heads", Arg::Int(shape_.num_qo_heads)),
                             LaunchArg::Value("num_kv_heads", Arg::Int(shape_.num_kv_heads)),
                             LaunchArg::Value("page_size", Arg::Int(shape_.block_size)),
                             LaunchArg::Value("max_blocks", Arg::Int(max_blocks_))});
  args->insert(args->end(), more);
}

Status TreeAttentionPlan::build_launches() {
  if (!num_branches()) return Status::Ok();
  Status st = add_partial_launches();
  return st.ok() ? add_last_launch() : st;
}

Status TreeAttentionPlan::add_partial_launches() {
  for (size_t i = 0; i < plan_.items.size(); ++i) {
    const ItemList& items = plan_.items[i];
    std::string key = "tree_partial/" + shape_.rule_suffix() + "/" + std::to_string(items.block_m);
    int64_t grid[3];
    ordered_grid(items.count(), shape_.num_kv_heads, items.heads_first, grid);
    OpLaunch launch;
    Status st =
        pick_launch(*ctx_, plan_shape_.num_sms, addressing_rule_key(*ctx_, key, shape_.block_size, slot_runs_[i]),
                    longest_item(items), grid[0], grid[1], grid[2], &launch);
    if (!st.ok()) return st;
    launch.launch.args = paged_args(true);
    launch.launch.args.insert(
        launch.launch.args.end(),
        {work_list("order", kOrder), work_list("items", kFirstItems + i), work_list("entry_slot", kEntrySlot),
         region_arg("partial_out", Region::kPartialOut), region_arg("partial_lse", Region::kPartialLse)});
    add_tree_scalars(&launch.launch.args, {LaunchArg::Value("early_final", Arg::Int(plan_.early_final)),
                                           LaunchArg::Value("heads_first", Arg::Int(items.heads_first))});
    launches_.push_back(std::move(launch));
  }
  return Status::Ok();
}

// The final launch (each branch's own range and its merge), the merge launch of a plan that
// merges separately, or, for a plan with no partials, paged_decode's kernel over its tables or
// tree_queries over its query tiles.
Status TreeAttentionPlan::add_last_launch() {
  if (plan_.as_query_tiles()) return add_query_tile_launch();
  int64_t n = num_branches(), tiles = plan_shape_.final_tiles(), lanes = plan_.final_lanes;
  int64_t longest = 0;  // the longest final range: what the final kernel is picked by
  for (int64_t b = 0; b < n; ++b) longest = std::max<int64_t>(longest, lengths_[b] - plan_.final_start[b]);
  OpLaunch launch;
  Status st;
  if (plan_.separate_merge) {
    st = pick_launch(*ctx_, plan_shape_.num_sms, "tree_merge/" + shape_.rule_suffix(), -1, n, shape_.num_qo_heads, 1,
                     &launch);
    launch.launch.args = {work_list("merge_ptr", kMergePtr), region_arg("partial_out", Region::kPartialOut),
                          region_arg("partial_lse", Region::kPartialLse), call(3),
                          LaunchArg::Value("num_qo_heads", Arg::Int(shape_.num_qo_heads))};
  } else if (plan_.as_paged_decode) {  // unsplit, each program a whole branch up to the table's end
    st = pick_launch(*ctx_, plan_shape_.num_sms,
                     addressing_rule_key(*ctx_, "paged_decode/" + shape_.rule_suffix(), shape_.block_size), longest, n,
                     tiles, 1, &launch);
    if (st.ok())
      add_decode_args(*ctx_, shape_,
                      {call(0), call(1), call(2), region_arg("block_tables", Region::kTables),
                       region_arg("seq_lens", Region::kLengths), call(3)},
                      max_blocks_, max_blocks_ * shape_.block_size, 0, 0, &launch);
  } else {
    // A packed program (several lanes) walks its lanes' ranges side by side: its own rule list,
    // one per final tile, and one for programs that read their lanes' shared range first.
    // Draft masks: the same kernels with the masks applied, each kind its own rule list.
    std::string kernel = "tree_final";
    if (lanes > 1) {
      bool wide = plan_shape_.final_block_m(lanes) > plan_shape_.block_ms[0];
      kernel = std::string(plan_.has_common() ? "tree_final_common" : "tree_final_packed") + (wide ? "_wide" : "");
    }
    kernel += drafts_.empty() ? "/" : "_draft/";
    int64_t grid[3];
    ordered_grid(ceil_div(n, lanes), tiles, plan_.final_heads_first, grid);
    st = pick_launch(*ctx_, plan_shape_.num_sms,
                     addressing_rule_key(*ctx_, kernel + shape_.rule_suffix(), shape_.block_size), longest * lanes,
                     grid[0], grid[1], grid[2], &launch);
    launch.launch.args = paged_args();
    launch.launch.args.insert(
        launch.launch.args.end(),
        {work_list("order", kOrder), work_list("final_start", kFinalStart), work_list("merge_ptr", kMergePtr),
         work_list("common", kCommon), region_arg("draft_masks", Region::kDraftMasks),
         region_arg("partial_out", Region::kPartialOut), region_arg("partial_lse", Region::kPartialLse), call(3)});
    add_tree_scalars(&launch.launch.args,
                     {LaunchArg::Value("num_rows", Arg::Int(n)), LaunchArg::Value("lanes", Arg::Int(lanes)),
                      LaunchArg::Value("heads_first", Arg::Int(plan_.final_heads_first))});
  }
  if (st.ok()) launches_.push_back(std::move(launch));
  return st;
}

// tree_queries: one program per (query tile, KV head), picked by the longest row (tiles cover all).
Status TreeAttentionPlan::add_query_tile_launch() {
  int64_t count = int64_t(plan_.query_tiles.size() / kQueryTileFields.size());
  int64_t longest = *std::max_element(lengths_.begin(), lengths_.end());
  std::string kernel = std::string("tree_queries") + (query_tiles_have_lanes(plan_.query_tiles) ? "_lanes" : "") +
                       (drafts_.empty() ? "/" : "_draft/");
  OpLaunch launch;
  Status st = pick_launch(*ctx_, plan_shape_.num_sms,
                          addressing_rule_key(*ctx_, kernel + shape_.rule_suffix(), shape_.block_size), longest, count,
                          shape_.num_kv_heads, 1, &launch);
  if (!st.ok()) return st;
  // The pools again, for the kernels that read a run of slots through TMA descriptors (the
  // others ignore them).
  launch.launch.args = paged_args();
  launch.launch.args.insert(launch.launch.args.end(),
                            {pool_map("k_tiles", 1), pool_map("v_tiles", 2), work_list("query_tiles", kQueryTiles),
                             region_arg("draft_masks", Region::kDraftMasks), call(3)});
  add_tree_scalars(&launch.launch.args);
  launches_.push_back(std::move(launch));
  return Status::Ok();
}

Status TreeAttentionPlan::bind(uint64_t workspace) {
  if (!ctx_) return invalid("a plan made without a context has no launches to bind");
  if (!workspace || workspace % kPointerAlign)
    return invalid("workspace must be a non-NULL, " + std::to_string(kPointerAlign) + "-byte aligned device pointer");
  std::vector<KernelLaunch> launches;
  for (const OpLaunch& l : launches_) launches.push_back(l.launch);
  std::unique_ptr<LaunchSequence> sequence;
  Status st = ctx_->prepare(launches, {kPlanPointers.begin(), kPlanPointers.end()}, workspace, &sequence);
  if (!st.ok()) return st;
  sequence_ = std::move(sequence);
  workspace_ = workspace;
  return Status::Ok();
}

Status TreeAttentionPlan::allocate_workspace() {
  if (!ctx_) return invalid("a plan made without a context cannot allocate device memory");
  CUdeviceptr workspace = 0;
  Status st = ctx_->alloc(workspace_bytes_, &workspace);
  if (!st.ok()) return st;
  st = ctx_->copy_to_device(workspace, image_.data(), image_.size());
  if (st.ok()) st = bind(workspace);
  if (!st.ok()) {
    ctx_->free(workspace);
    return st;
  }
  owns_workspace_ = true;
  return Status::Ok();
}

Status TreeAttentionPlan::run(const void* q, const void* k_pool, const void* v_pool, void* out, CUstream stream) const {
  Status st = check_pointers({{"q", q}, {"k_pool", k_pool}, {"v_pool", v_pool}, {"out", out}});
  if (st.ok())
    st = check_apart(reinterpret_cast<uint64_t>(q), reinterpret_cast<uint64_t>(out),
                     uint64_t(num_branches() * shape_.num_qo_heads * shape_.head_dim * shape_.dtype_bytes()));
  if (st.ok()) st = ctx_ ? ctx_->require_device("frPlanRun") : invalid("a plan made without a context cannot run");
  if (!st.ok() || launches_.empty()) return st;
  if (!sequence_) return invalid("the plan is not bound to a workspace (bind or allocate_workspace first)");
  const uint64_t pointers[] = {reinterpret_cast<uint64_t>(q), reinterpret_cast<uint64_t>(k_pool),
                               reinterpret_cast<uint64_t>(v_pool), reinterpret_cast<uint64_t>(out)};
  return sequence_->run(pointers, kPlanPointers.size(), stream);
}

Status TreeAttentionPlan::check_update(const TreeInput& tree, std::vector<int32_t>* tables,
                                       std::vector<int32_t>* lengths) const {
  if (tree.num_branches < 0) return invalid("tree.num_branches must be >= 0, got " + std::to_string(tree.num_branches));
  if (tree.num_branches != num_branches())
    return mismatch("the plan has " + std::to_string(num_branches()) + " branches, the tree " +
                    std::to_string(tree.num_branches));
  Status st = check_tree(shape_, tree, max_blocks_, Code::kPlanMismatch);
  if (!st.ok()) return st;
  for (int64_t b = 0; b < tree.num_branches; ++b) {
    int64_t shared_until = plan_.final_start[b];
    // A row's draft tokens are its last: they must stay in its final range, where the mask applies.
    int64_t drafted = drafts_.empty() ? 0 : drafts_[b].tokens;
    if (tree.lengths[b] - drafted < shared_until)
      return mismatch("branch " + std::to_string(b) + " shrank to " + std::to_string(tree.lengths[b]) +
                      " tokens, below the " + std::to_string(shared_until) + " the plan reads in shared ranges" +
                      (drafted ? " and its " + std::to_string(drafted) + " draft tokens" : ""));
    for (int64_t j = 0; j < ceil_div(shared_until, shape_.block_size); ++j)
      if (tree.tables[b * tree.stride + j] != tables_[b * max_blocks_ + j])
        return mismatch("branch " + std::to_string(b) + " changed block " + std::to_string(j) + " (" +
                        std::to_string(tables_[b * max_blocks_ + j]) + " -> " +
                        std::to_string(tree.tables[b * tree.stride + j]) + "), inside a range the plan shares");
  }
  const std::vector<int32_t>& tiles = plan_.query_tiles;
  for (size_t t = 0; t < tiles.size(); t += kQueryTileFields.size())
    if (!(st = check_query_tile(tree, &tiles[t])).ok()) return st;
  *tables = dense_tables(shape_, tree, max_blocks_);
  lengths->assign(tree.lengths, tree.lengths + tree.num_branches);
  return Status::Ok();
}

// A query tile reads each lane's rows through the lane's longest row's table, the lanes' shared
// tokens through the tile's longest row's: a lane's rows must list the same blocks, and every lane
// the first row's blocks over the shared tokens.
Status TreeAttentionPlan::check_query_tile(const TreeInput& tree, const int32_t* record) const {
  QueryTile tile(record);
  int64_t first = tile.first_row;
  for (int64_t row = first + 1; row < first + tile.rows; ++row) {
    int64_t lane_first = first + (row - first) / tile.lane_rows * tile.lane_rows;
    if (row != lane_first && !same_blocks(shape_, tree, lane_first, row))
      return mismatch("branch " + std::to_string(row) + " no longer lists the blocks of branch " +
                      std::to_string(lane_first) + ", which its query tile reads as one sequence");
    bool holds = tree.lengths[first] >= tile.shared && tree.lengths[row] >= tile.shared;
    if (row == lane_first && !(holds && same_first_blocks(shape_, tree, first, row, tile.shared)))
      return mismatch("branch " + std::to_string(row) + " no longer holds the blocks of branch " +
                      std::to_string(first) + " for its first " + std::to_string(tile.shared) +
                      " tokens, which its query tile reads once for both");
  }
  return Status::Ok();
}

Status TreeAttentionPlan::update(const TreeInput& tree, CUstream stream) {
  Status st = ctx_ ? ctx_->require_device("frPlanUpdate") : invalid("a plan made without a context has no workspace");
  std::vector<int32_t> tables, lengths;
  if (st.ok()) st = check_update(tree, &tables, &lengths);
  if (st.ok() && !owns_workspace_) st = invalid("update writes the plan's own workspace (allocate_workspace)");
  if (!st.ok()) return st;
  // Pageable sources: each copy returns once its bytes are staged, so the buffers may change after.
  st = ctx_->copy_to_device_async(workspace_ + regions_[int(Region::kTables)].offset, tables.data(), tables.size() * 4,
                                  stream);
  if (st.ok())
    st = ctx_->copy_to_device_async(workspace_ + regions_[int(Region::kLengths)].offset, lengths.data(),
                                    lengths.size() * 4, stream);
  if (!st.ok()) return st;
  tables_.swap(tables);
  lengths_.swap(lengths);
  return Status::Ok();
}

}  // namespace flash_reasoning
