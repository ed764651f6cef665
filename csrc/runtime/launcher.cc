#include "runtime/launcher.h"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <mutex>

#include "util/file_util.h"
#include "util/sha256.h"

namespace flash_reasoning {
namespace {

constexpr int kDefaultSharedLimit = 48 * 1024;               // above this, kernels must opt in
constexpr int64_t kMaxGrid[3] = {2147483647, 65535, 65535};  // CUDA grid limits

std::string describe(const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::kInt: return std::to_string(a.i);
    case Arg::Kind::kUInt: return std::to_string(a.u);
    case Arg::Kind::kFloat: return std::to_string(a.f);
    case Arg::Kind::kTooLarge: return "an integer beyond 64 bits";
    default: return "a value that is not a number";
  }
}

// Converts an integer arg into `bits` of a slot, checking [lo, hi] of the param's type.
bool integer_bits(const Arg& a, const ParamType& t, bool is_i1, uint64_t* bits) {
  int width = 8 * t.size;
  if (a.kind == Arg::Kind::kInt) {
    int64_t lo = t.kind == ParamKind::kSigned ? (width == 64 ? INT64_MIN : -(int64_t(1) << (width - 1))) : 0;
    int64_t hi = t.kind == ParamKind::kSigned ? (width == 64 ? INT64_MAX : (int64_t(1) << (width - 1)) - 1)
                 : is_i1                      ? 1
                                              : (width == 64 ? INT64_MAX : (int64_t(1) << width) - 1);
    if (a.i < lo || a.i > hi) return false;
    *bits = static_cast<uint64_t>(a.i);  // two's complement: the low bytes are the narrow value
    return true;
  }
  if (a.kind != Arg::Kind::kUInt || is_i1) return false;  // kUInt only holds values > INT64_MAX
  *bits = a.u;
  return t.kind != ParamKind::kSigned && width == 64;
}

// Writes one arg into its 8-byte slot, or explains why it does not fit.
Status convert(const KernelInfo& k, size_t i, const Arg& a, uint64_t* slot) {
  const ParamInfo& p = k.params[i];
  *slot = 0;
  bool ok = false;
  if (p.packed.kind == ParamKind::kFloat) {
    ok = a.kind == Arg::Kind::kFloat || a.kind == Arg::Kind::kInt || a.kind == Arg::Kind::kUInt;
    double v = a.kind == Arg::Kind::kFloat ? a.f : a.kind == Arg::Kind::kInt ? double(a.i) : double(a.u);
    if (ok && p.packed.size == 4) {
      ok = !(std::isfinite(v) && std::fabs(v) > FLT_MAX);
      float f = static_cast<float>(v);
      std::memcpy(slot, &f, 4);
    } else if (ok) {
      std::memcpy(slot, &v, 8);
    }
  } else {
    bool address = p.packed.kind == ParamKind::kPointer || p.packed.kind == ParamKind::kTensorMap;
    ParamType t = address ? ParamType{ParamKind::kUnsigned, 8} : p.packed;
    uint64_t bits = 0;
    ok = integer_bits(a, t, p.type == "i1", &bits);
    std::memcpy(slot, &bits, t.size);  // little-endian: the low bytes come first
  }
  if (ok) return Status::Ok();
  return Status::Error(Code::kInvalidArgument, "kernel '" + k.name + "': argument " + std::to_string(i) + " ('" +
                                                   p.name + "', " + p.type + ") cannot take " + describe(a));
}

// A tensor map's view (the kTensorMapFields slots after it, already range-checked as i32/i64)
// must be one cuTensorMapEncodeTiled takes: row-major, rows 16-byte aligned.
Status check_tensor_map_view(const KernelInfo& k, size_t i, const uint64_t* fields) {
  const ParamInfo& p = k.params[i];
  int64_t rows = int32_t(fields[0]), cols = int32_t(fields[1]), row_stride = int64_t(fields[2]),
          col_stride = int64_t(fields[3]);
  int64_t row_bytes = row_stride * p.tensor_map.elem_size;
  if (rows >= 1 && cols >= 1 && col_stride == 1 && row_stride >= cols && row_bytes % 16 == 0 &&
      row_bytes < (int64_t(1) << 40))
    return Status::Ok();
  return Status::Error(Code::kInvalidArgument, "kernel '" + k.name + "': tensor map '" + p.name + "' views " +
                                                   std::to_string(rows) + " x " + std::to_string(cols) +
                                                   " elements with strides (" + std::to_string(row_stride) + ", " +
                                                   std::to_string(col_stride) +
                                                   "); it needs rows, cols >= 1, column stride 1 and a row "
                                                   "stride >= cols whose bytes are a multiple of 16");
}

// Encodes a kTensorMap parameter's descriptor from its address slot and the fields after it.
Status encode_tensor_map(const Driver& d, const KernelInfo& k, size_t i, const uint64_t* slots, CUtensorMap* out) {
  const TensorMapInfo& t = k.params[i].tensor_map;
  if (!d.cuTensorMapEncodeTiled)
    return Status::Error(Code::kDriverUnavailable, "kernel '" + k.name +
                                                       "' reads through TMA descriptors, but "
                                                       "this driver has no cuTensorMapEncodeTiled (CUDA 12 or newer)");
  const uint64_t* f = slots + i + 1;
  unsigned long long dims[2] = {uint32_t(f[1]), uint32_t(f[0])};   // innermost first: cols, rows
  unsigned long long strides[1] = {f[2] * uint64_t(t.elem_size)};  // bytes between rows
  unsigned box[2] = {unsigned(t.box[1]), unsigned(t.box[0])};
  unsigned element_strides[2] = {1, 1};
  CUresult rc = d.cuTensorMapEncodeTiled(out, t.data_type, 2, reinterpret_cast<void*>(slots[i]), dims, strides, box,
                                         element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, t.swizzle,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return rc == CUDA_SUCCESS ? Status::Ok()
                            : d.error(rc, "cuTensorMapEncodeTiled(" + k.name + ", '" + k.params[i].name + "')");
}

}  // namespace

Launcher::Launcher(Manifest manifest, int device) : manifest_(std::move(manifest)), device_(device) {
  for (size_t i = 0; i < manifest_.kernels.size(); ++i) index_[manifest_.kernels[i].name] = int(i);
}

Launcher::~Launcher() {
  // Errors are ignored: at process exit the driver may already be shut down.
  if (const Driver* d = loaded_driver())
    for (CUmodule m : modules_) d->cuModuleUnload(m);
}

Status Launcher::open(const std::string& arch_dir, int device, std::unique_ptr<Launcher>* out) {
  Manifest m;
  Status st = load_manifest(arch_dir, &m);
  if (st.ok()) out->reset(new Launcher(std::move(m), device));
  return st;
}

Status Launcher::find(const std::string& name, int* index) const {
  auto it = index_.find(name);
  if (it != index_.end()) {
    *index = it->second;
    return Status::Ok();
  }
  const auto& ks = manifest_.kernels;
  std::string msg = "unknown kernel '" + name + "' (the manifest of " + manifest_.arch + " has " +
                    std::to_string(ks.size()) + " kernels";
  for (size_t i = 0; i < ks.size() && i < 5; ++i) msg += (i ? ", " : ": ") + ks[i].name;
  msg += ks.size() > 5 ? ", ...)" : ")";
  return Status::Error(Code::kNotFound, msg);
}

Status Launcher::pack(const KernelInfo& k, const Arg* args, size_t num_args, uint64_t* slots) const {
  if (num_args != k.params.size())
    return Status::Error(Code::kInvalidArgument, "kernel '" + k.name + "' takes " + std::to_string(k.params.size()) +
                                                     " arguments, got " + std::to_string(num_args));
  for (size_t i = 0; i < num_args; ++i) {
    Status st = convert(k, i, args[i], &slots[i]);
    if (!st.ok()) return st;
  }
  for (size_t i = 0; i < num_args; ++i) {  // the manifest put each map's fields after it
    if (k.params[i].packed.kind != ParamKind::kTensorMap) continue;
    Status st = check_tensor_map_view(k, i, &slots[i + 1]);
    if (!st.ok()) return st;
  }
  slots[num_args] = slots[num_args + 1] = 0;  // Triton's global and profile scratch: unused (size 0)
  return Status::Ok();
}

Status Launcher::launch(int index, const int64_t grid[3], const Arg* args, size_t num_args, CUstream stream,
                        bool after_own_launch) {
  uint64_t slots[kMaxKernelParams];  // the manifest caps params, so this never overflows
  bool empty = false;
  Status st = pack_launch(index, grid, args, num_args, slots, &empty);
  if (!st.ok() || empty) return st;  // empty: no work; a zero-sized cuLaunchKernel would be an error
  return launch_packed(index, grid, slots, stream, after_own_launch);
}

Status Launcher::pack_launch(int index, const int64_t grid[3], const Arg* args, size_t num_args, uint64_t* slots,
                             bool* empty) const {
  if (index < 0 || size_t(index) >= manifest_.kernels.size())
    return Status::Error(Code::kNotFound, "kernel index " + std::to_string(index) + " out of range");
  const KernelInfo& k = manifest_.kernels[index];
  Status st = pack(k, args, num_args, slots);
  if (!st.ok()) return st;
  *empty = false;
  for (int i = 0; i < 3; ++i) {
    if (grid[i] < 0 || grid[i] > kMaxGrid[i])
      return Status::Error(Code::kInvalidArgument, "kernel '" + k.name + "': grid dimension " + std::to_string(i) +
                                                       " is " + std::to_string(grid[i]) + ", must be in [0, " +
                                                       std::to_string(kMaxGrid[i]) + "]");
    *empty = *empty || grid[i] == 0;
  }
  return Status::Ok();
}

Status Launcher::launch_packed(int index, const int64_t grid[3], const uint64_t* slots, CUstream stream,
                               bool after_own_launch) {
  const KernelInfo& k = manifest_.kernels[index];
  const Driver* d;
  Status st = get_driver(&d);
  if (!st.ok()) return st;
  CUfunction f;
  if (!(st = function(*d, index, &f)).ok()) return st;
  // cuLaunchKernel only reads the parameters, through non-const pointers.
  void* params[kMaxKernelParams];
  CUtensorMap maps[kMaxTensorMaps];  // encoded per launch: the address may differ per run
  int num_maps = 0;
  for (size_t i = 0; i < k.params.size() + 2; ++i) {
    params[i] = const_cast<uint64_t*>(&slots[i]);
    if (i >= k.params.size() || k.params[i].packed.kind != ParamKind::kTensorMap) continue;
    if (!(st = encode_tensor_map(*d, k, i, slots, &maps[num_maps])).ok()) return st;
    params[i] = &maps[num_maps++];
  }
  if (after_own_launch && k.overlaps_previous && d->cuLaunchKernelEx) {
    CUlaunchAttribute overlap = {};
    overlap.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    overlap.value.programmatic_stream_serialization_allowed = 1;
    CUlaunchConfig config = {unsigned(grid[0]),
                             unsigned(grid[1]),
                             unsigned(grid[2]),
                             unsigned(k.num_warps * 32),
                             1,
                             1,
                             unsigned(k.shared),
                             stream,
                             &overlap,
                             1};
    CUresult rc = d->cuLaunchKernelEx(&config, f, params, nullptr);
    return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuLaunchKernelEx(" + k.name + ", overlapping)");
  }
  CUresult rc = d->cuLaunchKernel(f, unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2]),
                                  unsigned(k.num_warps * 32), 1, 1, unsigned(k.shared), stream, params, nullptr);
  return rc == CUDA_SUCCESS ? Status::Ok() : d->error(rc, "cuLaunchKernel(" + k.name + ")");
}

Status Launcher::make_current() {
  const Driver* d;
  Status st = get_driver(&d);
  CUcontext ctx;
  return st.ok() ? current_context(*d, &ctx) : st;
}

Status Launcher::current_context(const Driver& d, CUcontext* ctx) {
  CUresult rc = d.cuCtxGetCurrent(ctx);
  if (rc != CUDA_SUCCESS) return d.error(rc, "cuCtxGetCurrent");
  if (*ctx) return Status::Ok();
  {
    // No context on this thread (e.g. nothing has touched CUDA yet): use the device's
    // primary context, the one the runtime API and PyTorch share. Retained once, never released.
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (!primary_) {
      CUdevice dev;
      rc = d.cuDeviceGet(&dev, device_);
      if (rc != CUDA_SUCCESS) return d.error(rc, "cuDeviceGet(" + std::to_string(device_) + ")");
      rc = d.cuDevicePrimaryCtxRetain(&primary_, dev);
      if (rc != CUDA_SUCCESS) return d.error(rc, "cuDevicePrimaryCtxRetain(" + std::to_string(device_) + ")");
    }
    *ctx = primary_;
  }
  rc = d.cuCtxSetCurrent(*ctx);
  return rc == CUDA_SUCCESS ? Status::Ok() : d.error(rc, "cuCtxSetCurrent");
}

Status Launcher::function(const Driver& d, int index, CUfunction* out) {
  CUcontext ctx;
  Status st = current_context(d, &ctx);
  if (!st.ok()) return st;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = functions_.find(ctx);
    if (it != functions_.end() && (*out = it->second[index])) return Status::Ok();
  }
  // Miss: load under the exclusive lock so two threads never load the same module twice.
  std::unique_lock<std::shared_mutex> lock(mutex_);
  std::vector<CUfunction>& row = functions_[ctx];
  row.resize(manifest_.kernels.size(), nullptr);
  if (row[index]) {
    *out = row[index];
    return Status::Ok();
  }
  if (!(st = load(d, manifest_.kernels[index], out)).ok()) return st;
  row[index] = *out;
  return Status::Ok();
}

// Reads and verifies the cubin, loads it into the current context, and opts in to large
// dynamic shared memory. Called with mutex_ held exclusively.
Status Launcher::load(const Driver& d, const KernelInfo& k, CUfunction* out) {
  std::string path = join_path(manifest_.dir, k.cubin);
  std::string image;
  Status st = read_file(path, "cubin", &image);
  if (!st.ok()) return st;
  std::string digest = sha256_hex(image.data(), image.size());
  if (digest != k.sha256)
    return Status::Error(Code::kCorruptedArtifact,
                         "corrupted artifact " + path + ": sha256 is " + digest + ", the manifest says " + k.sha256);
  CUmodule module;
  CUresult rc = d.cuModuleLoadData(&module, image.data());
  if (rc != CUDA_SUCCESS) return d.error(rc, "cuModuleLoadData(" + k.cubin + ")");
  rc = d.cuModuleGetFunction(out, module, k.entry.c_str());
  if (rc != CUDA_SUCCESS) {
    d.cuModuleUnload(module);
    return d.error(rc, "cuModuleGetFunction(" + k.entry + " in " + k.cubin + ")");
  }
  if (k.shared > kDefaultSharedLimit) {
    rc = d.cuFuncSetAttribute(*out, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.shared);
    if (rc != CUDA_SUCCESS) {
      d.cuModuleUnload(module);
      return d.error(
          rc, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES=" + std::to_string(k.shared) + ", " + k.name + ")");
    }
  }
  modules_.push_back(module);
  return Status::Ok();
}

}  // namespace flash_reasoning
