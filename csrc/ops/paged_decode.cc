#include "ops/paged_decode.h"

#include <algorithm>
#include <climits>
#include <string>

#include "util/int_math.h"

namespace flash_reasoning {
namespace {

constexpr size_t kRegionAlign = 256;

Status invalid(const std::string& message) { return Status::Error(Code::kInvalidArgument, message); }

// The kernels index tokens, table entries, queries and partials in int32: every count they
// index must stay below 2^31, checked before any launch is built.
Status check_sizes(const AttentionShape& s, int64_t num_seqs, int64_t max_blocks) {
  if (num_seqs < 0 || num_seqs > INT_MAX)
    return invalid("num_seqs must be in [0, 2^31), got " + std::to_string(num_seqs));
  if (max_blocks < 1 || max_blocks > INT_MAX)
    return invalid("max_blocks must be in [1, 2^31), got " + std::to_string(max_blocks));
  if (max_blocks * s.block_size > INT_MAX)
    return invalid("max_blocks * block_size = " + std::to_string(max_blocks * s.block_size) +
                   " tokens per sequence: the kernels index tokens in int32 (at most 2^31 - 1)");
  if (num_seqs * max_blocks > INT_MAX)
    return invalid("block tables of " + std::to_string(num_seqs) + " x " + std::to_string(max_blocks) +
                   " entries: the kernels index them in int32 (at most 2^31 - 1)");
  if (num_seqs * s.num_qo_heads * s.head_dim > INT_MAX)
    return invalid("q of " + std::to_string(num_seqs) + " x " + std::to_string(s.num_qo_heads) + " x " +
                   std::to_string(s.head_dim) + " elements: the kernels index it in int32 (at most 2^31 - 1)");
  return Status::Ok();
}

struct Split {
  int64_t splits = 1;
  int64_t tiles = 0;  // programs per sequence
  size_t partial_out_bytes = 0, partial_lse_bytes = 0;
  size_t lse_offset() const { return align_up(partial_out_bytes, kRegionAlign); }
  size_t workspace_bytes() const { return splits > 1 ? lse_offset() + partial_lse_bytes : 0; }
};

Status plan_split(const Context& ctx, const AttentionShape& s, int64_t num_seqs, int64_t max_blocks, int64_t splits,
                  Split* out) {
  Status st = check_shape(ctx, s, "paged_decode");
  if (st.ok()) st = check_sizes(s, num_seqs, max_blocks);
  if (st.ok()) st = query_tiles(ctx, s, &out->tiles);
  if (!st.ok()) return st;
  int64_t max_splits = 64;
  ctx.rules().constant("max_splits", &max_splits);
  if (splits < 0 || splits > max_splits)
    return invalid("splits must be 0 (chosen) or 1.." + std::to_string(max_splits) + ", got " + std::to_string(splits));
  out->splits = splits
                    ? splits
                    : paged_decode_splits(ctx.rules(), num_seqs, out->tiles, max_blocks * s.block_size, ctx.num_sms());
  if (out->splits > 1) {
    out->partial_out_bytes = size_t(num_seqs * s.num_qo_heads * out->splits * s.head_dim) * 4;
    out->partial_lse_bytes = size_t(num_seqs * s.num_qo_heads * out->splits) * 4;
  }
  return Status::Ok();
}

LaunchArg call(const char* name) {
  auto it = std::find_if(kDecodePointers.begin(), kDecodePointers.end(),
                         [&](const char* p) { return std::string(p) == name; });
  return LaunchArg::Call(name, it - kDecodePointers.begin());
}

}  // namespace

int64_t paged_decode_splits(const DispatchTable& rules, int64_t num_seqs, int64_t programs_per_seq, int64_t max_seq_len,
                            int64_t num_sms) {
  int64_t programs = num_seqs * programs_per_seq;
  if (programs == 0 || programs >= num_sms) return 1;
  int64_t min_tokens = 256, max_splits = 64;
  rules.constant("min_tokens_per_split", &min_tokens);
  rules.constant("max_splits", &max_splits);
  int64_t wanted = ceil_div(2 * num_sms, programs);
  int64_t by_length = std::max<int64_t>(1, max_seq_len / min_tokens);
  return std::max<int64_t>(1, std::min({wanted, by_length, max_splits}));
}

Status paged_decode_workspace(const Context& ctx, const AttentionShape& shape, int64_t num_seqs, int64_t max_blocks,
                              size_t* bytes) {
  Split split;
  Status st = plan_split(ctx, shape, num_seqs, max_blocks, 0, &split);
  if (st.ok()) *bytes = split.workspace_bytes();
  return st;
}

void add_decode_args(const Context& ctx, const AttentionShape& s, const DecodePointers& p, int64_t max_blocks,
                     int64_t per_split, int64_t partial_out, int64_t partial_lse, OpLaunch* launch) {
  int64_t block_n = ctx.kernel(launch->launch.kernel).constexprs.at("BLOCK_N");
  int64_t tokens_per_split = std::max(ceil_div(per_split, block_n) * block_n, block_n);
  bool split = launch->launch.grid[2] > 1;
  LaunchArg none_out = LaunchArg::Value("out", Arg::UInt(0));
  launch->launch.args = {
      p.q,
      p.k_pool,
      p.v_pool,
      p.block_tables,
      p.seq_lens,
      split ? none_out : p.out,
      split ? LaunchArg::Workspace("partial_out", partial_out) : LaunchArg::Value("partial_out", Arg::UInt(0)),
      split ? LaunchArg::Workspace("partial_lse", partial_lse) : LaunchArg::Value("partial_lse", Arg::UInt(0)),
      LaunchArg::Value("sm_scale_log2", Arg::Float(s.scale_log2())),
      LaunchArg::Value("num_qo_heads", Arg::Int(s.num_qo_heads)),
      LaunchArg::Value("num_kv_heads", Arg::Int(s.num_kv_heads)),
      LaunchArg::Value("page_size", Arg::Int(s.block_size)),
      LaunchArg::Value("max_blocks", Arg::Int(max_blocks)),
      LaunchArg::Value("tokens_per_split", Arg::Int(tokens_per_split))};
}

Status paged_decode_launches(const Context& ctx, const AttentionShape& s, int64_t num_seqs, int64_t max_blocks,
                             bool may_split, const DecodeOptions& options, DecodeLaunches* out) {
  Split split;
  Status st = plan_split(ctx, s, num_seqs, max_blocks, options.splits, &split);
  if (!st.ok()) return st;
  *out = DecodeLaunches();
  out->workspace_bytes = split.workspace_bytes();
  if (!may_split && !options.splits) split.splits = 1;
  out->splits = split.splits;
  if (!num_seqs) return Status::Ok();
  int64_t per_split = ceil_div(max_blocks * s.block_size, split.splits);
  OpLaunch decode;
  std::string family = split.splits > 1 ? "paged_decode_split/" : "paged_decode/";
  st = pick_launch(ctx, ctx.num_sms(), addressing_rule_key(ctx, family + s.rule_suffix(), s.block_size), per_split,
                   num_seqs, split.tiles, split.splits, &decode);
  if (!st.ok()) return st;
  if (options.kernel >= 0) decode.launch.kernel = options.kernel;
  DecodePointers pointers = {call("q"),        call("k_pool"), call("v_pool"), call("block_tables"),
                             call("seq_lens"), call("out")};
  add_decode_args(ctx, s, pointers, max_blocks, per_split, 0, int64_t(split.lse_offset()), &decode);
  out->launches.push_back(std::move(decode));
  if (split.splits == 1) return Status::Ok();
  OpLaunch merge;
  if (!(st = pick_launch(ctx, ctx.num_sms(), "merge_splits/" + s.rule_suffix(), -1, num_seqs * s.num_qo_heads, 1, 1,
                         &merge))
           .ok())
    return st;
  merge.launch.args = {LaunchArg::Workspace("partial_out", 0),
                       LaunchArg::Workspace("partial_lse", int64_t(split.lse_offset())), call("out"),
                       LaunchArg::Value("num_splits", Arg::Int(split.splits))};
  out->launches.push_back(std::move(merge));
  return Status::Ok();
}

Status paged_decode(Context& ctx, const AttentionShape& s, int64_t num_seqs, int64_t max_blocks,
                    const uint64_t* pointers, uint64_t workspace, size_t workspace_bytes, const DecodeOptions& options,
                    CUstream stream) {
  Status st = ctx.require_device("paged decode");
  DecodeLaunches decode;
  if (st.ok()) st = paged_decode_launches(ctx, s, num_seqs, max_blocks, workspace != 0, options, &decode);
  if (!st.ok()) return st;
  if (workspace && workspace_bytes < decode.workspace_bytes)
    return invalid("workspace has " + std::to_string(workspace_bytes) + " bytes, this decode needs " +
                   std::to_string(decode.workspace_bytes) +
                   " (frPagedDecodeWorkspaceSize), or pass NULL to never split");
  for (size_t i = 0; i < kDecodePointers.size(); ++i)
    if (!pointers[i] || pointers[i] % kPointerAlign)
      return invalid(std::string(kDecodePointers[i]) + " must be a non-NULL, " + std::to_string(kPointerAlign) +
                     "-byte aligned device pointer");
  st = check_apart(pointers[0], pointers[kDecodePointers.size() - 1],  // q, out
                   uint64_t(num_seqs * s.num_qo_heads * s.head_dim * s.dtype_bytes()));
  if (!st.ok()) return st;
  std::vector<KernelLaunch> launches;
  for (const OpLaunch& l : decode.launches) launches.push_back(l.launch);
  return ctx.run(launches, {kDecodePointers.begin(), kDecodePointers.end()}, pointers, workspace, stream);
}

Status append_kv_launch(const Context& ctx, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                        std::vector<OpLaunch>* out) {
  if (num_tokens < 0 || num_tokens > INT_MAX || num_kv_heads < 1 || head_dim < 1 || num_kv_heads * head_dim > INT_MAX)
    return invalid("num_tokens must be in [0, 2^31) and num_kv_heads, head_dim >= 1; got " +
                   std::to_string(num_tokens) + ", " + std::to_string(num_kv_heads) + ", " + std::to_string(head_dim));
  int64_t block = 0, row_elems = num_kv_heads * head_dim;
  Status st = ctx.rules().constant("append_block", &block);
  OpLaunch append;
  if (st.ok())
    st = pick_launch(ctx, ctx.num_sms(), "append_kv", -1, num_tokens, ceil_div(row_elems, block), 1, &append);
  if (!st.ok()) return st;
  out->clear();
  if (!num_tokens) return Status::Ok();
  for (size_t i = 0; i < kAppendPointers.size(); ++i)
    append.launch.args.push_back(LaunchArg::Call(kAppendPointers[i], int64_t(i)));
  append.launch.args.push_back(LaunchArg::Value("row_elems", Arg::Int(row_elems)));
  out->push_back(std::move(append));
  return Status::Ok();
}

Status append_kv(Context& ctx, const uint64_t* pointers, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                 CUstream stream) {
  Status st = ctx.require_device("append_kv");
  std::vector<OpLaunch> append;
  if (st.ok()) st = append_kv_launch(ctx, num_tokens, num_kv_heads, head_dim, &append);
  for (size_t i = 0; st.ok() && i < kAppendPointers.size(); ++i)
    if (!pointers[i] || pointers[i] % kPointerAlign)
      st = invalid(std::string(kAppendPointers[i]) + " must be a non-NULL, " + std::to_string(kPointerAlign) +
                   "-byte aligned device pointer");
  if (!st.ok() || append.empty()) return st;
  return ctx.run({append[0].launch}, {kAppendPointers.begin(), kAppendPointers.end()}, pointers, 0, stream);
}

}  // namespace flash_reasoning
