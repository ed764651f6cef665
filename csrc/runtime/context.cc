#include "runtime/context.h"

#include <vector>

#include "runtime/arch.h"
#include "util/file_util.h"
#include "util/version.h"

namespace flash_reasoning {

Status check_pointers(std::initializer_list<std::pair<const char*, const void*>> pointers) {
  for (const auto& p : pointers)
    if (!p.second || reinterpret_cast<uintptr_t>(p.second) % kPointerAlign)
      return Status::Error(Code::kInvalidArgument, std::string(p.first) + " must be a non-NULL, " +
                                                       std::to_string(kPointerAlign) + "-byte aligned device pointer");
  return Status::Ok();
}

Status check_apart(uint64_t q, uint64_t out, uint64_t bytes) {
  if ((q > out ? q - out : out - q) >= bytes) return Status::Ok();
  return Status::Error(Code::kInvalidArgument,
                       "out overlaps q (the kernels read q while they write out); pass a separate out");
}

namespace {

Status check_version(const Manifest& m) {
  if (m.package_version == kPackageVersion) return Status::Ok();
  return Status::Error(Code::kInvalidManifest, "manifest " + join_path(m.dir, "manifest.json") +
                                                   " was built by package version '" + m.package_version +
                                                   "', this library is " + kPackageVersion +
                                                   ": use the artifacts installed with it");
}

}  // namespace

Status Context::load(const std::string& artifact_root, const std::string& arch, int device, int num_sms,
                     std::unique_ptr<Context>* out) {
  std::unique_ptr<Launcher> launcher;
  Status st = Launcher::open(join_path(artifact_root, arch), device < 0 ? 0 : device, &launcher);
  if (st.ok()) st = check_version(launcher->manifest());
  // The folder names the arch the kernels are picked for; a manifest built for another would
  // hand the device cubins it cannot run, or plans tuned for another GPU.
  if (st.ok() && launcher->manifest().arch != arch)
    st = Status::Error(Code::kInvalidManifest, "manifest " + join_path(launcher->manifest().dir, "manifest.json") +
                                                   " is for arch '" + launcher->manifest().arch +
                                                   "' but lies in folder '" + arch + "': the artifacts are mixed up");
  if (st.ok() && !launcher->manifest().dispatch.present())
    st = Status::Error(Code::kInvalidManifest, "manifest of " + arch + " has no dispatch rules: rebuild the artifacts");
  if (st.ok()) out->reset(new Context(std::move(launcher), device, num_sms));
  return st;
}

Status Context::open(const std::string& artifact_root, int device, std::unique_ptr<Context>* out) {
  std::vector<std::string> archs;
  Status st = list_folders_with(artifact_root, "manifest.json", &archs);
  if (!st.ok()) return st;
  if (device < 0) return Status::Error(Code::kInvalidArgument, "device must be >= 0, got " + std::to_string(device));
  int cc = 0, num_sms = 0;
  std::string arch;
  if (!(st = device_compute_capability(device, &cc)).ok()) return st;
  if (!(st = select_arch(cc, archs, &arch)).ok()) return st;
  if (!(st = device_attribute(device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &num_sms)).ok()) return st;
  if (num_sms < 1)
    return Status::Error(Code::kCudaError, "device " + std::to_string(device) + " reports " + std::to_string(num_sms) +
                                               " multiprocessors: the driver's answer is unusable");
  return load(artifact_root, arch, device, num_sms, out);
}

Status Context::open_host_only(const std::string& artifact_root, const std::string& arch, std::unique_ptr<Context>* out,
                               int num_sms) {
  // An arch names a folder directly under the root ("sm90"), never a path ("../sm90").
  bool well_formed = arch.size() > 2 && arch.size() <= 6 && arch.compare(0, 2, "sm") == 0 &&
                     arch.find_first_not_of("0123456789", 2) == std::string::npos;
  if (!well_formed)
    return Status::Error(Code::kInvalidArgument,
                         "arch must be 'sm' followed by digits (a folder of the artifact "
                         "root, e.g. 'sm90'), got '" +
                             arch + "'");
  if (num_sms < 1) return Status::Error(Code::kInvalidArgument, "num_sms must be >= 1, got " + std::to_string(num_sms));
  return load(artifact_root, arch, -1, num_sms, out);
}

Status Context::require_device(const char* what) const {
  if (!host_only()) return Status::Ok();
  return Status::Error(Code::kDriverUnavailable,
                       std::string(what) + " needs a GPU: this context was created host-only (for planning)");
}

Status Context::pick(const std::string& rule_key, int64_t max_tokens, int64_t programs, int* kernel) const {
  Status st = rules().pick(rule_key, max_tokens, programs, num_sms(), kernel);
  if (st.code == Code::kNotFound) st.code = Code::kUnsupported;
  return st;
}

Status Context::override_rules(const std::string& json) {
  DispatchTable rules;
  Status st = parse_dispatch_rules(json, launcher_->manifest().kernels, &rules);
  if (!st.ok()) return st;
  DispatchTable merged = launcher_->manifest().dispatch;
  for (auto& [key, list] : rules.rules) merged.rules[key] = std::move(list);
  for (const auto& [name, value] : rules.constants) merged.constants[name] = value;
  launcher_->replace_rules(std::move(merged));
  return Status::Ok();
}

Status Context::prepare(const std::vector<KernelLaunch>& launches, std::vector<std::string> holes, uint64_t workspace,
                        std::unique_ptr<LaunchSequence>* out) {
  std::vector<SequenceLaunch> bound(launches.size());
  for (size_t i = 0; i < launches.size(); ++i) {
    if (launches[i].kernel < 0 || size_t(launches[i].kernel) >= launcher_->manifest().kernels.size())
      return Status::Error(Code::kNotFound, "kernel index " + std::to_string(launches[i].kernel) + " out of range");
    Status st = bind_launch(kernel(launches[i].kernel), launches[i], workspace, &bound[i]);
    if (!st.ok()) return st;
  }
  return LaunchSequence::prepare(launcher_.get(), bound, std::move(holes), out);
}

Status Context::run(const std::vector<KernelLaunch>& launches, std::vector<std::string> holes, const uint64_t* pointers,
                    uint64_t workspace, CUstream stream) {
  std::unique_ptr<LaunchSequence> sequence;
  size_t count = holes.size();
  Status st = prepare(launches, std::move(holes), workspace, &sequence);
  return st.ok() ? sequence->run(pointers, count, stream) : st;
}

Status Context::driver(const Driver** d) {
  Status st = require_device("device memory");
  if (st.ok()) st = get_driver(d);
  if (st.ok()) st = launcher_->make_current();
  return st;
}

Status Context::alloc(size_t bytes, CUdeviceptr* out) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok()) return st;
  CUresult rc = d->cuMemAlloc_v2(out, bytes);
  if (rc == CUDA_SUCCESS) return Status::Ok();
  st = d->error(rc, "cuMemAlloc(" + std::to_string(bytes) + " bytes)");
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) st.code = Code::kOutOfMemory;
  return st;
}

Status Context::free(CUdeviceptr ptr) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok() || !ptr) return st;
  CUresult rc = d->cuMemFree_v2(ptr);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuMemFree");
}

Status Context::copy_to_device(CUdeviceptr dst, const void* src, size_t bytes) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok() || !bytes) return st;
  CUresult rc = d->cuMemcpyHtoD_v2(dst, src, bytes);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuMemcpyHtoD");
}

Status Context::copy_to_device_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok() || !bytes) return st;
  CUresult rc = d->cuMemcpyHtoDAsync_v2(dst, src, bytes, stream);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuMemcpyHtoDAsync");
}

Status Context::copy_to_host(void* dst, CUdeviceptr src, size_t bytes) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok() || !bytes) return st;
  CUresult rc = d->cuMemcpyDtoH_v2(dst, src, bytes);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuMemcpyDtoH");
}

Status Context::synchronize(CUstream stream) {
  const Driver* d;
  Status st = driver(&d);
  if (!st.ok()) return st;
  CUresult rc = d->cuStreamSynchronize(stream);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuStreamSynchronize");
}

}  // namespace flash_reasoning
