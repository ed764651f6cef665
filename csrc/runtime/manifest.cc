#include "runtime/manifest.h"

#include <cctype>
#include <climits>
#include <cmath>
#include <unordered_set>

#include "util/file_util.h"
#include "util/json.h"

namespace flash_reasoning {

bool parse_param_type(const std::string& type, ParamType* out) {
  if (!type.empty() && type[0] == '*') {
    *out = {ParamKind::kPointer, 8};
    return true;
  }
  if (type == "nvTmaDesc") {
    *out = {ParamKind::kTensorMap, 128};
    return true;
  }
  // Triton passes i1 as a byte. Scalar fp16/bf16 are not supported (never used by our kernels).
  static const struct {
    const char* name;
    ParamType type;
  } kTable[] = {
      {"i1", {ParamKind::kUnsigned, 1}},  {"i8", {ParamKind::kSigned, 1}},    {"i16", {ParamKind::kSigned, 2}},
      {"i32", {ParamKind::kSigned, 4}},   {"i64", {ParamKind::kSigned, 8}},   {"u8", {ParamKind::kUnsigned, 1}},
      {"u16", {ParamKind::kUnsigned, 2}}, {"u32", {ParamKind::kUnsigned, 4}}, {"u64", {ParamKind::kUnsigned, 8}},
      {"fp32", {ParamKind::kFloat, 4}},   {"fp64", {ParamKind::kFloat, 8}},
  };
  for (const auto& row : kTable)
    if (type == row.name) {
      *out = row.type;
      return true;
    }
  return false;
}

namespace {

// A manifest is read whole into memory: a hundred times what a build writes (about 600 KB an arch)
// is no manifest.
constexpr size_t kMaxManifestBytes = size_t(64) << 20;

// Field readers: each names the offending field ("kernels[2].num_warps") in its error.
class Validator {
 public:
  explicit Validator(const std::string& path) : path_(path) {}

  Status error(const std::string& field, const std::string& problem) const {
    return Status::Error(Code::kInvalidManifest, "invalid manifest " + path_ + ": field '" + field + "' " + problem);
  }

  Status member(const JsonValue& obj, const std::string& key, const std::string& where, const JsonValue** out) const {
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
    if (!v->is_number() || v->number < lo || v->number > hi || v->number != double(int64_t(v->number)))
      return error(where + key, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    *out = static_cast<int>(v->number);
    return Status::Ok();
  }

  // An optional boolean: absent is false (manifests written before the field existed).
  Status optional_flag(const JsonValue& obj, const std::string& key, const std::string& where, bool* out) const {
    const JsonValue* v = obj.find(key);
    if (v && v->kind != JsonValue::Kind::kBool) return error(where + key, "must be true or false");
    *out = v && v->boolean;
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

// A tensor map's "tensor_map": {"data_type", "elem_size", "swizzle", "box": [rows, cols]}.
Status parse_tensor_map(const Validator& v, const JsonValue& param, const std::string& at, ParamInfo* p) {
  const JsonValue* map;
  Status st = v.member(param, "tensor_map", at, &map);
  if (!st.ok()) return st;
  std::string where = at + "tensor_map.";
  if (!map->is_object()) return v.error(at + "tensor_map", "must be an object");
  TensorMapInfo& t = p->tensor_map;
  if (!(st = v.integer(*map, "data_type", where, 0, 15, &t.data_type)).ok()) return st;
  if (!(st = v.integer(*map, "elem_size", where, 1, 8, &t.elem_size)).ok()) return st;
  if (!(st = v.integer(*map, "swizzle", where, 0, 3, &t.swizzle)).ok()) return st;
  const JsonValue* box;
  if (!(st = v.member(*map, "box", where, &box)).ok()) return st;
  bool ok = box->is_array() && box->items.size() == 2;
  for (size_t d = 0; ok && d < 2; ++d) {
    const JsonValue& b = box->items[d];
    ok = b.is_number() && b.number >= 1 && b.number <= 256 && b.number == double(int(b.number));
    if (ok) t.box[d] = int(b.number);
  }
  return ok ? Status::Ok() : v.error(where + "box", "must be [rows, cols], each an integer in [1, 256]");
}

// After a tensor map come its view's shape and strides: i32 rows and cols, i64 strides.
Status check_tensor_map_fields(const Validator& v, const KernelInfo& k, size_t i, const std::string& where) {
  static const char* kTypes[kTensorMapFields] = {"i32", "i32", "i64", "i64"};
  for (int f = 0; f < kTensorMapFields; ++f)
    if (i + 1 + f >= k.params.size() || k.params[i + 1 + f].type != kTypes[f])
      return v.error(where + "params[" + std::to_string(i + 1 + f) + "].type",
                     std::string("must be ") + kTypes[f] + ": tensor map '" + k.params[i].name +
                         "' is followed by its rows, cols (i32), row and column strides (i64)");
  return Status::Ok();
}

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
    if (!parse_param_type(p.type, &p.packed)) return v.error(at + "type", "has unsupported type '" + p.type + "'");
    bool scratch = i + 2 >= n;
    if (scratch && p.packed.kind != ParamKind::kPointer)
      return v.error(at + "type", "must be a pointer (Triton scratch parameter), got '" + p.type + "'");
    if (p.packed.kind == ParamKind::kTensorMap && !(st = parse_tensor_map(v, params->items[i], at, &p)).ok()) return st;
    if (!scratch) k->params.push_back(std::move(p));
  }
  int maps = 0;
  for (size_t i = 0; i < k->params.size(); ++i) {
    if (k->params[i].packed.kind != ParamKind::kTensorMap) continue;
    if (++maps > kMaxTensorMaps)
      return v.error(where + "params", "has more than " + std::to_string(kMaxTensorMaps) + " tensor maps");
    if (!(st = check_tensor_map_fields(v, *k, i, where)).ok()) return st;
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
  if (!(st = v.optional_flag(obj, "overlaps_previous", where, &k->overlaps_previous)).ok()) return st;
  const JsonValue* family = obj.find("kernel");
  if (family && family->is_string()) k->family = family->string;
  const JsonValue* key = obj.find("key");
  for (size_t i = 0; key && key->is_object() && i < key->keys.size(); ++i)
    if (key->items[i].is_number()) k->constexprs[key->keys[i]] = int64_t(key->items[i].number);
  return parse_params(v, obj, where, k);
}

// A rule's bound: a positive number, or null for any (-1).
bool parse_bound(const JsonValue& value, double* bound) {
  if (value.kind == JsonValue::Kind::kNull) {
    *bound = -1;
    return true;
  }
  *bound = value.is_number() ? value.number : 0;
  return value.is_number() && value.number > 0;
}

// One rule list: [[max_programs_per_sm or null, max_tokens or null, kernel name], ...], names
// resolved to indices; it must end with a rule for any launch.
Status parse_rules(const Validator& v, const JsonValue& list, const std::string& where,
                   const std::unordered_map<std::string, int>& index, std::vector<DispatchRule>* out) {
  if (!list.is_array() || list.items.empty()) return v.error(where, "must be a non-empty array");
  for (size_t i = 0; i < list.items.size(); ++i) {
    const JsonValue& rule = list.items[i];
    std::string at = where + "[" + std::to_string(i) + "]";
    DispatchRule parsed;
    double tokens = -1;
    if (!rule.is_array() || rule.items.size() != 3 || !rule.items[2].is_string() ||
        !parse_bound(rule.items[0], &parsed.max_programs_per_sm) || !parse_bound(rule.items[1], &tokens))
      return v.error(at, "must be [max_programs_per_sm or null, max_tokens or null, kernel name], bounds positive");
    auto it = index.find(rule.items[2].string);
    if (it == index.end()) return v.error(at, "names kernel '" + rule.items[2].string + "', not in the manifest");
    parsed.max_tokens = int64_t(tokens);  // -1: any
    parsed.kernel = it->second;
    out->push_back(parsed);
  }
  if (out->back().max_tokens != -1 || out->back().max_programs_per_sm != -1)
    return v.error(where, "must end with a rule for any launch ([null, null, kernel])");
  return Status::Ok();
}

Status parse_dispatch_section(const Validator& v, const JsonValue* dispatch, const std::vector<KernelInfo>& kernels,
                              DispatchTable* out) {
  const JsonValue* rules = dispatch->find("rules");
  const JsonValue* constants = dispatch->find("constants");
  if (!rules || !rules->is_object() || !constants || !constants->is_object())
    return v.error("dispatch", "must be an object with objects 'rules' and 'constants'");
  std::unordered_map<std::string, int> index;
  for (size_t i = 0; i < kernels.size(); ++i) index[kernels[i].name] = int(i);
  for (size_t i = 0; i < rules->keys.size(); ++i) {
    Status st = parse_rules(v, rules->items[i], "dispatch.rules." + rules->keys[i], index, &out->rules[rules->keys[i]]);
    if (!st.ok()) return st;
  }
  for (size_t i = 0; i < constants->keys.size(); ++i) {
    const JsonValue& c = constants->items[i];
    if (!c.is_number() || std::fabs(c.number) > 9e18 || c.number != double(int64_t(c.number)))
      return v.error("dispatch.constants." + constants->keys[i], "must be an integer");
    out->constants[constants->keys[i]] = int64_t(c.number);
  }
  return Status::Ok();
}

Status parse_dispatch(const Validator& v, const JsonValue& root, const std::vector<KernelInfo>& kernels,
                      DispatchTable* out) {
  const JsonValue* dispatch = root.find("dispatch");
  return dispatch ? parse_dispatch_section(v, dispatch, kernels, out) : Status::Ok();
}

}  // namespace

Status parse_dispatch_rules(const std::string& json, const std::vector<KernelInfo>& kernels, DispatchTable* out) {
  JsonValue root;
  Status st = parse_json(json, &root);
  if (!st.ok()) return Status::Error(Code::kInvalidArgument, "invalid dispatch rules: " + st.message);
  if (!root.is_object()) return Status::Error(Code::kInvalidArgument, "dispatch rules must be a JSON object");
  DispatchTable rules;
  if (!(st = parse_dispatch_section(Validator("dispatch rules"), &root, kernels, &rules)).ok()) return st;
  *out = std::move(rules);
  return Status::Ok();
}

bool DispatchRule::serves(int64_t max_tokens, int64_t programs, int64_t num_sms) const {
  bool few_enough = max_programs_per_sm < 0 ||
                    (programs >= 0 && num_sms > 0 && double(programs) <= max_programs_per_sm * double(num_sms));
  return few_enough && (this->max_tokens < 0 || (max_tokens >= 0 && max_tokens <= this->max_tokens));
}

Status DispatchTable::pick(const std::string& key, int64_t max_tokens, int64_t programs, int64_t num_sms,
                           int* kernel) const {
  auto it = rules.find(key);
  if (it == rules.end())
    return Status::Error(Code::kNotFound, "no compiled kernel serves " + key + " (" +
                                              (rules.empty() ? "the manifest has no dispatch rules: rebuild it"
                                                             : "head_dim or dtype not built for this arch") +
                                              ")");
  for (const DispatchRule& r : it->second)
    if (r.serves(max_tokens, programs, num_sms)) {
      *kernel = r.kernel;
      return Status::Ok();
    }
  // Parsing requires a final rule for any launch, so only a table built in memory gets here.
  return Status::Error(Code::kInvalidManifest, "the rules for " + key + " end without a rule for any launch");
}

Status DispatchTable::constant(const std::string& name, int64_t* value) const {
  auto it = constants.find(name);
  if (it == constants.end())
    return Status::Error(Code::kInvalidManifest, "the manifest's dispatch constants lack '" + name + "': rebuild it");
  *value = it->second;
  return Status::Ok();
}

Status load_manifest(const std::string& arch_dir, Manifest* out) {
  std::string path = join_path(arch_dir, "manifest.json");
  std::string text;
  Status st = read_file(path, "manifest", &text, kMaxManifestBytes);
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
  const JsonValue* version = root.find("package_version");
  if (version && version->is_string()) out->package_version = version->string;
  return parse_dispatch(v, root, out->kernels, &out->dispatch);
}

}  // namespace flash_reasoning
