#include "runtime/launch_sequence.h"

#include <algorithm>
#include <cstdio>

namespace flash_reasoning {
namespace {

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string describe_param(const KernelInfo& k, size_t i) {
  return "argument " + std::to_string(i) + " ('" + k.params[i].name + "', " + k.params[i].type + ")";
}

Status invalid(const std::string& message) { return Status::Error(Code::kInvalidArgument, message); }

Status mismatch(const KernelInfo& k, size_t i, const char* passed, const char* why) {
  return Status::Error(Code::kInvalidManifest, "kernel '" + k.name + "' parameter " + std::to_string(i) + " is '" +
                                                   (i < k.params.size() ? k.params[i].name : std::string("(none)")) +
                                                   "', the library passes '" + passed + "'" + why +
                                                   ": artifacts and library differ");
}

}  // namespace

LaunchArg LaunchArg::Value(const char* name, Arg value) {
  LaunchArg a;
  a.name = name, a.value = value;
  return a;
}

LaunchArg LaunchArg::Call(const char* name, int64_t index, int64_t rows, int64_t cols) {
  LaunchArg a;
  a.name = name, a.source = Source::kCall, a.index = index, a.rows = rows, a.cols = cols;
  return a;
}

LaunchArg LaunchArg::Workspace(const char* name, int64_t offset) {
  LaunchArg a;
  a.name = name, a.source = Source::kWorkspace, a.index = offset;
  return a;
}

Status bind_launch(const KernelInfo& k, const KernelLaunch& launch, uint64_t workspace, SequenceLaunch* out) {
  out->kernel = launch.kernel;
  std::copy(launch.grid, launch.grid + 3, out->grid);
  out->args.clear();
  for (const LaunchArg& a : launch.args) {
    size_t i = out->args.size();
    if (i >= k.params.size() || k.params[i].name != a.name) return mismatch(k, i, a.name, "");
    if (a.source == LaunchArg::Source::kCall)
      out->args.push_back(SequenceArg::Hole(int(a.index)));
    else if (a.source == LaunchArg::Source::kWorkspace)
      out->args.push_back(SequenceArg::Value(Arg::UInt(workspace + uint64_t(a.index))));
    else
      out->args.push_back(SequenceArg::Value(a.value));
    if (k.params[i].packed.kind != ParamKind::kTensorMap) continue;
    if (a.rows <= 0) return mismatch(k, i, a.name, " with no view for its TMA descriptor");
    for (int64_t field : {a.rows, a.cols, a.cols, int64_t(1)}) out->args.push_back(SequenceArg::Value(Arg::Int(field)));
  }
  return Status::Ok();
}

Status LaunchSequence::prepare(Launcher* launcher, const std::vector<SequenceLaunch>& launches,
                               std::vector<std::string> holes, std::unique_ptr<LaunchSequence>* out) {
  if (holes.size() > kMaxHoles)
    return invalid("a prepared sequence takes at most " + std::to_string(kMaxHoles) + " pointers, got " +
                   std::to_string(holes.size()));
  std::unique_ptr<LaunchSequence> seq(new LaunchSequence(launcher, std::move(holes)));
  for (size_t i = 0; i < launches.size(); ++i) {
    Status st = seq->add(launches[i]);
    if (!st.ok()) {
      // Which launch failed: the kernel name alone is ambiguous when a sequence repeats one.
      st.message =
          "prepared launch " + std::to_string(i) + " of " + std::to_string(launches.size()) + ": " + st.message;
      return st;
    }
  }
  *out = std::move(seq);
  return Status::Ok();
}

// Packs through the launcher (holes hold 0 meanwhile), then checks what only a sequence has.
Status LaunchSequence::add(const SequenceLaunch& launch) {
  std::vector<Arg> values(launch.args.size());
  std::transform(launch.args.begin(), launch.args.end(), values.begin(),
                 [](const SequenceArg& a) { return a.hole < 0 ? a.value : Arg::Int(0); });
  Step step;
  step.kernel = launch.kernel;
  std::copy(launch.grid, launch.grid + 3, step.grid);
  step.slots.resize(kMaxKernelParams);
  bool empty = false;
  Status st =
      launcher_->pack_launch(launch.kernel, launch.grid, values.data(), values.size(), step.slots.data(), &empty);
  if (!st.ok()) return st;
  const KernelInfo& k = launcher_->manifest().kernels[launch.kernel];
  for (size_t i = 0; i < launch.args.size(); ++i) {
    const SequenceArg& a = launch.args[i];
    if (!(st = check_arg(k, i, a, step.slots.data())).ok()) return st;
    if (a.hole < 0) continue;
    step.fills.emplace_back(i, a.hole);
    if (first_use_[a.hole].empty())
      first_use_[a.hole] = "argument '" + k.params[i].name + "' of kernel '" + k.name + "'";
  }
  step.slots.resize(k.params.size() + 2);         // the params, then Triton's two scratch pointers
  if (!empty) steps_.push_back(std::move(step));  // an empty grid is no work: nothing to run
  return Status::Ok();
}

// A hole must name a pointer parameter; a fixed pointer must be as aligned as a filled one.
Status LaunchSequence::check_arg(const KernelInfo& k, size_t i, const SequenceArg& a, const uint64_t* slots) const {
  // A tensor map's parameter takes its base address, a pointer like any other.
  bool pointer = k.params[i].packed.kind == ParamKind::kPointer || k.params[i].packed.kind == ParamKind::kTensorMap;
  auto where = [&] { return "kernel '" + k.name + "': " + describe_param(k, i); };
  if (a.hole < -1 || (a.hole >= 0 && size_t(a.hole) >= holes_.size()))
    return invalid(where() + " takes pointer " + std::to_string(a.hole) + ", but the sequence has " +
                   std::to_string(holes_.size()) + " pointers");
  if (a.hole >= 0 && !pointer) return invalid(where() + " cannot be a per-run pointer: it is not a pointer parameter");
  if (a.hole < 0 && pointer && slots[i] % kPointerAlign)
    return invalid(where() + " is " + hex(slots[i]) + ", not " + std::to_string(kPointerAlign) +
                   "-byte aligned (the kernels assume it)");
  return Status::Ok();
}

Status LaunchSequence::check_count(size_t num_pointers) const {
  if (num_pointers == holes_.size()) return Status::Ok();
  std::string names;
  for (const std::string& h : holes_) names += (names.empty() ? "" : ", ") + h;
  return invalid("the prepared launches take " + std::to_string(holes_.size()) + " pointers (" + names + "), got " +
                 std::to_string(num_pointers));
}

Status LaunchSequence::run(const uint64_t* pointers, size_t num_pointers, CUstream stream) const {
  Status st = check_count(num_pointers);
  for (size_t h = 0; st.ok() && h < num_pointers; ++h) st = check_pointer(h, pointers[h]);
  if (!st.ok()) return st;
  uint64_t slots[kMaxKernelParams];  // a copy per launch: concurrent runs never share slots
  for (const Step& s : steps_) {
    std::copy(s.slots.begin(), s.slots.end(), slots);
    for (const auto& [slot, hole] : s.fills) slots[slot] = pointers[hole];
    bool after_own_launch = &s != &steps_.front();  // a kernel that waits may overlap it
    if (!(st = launcher_->launch_packed(s.kernel, s.grid, slots, stream, after_own_launch)).ok()) return st;
  }
  return Status::Ok();
}

Status LaunchSequence::check_pointer(size_t hole, uint64_t value) const {
  if (value != 0 && value % kPointerAlign == 0) return Status::Ok();
  std::string what = "pointer " + std::to_string(hole) + " ('" + holes_[hole] + "'" +
                     (first_use_[hole].empty() ? "" : ", passed as " + first_use_[hole]) + ")";
  if (value == 0) return invalid(what + " is null");
  return invalid(what + " is " + hex(value) + ", not " + std::to_string(kPointerAlign) +
                 "-byte aligned (the kernels assume it)");
}

}  // namespace flash_reasoning
