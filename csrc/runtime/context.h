// What the C ABI holds per device: the launcher of the device's arch, its dispatch rules, the
// device's SM count, and device-memory helpers. A host-only context (an arch named, no driver)
// validates and plans but cannot run: tests and planning tools use it without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "runtime/driver.h"
#include "runtime/launcher.h"
#include "util/status.h"

namespace flash_reasoning {

// One launch argument with the parameter name it must bind to: a launch checks each name
// against the manifest, so kernels and the C++ callers cannot drift apart silently.
struct NamedArg {
  const char* name;
  Arg value;
  // A pool: its row-major 2-D view [rows, cols], for a kernel that reads it through a TMA
  // descriptor (a kTensorMap parameter, followed by the view's fields); ignored otherwise.
  int64_t rows = 0, cols = 0;
};

inline Arg pointer_arg(const void* p) { return Arg::UInt(reinterpret_cast<uintptr_t>(p)); }

// kInvalidArgument naming the first of `pointers` that is NULL or not kPointerAlign-aligned.
Status check_pointers(std::initializer_list<std::pair<const char*, const void*>> pointers);

class Context {
 public:
  // The arch folder under `artifact_root` serving `device`.
  static Status open(const std::string& artifact_root, int device, std::unique_ptr<Context>* out);
  // `arch` (e.g. "sm90") under `artifact_root`, with no driver; num_sms is assumed 132.
  static Status open_host_only(const std::string& artifact_root, const std::string& arch,
                               std::unique_ptr<Context>* out);

  const std::string& arch() const { return launcher_->manifest().arch; }
  const DispatchTable& rules() const { return launcher_->manifest().dispatch; }
  int num_sms() const { return num_sms_; }
  bool host_only() const { return device_ < 0; }

  // kDriverUnavailable, naming `what`, on a host-only context.
  Status require_device(const char* what) const;
  // The kernel the rules pick for `rule_key` and a launch of `programs` programs on this
  // device, each walking at most `max_tokens` tokens (-1: unknown, served as many and long).
  Status pick(const std::string& rule_key, int64_t max_tokens, int64_t programs, int* kernel) const;
  // The attention rule list for `block_size`-token pages: "<rule_key>/page<N>" where the
  // manifest compiles that page size as a constant, else `rule_key` (the page size at run time);
  // for a launch whose items lie in `runs` runs of consecutive slots at most (planner.h's
  // item_runs; 0: take the pages), "<rule_key>/one_run" (one run) or "<rule_key>/two_runs"
  // where the manifest has it (dispatch.rule_key names them the same way).
  std::string addressing_rule_key(const std::string& rule_key, int64_t block_size, int runs = 0) const;
  const KernelInfo& kernel(int index) const { return launcher_->manifest().kernels[index]; }
  // after_own_launch: the previous launch on `stream` was the library's (Launcher::launch).
  Status launch(int kernel, int64_t gx, int64_t gy, int64_t gz, std::initializer_list<NamedArg> args,
                CUstream stream, bool after_own_launch = false);

  Status alloc(size_t bytes, CUdeviceptr* out);
  Status free(CUdeviceptr ptr);
  Status copy_to_device(CUdeviceptr dst, const void* src, size_t bytes);
  Status copy_to_device_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
  Status copy_to_host(void* dst, CUdeviceptr src, size_t bytes);
  Status synchronize(CUstream stream);

 private:
  Context(std::unique_ptr<Launcher> launcher, int device, int num_sms)
      : launcher_(std::move(launcher)), device_(device), num_sms_(num_sms) {}
  static Status load(const std::string& artifact_root, const std::string& arch, int device, int num_sms,
                     std::unique_ptr<Context>* out);
  Status driver(const Driver** d);

  std::unique_ptr<Launcher> launcher_;
  int device_;  // -1: host only
  int num_sms_;
};

}  // namespace flash_reasoning
