// The handles the C ABI issues: numbers naming live objects in a registry, never addresses.
// Every call finds its handles here before it touches anything, so a destroyed, doubly
// destroyed, foreign or garbage handle is an error that says which, never a dereference.
#pragma once

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops/tree_attention_plan.h"
#include "runtime/context.h"
#include "util/status.h"

namespace flash_reasoning {
namespace capi {

struct ContextObject {
  std::unique_ptr<Context> core;
};

struct PlanObject {
  // Declared before `core`, so destroyed after it: a plan frees its device memory through its
  // context, which the plan keeps alive until then.
  std::shared_ptr<ContextObject> context;
  uint64_t context_handle = 0;
  std::unique_ptr<TreeAttentionPlan> core;
};

// A handle's 64 bits, high to low: kMark (4 bits; a non-canonical address on x86-64 and
// AArch64, so no pointer a caller holds equals a handle), this copy of the library's tag (20
// bits: a handle of another copy loaded in the process is foreign here), the object's serial
// number (36 bits, never reused: a destroyed handle never names a newer object) and its kind.
enum class Kind : uint64_t { kContext = 1, kPlan = 2 };

class Handles {
 public:
  // One registry per copy of the library, never destroyed: a C++ caller's static destructor
  // may still destroy its handles after this library's statics are gone.
  static Handles& instance() {
    static Handles* registry = new Handles();
    return *registry;
  }

  Status add_context(std::unique_ptr<Context> core, uint64_t* handle) {
    auto object = std::make_shared<ContextObject>();
    object->core = std::move(core);
    std::lock_guard<std::mutex> lock(mutex_);
    Status st = issue(Kind::kContext, handle);
    if (st.ok()) contexts_.emplace(*handle, std::move(object));
    return st;
  }

  // Refused when the context was destroyed since `context` was found (by another thread).
  Status add_plan(uint64_t context_handle, std::shared_ptr<ContextObject> context,
                  std::unique_ptr<TreeAttentionPlan> core, uint64_t* handle) {
    auto object = std::make_shared<PlanObject>();
    object->context = std::move(context);
    object->context_handle = context_handle;
    object->core = std::move(core);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!contexts_.count(context_handle)) return dead(context_handle, Kind::kContext, "context");
    Status st = issue(Kind::kPlan, handle);
    if (st.ok()) plans_.emplace(*handle, std::move(object));
    return st;  // a refused plan is destroyed on return, after the lock
  }

  // The live object `handle` names; `name` is the argument's, for errors.
  Status find_context(uint64_t handle, const char* name, std::shared_ptr<ContextObject>* out) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = contexts_.find(handle);
    if (it == contexts_.end()) return dead(handle, Kind::kContext, name);
    *out = it->second;
    return Status::Ok();
  }

  Status find_plan(uint64_t handle, const char* name, std::shared_ptr<PlanObject>* out) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(handle);
    if (it == plans_.end()) return dead(handle, Kind::kPlan, name);
    *out = it->second;
    return Status::Ok();
  }

  // Ends a context and every plan made from it. The objects are freed after the lock is
  // released (freeing calls the driver), and once no call in flight on another thread holds them.
  Status remove_context(uint64_t handle, const char* name) {
    std::shared_ptr<ContextObject> context;  // declared before the lock: released after it
    std::vector<std::shared_ptr<PlanObject>> plans;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = contexts_.find(handle);
    if (it == contexts_.end()) return dead(handle, Kind::kContext, name);
    size_t count = 0;
    for (const auto& plan : plans_) count += plan.second->context_handle == handle;
    plans.reserve(count);  // the only allocation: if it fails, nothing has changed
    for (auto p = plans_.begin(); p != plans_.end();) {
      if (p->second->context_handle != handle) {
        ++p;
        continue;
      }
      plans.push_back(std::move(p->second));
      p = plans_.erase(p);
    }
    context = std::move(it->second);
    contexts_.erase(it);
    return Status::Ok();
  }

  Status remove_plan(uint64_t handle, const char* name) {
    std::shared_ptr<PlanObject> plan;  // declared before the lock: released after it
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(handle);
    if (it == plans_.end()) return dead(handle, Kind::kPlan, name);
    plan = std::move(it->second);
    plans_.erase(it);
    return Status::Ok();
  }

 private:
  static constexpr uint64_t kMark = uint64_t(0xF) << 60;
  static constexpr int kTagShift = 40, kSerialShift = 4;
  static constexpr uint64_t kTagMask = (uint64_t(1) << 20) - 1, kSerialMask = (uint64_t(1) << 36) - 1;

  // The tag: the registry's address (where this copy was loaded) and the time, mixed.
  Handles() {
    uint64_t x =
        reinterpret_cast<uintptr_t>(this) ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;  // splitmix64's finaliser
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    tag_ = (x ^ (x >> 31)) & kTagMask;
  }

  Status issue(Kind kind, uint64_t* handle) {
    if (next_serial_ > kSerialMask)
      return Status::Error(Code::kOutOfMemory, "this process has created 2^36 contexts and plans: no handles left");
    *handle = kMark | tag_ << kTagShift | next_serial_++ << kSerialShift | uint64_t(kind);
    return Status::Ok();
  }

  // Why `handle`, passed as argument `name` of kind `want`, names no live object.
  Status dead(uint64_t handle, Kind want, const char* name) const {
    char hex[24];
    std::snprintf(hex, sizeof hex, "0x%016" PRIx64, handle);
    std::string what = std::string(name) + " " + hex;
    if (!handle) return Status::Error(Code::kInvalidArgument, std::string(name) + " must not be NULL");
    uint64_t serial = handle >> kSerialShift & kSerialMask;
    uint64_t kind = handle & 0xF;
    bool ours = (handle & kMark) == kMark && (handle >> kTagShift & kTagMask) == tag_ && serial >= 1 &&
                serial < next_serial_ && (kind == uint64_t(Kind::kContext) || kind == uint64_t(Kind::kPlan));
    std::string why;
    if (!ours)
      why = "is not a handle this library issued (a garbage value, or a handle of another copy of the library)";
    else if (kind != uint64_t(want))
      why = want == Kind::kPlan ? "is a context handle, not a plan" : "is a plan handle, not a context";
    else if (want == Kind::kPlan)
      why = "was destroyed (by frPlanDestroy, or with its context by frContextDestroy)";
    else
      why = "was destroyed (by frContextDestroy)";
    return Status::Error(Code::kInvalidArgument, what + " " + why);
  }

  mutable std::mutex mutex_;
  uint64_t tag_ = 0;
  uint64_t next_serial_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<ContextObject>> contexts_;
  std::unordered_map<uint64_t, std::shared_ptr<PlanObject>> plans_;
};

}  // namespace capi
}  // namespace flash_reasoning
