#include "ops/op_launch.h"

#include "planner/planner.h"

namespace flash_reasoning {

std::string addressing_rule_key(const Context& ctx, const std::string& rule_key, int64_t block_size, int runs) {
  static const char* const kRunSuffixes[] = {"", "/one_run", "/two_runs"};
  static_assert(sizeof(kRunSuffixes) / sizeof(kRunSuffixes[0]) == kMaxItemRuns + 1, "a suffix per run count");
  if (runs > 0 && runs <= kMaxItemRuns) {
    std::string run = rule_key + kRunSuffixes[runs];
    if (ctx.rules().rules.count(run)) return run;
  }
  std::string paged = rule_key + "/page" + std::to_string(block_size);
  return ctx.rules().rules.count(paged) ? paged : rule_key;
}

Status pick_launch(const Context& ctx, int64_t num_sms, const std::string& rule_key, int64_t max_tokens, int64_t gx,
                   int64_t gy, int64_t gz, OpLaunch* out) {
  *out = OpLaunch();
  out->launch.grid[0] = gx, out->launch.grid[1] = gy, out->launch.grid[2] = gz;
  out->rule_key = rule_key, out->max_tokens = max_tokens, out->programs = gx * gy * gz;
  Status st = ctx.rules().pick(rule_key, max_tokens, out->programs, num_sms, &out->launch.kernel);
  if (st.code == Code::kNotFound) st.code = Code::kUnsupported;  // a head_dim or dtype not built
  return st;
}

}  // namespace flash_reasoning
