// The package version this core was built for: a manifest from another version is refused.
// Must equal flash_reasoning.__version__ (tests/test_capi.py checks).
#pragma once

namespace flash_reasoning {

constexpr const char* kPackageVersion = "0.1.0";

}  // namespace flash_reasoning
