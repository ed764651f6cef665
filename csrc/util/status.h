// Status: the error type of the launcher core. The core never throws or exits:
// every fallible call returns a Status, so a C ABI can wrap it unchanged.
#pragma once

#include <string>
#include <utility>

namespace flash_reasoning {

// Stable numeric codes: exposed to Python as LauncherError.code and to C callers.
enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,    // bad caller input (arg count, range, grid)
  kNotFound = 2,           // unknown kernel, missing file
  kInvalidManifest = 3,    // manifest.json unreadable as JSON or missing/bad field
  kCorruptedArtifact = 4,  // cubin bytes do not match the manifest's sha256
  kDriverUnavailable = 5,  // libcuda cannot be loaded or lacks an entry point
  kCudaError = 6,          // a driver call returned an error
  kUnsupportedArch = 7,    // no compiled arch serves this device
  kIoError = 8,            // a file exists but cannot be read
  kOutOfMemory = 9,        // host or device memory exhausted
  kPlanMismatch = 10,      // a plan update would change what the plan reads once: re-plan
  kUnsupported = 11,       // head_dim or dtype not compiled for this arch
};

struct Status {
  Code code = Code::kOk;
  std::string message;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return Status(); }
  static Status Error(Code c, std::string msg) { return Status{c, std::move(msg)}; }
};

}  // namespace flash_reasoning
