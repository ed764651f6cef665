// What the ops share: a launch with the rule list that picked its kernel, and the rule lists'
// names (Python's dispatch.rule_key names them the same way).
#pragma once

#include <cstdint>
#include <string>

#include "runtime/context.h"
#include "runtime/launch_sequence.h"
#include "util/status.h"

namespace flash_reasoning {

// A launch an op built, and what its kernel was picked by: the rule list `rule_key` ("" for a
// kernel with one config) for a launch of `programs` programs that each walk at most
// `max_tokens` tokens (-1: not by length). Logs and the tuner read the last three.
struct OpLaunch {
  KernelLaunch launch;
  std::string rule_key;
  int64_t max_tokens = -1;
  int64_t programs = -1;
};

// The attention rule list for `block_size`-token pages: "<rule_key>/page<N>" where the manifest
// compiles that page size as a constant, else `rule_key` (the page size at run time); for a
// launch whose items lie in `runs` runs of consecutive slots at most (planner.h's item_runs; 0:
// take the pages), "<rule_key>/one_run" or "<rule_key>/two_runs" where the manifest has it.
std::string addressing_rule_key(const Context& ctx, const std::string& rule_key, int64_t block_size, int runs = 0);

// An OpLaunch of the kernel `rule_key`'s rules pick for `grid`'s programs of at most
// `max_tokens` tokens each; the arguments are the caller's to add.
// `num_sms`: the SMs the launch is planned for (a plan's, which may differ from the device's).
Status pick_launch(const Context& ctx, int64_t num_sms, const std::string& rule_key, int64_t max_tokens, int64_t gx,
                   int64_t gy, int64_t gz, OpLaunch* out);

}  // namespace flash_reasoning
