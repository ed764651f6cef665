#include "runtime/driver.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace flash_reasoning {

Status Driver::error(CUresult rc, const std::string& call) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
  if (cuGetErrorString(rc, &text) != CUDA_SUCCESS || !text) text = "no description";
  return Status::Error(Code::kCudaError,
                       call + " failed: " + name + " (" + text + ", code " + std::to_string(rc) + ")");
}

namespace {

std::mutex g_load_mutex;
Driver g_driver;  // filled once, then read-only
std::atomic<const Driver*> g_ready{nullptr};

template <typename Fn>
bool resolve(void* lib, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  return *fn != nullptr;
}

// Resolves every entry point; on failure names the first missing symbol.
bool resolve_all(void* lib, Driver* d, const char** missing) {
#define FR_RESOLVE(sym)                 \
  do {                                  \
    if (!resolve(lib, #sym, &d->sym)) { \
      *missing = #sym;                  \
      return false;                     \
    }                                   \
  } while (0)
  FR_RESOLVE(cuInit);
  FR_RESOLVE(cuGetErrorName);
  FR_RESOLVE(cuGetErrorString);
  FR_RESOLVE(cuDeviceGet);
  FR_RESOLVE(cuDeviceGetAttribute);
  FR_RESOLVE(cuDevicePrimaryCtxRetain);
  FR_RESOLVE(cuCtxGetCurrent);
  FR_RESOLVE(cuCtxSetCurrent);
  FR_RESOLVE(cuModuleLoadData);
  FR_RESOLVE(cuModuleUnload);
  FR_RESOLVE(cuModuleGetFunction);
  FR_RESOLVE(cuFuncSetAttribute);
  FR_RESOLVE(cuLaunchKernel);
  FR_RESOLVE(cuMemAlloc_v2);
  FR_RESOLVE(cuMemFree_v2);
  FR_RESOLVE(cuMemcpyHtoD_v2);
  FR_RESOLVE(cuMemcpyDtoH_v2);
  FR_RESOLVE(cuMemcpyHtoDAsync_v2);
  FR_RESOLVE(cuStreamSynchronize);
#undef FR_RESOLVE
  resolve(lib, "cuLaunchKernelEx", &d->cuLaunchKernelEx);              // optional: may stay null
  resolve(lib, "cuTensorMapEncodeTiled", &d->cuTensorMapEncodeTiled);  // optional too
  return true;
}

Status load_locked() {
  const char* env = std::getenv("FLASH_REASONING_LIBCUDA");
  std::string path = (env && *env) ? env : "libcuda.so.1";
  std::string label = (env && *env) ? "libcuda from FLASH_REASONING_LIBCUDA=" + path : path;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    return Status::Error(Code::kDriverUnavailable, "could not load " + label + " (" + (why ? why : "unknown") +
                                                       "): is the NVIDIA driver installed?");
  }
  Driver d;
  const char* missing = nullptr;
  if (!resolve_all(lib, &d, &missing)) {
    dlclose(lib);
    return Status::Error(Code::kDriverUnavailable,
                         "could not load " + label + ": it has no symbol " + missing + " (driver too old?)");
  }
  // On cuInit failure the library stays open: unloading an initialised driver is unsafe,
  // and a retry's dlopen just returns the same handle.
  CUresult rc = d.cuInit(0);
  if (rc != CUDA_SUCCESS) return d.error(rc, "cuInit");
  g_driver = d;
  g_ready.store(&g_driver, std::memory_order_release);
  return Status::Ok();
}

}  // namespace

const Driver* loaded_driver() { return g_ready.load(std::memory_order_acquire); }

Status get_driver(const Driver** out) {
  if ((*out = loaded_driver())) return Status::Ok();
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if ((*out = loaded_driver())) return Status::Ok();
  Status st = load_locked();
  *out = loaded_driver();
  return st;
}

Status device_attribute(int ordinal, int attribute, int* out) {
  const Driver* d;
  Status st = get_driver(&d);
  if (!st.ok()) return st;
  CUdevice dev;
  CUresult rc = d->cuDeviceGet(&dev, ordinal);
  if (rc != CUDA_SUCCESS) return d->error(rc, "cuDeviceGet(" + std::to_string(ordinal) + ")");
  rc = d->cuDeviceGetAttribute(out, attribute, dev);
  if (rc != CUDA_SUCCESS) return d->error(rc, "cuDeviceGetAttribute(" + std::to_string(attribute) + ")");
  return Status::Ok();
}

Status device_compute_capability(int ordinal, int* out) {
  int major = 0, minor = 0;
  Status st = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major);
  if (st.ok()) st = device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor);
  *out = major * 10 + minor;
  return st;
}

}  // namespace flash_reasoning
