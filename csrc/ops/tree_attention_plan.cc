#include "ops/tree_attention_plan.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "util/int_math.h"
#include "ops/paged_decode.h"

namespace flash_reasoning {
namespace {

constexpr size_t kRegionAlign = 256;

Status mismatch(const std::string& why) {
  return Status::Error(Code::kPlanMismatch, why + ": the plan no longer describes the tree; create a new plan");
}

// Checks the host arrays of `tree`: lengths >= 0, each row's blocks within `columns` table
// columns and the pool. A row needing more than `columns` is kInvalidArgument, or
// `too_long` when given (an update past the plan's room).
Status check_tree(const AttentionShape& shape, const TreeInput& tree, int64_t columns, Code too_long) {
  if (tree.num_branches < 0)
    return Status::Error(Code::kInvalidArgument, "tree.num_branches must be >= 0, got " + std::to_string(tree.num_branches));
  if (tree.num_branches && (!tree.lengths || !tree.tables))
    return Status::Error(Code::kInvalidArgument, "tree.lengths and tree.block_tables must not be NULL");
  if (tree.stride < 0) return Status::Error(Code::kInvalidArgument, "tree.table_stride must be >= 0");
  for (int64_t i = 0; i < tree.num_branches; ++i) {
    std::string at = "branch " + std::to_string(i);
    if (tree.lengths[i] < 0)
      return Status::Error(Code::kInvalidArgument, "tree.lengths[" + std::to_string(i) + "] must be >= 0, got " +
                                                       std::to_string(tree.lengths[i]));
    int64_t cols = ceil_div(tree.lengths[i], shape.block_size);
    if (cols > tree.stride)
      return Status::Error(Code::kInvalidArgument, at + " has " + std::to_string(tree.lengths[i]) + " tokens: " +
                                                       std::to_string(cols) + " blocks, but tree.table_stride is " +
                                                       std::to_string(tree.stride));
    if (cols > columns)
      return Status::Error(too_long, at + " needs " + std::to_string(cols) + " blocks, the plan holds " +
                                         std::to_string(columns) + " per branch (extra_blocks at creation)");
    for (int64_t j = 0; j < cols; ++j) {
      int32_t block = tree.tables[i * tree.stride + j];
      if (block < 0 || block >= shape.num_blocks)
        return Status::Error(Code::kInvalidArgument, at + ": block_tables[" + std::to_string(i) + "][" +
                                                         std::to_string(j) + "] is " + std::to_string(block) +
                                                         ", must be in [0, shape.num_blocks = " +
                                                         std::to_string(shape.num_blocks) + ")");
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

int64_t longest_item(const ItemList& items) {
  int64_t longest = 0;
  for (int64_t k = 0; k < items.count(); ++k)
    longest = std::max<int64_t>(longest, items.records[k * kTreeItemFields.size() + 2] -
                                             items.records[k * kTreeItemFields.size() + 1]);
  return longest;
}

// A tree launch's grid (x, y): (programs, heads), or (heads, programs) where each program's
// heads run together (partial items by ItemList::heads_first, packed final programs by
// Plan::final_heads_first; the kernels' item_and_head).
std::pair<int64_t, int64_t> ordered_grid(int64_t programs, int64_t heads, bool heads_first) {
  return heads_first ? std::pair<int64_t, int64_t>{heads, programs} : std::pair<int64_t, int64_t>{programs, heads};
}

}  // namespace

Status TreeAttentionPlan::create(Context& ctx, const AttentionShape& shape, const TreeInput& tree,
                                 int64_t extra_blocks, std::unique_ptr<TreeAttentionPlan>* out) {
  Status st = check_shape(ctx, shape, "tree_final");
  if (!st.ok()) return st;
  if (extra_blocks < 0) return Status::Error(Code::kInvalidArgument, "extra_blocks must be >= 0, got " + std::to_string(extra_blocks));
  if (!(st = check_tree(shape, tree, tree.stride, Code::kInvalidArgument)).ok()) return st;

  std::unique_ptr<TreeAttentionPlan> p(new TreeAttentionPlan(ctx, shape));
  std::vector<int64_t> lengths(tree.lengths, tree.lengths + tree.num_branches);
  if (!(st = segment_tree_from_tables(tree.num_branches, lengths.data(), tree.tables, tree.stride, shape.block_size,
                                      &p->tree_)).ok())
    return st;
  PlanShape& plan_shape = p->plan_shape_;
  plan_shape.num_qo_heads = shape.num_qo_heads;
  plan_shape.num_kv_heads = shape.num_kv_heads;
  plan_shape.head_dim = shape.head_dim;
  plan_shape.num_sms = ctx.num_sms();
  if (!(st = ctx.rules().constant("tree_block_m_narrow", &plan_shape.block_ms[0])).ok()) return st;
  if (!(st = ctx.rules().constant("tree_block_m_wide", &plan_shape.block_ms[1])).ok()) return st;
  if (!(st = ctx.rules().constant("tree_final_block_m_wide", &plan_shape.wide_final_rows)).ok()) return st;
  if (!(st = make_plan(p->tree_, plan_shape, PlanOptions(), &p->plan_)).ok()) return st;

  int64_t longest = 0;
  for (int64_t len : lengths) longest = std::max(longest, ceil_div(len, shape.block_size));
  p->max_blocks_ = std::max<int64_t>(1, longest + extra_blocks);
  if (p->max_blocks_ > INT_MAX || p->max_blocks_ * tree.num_branches > INT_MAX)
    return Status::Error(Code::kInvalidArgument, "block tables of " + std::to_string(tree.num_branches) + " x " +
                                                     std::to_string(p->max_blocks_) + " entries overflow int32 indexing");
  p->tables_ = dense_tables(shape, tree, p->max_blocks_);
  p->lengths_.assign(tree.lengths, tree.lengths + tree.num_branches);
  if (!(st = p->pick_kernels()).ok()) return st;  // writes the items' run splits: before packing
  pack_work_lists(p->plan_, &p->work_, &p->work_offset_);
  if (!(st = p->allocate_and_upload()).ok()) return st;
  *out = std::move(p);
  return Status::Ok();
}

TreeAttentionPlan::~TreeAttentionPlan() {
  if (workspace_) ctx_.free(workspace_);  // an error here has no one to report to
}

int64_t TreeAttentionPlan::num_launches() const {
  return num_branches() ? int64_t(plan_.items.size()) + 1 : 0;
}

const std::string& TreeAttentionPlan::kernel_name(int64_t launch) const {
  static const std::string none;
  if (launch < 0 || launch >= num_launches()) return none;
  size_t partials = partial_kernels_.size();
  return ctx_.kernel(size_t(launch) < partials ? partial_kernels_[launch] : last_kernel_).name;
}

int64_t TreeAttentionPlan::unique_tokens() const {
  int64_t total = 0;
  for (int64_t v = 0; v < tree_.num_nodes(); ++v) total += tree_.node_end[v] - tree_.node_start[v];
  return total;
}

int64_t TreeAttentionPlan::logical_tokens() const {
  int64_t total = 0;
  for (int32_t len : lengths_) total += len;
  return total;
}

Status TreeAttentionPlan::pick_kernels() {
  partial_kernels_.clear();
  for (ItemList& items : plan_.items) {
    int kernel = -1;
    std::string key = "tree_partial/" + shape_.rule_suffix() + "/" + std::to_string(items.block_m);
    // check_update keeps the shared ranges' blocks: an item's runs stay where they are.
    int runs = item_runs(&items, plan_.final_start, tables_.data(), max_blocks_, shape_.block_size);
    Status st = ctx_.pick(ctx_.addressing_rule_key(key, shape_.block_size, runs), longest_item(items),
                          items.count() * shape_.num_kv_heads, &kernel);
    if (!st.ok()) return st;
    partial_kernels_.push_back(kernel);
  }
  if (plan_.separate_merge) return ctx_.pick("tree_merge/" + shape_.rule_suffix(), -1, -1, &last_kernel_);
  return pick_final_kernel();
}

// The rule list of the final launch: a packed program (several lanes) has its own, one per
// final tile, and so has one that reads its lanes' shared range (dispatch.tree_final_kernel).
std::string TreeAttentionPlan::final_kernel() const {
  if (plan_.as_paged_decode) return "paged_decode/";
  if (plan_.final_lanes == 1) return "tree_final/";
  bool wide = plan_shape_.final_block_m(plan_.final_lanes) > plan_shape_.block_ms[0];
  return std::string(plan_.has_common() ? "tree_final_common" : "tree_final_packed") + (wide ? "_wide/" : "/");
}

// By the longest final range, which grows with the leaves: picked again on each update. A
// packed program walks its lanes' ranges side by side.
Status TreeAttentionPlan::pick_final_kernel() {
  if (plan_.separate_merge) return Status::Ok();  // no final kernel
  int64_t longest = 0;
  for (size_t b = 0; b < lengths_.size(); ++b)
    longest = std::max<int64_t>(longest, lengths_[b] - plan_.final_start[b]);
  return ctx_.pick(ctx_.addressing_rule_key(final_kernel() + shape_.rule_suffix(), shape_.block_size),
                   longest * plan_.final_lanes,
                   final_programs() * plan_shape_.final_tiles(), &last_kernel_);
}

int64_t TreeAttentionPlan::final_programs() const { return ceil_div(num_branches(), plan_.final_lanes); }

Status TreeAttentionPlan::allocate_and_upload() {
  int64_t n = num_branches();
  size_t sizes[] = {work_.size() * 4, size_t(n * max_blocks_) * 4, size_t(std::max<int64_t>(n, 4)) * 4,
                    size_t(plan_.num_entries * shape_.num_qo_heads * shape_.head_dim) * 4,
                    size_t(plan_.num_entries * shape_.num_qo_heads) * 4};
  size_t offsets[5];
  workspace_bytes_ = 0;
  for (int r = 0; r < 5; ++r) {
    offsets[r] = workspace_bytes_;
    workspace_bytes_ += align_up(std::max<size_t>(sizes[r], 16), kRegionAlign);
  }
  if (ctx_.host_only()) return Status::Ok();
  Status st = ctx_.alloc(workspace_bytes_, &workspace_);
  if (!st.ok()) return st;
  d_work_ = workspace_ + offsets[0];
  d_tables_ = workspace_ + offsets[1];
  d_lengths_ = workspace_ + offsets[2];
  d_partial_out_ = workspace_ + offsets[3];
  d_partial_lse_ = workspace_ + offsets[4];
  if (st.ok()) st = ctx_.copy_to_device(d_work_, work_.data(), sizes[0]);
  if (st.ok()) st = ctx_.copy_to_device(d_tables_, tables_.data(), sizes[1]);
  if (st.ok()) st = ctx_.copy_to_device(d_lengths_, lengths_.data(), size_t(n) * 4);
  return st;  // on failure the destructor frees the workspace
}

Status TreeAttentionPlan::run(const void* q, const void* k_pool, const void* v_pool, void* out, CUstream stream) {
  Status st = ctx_.require_device("frPlanRun");
  if (!st.ok()) return st;
  if (!(st = check_pointers({{"q", q}, {"k_pool", k_pool}, {"v_pool", v_pool}, {"out", out}})).ok()) return st;
  if (!num_branches()) return Status::Ok();
  auto work = [&](size_t list) { return pointer_arg(reinterpret_cast<void*>(d_work_ + 4 * work_offset_[list])); };
  auto device = [](CUdeviceptr p) { return pointer_arg(reinterpret_cast<void*>(p)); };
  Arg scale = Arg::Float(shape_.scale_log2()), qo = Arg::Int(shape_.num_qo_heads), kv = Arg::Int(shape_.num_kv_heads),
      page = Arg::Int(shape_.block_size), cols = Arg::Int(max_blocks_);
  // The pools as [slots, KV heads x head_dim], for partial kernels that read them through TMA.
  int64_t slots = shape_.num_blocks * shape_.block_size, row = shape_.num_kv_heads * shape_.head_dim;
  for (size_t i = 0; i < plan_.items.size() && st.ok(); ++i) {
    const ItemList& items = plan_.items[i];
    auto [gx, gy] = ordered_grid(items.count(), shape_.num_kv_heads, items.heads_first);
    st = ctx_.launch(partial_kernels_[i], gx, gy, 1,
                     {{"q", pointer_arg(q)}, {"k_pool", pointer_arg(k_pool), slots, row},
                      {"v_pool", pointer_arg(v_pool), slots, row},
                      {"block_tables", device(d_tables_)}, {"seq_lens", device(d_lengths_)},
                      {"order", work(kOrder)}, {"items", work(kFirstItems + i)},
                      {"entry_slot", work(kEntrySlot)}, {"partial_out", device(d_partial_out_)},
                      {"partial_lse", device(d_partial_lse_)}, {"sm_scale_log2", scale}, {"num_qo_heads", qo},
                      {"num_kv_heads", kv}, {"page_size", page}, {"max_blocks", cols},
                      {"early_final", Arg::Int(plan_.early_final)},
                      {"heads_first", Arg::Int(items.heads_first)}},
                     stream, i > 0);  // the second tile's launch overlaps the first's
  }
  if (!st.ok()) return st;
  if (plan_.as_paged_decode) {  // no partials: paged_decode's kernel over the plan's tables, unsplit
    PagedDecodeArgs decode;
    decode.q = q, decode.k_pool = k_pool, decode.v_pool = v_pool, decode.out = out;
    decode.block_tables = reinterpret_cast<const void*>(d_tables_);
    decode.seq_lens = reinterpret_cast<const void*>(d_lengths_);
    decode.num_seqs = num_branches(), decode.max_blocks = max_blocks_;
    return launch_decode_kernel(ctx_, last_kernel_, shape_, decode, plan_shape_.final_tiles(), 1,
                                max_blocks_ * shape_.block_size, nullptr, nullptr, stream);
  }
  bool after_partials = !plan_.items.empty();  // the last launch may overlap the partial launch
  if (plan_.separate_merge)
    return ctx_.launch(last_kernel_, num_branches(), shape_.num_qo_heads, 1,
                       {{"merge_ptr", work(kMergePtr)}, {"partial_out", device(d_partial_out_)},
                        {"partial_lse", device(d_partial_lse_)}, {"out", pointer_arg(out)}, {"num_qo_heads", qo}},
                       stream, after_partials);
  auto [gx, gy] = ordered_grid(final_programs(), plan_shape_.final_tiles(), plan_.final_heads_first);
  return ctx_.launch(last_kernel_, gx, gy, 1,
                     {{"q", pointer_arg(q)}, {"k_pool", pointer_arg(k_pool)}, {"v_pool", pointer_arg(v_pool)},
                      {"block_tables", device(d_tables_)}, {"seq_lens", device(d_lengths_)}, {"order", work(kOrder)},
                      {"final_start", work(kFinalStart)}, {"merge_ptr", work(kMergePtr)}, {"common", work(kCommon)},
                      {"partial_out", device(d_partial_out_)}, {"partial_lse", device(d_partial_lse_)},
                      {"out", pointer_arg(out)}, {"sm_scale_log2", scale}, {"num_qo_heads", qo},
                      {"num_kv_heads", kv}, {"page_size", page}, {"max_blocks", cols},
                      {"num_rows", Arg::Int(num_branches())}, {"lanes", Arg::Int(plan_.final_lanes)},
                      {"heads_first", Arg::Int(plan_.final_heads_first)}},
                     stream, after_partials);
}

Status TreeAttentionPlan::check_update(const TreeInput& tree, std::vector<int32_t>* tables,
                                       std::vector<int32_t>* lengths) const {
  if (tree.num_branches != num_branches())
    return mismatch("the plan has " + std::to_string(num_branches()) + " branches, the tree " +
                    std::to_string(tree.num_branches));
  Status st = check_tree(shape_, tree, max_blocks_, Code::kPlanMismatch);
  if (!st.ok()) return st;
  for (int64_t b = 0; b < tree.num_branches; ++b) {
    int64_t shared_until = plan_.final_start[b];
    if (tree.lengths[b] < shared_until)
      return mismatch("branch " + std::to_string(b) + " shrank to " + std::to_string(tree.lengths[b]) +
                      " tokens, below the " + std::to_string(shared_until) + " the plan reads in shared ranges");
    for (int64_t j = 0; j < ceil_div(shared_until, shape_.block_size); ++j)
      if (tree.tables[b * tree.stride + j] != tables_[b * max_blocks_ + j])
        return mismatch("branch " + std::to_string(b) + " changed block " + std::to_string(j) + " (" +
                        std::to_string(tables_[b * max_blocks_ + j]) + " -> " +
                        std::to_string(tree.tables[b * tree.stride + j]) + "), inside a range the plan shares");
  }
  *tables = dense_tables(shape_, tree, max_blocks_);
  lengths->assign(tree.lengths, tree.lengths + tree.num_branches);
  return Status::Ok();
}

Status TreeAttentionPlan::update(const TreeInput& tree, CUstream stream) {
  Status st = ctx_.require_device("frPlanUpdate");
  std::vector<int32_t> tables, lengths;
  if (st.ok()) st = check_update(tree, &tables, &lengths);
  if (!st.ok()) return st;
  // Pageable sources: each copy returns once its bytes are staged, so the buffers may change after.
  st = ctx_.copy_to_device_async(d_tables_, tables.data(), tables.size() * 4, stream);
  if (st.ok()) st = ctx_.copy_to_device_async(d_lengths_, lengths.data(), lengths.size() * 4, stream);
  if (!st.ok()) return st;
  tables_.swap(tables);
  lengths_.swap(lengths);
  return pick_final_kernel();
}

}  // namespace flash_reasoning
