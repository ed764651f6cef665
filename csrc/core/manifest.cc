#include "manifest.h"

#include <cctype>
#include <climits>
#include <cmath>
#include <unordered_set>

#include "file_util.h"
#include "json.h"

namespace flash_reasoning {

bool parse_param_type(const std::string& type, ParamType* out) {
  if (!type.empty() && type[0] == '*') { *out = {ParamKind::kPointer, 8}; return true; }
  // Triton passes i1 as a byte. Scalar fp16/bf16 are not supported (never used by our kernels).
  static const struct { const char* name; ParamType type; } kTable[] = {
      {"i1", {ParamKind::kUnsigned, 1}}, {"i8", {ParamKind::kSigned, 1}},
      {"i16", {ParamKind::kSigned, 2}},  {"i32", {ParamKind::kSigned, 4}},
      {"i64", {ParamKind::kSigned, 8}},  {"u8", {ParamKind::kUnsigned, 1}},
      {"u16", {ParamKind::kUnsigned, 2}}, {"u32", {ParamKind::kUnsigned, 4}},
      {"u64", {ParamKind::kUnsigned, 8}}, {"fp32", {ParamKind::kFloat, 4}},
      {"fp64", {ParamKind::kFloat, 8}},
  };
  for (const auto& row : kTable)
    if (type == row.name) { *out = row.type; return true; }
  return false;
}

namespace {

// Field readers: each names the offending field ("kernels[2].num_warps") in its error.
class Validator {
 public:
  explicit Validator(const std::string& path) : path_(path) {}

  Status error(const std::string& field, const std::string& problem) const {
    return Status::Error(Code::kInvalidManifest, "invalid manifest " + path_ + ": field '" + field + "' " + problem);
  }

  Status member(const JsonValue& obj, const std::string& key, const std::string& where,
                const JsonValue** out) const {
    *out = obj.find(key);
    return *out ? Status::Ok() : error(where + key, "is missing");
  }

  Status string(const JsonValue& obj, const std::string& key, const std::string& where, std::string* out) const {
    const JsonValue* v;
    Status st = member(obj, key, where, &v);
    if (!st.ok()) return st;
    if (!v->is_string() || v->string.empty()) return error(where + key, "must be a non-empty string");
    *out = v->string;
    return Status::Ok();
  }

  Status integer(const JsonValue& obj, const std::string& key, const std::string& where, int lo, int hi,
                 int* out) const {
    const JsonValue* v;
    Status st = member(obj, key, where, &v);
    if (!st.ok()) return st;
    if (!v->is_number() || v->number != std::floor(v->number) || v->number < lo || v->number > hi)
      return error(where + key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    *out = static_cast<int>(v->number);
    return Status::Ok();
  }

 private:
  std::string path_;
};

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

// The cubin must stay inside the arch folder.
bool is_safe_relative(const std::string& p) { return p[0] != '/' && p.find("..") == std::string::npos; }

Status parse_params(const Validator& v, const JsonValue& kernel, const std::string& where, KernelInfo* k) {
  const JsonValue* params;
  Status st = v.member(kernel, "params", where, &params);
  if (!st.ok()) return st;
  if (!params->is_array() || params->items.size() < 2 || params->items.size() > kMaxKernelParams)
    return v.error(where + "params", "must be an array of 2.." + std::to_string(kMaxKernelParams) +
                                         " entries (the last two are Triton's scratch pointers)");
  size_t n = params->items.size();
  for (size_t i = 0; i < n; ++i) {
    std::string at = where + "params[" + std::to_string(i) + "].";
    ParamInfo p;
    if (!(st = v.string(params->items[i], "name", at, &p.name)).ok()) return st;
    if (!(st = v.string(params->items[i], "type", at, &p.type)).ok()) return st;
    if (!parse_param_type(p.type, &p.packed))
      return v.error(at + "type", "has unsupported type '" + p.type + "'");
    bool scratch = i + 2 >= n;
    if (scratch && p.packed.kind != ParamKind::kPointer)
      return v.error(at + "type", "must be a pointer (Triton scratch parameter), got '" + p.type + "'");
    if (!scratch) k->params.push_back(std::move(p));
  }
  return Status::Ok();
}

Status parse_kernel(const Validator& v, const JsonValue& obj, const std::string& where, KernelInfo* k) {
  if (!obj.is_object()) return v.error(where.substr(0, where.size() - 1), "must be an object");
  Status st;
  if (!(st = v.string(obj, "name", where, &k->name)).ok()) return st;
  if (!(st = v.string(obj, "entry", where, &k->entry)).ok()) return st;
  if (!(st = v.string(obj, "cubin", where, &k->cubin)).ok()) return st;
  if (!is_safe_relative(k->cubin)) return v.error(where + "cubin", "must be a path inside the arch folder");
  if (!(st = v.string(obj, "sha256", where, &k->sha256)).ok()) return st;
  if (!is_sha256_hex(k->sha256)) return v.error(where + "sha256", "must be 64 hex digits");
  for (char& c : k->sha256) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!(st = v.integer(obj, "num_warps", where, 1, 32, &k->num_warps)).ok()) return st;
  if (!(st = v.integer(obj, "shared", where, 0, INT_MAX, &k->shared)).ok()) return st;
  const JsonValue* family = obj.find("kernel");
  if (family && family->is_string()) k->family = family->string;
  return parse_params(v, obj, where, k);
}

}  // namespace

Status load_manifest(const std::string& arch_dir, Manifest* out) {
  std::string path = join_path(arch_dir, "manifest.json");
  std::string text;
  Status st = read_file(path, "manifest", &text);
  if (!st.ok()) return st;
  JsonValue root;
  st = parse_json(text, &root);
  if (!st.ok()) return Status::Error(Code::kInvalidManifest, "invalid manifest " + path + ": " + st.message);
  Validator v(path);
  if (!root.is_object()) return v.error("(root)", "must be an object");

  int format = 0;
  if (!(st = v.integer(root, "format", "", 1, 1, &format)).ok()) return st;
  *out = Manifest();
  out->dir = arch_dir;
  if (!(st = v.string(root, "arch", "", &out->arch)).ok()) return st;
  const JsonValue* kernels;
  if (!(st = v.member(root, "kernels", "", &kernels)).ok()) return st;
  if (!kernels->is_array()) return v.error("kernels", "must be an array");

  std::unordered_set<std::string> seen;
  for (size_t i = 0; i < kernels->items.size(); ++i) {
    KernelInfo k;
    std::string where = "kernels[" + std::to_string(i) + "].";
    if (!(st = parse_kernel(v, kernels->items[i], where, &k)).ok()) return st;
    if (!seen.insert(k.name).second) return v.error(where + "name", "duplicates '" + k.name + "'");
    out->kernels.push_back(std::move(k));
  }
  return Status::Ok();
}

}  // namespace flash_reasoning
