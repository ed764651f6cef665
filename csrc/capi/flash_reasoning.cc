// The C ABI: argument conversion and error capture around the core, no logic of its own.
// Only the fr* functions leave the library (-fvisibility=hidden and a version script).
#include "flash_reasoning/flash_reasoning.h"

#include <cmath>
#include <memory>
#include <new>
#include <string>

#include "runtime/context.h"
#include "ops/paged_decode.h"
#include "ops/tree_attention_plan.h"
#include "util/version.h"

#define FR_EXPORT extern "C" __attribute__((visibility("default")))

struct frContext_t {
  std::unique_ptr<flash_reasoning::Context> core;
};

struct frPlan_t {
  std::unique_ptr<flash_reasoning::TreeAttentionPlan> core;
};

namespace fr = flash_reasoning;

namespace {

thread_local std::string g_last_error;

frStatus record(const fr::Status& st) {
  g_last_error = st.message;
  return static_cast<frStatus>(st.code);
}

frStatus invalid(const std::string& message) { return record(fr::Status::Error(fr::Code::kInvalidArgument, message)); }

// Runs `body` (returning a Status), turning exceptions (allocation failures) into codes.
template <typename Body>
frStatus guarded(Body body) {
  try {
    return record(body());
  } catch (const std::bad_alloc&) {
    return record(fr::Status::Error(fr::Code::kOutOfMemory, "host memory exhausted"));
  } catch (const std::exception& e) {
    return record(fr::Status::Error(fr::Code::kInvalidArgument, e.what()));
  }
}

fr::CUstream stream_of(void* stream) { return static_cast<fr::CUstream>(stream); }

uint64_t address(const void* pointer) { return reinterpret_cast<uint64_t>(pointer); }

frStatus to_shape(const frAttentionShape* in, fr::AttentionShape* out) {
  if (!in) return invalid("shape must not be NULL");
  out->num_qo_heads = in->num_qo_heads;
  out->num_kv_heads = in->num_kv_heads;
  out->head_dim = in->head_dim;
  out->dtype = in->dtype == FR_FLOAT16 ? "float16" : in->dtype == FR_BFLOAT16 ? "bfloat16"
                                                                              : "frDtype " + std::to_string(in->dtype);
  out->block_size = in->block_size;
  out->num_blocks = in->num_blocks;
  // The C ABI's 0 is the default scale; the core takes the scale itself.
  if (!std::isfinite(in->sm_scale) || in->sm_scale < 0)
    return invalid("shape.sm_scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got " +
                   std::to_string(in->sm_scale));
  out->sm_scale = in->sm_scale != 0 || in->head_dim < 1 ? in->sm_scale : 1.0 / std::sqrt(double(in->head_dim));
  return FR_OK;
}

frStatus to_tree(const frTree* in, fr::TreeInput* out) {
  if (!in) return invalid("tree must not be NULL");
  *out = {in->num_branches, in->lengths, in->block_tables, in->table_stride};
  return FR_OK;
}

}  // namespace

FR_EXPORT const char* frGetLastError(void) { return g_last_error.c_str(); }

FR_EXPORT const char* frStatusName(frStatus status) {
  static const char* const kNames[] = {"FR_OK", "FR_INVALID_ARGUMENT", "FR_NOT_FOUND", "FR_INVALID_MANIFEST",
                                       "FR_CORRUPTED_ARTIFACT", "FR_DRIVER_UNAVAILABLE", "FR_CUDA_ERROR",
                                       "FR_UNSUPPORTED_ARCH", "FR_IO_ERROR", "FR_OUT_OF_MEMORY", "FR_PLAN_MISMATCH",
                                       "FR_UNSUPPORTED"};
  int i = static_cast<int>(status);
  return i >= 0 && i < int(sizeof(kNames) / sizeof(kNames[0])) ? kNames[i] : "FR_UNKNOWN_STATUS";
}

FR_EXPORT const char* frVersion(void) { return fr::kPackageVersion; }

FR_EXPORT frStatus frContextCreate(const char* artifact_root, int device, frContext* out) {
  if (!artifact_root || !out) return invalid("artifact_root and out must not be NULL");
  return guarded([&] {
    std::unique_ptr<fr::Context> core;
    fr::Status st = fr::Context::open(artifact_root, device, &core);
    if (st.ok()) *out = new frContext_t{std::move(core)};
    return st;
  });
}

FR_EXPORT frStatus frContextCreateHostOnly(const char* artifact_root, const char* arch, frContext* out) {
  if (!artifact_root || !arch || !out) return invalid("artifact_root, arch and out must not be NULL");
  return guarded([&] {
    std::unique_ptr<fr::Context> core;
    fr::Status st = fr::Context::open_host_only(artifact_root, arch, &core);
    if (st.ok()) *out = new frContext_t{std::move(core)};
    return st;
  });
}

FR_EXPORT frStatus frContextDestroy(frContext context) {
  delete context;
  return record(fr::Status::Ok());
}

FR_EXPORT frStatus frContextArch(frContext context, const char** arch) {
  if (!context || !arch) return invalid("context and arch must not be NULL");
  *arch = context->core->arch().c_str();
  return record(fr::Status::Ok());
}

FR_EXPORT frStatus frPlanCreate(frContext context, const frAttentionShape* shape, const frTree* tree,
                                int32_t extra_blocks, frPlan* out) {
  fr::AttentionShape s;
  fr::TreeInput t;
  if (!context || !out) return invalid("context and out must not be NULL");
  if (frStatus rc = to_shape(shape, &s)) return rc;
  if (frStatus rc = to_tree(tree, &t)) return rc;
  return guarded([&] {
    std::unique_ptr<fr::TreeAttentionPlan> core;
    fr::Status st = fr::TreeAttentionPlan::create(context->core.get(), s, t, extra_blocks, fr::PlanOptions(), &core);
    if (st.ok() && !context->core->host_only()) st = core->allocate_workspace();
    if (st.ok()) *out = new frPlan_t{std::move(core)};
    return st;
  });
}

FR_EXPORT frStatus frPlanGetInfo(frPlan plan, frPlanInfo* info) {
  if (!plan || !info) return invalid("plan and info must not be NULL");
  const fr::TreeAttentionPlan& p = *plan->core;
  *info = {int32_t(p.num_branches()),
           int32_t(p.tree().num_nodes()),
           int32_t(p.plan().computed_nodes),
           int32_t(p.launches().size()),
           int32_t(p.max_blocks()),
           p.unique_tokens(),
           p.logical_tokens(),
           p.workspace_bytes()};
  return record(fr::Status::Ok());
}

FR_EXPORT frStatus frPlanKernelName(frPlan plan, int32_t launch, const char** name) {
  if (!plan || !name) return invalid("plan and name must not be NULL");
  const std::vector<fr::OpLaunch>& launches = plan->core->launches();
  if (launch < 0 || size_t(launch) >= launches.size())
    return invalid("launch " + std::to_string(launch) + " is out of range: the plan has " +
                   std::to_string(launches.size()) + " launches");
  *name = plan->core->context()->kernel(launches[launch].launch.kernel).name.c_str();
  return record(fr::Status::Ok());
}

FR_EXPORT frStatus frPlanRun(frPlan plan, const void* q, const void* k_pool, const void* v_pool, void* out,
                             void* stream) {
  if (!plan) return invalid("plan must not be NULL");
  return guarded([&] { return plan->core->run(q, k_pool, v_pool, out, stream_of(stream)); });
}

FR_EXPORT frStatus frPlanUpdate(frPlan plan, const frTree* tree, void* stream) {
  fr::TreeInput t;
  if (!plan) return invalid("plan must not be NULL");
  if (frStatus rc = to_tree(tree, &t)) return rc;
  return guarded([&] { return plan->core->update(t, stream_of(stream)); });
}

FR_EXPORT frStatus frPlanDestroy(frPlan plan) {
  delete plan;
  return record(fr::Status::Ok());
}

FR_EXPORT frStatus frAppendKV(frContext context, void* k_pool, void* v_pool, const void* slots, const void* k_new,
                              const void* v_new, int64_t num_tokens, int32_t num_kv_heads, int32_t head_dim,
                              void* stream) {
  if (!context) return invalid("context must not be NULL");
  const uint64_t pointers[] = {address(k_pool), address(v_pool), address(slots), address(k_new), address(v_new)};
  return guarded([&] {
    return fr::append_kv(*context->core, pointers, num_tokens, num_kv_heads, head_dim, stream_of(stream));
  });
}

FR_EXPORT frStatus frPagedDecodeWorkspaceSize(frContext context, const frAttentionShape* shape, int32_t num_seqs,
                                              int32_t max_blocks, size_t* bytes) {
  fr::AttentionShape s;
  if (!context || !bytes) return invalid("context and bytes must not be NULL");
  if (frStatus rc = to_shape(shape, &s)) return rc;
  return guarded([&] { return fr::paged_decode_workspace(*context->core, s, num_seqs, max_blocks, bytes); });
}

FR_EXPORT frStatus frPagedDecode(frContext context, const frAttentionShape* shape, const void* q, const void* k_pool,
                                 const void* v_pool, const void* block_tables, const void* seq_lens, int32_t num_seqs,
                                 int32_t max_blocks, void* out, void* workspace, size_t workspace_bytes, void* stream) {
  fr::AttentionShape s;
  if (!context) return invalid("context must not be NULL");
  if (frStatus rc = to_shape(shape, &s)) return rc;
  const uint64_t pointers[] = {address(q), address(k_pool), address(v_pool), address(block_tables), address(seq_lens),
                               address(out)};
  return guarded([&] {
    return fr::paged_decode(*context->core, s, num_seqs, max_blocks, pointers, address(workspace), workspace_bytes,
                            fr::DecodeOptions(), stream_of(stream));
  });
}

FR_EXPORT frStatus frDeviceAlloc(frContext context, size_t bytes, void** ptr) {
  if (!context || !ptr) return invalid("context and ptr must not be NULL");
  return guarded([&] {
    fr::CUdeviceptr p = 0;
    fr::Status st = context->core->alloc(bytes, &p);
    if (st.ok()) *ptr = reinterpret_cast<void*>(p);
    return st;
  });
}

FR_EXPORT frStatus frDeviceFree(frContext context, void* ptr) {
  if (!context) return invalid("context must not be NULL");
  return guarded([&] { return context->core->free(reinterpret_cast<fr::CUdeviceptr>(ptr)); });
}

FR_EXPORT frStatus frCopyToDevice(frContext context, void* dst, const void* src, size_t bytes) {
  if (!context || ((!dst || !src) && bytes)) return invalid("context, dst and src must not be NULL");
  return guarded([&] { return context->core->copy_to_device(reinterpret_cast<fr::CUdeviceptr>(dst), src, bytes); });
}

FR_EXPORT frStatus frCopyToHost(frContext context, void* dst, const void* src, size_t bytes) {
  if (!context || ((!dst || !src) && bytes)) return invalid("context, dst and src must not be NULL");
  return guarded([&] { return context->core->copy_to_host(dst, reinterpret_cast<fr::CUdeviceptr>(src), bytes); });
}

FR_EXPORT frStatus frStreamSynchronize(frContext context, void* stream) {
  if (!context) return invalid("context must not be NULL");
  return guarded([&] { return context->core->synchronize(stream_of(stream)); });
}
