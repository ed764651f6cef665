// The per-arch manifest written by the AOT build (<arch_dir>/manifest.json),
// parsed once into plain structs so the launch path never touches JSON.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

// How one kernel parameter is passed to cuLaunchKernel. kTensorMap ("nvTmaDesc"): a TMA
// descriptor (CUtensorMap, 128 bytes) the launcher encodes at each launch; the caller passes
// its base pointer there and, in the kTensorMapFields parameters after it, the 2-D view's shape
// and strides in elements (rows i32, cols i32, row stride i64, column stride i64).
enum class ParamKind { kPointer, kSigned, kUnsigned, kFloat, kTensorMap };

struct ParamType {
  ParamKind kind;
  int size;  // bytes in the kernel's parameter buffer (1, 2, 4 or 8; 128 for a tensor map)
};

// How a kTensorMap parameter's descriptor is encoded (cuTensorMapEncodeTiled's arguments the
// compiled kernel fixed): from the manifest's "tensor_map" of the parameter.
struct TensorMapInfo {
  int data_type = 0;    // CUtensorMapDataType
  int elem_size = 0;    // bytes
  int swizzle = 0;      // CUtensorMapSwizzle
  int box[2] = {0, 0};  // the tile one load reads: rows, columns
};

constexpr int kTensorMapFields = 4;  // rows, cols, row_stride, col_stride
constexpr int kMaxTensorMaps = 4;    // per kernel: the launcher encodes them on its stack

struct ParamInfo {
  std::string name;
  std::string type;  // as written in the manifest, e.g. "*fp16", "i32", "nvTmaDesc"
  ParamType packed;
  TensorMapInfo tensor_map;  // kTensorMap only
};

struct KernelInfo {
  std::string name;               // unique id used to launch
  std::string family;             // "kernel" field (informational; may be empty)
  std::string entry;              // function name inside the cubin
  std::string cubin;              // file name relative to the arch folder
  std::string sha256;             // lowercase hex of the cubin bytes
  std::vector<ParamInfo> params;  // caller-supplied params only (scratch params dropped)
  int num_warps = 0;
  int shared = 0;  // dynamic shared memory, bytes
  // Compiled to wait for the launch before it before reading that launch's output (grid
  // dependency control): launched right after another launch of ours, it may overlap it.
  bool overlaps_previous = false;
  std::unordered_map<std::string, int64_t> constexprs;  // integer members of "key", e.g. BLOCK_N
};

// The dispatch rules the AOT build exported from flash_reasoning.dispatch (the one place they
// are made), so a C caller picks the same kernels as Python. A rule list maps a launch (its
// program count and the longest range one program walks) to a kernel: the first rule that
// serves it.
struct DispatchRule {
  double max_programs_per_sm = -1;  // -1: any count
  int64_t max_tokens = -1;          // -1: any length
  int kernel = -1;                  // index into Manifest::kernels
  // Whether the rule serves `programs` programs on `num_sms` SMs of at most `max_tokens` tokens
  // each (-1: unknown, served as many and long), comparing as Python's dispatch.pick_rule does.
  bool serves(int64_t max_tokens, int64_t programs, int64_t num_sms) const;
};

struct DispatchTable {
  std::unordered_map<std::string, std::vector<DispatchRule>> rules;  // e.g. "tree_final/float16/128"
  std::unordered_map<std::string, int64_t> constants;                // e.g. "block_m"
  bool present() const { return !rules.empty(); }

  // kNotFound when the manifest has no rule list `key` (a head_dim or dtype this build did not
  // compile); kInvalidManifest when a list built in memory ends without a rule for any launch.
  Status pick(const std::string& key, int64_t max_tokens, int64_t programs, int64_t num_sms, int* kernel) const;
  Status constant(const std::string& name, int64_t* value) const;
};

struct Manifest {
  std::string dir;              // the arch folder the manifest was read from
  std::string arch;             // e.g. "sm90"
  std::string package_version;  // of the package that built it ("" when absent)
  std::vector<KernelInfo> kernels;
  DispatchTable dispatch;  // empty for manifests without a "dispatch" section
};

// Upper bound on parameters per kernel: lets the launch path pack into stack buffers.
constexpr int kMaxKernelParams = 128;

// Maps a manifest type string to its packing; false for unsupported types.
bool parse_param_type(const std::string& type, ParamType* out);

// A dispatch table from JSON text in the manifest's "dispatch" format ({"rules": ..., "constants":
// ...}), every kernel it names one of `kernels`: a tuning table chosen at run time.
Status parse_dispatch_rules(const std::string& json, const std::vector<KernelInfo>& kernels, DispatchTable* out);

// Reads and validates <arch_dir>/manifest.json. Errors name the file and the field.
Status load_manifest(const std::string& arch_dir, Manifest* out);

}  // namespace flash_reasoning
