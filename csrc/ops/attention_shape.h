// The attention call a C caller describes (heads, head_dim, dtype, paging), validated once.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/context.h"
#include "util/status.h"

namespace flash_reasoning {

struct AttentionShape {
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  std::string dtype;  // "float16" | "bfloat16"
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  double sm_scale = 0;  // the softmax scale (the C ABI maps its 0 to 1/sqrt(head_dim))

  int64_t group() const { return num_qo_heads / num_kv_heads; }
  // "float16/128": the rule key suffix of this dtype and head_dim.
  std::string rule_suffix() const { return dtype + "/" + std::to_string(head_dim); }
  // sm_scale in base 2, as the kernels take it.
  double scale_log2() const;
  // Bytes per K/V element: 2 for the kernels' dtypes; a plan without kernels (the PyTorch path)
  // may also be "float32" (4) or "float64" (8).
  int64_t dtype_bytes() const { return dtype == "float32" ? 4 : dtype == "float64" ? 8 : 2; }
};

// Checks every field's range, and the dtype among the kernels' unless `kernel_dtype` is false (no kernels
// consulted: a plan made without a context, which the PyTorch path runs in any float dtype).
Status check_shape_fields(const AttentionShape& shape, bool kernel_dtype = true);
// Checks every field; kUnsupported when the context's arch has no kernel for the dtype and
// head_dim (`family` names the rule family to look up, e.g. "tree_final").
Status check_shape(const Context& ctx, const AttentionShape& shape, const char* family);

// Programs per KV head's group of query heads, times the KV heads: the decode-tile programs of
// one sequence or branch (the manifest's block_m rows per tile, as Python's
// dispatch.decode_tiles_per_kv_head).
Status query_tiles(const Context& ctx, const AttentionShape& shape, int64_t* tiles);

}  // namespace flash_reasoning
