// The CUDA driver API, loaded with dlopen at run time so the build needs no CUDA toolkit
// and one binary runs on any driver. Only the few types and entry points we use are declared.
#pragma once

#include <string>

#include "util/status.h"

namespace flash_reasoning {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = unsigned long long;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;

// cuLaunchKernelEx's configuration, laid out as cuda.h (12.0+) declares it: an attribute is an
// id padded to 8 bytes, then a 64-byte value union.
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
struct CUlaunchAttribute {
  int id;
  char pad[4];
  union alignas(8) {
    char bytes[64];
    int programmatic_stream_serialization_allowed;
  } value;
};
struct CUlaunchConfig {
  unsigned grid_dim_x, grid_dim_y, grid_dim_z;
  unsigned block_dim_x, block_dim_y, block_dim_z;
  unsigned shared_mem_bytes;
  CUstream stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72, "cuda.h's CUlaunchAttribute is 72 bytes");
static_assert(sizeof(CUlaunchConfig) == 56, "cuda.h's CUlaunchConfig is 56 bytes");

// A TMA descriptor (cuda.h 12.0+): 128 opaque bytes, aligned as cuda.h 13 aligns it, passed to
// a kernel by value. cuTensorMapEncodeTiled's enums are plain ints here (CUtensorMapDataType etc.).
struct alignas(128) CUtensorMap {
  unsigned long long opaque[16];
};
static_assert(sizeof(CUtensorMap) == 128, "cuda.h's CUtensorMap is 128 bytes");
constexpr int CU_TENSOR_MAP_INTERLEAVE_NONE = 0;
constexpr int CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2;
constexpr int CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0;  // rows past the view read as zeros

struct Driver {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int*, int attrib, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void* image);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char* name);
  CUresult (*cuFuncSetAttribute)(CUfunction, int attrib, int value);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shared_bytes, CUstream, void** params, void** extra);
  // Device memory, for the C ABI's plans and callers without the CUDA runtime.
  CUresult (*cuMemAlloc_v2)(CUdeviceptr*, size_t bytes);
  CUresult (*cuMemFree_v2)(CUdeviceptr);
  CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr dst, const void* src, size_t bytes);
  CUresult (*cuMemcpyDtoH_v2)(void* dst, CUdeviceptr src, size_t bytes);
  CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr dst, const void* src, size_t bytes, CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  // Optional (null on drivers before CUDA 12): launches with attributes, here programmatic
  // dependent launch; without it every launch waits for the one before.
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void** params, void** extra);
  // Optional (null before CUDA 12): encodes the TMA descriptors of kernels that take them.
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, int data_type, unsigned rank, void* address,
                                     const unsigned long long* dims, const unsigned long long* strides,
                                     const unsigned* box, const unsigned* element_strides, int interleave, int swizzle,
                                     int l2_promotion, int oob_fill);

  // "call failed: CUDA_ERROR_X (description)" for a failed driver call.
  Status error(CUresult rc, const std::string& call) const;
};

// Loads libcuda (FLASH_REASONING_LIBCUDA if set, else "libcuda.so.1") and calls cuInit(0)
// once per process; thread safe. Failures are not cached, so a later call retries.
Status get_driver(const Driver** out);

// The driver if get_driver() already succeeded, else nullptr; lock-free for the launch path.
const Driver* loaded_driver();

// major*10 + minor of CUDA device `ordinal`.
Status device_compute_capability(int ordinal, int* out);

// A device attribute (CU_DEVICE_ATTRIBUTE_*) of device `ordinal`.
Status device_attribute(int ordinal, int attribute, int* out);

}  // namespace flash_reasoning
