// tree_attention's plan: the one place a tree's launches are built, for both front ends. A plan
// is made from a segment tree and the branches' block tables (the planner's work lists, each
// launch's kernel picked by the context's dispatch rules, every argument named); it runs against
// one workspace (work lists, tables, lengths, partials) with four pointers per call, so a run
// allocates nothing and never syncs. The C ABI's plan owns its workspace (allocate_workspace,
// update); Python's lives in a torch tensor it fills from image() and binds.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "ops/attention_shape.h"
#include "ops/op_launch.h"
#include "planner/planner.h"
#include "planner/segment_tree.h"
#include "runtime/context.h"
#include "runtime/launch_sequence.h"

namespace flash_reasoning {

// The branches of one step on the host: branch i holds lengths[i] tokens in blocks
// tables[i * stride + j].
struct TreeInput {
  int64_t num_branches = 0;
  const int32_t* lengths = nullptr;
  const int32_t* tables = nullptr;
  int64_t stride = 0;
};

// The most tokens a row's draft mask covers: its allowed bits are one 64-bit word.
constexpr int64_t kMaxDraftTokens = 64;

// A row's draft mask (speculative-tree verification): the row's last `tokens` tokens are a
// draft, of which it attends those whose bit is set in `allowed` (bit k: the k-th), and every
// token before them. The kernels read it as two int64 per row.
struct DraftMask {
  int64_t tokens = 0;
  uint64_t allowed = 0;
};
static_assert(sizeof(DraftMask) == 16, "the kernels read a row's draft mask as two int64");

// The pointers each run passes, in this order (LaunchArg::Call indices).
constexpr std::array<const char*, 4> kPlanPointers = {"q", "k_pool", "v_pool", "out"};

// A plan's workspace: these regions in this order, each 256-byte aligned. The first four are the
// plan's image (written from the host); its kernels write the partials.
enum class Region { kWork, kTables, kLengths, kDraftMasks, kPartialOut, kPartialLse };
constexpr int kNumRegions = 6;
struct RegionSpan {
  size_t offset = 0, bytes = 0;
};

class TreeAttentionPlan {
 public:
  // Plans `tree`, whose row i holds tree.lengths[i] tokens in blocks tables[i * stride + j]
  // (which decide the slot-run kernels and fill the plan's table region; extra_blocks columns
  // beyond the longest branch let branches grow), for `num_sms` SMs (0: the context's). With a
  // context the kernels are picked and the launches listed; without (`ctx` null: the PyTorch
  // path, planning tools; any dtype) there are none, and `tables` may be null (planning only).
  // `drafts` (null: none): row i's draft mask, its draft tokens beyond tree.lengths[i] (the row
  // is planned without them, and they are read in its final range only, where the mask applies).
  // `row_sequence` (null: none): row i's sequence, rows of one sequence consecutive and holding
  // the same blocks while the plan lives (several queries of a branch): query tiles may group them.
  static Status create(Context* ctx, const AttentionShape& shape, SegmentTree tree, const int32_t* tables,
                       int64_t stride, int64_t extra_blocks, const PlanOptions& options,
                       std::unique_ptr<TreeAttentionPlan>* out, int64_t num_sms = 0, const DraftMask* drafts = nullptr,
                       const int32_t* row_sequence = nullptr);
  // The C ABI's: sharing read from the tables (segment_tree_from_tables); `drafts` as above,
  // each row's draft tokens its last (within tree.lengths[i]).
  static Status create(Context* ctx, const AttentionShape& shape, const TreeInput& tree, int64_t extra_blocks,
                       const PlanOptions& options, std::unique_ptr<TreeAttentionPlan>* out,
                       const DraftMask* drafts = nullptr);
  ~TreeAttentionPlan();
  TreeAttentionPlan(const TreeAttentionPlan&) = delete;
  TreeAttentionPlan& operator=(const TreeAttentionPlan&) = delete;

  Context* context() const { return ctx_; }
  const Plan& plan() const { return plan_; }
  const PlanShape& plan_shape() const { return plan_shape_; }
  const SegmentTree& tree() const { return tree_; }
  // The partial launches (one per row tile in plan().items), then the final, merge, decode or
  // query-tile one.
  const std::vector<OpLaunch>& launches() const { return launches_; }
  // Per plan().items entry: the runs of consecutive slots its launch reads each item as (1 or 2),
  // or 0 (the page kernels); planner.h's item_runs.
  const std::vector<int>& slot_runs() const { return slot_runs_; }
  int64_t num_branches() const { return tree_.num_rows(); }
  // Row i's draft mask (empty: a plan without drafts).
  const std::vector<DraftMask>& drafts() const { return drafts_; }
  int64_t max_blocks() const { return max_blocks_; }
  int64_t unique_tokens() const;
  int64_t logical_tokens() const;

  size_t workspace_bytes() const { return workspace_bytes_; }
  RegionSpan region(Region r) const { return regions_[int(r)]; }
  // The first bytes of the workspace as the launches expect them before a run: the work lists,
  // the tables (max_blocks() columns a branch) and the lengths, each at its region's offset.
  const std::vector<uint8_t>& image() const { return image_; }

  // Prepares the launches against `workspace` (device memory of workspace_bytes(), holding
  // image()): then run() may be called. Needs a context.
  Status bind(uint64_t workspace);
  // Allocates the workspace through the context, uploads image() and binds: the plan owns it.
  Status allocate_workspace();
  // The launches on `stream` with this call's pointers (each non-null, 16-byte aligned).
  Status run(const void* q, const void* k_pool, const void* v_pool, void* out, CUstream stream) const;
  // An owned workspace's next decode step: new lengths and tables, accepted when every branch
  // still holds the blocks the plan reads in shared ranges (else kPlanMismatch; nothing changes).
  // The kernels stay those picked at creation (a CUDA graph captured from run() stays valid).
  Status update(const TreeInput& tree, CUstream stream);

 private:
  TreeAttentionPlan(Context* ctx, AttentionShape shape) : ctx_(ctx), shape_(std::move(shape)) {}
  Status take_tables(const TreeInput& input, int64_t extra_blocks);
  Status build_launches();
  Status add_partial_launches();
  Status add_last_launch();
  Status add_query_tile_launch();
  LaunchArg work_list(const char* name, size_t list) const;
  LaunchArg region_arg(const char* name, Region r) const;
  std::vector<LaunchArg> paged_args(bool pool_maps = false) const;
  LaunchArg pool_map(const char* name, size_t pointer) const;
  void add_tree_scalars(std::vector<LaunchArg>* args, std::initializer_list<LaunchArg> more = {}) const;
  void layout_workspace();
  Status check_update(const TreeInput& tree, std::vector<int32_t>* tables, std::vector<int32_t>* lengths) const;
  Status check_query_tile(const TreeInput& tree, const int32_t* record) const;

  Context* ctx_;  // null: planning only
  AttentionShape shape_;
  SegmentTree tree_;
  PlanShape plan_shape_;
  Plan plan_;
  int64_t max_blocks_ = 0;
  std::vector<int32_t> tables_;    // [num_branches, max_blocks_]
  std::vector<int32_t> lengths_;   // [num_branches]: at creation, then each update's
  std::vector<DraftMask> drafts_;  // [num_branches] or empty
  std::vector<int32_t> work_;      // the planner's lists packed for one upload (pack_work_lists)
  std::vector<int64_t> work_offset_;
  std::vector<int> slot_runs_;
  std::vector<OpLaunch> launches_;
  std::array<RegionSpan, kNumRegions> regions_;
  size_t workspace_bytes_ = 0;
  std::vector<uint8_t> image_;
  uint64_t workspace_ = 0;       // bound
  bool owns_workspace_ = false;  // allocate_workspace()'s, freed with the plan
  std::unique_ptr<LaunchSequence> sequence_;
};

}  // namespace flash_reasoning
