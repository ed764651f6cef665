#include "util/json.h"

#include <cstdlib>
#include <cstring>

namespace flash_reasoning {

const JsonValue* JsonValue::find(const std::string& key) const {
  if (kind != Kind::kObject) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == key) return &items[i];
  return nullptr;
}

namespace {

// Recursive-descent parser. Errors are recorded once (first failure wins) and
// every routine returns false so callers unwind without exceptions.
class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Status parse(JsonValue* out) {
    skip_space();
    if (value(out, 0)) {
      skip_space();
      if (pos_ == s_.size()) return Status::Ok();
      fail("unexpected trailing text");
    }
    return Status::Error(Code::kInvalidManifest, error_);
  }

 private:
  static constexpr int kMaxDepth = 64;  // bounds recursion on hostile input

  bool fail(const char* what) {
    if (error_.empty()) error_ = "invalid JSON at byte " + std::to_string(pos_) + ": " + what;
    return false;
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\r' || s_[pos_] == '\n')) ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool literal(const char* word) {
    size_t n = std::strlen(word);
    if (s_.compare(pos_, n, word) != 0) return fail("invalid literal");
    pos_ += n;
    return true;
  }

  bool value(JsonValue* v, int depth) {
    if (depth > kMaxDepth) return fail("nesting too deep");
    skip_space();
    if (pos_ >= s_.size()) return fail("unexpected end of input");
    char c = s_[pos_];
    if (c == '{') return object(v, depth);
    if (c == '[') return array(v, depth);
    if (c == '"') {
      v->kind = JsonValue::Kind::kString;
      return string(&v->string);
    }
    if (c == 't' || c == 'f') {
      v->kind = JsonValue::Kind::kBool;
      v->boolean = (c == 't');
      return literal(c == 't' ? "true" : "false");
    }
    if (c == 'n') {
      v->kind = JsonValue::Kind::kNull;
      return literal("null");
    }
    return number(v);
  }

  bool object(JsonValue* v, int depth) {
    v->kind = JsonValue::Kind::kObject;
    ++pos_;  // '{'
    if (eat('}')) return true;
    do {
      skip_space();
      std::string key;
      if (pos_ >= s_.size() || s_[pos_] != '"') return fail("expected object key");
      if (!string(&key)) return false;
      if (!eat(':')) return fail("expected ':'");
      v->keys.push_back(std::move(key));
      v->items.emplace_back();
      if (!value(&v->items.back(), depth + 1)) return false;
    } while (eat(','));
    return eat('}') || fail("expected ',' or '}'");
  }

  bool array(JsonValue* v, int depth) {
    v->kind = JsonValue::Kind::kArray;
    ++pos_;  // '['
    if (eat(']')) return true;
    do {
      v->items.emplace_back();
      if (!value(&v->items.back(), depth + 1)) return false;
    } while (eat(','));
    return eat(']') || fail("expected ',' or ']'");
  }

  bool number(JsonValue* v) {
    // Validate the JSON grammar first: strtod alone would accept "0x1p3", "inf", ...
    size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0')
      ++pos_;  // no leading zeros: "01" is invalid JSON
    else if (!digits())
      return fail("invalid number");
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) return fail("invalid number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) return fail("invalid number");
    }
    v->kind = JsonValue::Kind::kNumber;
    v->number = std::strtod(s_.substr(start, pos_ - start).c_str(), nullptr);
    return true;
  }
  bool digits() {
    size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start;
  }

  bool hex4(unsigned* out) {
    if (pos_ + 4 > s_.size()) return fail("truncated \\u escape");
    *out = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      int d = (c >= '0' && c <= '9')   ? c - '0'
              : (c >= 'a' && c <= 'f') ? c - 'a' + 10
              : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                       : -1;
      if (d < 0) return fail("invalid \\u escape");
      *out = *out * 16 + d;
    }
    return true;
  }
  static void append_utf8(unsigned cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(char(cp));
      return;
    }
    if (cp < 0x800) {
      out->push_back(char(0xC0 | cp >> 6));
    } else if (cp < 0x10000) {
      out->push_back(char(0xE0 | cp >> 12));
      out->push_back(char(0x80 | (cp >> 6 & 0x3F)));
    } else {
      out->push_back(char(0xF0 | cp >> 18));
      out->push_back(char(0x80 | (cp >> 12 & 0x3F)));
      out->push_back(char(0x80 | (cp >> 6 & 0x3F)));
    }
    out->push_back(char(0x80 | (cp & 0x3F)));
  }
  bool unicode_escape(std::string* out) {
    unsigned cp = 0;
    if (!hex4(&cp)) return false;
    if (cp >= 0xD800 && cp < 0xDC00) {  // high surrogate: a low one must follow
      unsigned lo = 0;
      if (s_.compare(pos_, 2, "\\u") != 0) return fail("unpaired surrogate");
      pos_ += 2;
      if (!hex4(&lo)) return false;
      if (lo < 0xDC00 || lo >= 0xE000) return fail("unpaired surrogate");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    } else if (cp >= 0xDC00 && cp < 0xE000) {
      return fail("unpaired surrogate");
    }
    append_utf8(cp, out);
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // opening quote
    while (pos_ < s_.size()) {
      char c = s_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) break;
      char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u':
          if (!unicode_escape(out)) return false;
          break;
        default: return fail("invalid escape");
      }
    }
    return fail("unterminated string");
  }

  const std::string& s_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace

Status parse_json(const std::string& text, JsonValue* out) {
  *out = JsonValue();
  return Parser(text).parse(out);
}

}  // namespace flash_reasoning
