// Compiled (not run) on a machine with the CUDA toolkit, by ci/gpu_check.sh: the launcher
// declares the few driver structs it passes (csrc/core/driver.h) instead of including cuda.h,
// so their layout is checked against cuda.h's here.
#include <cuda.h>

#include <cstddef>

#include "../csrc/core/driver.h"

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

int main() { return 0; }
