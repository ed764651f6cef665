// paged_decode for C callers: one query per sequence over its own block table (no sharing),
// split along the sequence when few sequences cannot fill the GPU, as Python's paged_decode.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/attention_shape.h"
#include "runtime/context.h"

namespace flash_reasoning {

struct PagedDecodeArgs {
  const void* q = nullptr;
  const void* k_pool = nullptr;
  const void* v_pool = nullptr;
  const void* block_tables = nullptr;  // int32 [num_seqs, max_blocks]
  const void* seq_lens = nullptr;      // int32 [num_seqs]
  int64_t num_seqs = 0;
  int64_t max_blocks = 0;
  void* out = nullptr;
  void* workspace = nullptr;  // fp32 partials of a split decode; nullptr: never split
  size_t workspace_bytes = 0;
};

// Splits per sequence: until about two programs run per SM (Python: dispatch.num_splits).
int64_t paged_decode_splits(const DispatchTable& rules, int64_t num_seqs, int64_t programs_per_seq,
                            int64_t max_seq_len, int64_t num_sms);

// Bytes of workspace that let the decode split as it wants (0 when it would not split).
Status paged_decode_workspace(const Context& ctx, const AttentionShape& shape, int64_t num_seqs, int64_t max_blocks,
                              size_t* bytes);

Status paged_decode(Context& ctx, const AttentionShape& shape, const PagedDecodeArgs& args, CUstream stream);

// One launch of paged_decode's kernel `kernel`: `tiles` programs per sequence and split, each
// split at most `per_split` tokens. Unsplit (splits 1) it writes args.out; split, the fp32
// partials (workspace and size ignored). A tree plan with no partials runs it too.
Status launch_decode_kernel(Context& ctx, int kernel, const AttentionShape& shape, const PagedDecodeArgs& args,
                            int64_t tiles, int64_t splits, int64_t per_split, const void* partial_out,
                            const void* partial_lse, CUstream stream);

// Writes num_tokens rows of [num_kv_heads, head_dim] 16-bit values into pool slots.
Status append_kv(Context& ctx, void* k_pool, void* v_pool, const void* slots, const void* k_new, const void* v_new,
                 int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, CUstream stream);

}  // namespace flash_reasoning
