// Compiled (not run) on a machine with the CUDA toolkit, by ci/gpu_check.sh: the launcher
// declares the few driver structs it passes (csrc/runtime/driver.h) instead of including cuda.h,
// so their layout is checked against cuda.h's here.
#include <cuda.h>

#include <cstddef>

#include "../csrc/runtime/driver.h"

namespace fr = flash_reasoning;

static_assert(fr::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION ==
              CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, "attribute id");
static_assert(sizeof(fr::CUlaunchAttribute) == sizeof(CUlaunchAttribute), "CUlaunchAttribute size");
static_assert(offsetof(fr::CUlaunchAttribute, value) == offsetof(CUlaunchAttribute, value), "value offset");
static_assert(sizeof(fr::CUlaunchConfig) == sizeof(CUlaunchConfig), "CUlaunchConfig size");
static_assert(offsetof(fr::CUlaunchConfig, shared_mem_bytes) == offsetof(CUlaunchConfig, sharedMemBytes), "smem");
static_assert(offsetof(fr::CUlaunchConfig, stream) == offsetof(CUlaunchConfig, hStream), "stream");
static_assert(offsetof(fr::CUlaunchConfig, attrs) == offsetof(CUlaunchConfig, attrs), "attrs");
static_assert(offsetof(fr::CUlaunchConfig, num_attrs) == offsetof(CUlaunchConfig, numAttrs), "numAttrs");

static_assert(sizeof(fr::CUtensorMap) == sizeof(CUtensorMap), "CUtensorMap size");
static_assert(alignof(fr::CUtensorMap) == alignof(CUtensorMap), "CUtensorMap alignment");
static_assert(fr::CU_TENSOR_MAP_INTERLEAVE_NONE == CU_TENSOR_MAP_INTERLEAVE_NONE, "interleave");
static_assert(fr::CU_TENSOR_MAP_L2_PROMOTION_L2_128B == CU_TENSOR_MAP_L2_PROMOTION_L2_128B, "L2 promotion");
static_assert(fr::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE == CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, "OOB fill");
static_assert(CU_TENSOR_MAP_DATA_TYPE_FLOAT16 == 6 && CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 == 9,
              "aot/build.py's _TENSOR_MAP_DATA_TYPES");
// The entry point's signature, as the launcher calls it.
static_assert(sizeof(CUtensorMapDataType) == sizeof(int) && sizeof(CUtensorMapSwizzle) == sizeof(int), "enums");
static_assert(sizeof(cuuint64_t) == sizeof(unsigned long long) && sizeof(cuuint32_t) == sizeof(unsigned), "ints");

int main() { return 0; }
