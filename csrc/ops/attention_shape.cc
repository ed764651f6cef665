#include "ops/attention_shape.h"

#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <set>
#include <sstream>

#include "util/int_math.h"

namespace flash_reasoning {
namespace {

Status bad(const std::string& field, const std::string& expected, int64_t got) {
  return Status::Error(Code::kInvalidArgument,
                       "shape." + field + " must be " + expected + ", got " + std::to_string(got));
}

// The head_dims compiled for `family` and `dtype`, from the rule keys ("family/dtype/hd[/..]").
std::string compiled_head_dims(const Context& ctx, const std::string& family, const std::string& dtype) {
  std::string prefix = family + "/" + dtype + "/", list;
  std::set<int64_t> dims;
  for (const auto& rule : ctx.rules().rules)
    if (rule.first.compare(0, prefix.size(), prefix) == 0) dims.insert(std::atoll(rule.first.c_str() + prefix.size()));
  for (int64_t d : dims) list += (list.empty() ? "" : ", ") + std::to_string(d);
  return list.empty() ? "none" : list;
}

// The kernels compute base-2 scores (q . k) * (sm_scale * log2 e) in float32 from float16 or bfloat16
// q and K. A float16 product sum is at most head_dim * 65504^2 in magnitude; this bound keeps every
// such score within half the float32 range, so the scores and their differences (the online softmax
// subtracts the running maximum) stay finite. Python's ops.checks.max_scale computes the same double
// in the same order: both front ends accept exactly the same scales.
double max_scale(int64_t head_dim) {
  const double kFloat32Max = 3.4028234663852886e38, kFloat16Max = 65504.0, kLog2E = 1.4426950408889634;
  return kFloat32Max / (2.0 * kLog2E * double(head_dim) * kFloat16Max * kFloat16Max);
}

}  // namespace

double AttentionShape::scale_log2() const {
  return sm_scale * 1.4426950408889634;  // log2(e)
}

Status check_shape_fields(const AttentionShape& s, bool kernel_dtype) {
  if (s.num_kv_heads < 1) return bad("num_kv_heads", ">= 1", s.num_kv_heads);
  if (s.num_qo_heads < 1 || s.num_qo_heads % s.num_kv_heads)
    return bad("num_qo_heads", "a positive multiple of num_kv_heads (" + std::to_string(s.num_kv_heads) + ")",
               s.num_qo_heads);
  if (s.head_dim < 1) return bad("head_dim", ">= 1", s.head_dim);
  if (s.block_size < 1) return bad("block_size", ">= 1", s.block_size);
  if (s.num_blocks < 1) return bad("num_blocks", ">= 1", s.num_blocks);
  if (!(std::fabs(s.sm_scale) <= max_scale(s.head_dim))) {  // NaN fails too
    std::ostringstream msg;
    msg << "shape.sm_scale must be finite and at most " << std::setprecision(6) << max_scale(s.head_dim)
        << " in magnitude for head_dim " << s.head_dim
        << " (float32 scores q.k * sm_scale * log2(e) of float16 inputs must not overflow), got "
        << std::setprecision(9) << s.sm_scale;
    return Status::Error(Code::kInvalidArgument, msg.str());
  }
  if (kernel_dtype && s.dtype != "float16" && s.dtype != "bfloat16")
    return Status::Error(Code::kInvalidArgument, "shape.dtype must be FR_FLOAT16 or FR_BFLOAT16, got " + s.dtype);
  return Status::Ok();
}

Status check_shape(const Context& ctx, const AttentionShape& s, const char* family) {
  Status st = check_shape_fields(s);
  if (!st.ok()) return st;
  if (!ctx.rules().rules.count(std::string(family) + "/" + s.rule_suffix()))
    return Status::Error(Code::kUnsupported,
                         "head_dim " + std::to_string(s.head_dim) + " with " + s.dtype + " is not compiled for " +
                             ctx.arch() + " (compiled head_dims: " + compiled_head_dims(ctx, family, s.dtype) + ")");
  return Status::Ok();
}

Status query_tiles(const Context& ctx, const AttentionShape& shape, int64_t* tiles) {
  int64_t block_m = 0;
  Status st = ctx.rules().constant("block_m", &block_m);
  if (st.ok()) *tiles = shape.num_kv_heads * ceil_div(shape.group(), block_m);
  return st;
}

}  // namespace flash_reasoning
