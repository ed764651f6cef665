// The C ABI: handle lookup, argument conversion and error capture around the core, no logic
// of its own. Only the fr* functions leave the library (-fvisibility=hidden and a version script).
#include "flash_reasoning/flash_reasoning.h"

#include <cmath>
#include <cstddef>
#include <memory>
#include <new>
#include <string>

#include "capi/handles.h"
#include "ops/paged_decode.h"
#include "ops/tree_attention_plan.h"
#include "runtime/context.h"
#include "util/version.h"

#define FR_EXPORT extern "C" __attribute__((visibility("default")))

namespace fr = flash_reasoning;
using fr::capi::ContextObject;
using fr::capi::Handles;
using fr::capi::PlanObject;

namespace {

thread_local std::string g_last_error;

frStatus record(const fr::Status& st) {
  try {
    g_last_error = st.message;
  } catch (const std::bad_alloc&) {
    g_last_error.clear();  // the status still says what failed
  }
  return static_cast<frStatus>(st.code);
}

fr::Status invalid(const std::string& message) { return fr::Status::Error(fr::Code::kInvalidArgument, message); }

// Runs `body` (returning a Status), turning exceptions (allocation failures) into codes: no
// exception leaves the library.
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

uint64_t value_of(const void* handle) { return reinterpret_cast<uintptr_t>(handle); }

// `body(Context&)` on the live context `context`; the handle's error when it names none.
template <typename Body>
frStatus with_context(frContext context, Body body) {
  return guarded([&] {
    std::shared_ptr<ContextObject> object;
    fr::Status st = Handles::instance().find_context(value_of(context), "context", &object);
    return st.ok() ? body(*object->core) : st;
  });
}

template <typename Body>
frStatus with_plan(frPlan plan, Body body) {
  return guarded([&] {
    std::shared_ptr<PlanObject> object;
    fr::Status st = Handles::instance().find_plan(value_of(plan), "plan", &object);
    return st.ok() ? body(*object->core) : st;
  });
}

fr::CUstream stream_of(void* stream) { return static_cast<fr::CUstream>(stream); }

uint64_t address(const void* pointer) { return reinterpret_cast<uint64_t>(pointer); }

fr::Status to_shape(const frAttentionShape* in, fr::AttentionShape* out) {
  if (!in) return invalid("shape must not be NULL");
  out->num_qo_heads = in->num_qo_heads;
  out->num_kv_heads = in->num_kv_heads;
  out->head_dim = in->head_dim;
  out->dtype = in->dtype == FR_FLOAT16    ? "float16"
               : in->dtype == FR_BFLOAT16 ? "bfloat16"
                                          : "frDtype " + std::to_string(in->dtype);
  out->block_size = in->block_size;
  out->num_blocks = in->num_blocks;
  // The C ABI's 0 is the default scale, 1/sqrt(head_dim); the core takes the scale itself.
  out->sm_scale = in->sm_scale != 0 || in->head_dim < 1 ? in->sm_scale : 1.0 / std::sqrt(double(in->head_dim));
  return fr::Status::Ok();
}

// The tree's own consistency, checked before the core reads it or compares it with a plan:
// bad input is FR_INVALID_ARGUMENT, never a changed tree (FR_PLAN_MISMATCH).
fr::Status to_tree(const frTree* in, fr::TreeInput* out) {
  if (!in) return invalid("tree must not be NULL");
  if (in->num_branches < 0) return invalid("tree.num_branches must be >= 0, got " + std::to_string(in->num_branches));
  if (in->num_branches && (!in->lengths || !in->block_tables))
    return invalid("tree.lengths and tree.block_tables must not be NULL");
  if (in->table_stride < 0) return invalid("tree.table_stride must be >= 0, got " + std::to_string(in->table_stride));
  for (int32_t i = 0; i < in->num_branches; ++i)
    if (in->lengths[i] < 0)
      return invalid("tree.lengths[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(in->lengths[i]));
  *out = {in->num_branches, in->lengths, in->block_tables, in->table_stride};
  return fr::Status::Ok();
}

frContext context_handle(uint64_t handle) { return reinterpret_cast<frContext>(uintptr_t(handle)); }
frPlan plan_handle(uint64_t handle) { return reinterpret_cast<frPlan>(uintptr_t(handle)); }

// Registers the context an open call made (when `opened` is Ok) and hands out its handle.
fr::Status register_context(fr::Status opened, std::unique_ptr<fr::Context> core, frContext* out) {
  uint64_t handle = 0;
  fr::Status st = opened;
  if (st.ok()) st = Handles::instance().add_context(std::move(core), &handle);
  if (st.ok()) *out = context_handle(handle);
  return st;
}

}  // namespace

FR_EXPORT const char* frGetLastError(void) { return g_last_error.c_str(); }

FR_EXPORT const char* frStatusName(frStatus status) {
  static const char* const kNames[] = {"FR_OK",
                                       "FR_INVALID_ARGUMENT",
                                       "FR_NOT_FOUND",
                                       "FR_INVALID_MANIFEST",
                                       "FR_CORRUPTED_ARTIFACT",
                                       "FR_DRIVER_UNAVAILABLE",
                                       "FR_CUDA_ERROR",
                                       "FR_UNSUPPORTED_ARCH",
                                       "FR_IO_ERROR",
                                       "FR_OUT_OF_MEMORY",
                                       "FR_PLAN_MISMATCH",
                                       "FR_UNSUPPORTED"};
  int i = static_cast<int>(status);
  return i >= 0 && i < int(sizeof(kNames) / sizeof(kNames[0])) ? kNames[i] : "FR_UNKNOWN_STATUS";
}

FR_EXPORT const char* frVersion(void) { return fr::kPackageVersion; }

FR_EXPORT frStatus frContextCreate(const char* artifact_root, int device, frContext* out) {
  return guarded([&] {
    if (!artifact_root || !out) return invalid("artifact_root and out must not be NULL");
    std::unique_ptr<fr::Context> core;
    fr::Status st = fr::Context::open(artifact_root, device, &core);
    return register_context(st, std::move(core), out);
  });
}

FR_EXPORT frStatus frContextCreateHostOnly(const char* artifact_root, const char* arch, frContext* out) {
  return guarded([&] {
    if (!artifact_root || !arch || !out) return invalid("artifact_root, arch and out must not be NULL");
    std::unique_ptr<fr::Context> core;
    fr::Status st = fr::Context::open_host_only(artifact_root, arch, &core);
    return register_context(st, std::move(core), out);
  });
}

FR_EXPORT frStatus frContextDestroy(frContext context) {
  return guarded(
      [&] { return context ? Handles::instance().remove_context(value_of(context), "context") : fr::Status::Ok(); });
}

FR_EXPORT frStatus frContextArch(frContext context, const char** arch) {
  return with_context(context, [&](fr::Context& ctx) {
    if (!arch) return invalid("arch must not be NULL");
    *arch = ctx.arch().c_str();
    return fr::Status::Ok();
  });
}

FR_EXPORT frStatus frPlanCreate(frContext context, const frAttentionShape* shape, const frTree* tree,
                                int32_t extra_blocks, frPlan* out) {
  return frPlanCreateWithDraftMasks(context, shape, tree, nullptr, extra_blocks, out);
}

static_assert(sizeof(frDraftMask) == sizeof(fr::DraftMask) && offsetof(frDraftMask, allowed) == 8,
              "frDraftMask is the core's DraftMask");
static_assert(FR_MAX_DRAFT_TOKENS == fr::kMaxDraftTokens, "one draft bound");

FR_EXPORT frStatus frPlanCreateWithDraftMasks(frContext context, const frAttentionShape* shape, const frTree* tree,
                                              const frDraftMask* masks, int32_t extra_blocks, frPlan* out) {
  return guarded([&] {
    if (!context || !out) return invalid("context and out must not be NULL");
    std::shared_ptr<ContextObject> object;
    fr::Status st = Handles::instance().find_context(value_of(context), "context", &object);
    fr::AttentionShape s;
    fr::TreeInput t;
    if (st.ok()) st = to_shape(shape, &s);
    if (st.ok()) st = to_tree(tree, &t);
    std::unique_ptr<fr::TreeAttentionPlan> core;
    if (st.ok())
      st = fr::TreeAttentionPlan::create(object->core.get(), s, t, extra_blocks, fr::PlanOptions(), &core,
                                         reinterpret_cast<const fr::DraftMask*>(masks));
    if (st.ok() && !object->core->host_only()) st = core->allocate_workspace();
    uint64_t handle = 0;
    if (st.ok()) st = Handles::instance().add_plan(value_of(context), std::move(object), std::move(core), &handle);
    if (st.ok()) *out = plan_handle(handle);
    return st;
  });
}

FR_EXPORT frStatus frPlanGetInfo(frPlan plan, frPlanInfo* info) {
  return with_plan(plan, [&](const fr::TreeAttentionPlan& p) {
    if (!info) return invalid("info must not be NULL");
    *info = {int32_t(p.num_branches()),
             int32_t(p.tree().num_nodes()),
             int32_t(p.plan().computed_nodes),
             int32_t(p.launches().size()),
             int32_t(p.max_blocks()),
             p.unique_tokens(),
             p.logical_tokens(),
             p.workspace_bytes()};
    return fr::Status::Ok();
  });
}

FR_EXPORT frStatus frPlanKernelName(frPlan plan, int32_t launch, const char** name) {
  return with_plan(plan, [&](const fr::TreeAttentionPlan& p) {
    if (!name) return invalid("name must not be NULL");
    const std::vector<fr::OpLaunch>& launches = p.launches();
    if (launch < 0 || size_t(launch) >= launches.size())
      return invalid("launch " + std::to_string(launch) + " is out of range: the plan has " +
                     std::to_string(launches.size()) + " launches");
    *name = p.context()->kernel(launches[launch].launch.kernel).name.c_str();
    return fr::Status::Ok();
  });
}

FR_EXPORT frStatus frPlanRun(frPlan plan, const void* q, const void* k_pool, const void* v_pool, void* out,
                             void* stream) {
  return with_plan(plan, [&](fr::TreeAttentionPlan& p) { return p.run(q, k_pool, v_pool, out, stream_of(stream)); });
}

FR_EXPORT frStatus frPlanUpdate(frPlan plan, const frTree* tree, void* stream) {
  return with_plan(plan, [&](fr::TreeAttentionPlan& p) {
    fr::TreeInput t;
    fr::Status st = to_tree(tree, &t);
    return st.ok() ? p.update(t, stream_of(stream)) : st;
  });
}

FR_EXPORT frStatus frPlanDestroy(frPlan plan) {
  return guarded([&] { return plan ? Handles::instance().remove_plan(value_of(plan), "plan") : fr::Status::Ok(); });
}

FR_EXPORT frStatus frAppendKV(frContext context, void* k_pool, void* v_pool, const void* slots, const void* k_new,
                              const void* v_new, int64_t num_tokens, int32_t num_kv_heads, int32_t head_dim,
                              void* stream) {
  return with_context(context, [&](fr::Context& ctx) {
    const uint64_t pointers[] = {address(k_pool), address(v_pool), address(slots), address(k_new), address(v_new)};
    return fr::append_kv(ctx, pointers, num_tokens, num_kv_heads, head_dim, stream_of(stream));
  });
}

FR_EXPORT frStatus frPagedDecodeWorkspaceSize(frContext context, const frAttentionShape* shape, int32_t num_seqs,
                                              int32_t max_blocks, size_t* bytes) {
  return with_context(context, [&](fr::Context& ctx) {
    fr::AttentionShape s;
    fr::Status st = bytes ? to_shape(shape, &s) : invalid("bytes must not be NULL");
    return st.ok() ? fr::paged_decode_workspace(ctx, s, num_seqs, max_blocks, bytes) : st;
  });
}

FR_EXPORT frStatus frPagedDecode(frContext context, const frAttentionShape* shape, const void* q, const void* k_pool,
                                 const void* v_pool, const void* block_tables, const void* seq_lens, int32_t num_seqs,
                                 int32_t max_blocks, void* out, void* workspace, size_t workspace_bytes, void* stream) {
  return with_context(context, [&](fr::Context& ctx) {
    fr::AttentionShape s;
    fr::Status st = to_shape(shape, &s);
    if (!st.ok()) return st;
    const uint64_t pointers[] = {address(q),        address(k_pool), address(v_pool), address(block_tables),
                                 address(seq_lens), address(out)};
    return fr::paged_decode(ctx, s, num_seqs, max_blocks, pointers, address(workspace), workspace_bytes,
                            fr::DecodeOptions(), stream_of(stream));
  });
}

FR_EXPORT frStatus frDeviceAlloc(frContext context, size_t bytes, void** ptr) {
  return with_context(context, [&](fr::Context& ctx) {
    if (!ptr) return invalid("ptr must not be NULL");
    fr::CUdeviceptr p = 0;
    fr::Status st = ctx.alloc(bytes, &p);
    if (st.ok()) *ptr = reinterpret_cast<void*>(p);
    return st;
  });
}

FR_EXPORT frStatus frDeviceFree(frContext context, void* ptr) {
  return with_context(context, [&](fr::Context& ctx) { return ctx.free(reinterpret_cast<fr::CUdeviceptr>(ptr)); });
}

FR_EXPORT frStatus frCopyToDevice(frContext context, void* dst, const void* src, size_t bytes) {
  return with_context(context, [&](fr::Context& ctx) {
    if ((!dst || !src) && bytes) return invalid("dst and src must not be NULL");
    return ctx.copy_to_device(reinterpret_cast<fr::CUdeviceptr>(dst), src, bytes);
  });
}

FR_EXPORT frStatus frCopyToHost(frContext context, void* dst, const void* src, size_t bytes) {
  return with_context(context, [&](fr::Context& ctx) {
    if ((!dst || !src) && bytes) return invalid("dst and src must not be NULL");
    return ctx.copy_to_host(dst, reinterpret_cast<fr::CUdeviceptr>(src), bytes);
  });
}

FR_EXPORT frStatus frStreamSynchronize(frContext context, void* stream) {
  return with_context(context, [&](fr::Context& ctx) { return ctx.synchronize(stream_of(stream)); });
}
