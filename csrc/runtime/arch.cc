#include "runtime/arch.h"

namespace flash_reasoning {
namespace {

// "sm86" -> 86; -1 for anything not of the form sm<digits>.
int parse_arch(const std::string& arch) {
  if (arch.size() < 3 || arch.size() > 6 || arch.compare(0, 2, "sm") != 0) return -1;
  int cc = 0;
  for (size_t i = 2; i < arch.size(); ++i) {
    if (arch[i] < '0' || arch[i] > '9') return -1;
    cc = cc * 10 + (arch[i] - '0');
  }
  return cc;
}

std::string join(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

Status select_arch(int compute_capability, const std::vector<std::string>& available, std::string* out) {
  int best = -1;
  for (const auto& name : available) {
    int cc = parse_arch(name);
    bool usable = compute_capability / 10 == 8 ? (cc / 10 == 8 && cc <= compute_capability)
                                               : (compute_capability == 90 && cc == 90);
    if (usable && cc > best) {
      best = cc;
      *out = name;
    }
  }
  if (best >= 0) return Status::Ok();
  return Status::Error(Code::kUnsupportedArch, "no compiled kernels for device arch sm" +
                                                   std::to_string(compute_capability) +
                                                   " (archs available: " + join(available) + ")");
}

}  // namespace flash_reasoning
