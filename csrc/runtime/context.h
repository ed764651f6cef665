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
#include <vector>

#include "runtime/driver.h"
#include "runtime/launch_sequence.h"
#include "runtime/launcher.h"
#include "util/status.h"

namespace flash_reasoning {

// kInvalidArgument naming the first of `pointers` that is NULL or not kPointerAlign-aligned.
Status check_pointers(std::initializer_list<std::pair<const char*, const void*>> pointers);
// kInvalidArgument when `out` and `q` (`bytes` each) share memory: a program writes its rows of
// `out` while other programs, of its launch or an earlier one still running, may read theirs of `q`.
Status check_apart(uint64_t q, uint64_t out, uint64_t bytes);

class Context {
 public:
  // The arch folder under `artifact_root` serving `device`.
  static Status open(const std::string& artifact_root, int device, std::unique_ptr<Context>* out);
  // `arch` (e.g. "sm90") under `artifact_root`, with no driver, planning for `num_sms` SMs.
  static Status open_host_only(const std::string& artifact_root, const std::string& arch, std::unique_ptr<Context>* out,
                               int num_sms = kHostOnlySms);
  static constexpr int kHostOnlySms = 132;  // an H100's: plans made without a device look like its plans

  const std::string& arch() const { return launcher_->manifest().arch; }
  const DispatchTable& rules() const { return launcher_->manifest().dispatch; }
  int num_sms() const { return num_sms_; }
  bool host_only() const { return device_ < 0; }

  // kDriverUnavailable, naming `what`, on a host-only context.
  Status require_device(const char* what) const;
  // The kernel the rules pick for `rule_key` and a launch of `programs` programs on this
  // device, each walking at most `max_tokens` tokens (-1: unknown, served as many and long).
  Status pick(const std::string& rule_key, int64_t max_tokens, int64_t programs, int* kernel) const;
  const KernelInfo& kernel(int index) const { return launcher_->manifest().kernels[index]; }
  Launcher& launcher() { return *launcher_; }
  Status find(const std::string& name, int* index) const { return launcher_->find(name, index); }
  const std::string& package_version() const { return launcher_->manifest().package_version; }
  // Replaces the manifest's rule lists (and constants) that `json` names (the manifest's
  // "dispatch" format; every kernel named must be in the manifest): a tuning table chosen at
  // run time.
  Status override_rules(const std::string& json);

  // `launches` checked and packed once (bind_launch, LaunchSequence::prepare), their workspace
  // arguments at `workspace`; each run passes one pointer per name in `holes`.
  Status prepare(const std::vector<KernelLaunch>& launches, std::vector<std::string> holes, uint64_t workspace,
                 std::unique_ptr<LaunchSequence>* out);
  // `launches` prepared and run once, with `pointers` for `holes`.
  Status run(const std::vector<KernelLaunch>& launches, std::vector<std::string> holes, const uint64_t* pointers,
             uint64_t workspace, CUstream stream);

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
