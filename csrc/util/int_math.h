// Integer rounding shared by the planner and the C ABI's objects.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flash_reasoning {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace flash_reasoning
