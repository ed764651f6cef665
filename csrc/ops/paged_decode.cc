#include "ops/paged_decode.h"

#include <algorithm>
#include <climits>
#include <string>

#include "util/int_math.h"

namespace flash_reasoning {
namespace {

struct Split {
  int64_t splits = 1;
  int64_t tiles = 0;  // programs per sequence
  size_t partial_out_bytes = 0, partial_lse_bytes = 0;
};

Status plan_split(const Context& ctx, const AttentionShape& s, int64_t num_seqs, int64_t max_blocks, Split* out) {
  Status st = check_shape(ctx, s, "paged_decode");
  if (!st.ok()) return st;
  if (num_seqs < 0 || max_blocks < 1 || max_blocks > INT_MAX || num_seqs > INT_MAX)
    return Status::Error(Code::kInvalidArgument, "num_seqs must be >= 0 and max_blocks in [1, 2^31), got " +
                                                     std::to_string(num_seqs) + " and " + std::to_string(max_blocks));
  if (!(st = query_tiles(ctx, s, &out->tiles)).ok()) return st;
  out->splits = paged_decode_splits(ctx.rules(), num_seqs, out->tiles, max_blocks * s.block_size, ctx.num_sms());
  if (out->splits > 1) {
    out->partial_out_bytes = size_t(num_seqs * s.num_qo_heads * out->splits * s.head_dim) * 4;
    out->partial_lse_bytes = size_t(num_seqs * s.num_qo_heads * out->splits) * 4;
  }
  return Status::Ok();
}

size_t lse_offset(const Split& split) { return align_up(split.partial_out_bytes, 256); }

}  // namespace

int64_t paged_decode_splits(const DispatchTable& rules, int64_t num_seqs, int64_t programs_per_seq,
                            int64_t max_seq_len, int64_t num_sms) {
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
  Status st = plan_split(ctx, shape, num_seqs, max_blocks, &split);
  if (st.ok()) *bytes = split.splits > 1 ? lse_offset(split) + split.partial_lse_bytes : 0;
  return st;
}

Status paged_decode(Context& ctx, const AttentionShape& s, const PagedDecodeArgs& a, CUstream stream) {
  Status st = ctx.require_device("frPagedDecode");
  Split split;
  if (st.ok()) st = plan_split(ctx, s, a.num_seqs, a.max_blocks, &split);
  if (st.ok()) st = check_pointers({{"q", a.q}, {"k_pool", a.k_pool}, {"v_pool", a.v_pool},
                                    {"block_tables", a.block_tables}, {"seq_lens", a.seq_lens}, {"out", a.out}});
  if (!st.ok()) return st;
  size_t needed = split.splits > 1 ? lse_offset(split) + split.partial_lse_bytes : 0;
  if (a.workspace && a.workspace_bytes < needed)
    return Status::Error(Code::kInvalidArgument, "workspace has " + std::to_string(a.workspace_bytes) +
                                                     " bytes, this decode needs " + std::to_string(needed) +
                                                     " (frPagedDecodeWorkspaceSize), or pass NULL to never split");
  if (!a.workspace) split.splits = 1;
  if (!a.num_seqs) return Status::Ok();
  int64_t capacity = a.max_blocks * s.block_size;
  int64_t per_split = ceil_div(capacity, split.splits);
  int kernel = -1;
  std::string family = split.splits > 1 ? "paged_decode_split/" : "paged_decode/";
  int64_t programs = a.num_seqs * split.tiles * split.splits;
  if (!(st = ctx.pick(ctx.addressing_rule_key(family + s.rule_suffix(), s.block_size), per_split, programs, &kernel)).ok())
    return st;
  const char* ws = static_cast<const char*>(a.workspace);
  const void* partial_out = split.splits > 1 ? ws : nullptr;
  const void* partial_lse = split.splits > 1 ? ws + lse_offset(split) : nullptr;
  st = launch_decode_kernel(ctx, kernel, s, a, split.tiles, split.splits, per_split, partial_out, partial_lse, stream);
  if (!st.ok() || split.splits == 1) return st;
  if (!(st = ctx.pick("merge_splits/" + s.rule_suffix(), -1, -1, &kernel)).ok()) return st;
  return ctx.launch(kernel, a.num_seqs * s.num_qo_heads, 1, 1,
                    {{"partial_out", pointer_arg(partial_out)}, {"partial_lse", pointer_arg(partial_lse)},
                     {"out", pointer_arg(a.out)}, {"num_splits", Arg::Int(split.splits)}},
                    stream);
}

Status launch_decode_kernel(Context& ctx, int kernel, const AttentionShape& s, const PagedDecodeArgs& a,
                            int64_t tiles, int64_t splits, int64_t per_split, const void* partial_out,
                            const void* partial_lse, CUstream stream) {
  int64_t block_n = ctx.kernel(kernel).constexprs.at("BLOCK_N");
  int64_t tokens_per_split = std::max(ceil_div(per_split, block_n) * block_n, block_n);
  return ctx.launch(kernel, a.num_seqs, tiles, splits,
                    {{"q", pointer_arg(a.q)}, {"k_pool", pointer_arg(a.k_pool)}, {"v_pool", pointer_arg(a.v_pool)},
                     {"block_tables", pointer_arg(a.block_tables)}, {"seq_lens", pointer_arg(a.seq_lens)},
                     {"out", pointer_arg(splits > 1 ? nullptr : a.out)},
                     {"partial_out", pointer_arg(partial_out)}, {"partial_lse", pointer_arg(partial_lse)},
                     {"sm_scale_log2", Arg::Float(s.scale_log2())}, {"num_qo_heads", Arg::Int(s.num_qo_heads)},
                     {"num_kv_heads", Arg::Int(s.num_kv_heads)}, {"page_size", Arg::Int(s.block_size)},
                     {"max_blocks", Arg::Int(a.max_blocks)}, {"tokens_per_split", Arg::Int(tokens_per_split)}},
                    stream);
}

Status append_kv(Context& ctx, void* k_pool, void* v_pool, const void* slots, const void* k_new, const void* v_new,
                 int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, CUstream stream) {
  Status st = ctx.require_device("frAppendKV");
  if (st.ok() && (num_tokens < 0 || num_tokens > INT_MAX || num_kv_heads < 1 || head_dim < 1 ||
                  num_kv_heads * head_dim > INT_MAX))
    st = Status::Error(Code::kInvalidArgument, "num_tokens must be in [0, 2^31) and num_kv_heads, head_dim >= 1; got " +
                                                   std::to_string(num_tokens) + ", " + std::to_string(num_kv_heads) +
                                                   ", " + std::to_string(head_dim));
  if (st.ok()) st = check_pointers({{"k_pool", k_pool}, {"v_pool", v_pool}, {"slots", slots}, {"k_new", k_new},
                                    {"v_new", v_new}});
  int kernel = -1;
  int64_t block = 0;
  if (st.ok()) st = ctx.pick("append_kv", -1, -1, &kernel);
  if (st.ok()) st = ctx.rules().constant("append_block", &block);
  if (!st.ok() || !num_tokens) return st;
  int64_t row_elems = num_kv_heads * head_dim;
  return ctx.launch(kernel, num_tokens, ceil_div(row_elems, block), 1,
                    {{"k_pool", pointer_arg(k_pool)}, {"v_pool", pointer_arg(v_pool)}, {"slots", pointer_arg(slots)},
                     {"k_new", pointer_arg(k_new)}, {"v_new", pointer_arg(v_new)}, {"row_elems", Arg::Int(row_elems)}},
                    stream);
}

}  // namespace flash_reasoning
