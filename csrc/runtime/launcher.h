// Launches the AOT-compiled kernels of one arch folder. Cubins are loaded lazily, once per
// (CUDA context, kernel), and the CUfunction is cached; a launch packs arguments on the stack,
// calls cuLaunchKernel on the caller's stream and neither syncs nor allocates device memory,
// so it can be captured in a CUDA graph. A kernel the manifest marks overlaps_previous, launched
// right after another launch of the caller's (after_own_launch), goes through cuLaunchKernelEx
// with programmatic stream serialization: it may start before that launch ends, and waits for
// it inside (grid dependency control) before reading its output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/driver.h"
#include "runtime/manifest.h"
#include "util/status.h"

namespace flash_reasoning {

// One caller-supplied scalar, converted to its parameter's type (with range checks) at launch.
struct Arg {
  enum class Kind : uint8_t { kInt, kUInt, kFloat, kTooLarge, kNotANumber };
  Kind kind = Kind::kNotANumber;
  union {
    int64_t i;
    uint64_t u;
    double f;
  };

  // clang-format off: one line each reads as the table it is
  static Arg Int(int64_t v) { Arg a; a.kind = Kind::kInt; a.i = v; return a; }
  static Arg UInt(uint64_t v) { Arg a; a.kind = Kind::kUInt; a.u = v; return a; }
  static Arg Float(double v) { Arg a; a.kind = Kind::kFloat; a.f = v; return a; }
  // kTooLarge or kNotANumber: a value that cannot be packed, kept to be reported.
  static Arg Of(Kind k) { Arg a; a.kind = k; a.u = 0; return a; }
  // clang-format on
};

// Pointer alignment the kernels were compiled for (tt.divisibility 16 on every pointer).
constexpr uint64_t kPointerAlign = 16;

class Launcher {
 public:
  // Parses <arch_dir>/manifest.json; needs no driver. `device` is used only when a launching
  // thread has no current CUDA context (then the device's primary context is made current).
  static Status open(const std::string& arch_dir, int device, std::unique_ptr<Launcher>* out);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  const Manifest& manifest() const { return manifest_; }
  // Replaces the manifest's dispatch rules (Context::replace_rules); before any launch.
  void replace_rules(DispatchTable rules) { manifest_.dispatch = std::move(rules); }

  // Index of kernel `name`; kNotFound names it and lists a few known kernels.
  Status find(const std::string& name, int* index) const;

  // Checks, in order: arg count, each arg against its param type, grid. A grid with a zero
  // dimension is empty work: returns Ok without touching the driver.
  Status launch(int index, const int64_t grid[3], const Arg* args, size_t num_args, CUstream stream,
                bool after_own_launch = false);

  // launch() in two halves, so a caller can check and pack once and launch many times
  // (LaunchSequence). pack_launch makes every check launch() makes, without the driver, and
  // writes the kernel's parameter slots (its params, then the two scratch pointers) into
  // `slots` (kMaxKernelParams entries); *empty: the grid has a zero dimension (no work).
  Status pack_launch(int index, const int64_t grid[3], const Arg* args, size_t num_args, uint64_t* slots,
                     bool* empty) const;
  // Launches slots and a grid that pack_launch accepted as non-empty (they are not checked again).
  Status launch_packed(int index, const int64_t grid[3], const uint64_t* slots, CUstream stream,
                       bool after_own_launch = false);

  // Makes a context of the device current on this thread (the current one, or the device's
  // primary context when there is none): memory calls need one.
  Status make_current();

 private:
  Launcher(Manifest manifest, int device);
  Status pack(const KernelInfo& k, const Arg* args, size_t num_args, uint64_t* slots) const;
  Status current_context(const Driver& d, CUcontext* ctx);
  Status function(const Driver& d, int index, CUfunction* out);
  Status load(const Driver& d, const KernelInfo& k, CUfunction* out);

  Manifest manifest_;
  int device_;
  std::unordered_map<std::string, int> index_;
  // Guards functions_, modules_ and primary_. Readers (every launch) take it shared.
  // Keyed by context handle: contexts are assumed to outlive the Launcher (primary contexts do).
  std::shared_mutex mutex_;
  std::unordered_map<CUcontext, std::vector<CUfunction>> functions_;  // [ctx][kernel index]
  std::vector<CUmodule> modules_;
  CUcontext primary_ = nullptr;
};

}  // namespace flash_reasoning
