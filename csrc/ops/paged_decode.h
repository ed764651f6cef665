// paged_decode: one query per sequence over its own block table (no sharing), split along the
// sequence when few sequences cannot fill the GPU; and append_kv, which writes new tokens' K/V.
// Each builds its launches here, once, for both front ends (Python and the C ABI).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/attention_shape.h"
#include "ops/op_launch.h"
#include "runtime/context.h"

namespace flash_reasoning {

// The pointers each paged decode passes, in this order (LaunchArg::Call indices).
constexpr std::array<const char*, 6> kDecodePointers = {"q", "k_pool", "v_pool", "block_tables", "seq_lens", "out"};

// Overrides for the tuner, which times each compiled config: `splits` > 0 forces the split
// count, `kernel` >= 0 the decode kernel (a manifest index).
struct DecodeOptions {
  int64_t splits = 0;
  int kernel = -1;
};

// The launches of one paged decode of `num_seqs` sequences whose tables hold `max_blocks`
// columns: the decode kernel, then the merge when it splits (only where `may_split`: the caller
// has `workspace_bytes` of workspace for the fp32 partials). No launches for no sequences.
struct DecodeLaunches {
  std::vector<OpLaunch> launches;
  int64_t splits = 1;
  size_t workspace_bytes = 0;  // what a split decode needs (0 when it would not split)
};
Status paged_decode_launches(const Context& ctx, const AttentionShape& shape, int64_t num_seqs, int64_t max_blocks,
                             bool may_split, const DecodeOptions& options, DecodeLaunches* out);

// Splits per sequence: until about two programs run per SM (Python: dispatch.num_splits).
int64_t paged_decode_splits(const DispatchTable& rules, int64_t num_seqs, int64_t programs_per_seq, int64_t max_seq_len,
                            int64_t num_sms);

// Bytes of workspace that let the decode split as it wants (0 when it would not split).
Status paged_decode_workspace(const Context& ctx, const AttentionShape& shape, int64_t num_seqs, int64_t max_blocks,
                              size_t* bytes);

// The decode kernel `launch.kernel` over `grid` (sequences, query tiles, splits) with the
// arguments for splits of at most `per_split` tokens: pointers from `pointers` (indices of the
// kDecodePointers names), unsplit writing `out`, split writing the partials at `partial_out`
// and `partial_lse` (workspace offsets). A tree plan with no partials launches it too.
struct DecodePointers {
  LaunchArg q, k_pool, v_pool, block_tables, seq_lens, out;
};
void add_decode_args(const Context& ctx, const AttentionShape& shape, const DecodePointers& pointers,
                     int64_t max_blocks, int64_t per_split, int64_t partial_out, int64_t partial_lse, OpLaunch* launch);

// Runs a paged decode: `pointers` in kDecodePointers order; `workspace` (workspace_bytes of
// paged_decode_launches) or 0 to never split.
Status paged_decode(Context& ctx, const AttentionShape& shape, int64_t num_seqs, int64_t max_blocks,
                    const uint64_t* pointers, uint64_t workspace, size_t workspace_bytes, const DecodeOptions& options,
                    CUstream stream);

// The pointers append_kv passes, in this order.
constexpr std::array<const char*, 5> kAppendPointers = {"k_pool", "v_pool", "slots", "k_new", "v_new"};

// The launch writing num_tokens rows of [num_kv_heads, head_dim] 16-bit values into pool slots.
Status append_kv_launch(const Context& ctx, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                        std::vector<OpLaunch>* out);
Status append_kv(Context& ctx, const uint64_t* pointers, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                 CUstream stream);

}  // namespace flash_reasoning
