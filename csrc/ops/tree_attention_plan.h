// tree_attention for C callers: a plan built from block tables (segment tree, planner,
// kernels picked by the manifest's dispatch rules) that owns its device workspace, runs with
// no allocation or sync, and takes the next step's lengths without re-planning.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ops/attention_shape.h"
#include "runtime/context.h"
#include "planner/planner.h"
#include "planner/segment_tree.h"

namespace flash_reasoning {

// The branches of one step on the host: branch i holds lengths[i] tokens in blocks
// tables[i * stride + j].
struct TreeInput {
  int64_t num_branches = 0;
  const int32_t* lengths = nullptr;
  const int32_t* tables = nullptr;
  int64_t stride = 0;
};

class TreeAttentionPlan {
 public:
  static Status create(Context& ctx, const AttentionShape& shape, const TreeInput& tree, int64_t extra_blocks,
                       std::unique_ptr<TreeAttentionPlan>* out);
  ~TreeAttentionPlan();

  Status run(const void* q, const void* k_pool, const void* v_pool, void* out, CUstream stream);
  Status update(const TreeInput& tree, CUstream stream);

  int64_t num_branches() const { return int64_t(lengths_.size()); }
  int64_t num_nodes() const { return tree_.num_nodes(); }
  int64_t computed_nodes() const { return plan_.computed_nodes; }
  int64_t num_launches() const;
  // The manifest name of launch `launch` (0 <= launch < num_launches()) of the next run: the
  // partial launches in order, then the final (or merge) kernel; an empty name out of range.
  const std::string& kernel_name(int64_t launch) const;
  int64_t max_blocks() const { return max_blocks_; }
  int64_t unique_tokens() const;
  int64_t logical_tokens() const;
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  TreeAttentionPlan(Context& ctx, AttentionShape shape) : ctx_(ctx), shape_(std::move(shape)) {}
  Status pick_kernels();
  Status pick_final_kernel();
  std::string final_kernel() const;
  // Final-kernel programs per GQA tile: a packed program serves plan_.final_lanes branches.
  int64_t final_programs() const;
  Status allocate_and_upload();
  // Validates `tree` against the plan (same branches, each still holding the blocks the plan
  // reads for several branches) and fills `tables`/`lengths` (max_blocks_ columns).
  Status check_update(const TreeInput& tree, std::vector<int32_t>* tables, std::vector<int32_t>* lengths) const;

  Context& ctx_;
  AttentionShape shape_;
  SegmentTree tree_;
  PlanShape plan_shape_;  // what plan_ was made for; its final_tiles() is the final launch's grid.y
  Plan plan_;
  int64_t max_blocks_ = 0;
  std::vector<int32_t> tables_;   // [num_branches, max_blocks_], as on the device
  std::vector<int32_t> lengths_;  // [num_branches]
  std::vector<int32_t> work_;     // order, final_start, merge_ptr, entry_slot, items: as on the device
  std::vector<int64_t> work_offset_;  // element offset of each of those lists in work_
  std::vector<int> partial_kernels_;  // per plan_.items entry
  int last_kernel_ = -1;  // tree_final, tree_merge when the plan merges separately, paged_decode (plan_.decode)
  CUdeviceptr workspace_ = 0;
  size_t workspace_bytes_ = 0;
  CUdeviceptr d_tables_ = 0, d_lengths_ = 0, d_work_ = 0, d_partial_out_ = 0, d_partial_lse_ = 0;
};

}  // namespace flash_reasoning
