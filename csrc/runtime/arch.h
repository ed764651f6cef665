// Which compiled arch folder serves a device.
#pragma once

#include <string>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

// compute_capability = major*10 + minor. An sm8x device takes the highest available sm8y
// with y <= x (cubins run forward within a major version); sm90 takes only sm90, since its
// cubins are sm_90a. Anything else is kUnsupportedArch, naming the device and what exists.
Status select_arch(int compute_capability, const std::vector<std::string>& available, std::string* out);

}  // namespace flash_reasoning
