// SHA-256 (FIPS 180-4), used to check cubins against the manifest before loading them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace flash_reasoning {

// Lowercase hex digest of `size` bytes at `data`.
std::string sha256_hex(const void* data, size_t size);

}  // namespace flash_reasoning
