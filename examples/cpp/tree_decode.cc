// tree_decode: tree attention from C++ through the C ABI alone (no CUDA headers, no Python).
//
//   tree_decode <artifact_root> <reference.bin>
//
// artifact_root is the package's flash_reasoning/_artifacts (`python -m flash_reasoning.capi`
// prints it); reference.bin comes from make_reference.py next to this file, whose docstring
// documents the file format and the block layout this program rebuilds its tables from.
//
// Steps: upload the pools and q, plan the tree (a 2048-token root shared by 64 branches),
// run and check against the float64 reference, time back-to-back runs, then one real decode
// step: append one token per branch (frAppendKV), update the plan to the longer tree
// (frPlanUpdate, no re-plan) and check again. Exits 1 when a check or a call fails.
#include <flash_reasoning/flash_reasoning.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int kTimedRuns = 200;
constexpr int kWarmupRuns = 10;
constexpr int32_t kExtraBlocks = 1;  // table room for the block the decode step may add
constexpr char kMagic[8] = {'F', 'R', 'T', 'D', 'R', 'E', 'F', '\0'};
constexpr int32_t kVersion = 1;

// The file's header (make_reference.py's HEADER): packed, little-endian.
#pragma pack(push, 1)
struct Header {
  char magic[8];
  int32_t version, dtype, num_branches, root_tokens, leaf_tokens, block_size;
  int32_t num_qo_heads, num_kv_heads, head_dim, num_blocks, first_block;
  float tolerance;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 56, "Header must match make_reference.py's struct");

using Half = uint16_t;  // float16 bits: the host never computes with them

struct Reference {
  Header h;
  std::vector<Half> k_pool, v_pool, q, k_new, v_new, q_next;
  std::vector<float> expected, expected_next;

  size_t q_elems() const { return size_t(h.num_branches) * h.num_qo_heads * h.head_dim; }
  size_t kv_row_elems() const { return size_t(h.num_kv_heads) * h.head_dim; }
  size_t pool_elems() const { return size_t(h.num_blocks) * h.block_size * kv_row_elems(); }
};

void check(frStatus status, const char* call) {
  if (status != FR_OK)
    throw std::runtime_error(std::string(call) + " failed: " + frStatusName(status) + ": " + frGetLastError());
}

template <typename T>
void read_array(std::ifstream& in, size_t count, std::vector<T>* out) {
  out->resize(count);
  if (!in.read(reinterpret_cast<char*>(out->data()), std::streamsize(count * sizeof(T))))
    throw std::runtime_error("reference file ends early");
}

Reference read_reference(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot open ") + path);
  Reference r;
  if (!in.read(reinterpret_cast<char*>(&r.h), sizeof r.h) || std::memcmp(r.h.magic, kMagic, 8) ||
      r.h.version != kVersion)
    throw std::runtime_error(std::string(path) + " is not a version 1 reference file (make_reference.py)");
  if (r.h.dtype != FR_FLOAT16 || r.h.root_tokens % r.h.block_size)
    throw std::runtime_error("this example expects float16 and a root ending on a block boundary");
  read_array(in, r.pool_elems(), &r.k_pool);
  read_array(in, r.pool_elems(), &r.v_pool);
  read_array(in, r.q_elems(), &r.q);
  read_array(in, r.q_elems(), &r.expected);
  read_array(in, r.h.num_branches * r.kv_row_elems(), &r.k_new);
  read_array(in, r.h.num_branches * r.kv_row_elems(), &r.v_new);
  read_array(in, r.q_elems(), &r.q_next);
  read_array(in, r.q_elems(), &r.expected_next);
  if (in.peek() != std::char_traits<char>::eof())
    throw std::runtime_error("reference file is longer than its header says");
  return r;
}

int32_t blocks_for(int64_t tokens, int32_t block_size) { return int32_t((tokens + block_size - 1) / block_size); }

// The tables of make_reference.py's layout after `decoded` decode steps: the root's blocks
// shared by every branch, then each branch's own, then the blocks decoding added (one per
// branch per new column, in branch order, as the allocator hands them out).
struct TreeTables {
  std::vector<int32_t> lengths, tables;
  int32_t stride = 0;

  frTree tree() const { return {int32_t(lengths.size()), lengths.data(), tables.data(), stride}; }
};

TreeTables layout_tables(const Header& h, int decoded) {
  int32_t root = h.root_tokens / h.block_size, leaf = blocks_for(h.leaf_tokens, h.block_size);
  int32_t length = h.root_tokens + h.leaf_tokens + decoded;
  TreeTables t;
  t.stride = blocks_for(length, h.block_size);
  t.lengths.assign(h.num_branches, length);
  t.tables.resize(size_t(h.num_branches) * t.stride);
  for (int32_t b = 0; b < h.num_branches; ++b)
    for (int32_t j = 0; j < t.stride; ++j)
      t.tables[size_t(b) * t.stride + j] =
          h.first_block + (j < root          ? j
                           : j < root + leaf ? root + b * leaf + (j - root)
                                             : root + h.num_branches * leaf + (j - root - leaf) * h.num_branches + b);
  return t;
}

// Where each branch's next token goes: its flat slot (block * block_size + offset).
std::vector<int64_t> next_slots(const Header& h, const TreeTables& grown) {
  std::vector<int64_t> slots(h.num_branches);
  for (int32_t b = 0; b < h.num_branches; ++b) {
    int64_t position = grown.lengths[b] - 1;
    slots[b] = int64_t(grown.tables[size_t(b) * grown.stride + position / h.block_size]) * h.block_size +
               position % h.block_size;
  }
  return slots;
}

float half_to_float(Half bits) {
  uint32_t sign = uint32_t(bits >> 15) << 31, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return (sign ? -1.f : 1.f) * (mantissa ? NAN : INFINITY);
  float magnitude = exponent ? std::ldexp(float(mantissa | 0x400), int(exponent) - 25)
                             : std::ldexp(float(mantissa), -24);  // subnormal
  return sign ? -magnitude : magnitude;
}

// ||out - ref|| / ||ref|| as reference.relative_error: NaN or inf anywhere gives inf.
double relative_error(const std::vector<Half>& out, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    double value = half_to_float(out[i]);
    if (!std::isfinite(value)) return INFINITY;
    diff += (value - ref[i]) * (value - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Device memory owned through the C ABI.
class DeviceBuffer {
 public:
  DeviceBuffer(frContext ctx, size_t bytes) : ctx_(ctx) { check(frDeviceAlloc(ctx, bytes, &ptr_), "frDeviceAlloc"); }
  template <typename T>
  DeviceBuffer(frContext ctx, const std::vector<T>& host) : DeviceBuffer(ctx, host.size() * sizeof(T)) {
    upload(host);
  }
  ~DeviceBuffer() { frDeviceFree(ctx_, ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  void upload(const std::vector<T>& host) {
    check(frCopyToDevice(ctx_, ptr_, host.data(), host.size() * sizeof(T)), "frCopyToDevice");
  }
  template <typename T>
  void download(std::vector<T>* host) const {
    check(frCopyToHost(ctx_, host->data(), ptr_, host->size() * sizeof(T)), "frCopyToHost");
  }
  void* get() const { return ptr_; }

 private:
  frContext ctx_;
  void* ptr_ = nullptr;
};

struct Context {
  frContext handle = nullptr;
  explicit Context(const char* artifact_root) { check(frContextCreate(artifact_root, 0, &handle), "frContextCreate"); }
  ~Context() { frContextDestroy(handle); }
};

struct Plan {
  frPlan handle = nullptr;
  Plan(frContext ctx, const frAttentionShape& shape, const frTree& tree) {
    check(frPlanCreate(ctx, &shape, &tree, kExtraBlocks, &handle), "frPlanCreate");
  }
  ~Plan() { frPlanDestroy(handle); }
};

struct Buffers {
  DeviceBuffer k_pool, v_pool, q, out;
};

// Runs the plan on q into an output poisoned with NaN (an unwritten row fails the check) and
// returns the relative error against `expected`.
double run_and_check(frContext ctx, const Plan& plan, Buffers& d, const std::vector<Half>& q,
                     const std::vector<float>& expected) {
  std::vector<Half> out(expected.size(), Half(0x7e00));  // float16 NaN
  d.q.upload(q);
  d.out.upload(out);
  check(frPlanRun(plan.handle, d.q.get(), d.k_pool.get(), d.v_pool.get(), d.out.get(), nullptr), "frPlanRun");
  check(frStreamSynchronize(ctx, nullptr), "frStreamSynchronize");
  d.out.download(&out);
  return relative_error(out, expected);
}

double microseconds_per_run(frContext ctx, const Plan& plan, Buffers& d) {
  auto run = [&] {
    check(frPlanRun(plan.handle, d.q.get(), d.k_pool.get(), d.v_pool.get(), d.out.get(), nullptr), "frPlanRun");
  };
  for (int i = 0; i < kWarmupRuns; ++i) run();
  check(frStreamSynchronize(ctx, nullptr), "frStreamSynchronize");
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kTimedRuns; ++i) run();
  check(frStreamSynchronize(ctx, nullptr), "frStreamSynchronize");
  std::chrono::duration<double, std::micro> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / kTimedRuns;
}

bool report(const char* what, double error, float tolerance) {
  bool ok = error < tolerance;
  std::printf("%-24s relative error %.3e (tolerance %.0e): %s\n", what, error, tolerance, ok ? "PASS" : "FAIL");
  return ok;
}

void print_plan(const Plan& plan) {
  frPlanInfo info;
  check(frPlanGetInfo(plan.handle, &info), "frPlanGetInfo");
  std::printf(
      "plan: %d branches, %d nodes (%d computed once), %d launches, %lld unique / %lld logical tokens, "
      "%zu workspace bytes\n",
      info.num_branches, info.num_nodes, info.computed_nodes, info.num_launches,
      static_cast<long long>(info.unique_tokens), static_cast<long long>(info.logical_tokens), info.workspace_bytes);
}

// One decode step: each branch's new token written where the layout puts it, the plan moved
// to the longer tree without re-planning.
void decode_step(frContext ctx, Plan& plan, const Reference& r, Buffers& d) {
  TreeTables grown = layout_tables(r.h, 1);
  DeviceBuffer slots(ctx, next_slots(r.h, grown)), k_new(ctx, r.k_new), v_new(ctx, r.v_new);
  check(frAppendKV(ctx, d.k_pool.get(), d.v_pool.get(), slots.get(), k_new.get(), v_new.get(), r.h.num_branches,
                   r.h.num_kv_heads, r.h.head_dim, nullptr),
        "frAppendKV");
  frTree tree = grown.tree();
  check(frPlanUpdate(plan.handle, &tree, nullptr), "frPlanUpdate");
  check(frStreamSynchronize(ctx, nullptr), "frStreamSynchronize");  // before the slots and tokens are freed
}

bool run_example(const char* artifact_root, const char* reference_path) {
  Reference r = read_reference(reference_path);
  Context ctx(artifact_root);
  const char* arch = nullptr;
  check(frContextArch(ctx.handle, &arch), "frContextArch");
  std::printf("flash-reasoning %s, arch %s; %d branches of %d + %d tokens, block_size %d, %d/%d heads, head_dim %d\n",
              frVersion(), arch, r.h.num_branches, r.h.root_tokens, r.h.leaf_tokens, r.h.block_size, r.h.num_qo_heads,
              r.h.num_kv_heads, r.h.head_dim);
  Buffers d{{ctx.handle, r.k_pool}, {ctx.handle, r.v_pool}, {ctx.handle, r.q}, {ctx.handle, r.q.size() * sizeof(Half)}};
  frAttentionShape shape = {r.h.num_qo_heads, r.h.num_kv_heads, r.h.head_dim, FR_FLOAT16,
                            r.h.block_size,   r.h.num_blocks,   0.f};
  TreeTables initial = layout_tables(r.h, 0);
  Plan plan(ctx.handle, shape, initial.tree());
  print_plan(plan);

  bool ok = report("step 1 (planned)", run_and_check(ctx.handle, plan, d, r.q, r.expected), r.h.tolerance);
  std::printf("time: %.2f us per step (one layer, %d back-to-back frPlanRun, L2 warm)\n",
              microseconds_per_run(ctx.handle, plan, d), kTimedRuns);
  decode_step(ctx.handle, plan, r, d);
  ok &= report("step 2 (appended, updated)", run_and_check(ctx.handle, plan, d, r.q_next, r.expected_next),
               r.h.tolerance);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <artifact_root> <reference.bin>   (libflash_reasoning %s)\n", argv[0], frVersion());
    return 2;
  }
  try {
    bool ok = run_example(argv[1], argv[2]);
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tree_decode: %s\n", e.what());
    return 1;
  }
}
