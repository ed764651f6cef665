// A sequence of kernel launches checked and packed once, run many times. Most arguments of a
// plan's launches (its buffers, sizes, scale) are fixed for the plan's lifetime; only a few
// pointers (the query, the layer's KV pools, the output) change per call. Preparing converts
// and checks everything once and leaves a "hole" where each per-call pointer goes; a run
// checks just those pointers, fills them in and launches: no allocation and no sync, so it
// can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/launcher.h"

namespace flash_reasoning {

// Upper bound on the pointers one run supplies: lets a front end convert them on the stack.
constexpr size_t kMaxHoles = 64;

// One argument of a prepared launch: a value fixed now (hole -1), or the pointer that each run
// supplies as pointers[hole].
struct SequenceArg {
  Arg value = Arg::Int(0);
  int hole = -1;

  static SequenceArg Value(Arg a) {
    SequenceArg s;
    s.value = a;
    return s;
  }
  static SequenceArg Hole(int index) {
    SequenceArg s;
    s.hole = index;
    return s;
  }
};

struct SequenceLaunch {
  int kernel = -1;  // Launcher index
  int64_t grid[3] = {0, 0, 0};
  std::vector<SequenceArg> args;
};

// An argument of a KernelLaunch, bound to its kernel parameter by name (bind_launch checks the
// name against the manifest, so kernels and the C++ code that launches them cannot drift apart
// silently): a value fixed when the launch is made, one of the pointers each run passes, or an
// offset into the workspace the launches are bound to.
struct LaunchArg {
  enum class Source : uint8_t { kValue, kCall, kWorkspace };
  const char* name = "";
  Source source = Source::kValue;
  Arg value = Arg::Int(0);
  int64_t index = 0;           // kCall: the per-run pointer's index; kWorkspace: the byte offset
  int64_t rows = 0, cols = 0;  // a pool a kernel may read through a TMA descriptor: its 2-D view

  static LaunchArg Value(const char* name, Arg value);
  static LaunchArg Call(const char* name, int64_t index, int64_t rows = 0, int64_t cols = 0);
  static LaunchArg Workspace(const char* name, int64_t offset);
};

// A launch as the ops build it: the kernel, its grid and its arguments by name.
struct KernelLaunch {
  int kernel = -1;  // Launcher index
  int64_t grid[3] = {0, 0, 0};
  std::vector<LaunchArg> args;
};

// `launch` as LaunchSequence takes it: each argument checked against parameter k.params[i] by
// name (kInvalidManifest where they differ: artifacts and library disagree), each kWorkspace
// offset added to `workspace`, each kCall a hole, and each pool the kernel reads through a TMA
// descriptor followed by its view's fields (the manifest's parameters after the map).
Status bind_launch(const KernelInfo& k, const KernelLaunch& launch, uint64_t workspace, SequenceLaunch* out);

class LaunchSequence {
 public:
  // Makes every check Launcher::launch makes (kernel, argument count and types, grid) and also:
  // each hole index names one of `holes` and fills a pointer parameter; each fixed non-null
  // pointer is aligned. Errors say which launch of the sequence failed. `launcher` must outlive
  // the sequence.
  // `holes` names the per-run pointers, for errors.
  static Status prepare(Launcher* launcher, const std::vector<SequenceLaunch>& launches, std::vector<std::string> holes,
                        std::unique_ptr<LaunchSequence>* out);

  // Checks the pointers (count; each non-null and aligned) before launching
  // anything, then launches each non-empty launch in order on `stream` (each after the first
  // as after_own_launch: a kernel compiled to wait for its predecessor overlaps it).
  Status run(const uint64_t* pointers, size_t num_pointers, CUstream stream) const;
  // run's count check alone, for a front end that converts the pointers first.
  Status check_count(size_t num_pointers) const;

  const std::vector<std::string>& holes() const { return holes_; }
  size_t num_launches() const { return steps_.size(); }  // launches with work (empty grids dropped)

 private:
  // A packed launch; fills[i] = {slot, hole}: slot `slot` takes that hole's pointer.
  struct Step {
    int kernel = -1;
    int64_t grid[3] = {0, 0, 0};
    std::vector<uint64_t> slots;
    std::vector<std::pair<size_t, int>> fills;
  };

  LaunchSequence(Launcher* launcher, std::vector<std::string> holes)
      : launcher_(launcher), holes_(std::move(holes)), first_use_(holes_.size()) {}
  Status add(const SequenceLaunch& launch);
  Status check_arg(const KernelInfo& k, size_t i, const SequenceArg& a, const uint64_t* slots) const;
  Status check_pointer(size_t hole, uint64_t value) const;

  Launcher* launcher_;
  std::vector<std::string> holes_;
  std::vector<std::string> first_use_;  // per hole: the first parameter it fills, for run's errors
  std::vector<Step> steps_;
};

}  // namespace flash_reasoning
