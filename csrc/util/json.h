// Minimal JSON reader for the AOT manifests (RFC 8259 subset: no streaming,
// numbers held as double). Written here so the core needs no third-party library.
#pragma once

#include <string>
#include <vector>

#include "util/status.h"

namespace flash_reasoning {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  std::string string;
  std::vector<std::string> keys;  // object keys, parallel to items
  std::vector<JsonValue> items;   // array elements or object values

  // Object member by key, or nullptr when absent / not an object.
  const JsonValue* find(const std::string& key) const;
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kNumber; }
  bool is_array() const { return kind == Kind::kArray; }
  bool is_object() const { return kind == Kind::kObject; }
};

// Parses a whole document; trailing non-space text is an error. Messages give the byte offset.
Status parse_json(const std::string& text, JsonValue* out);

}  // namespace flash_reasoning
