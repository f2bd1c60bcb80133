// A small, strict JSON reader for the launch plan.
//
// Why here: the plan is the only structured data the op reads, the library must not depend on
// third-party C++ code, and a strict reader (depth limit, exact integers, no trailing garbage)
// turns a tampered or truncated attribute into a clear error instead of a wrong launch.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mlso {
namespace json {

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Null;
  bool b = false;
  bool is_int = false;  // the literal had no fraction or exponent and fits in int64
  int64_t i = 0;
  double d = 0.0;
  std::string s;
  std::vector<Value> items;                            // Array
  std::vector<std::pair<std::string, Value>> fields;   // Object, in document order

  const Value* get(const std::string& key) const {
    if (kind != Object) return nullptr;
    for (const auto& f : fields) {
      if (f.first == key) return &f.second;
    }
    return nullptr;
  }
};

class Parser {
 public:
  Parser(const char* text, size_t n) : p_(text), end_(text + n), begin_(text) {}

  // Parses one document; on failure returns false and sets `error`.
  bool parse(Value* out, std::string* error) {
    skip_ws();
    if (!value(out, 0)) {
      *error = error_;
      return false;
    }
    skip_ws();
    if (p_ != end_) {
      *error = at("unexpected text after the JSON value");
      return false;
    }
    return true;
  }

 private:
  static constexpr int kMaxDepth = 64;

  std::string at(const std::string& what) const {
    return what + " at offset " + std::to_string(static_cast<long long>(p_ - begin_));
  }
  bool fail(const std::string& what) {
    if (error_.empty()) error_ = at(what);
    return false;
  }
  void skip_ws() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  bool literal(const char* word) {
    const char* q = p_;
    for (; *word; ++word, ++q) {
      if (q == end_ || *q != *word) return false;
    }
    p_ = q;
    return true;
  }

  bool value(Value* out, int depth) {
    if (depth > kMaxDepth) return fail("JSON nested too deeply");
    if (p_ == end_) return fail("unexpected end of JSON");
    char c = *p_;
    if (c == '{') return object(out, depth);
    if (c == '[') return array(out, depth);
    if (c == '"') {
      out->kind = Value::String;
      return string(&out->s);
    }
    if (c == 't') {
      if (!literal("true")) return fail("invalid literal");
      out->kind = Value::Bool;
      out->b = true;
      return true;
    }
    if (c == 'f') {
      if (!literal("false")) return fail("invalid literal");
      out->kind = Value::Bool;
      out->b = false;
      return true;
    }
    if (c == 'n') {
      if (!literal("null")) return fail("invalid literal");
      out->kind = Value::Null;
      return true;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number(out);
    return fail(std::string("unexpected character '") + c + "'");
  }

  // Whether `key` is not yet a field of obj. Why a hash set past a few fields: a scan per key
  // is quadratic, and a hostile plan can hold one object of a million keys (seconds to hours).
  static bool new_key(const Value& obj, const std::string& key,
                      std::unordered_set<std::string>* seen) {
    constexpr size_t kScanMax = 16;
    if (obj.fields.size() < kScanMax) {
      for (const auto& f : obj.fields) {
        if (f.first == key) return false;
      }
      return true;
    }
    if (seen->empty()) {
      for (const auto& f : obj.fields) seen->insert(f.first);
    }
    return seen->insert(key).second;
  }

  bool object(Value* out, int depth) {
    std::unordered_set<std::string> seen;  // filled only for objects of kScanMax fields or more
    out->kind = Value::Object;
    ++p_;  // {
    skip_ws();
    if (p_ != end_ && *p_ == '}') {
      ++p_;
      return true;
    }
    for (;;) {
      skip_ws();
      if (p_ == end_ || *p_ != '"') return fail("expected a string key");
      std::string key;
      if (!string(&key)) return false;
      skip_ws();
      if (p_ == end_ || *p_ != ':') return fail("expected ':'");
      ++p_;
      skip_ws();
      Value v;
      if (!value(&v, depth + 1)) return false;
      if (!new_key(*out, key, &seen)) return fail("duplicate key \"" + key + "\"");
      out->fields.emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (p_ == end_) return fail("unexpected end of JSON in an object");
      if (*p_ == ',') {
        ++p_;
        continue;
      }
      if (*p_ == '}') {
        ++p_;
        return true;
      }
      return fail("expected ',' or '}'");
    }
  }

  bool array(Value* out, int depth) {
    out->kind = Value::Array;
    ++p_;  // [
    skip_ws();
    if (p_ != end_ && *p_ == ']') {
      ++p_;
      return true;
    }
    for (;;) {
      skip_ws();
      Value v;
      if (!value(&v, depth + 1)) return false;
      out->items.push_back(std::move(v));
      skip_ws();
      if (p_ == end_) return fail("unexpected end of JSON in an array");
      if (*p_ == ',') {
        ++p_;
        continue;
      }
      if (*p_ == ']') {
        ++p_;
        return true;
      }
      return fail("expected ',' or ']'");
    }
  }

  static void put_utf8(std::string* s, uint32_t cp) {
    if (cp < 0x80) {
      s->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      s->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool hex4(uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      if (p_ == end_) return fail("truncated \\u escape");
      char c = *p_++;
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        return fail("invalid \\u escape");
      }
    }
    *out = v;
    return true;
  }

  // Copies one well-formed UTF-8 sequence (Unicode Table 3-7: no overlong forms, no
  // surrogates, nothing above U+10FFFF) from p_ to out. Why: RFC 8259 text is UTF-8, the Python
  // side decodes the attribute strictly, and both must refuse the same bytes.
  bool utf8(std::string* out) {
    const unsigned char b0 = static_cast<unsigned char>(*p_);
    int n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 1;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 2;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 3;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (end_ - p_ <= n) return false;
    for (int k = 1; k <= n; ++k) {
      const unsigned char b = static_cast<unsigned char>(p_[k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
    }
    out->append(p_, static_cast<size_t>(n) + 1);
    p_ += n + 1;
    return true;
  }

  bool string(std::string* out) {
    ++p_;  // opening quote
    for (;;) {
      if (p_ == end_) return fail("unterminated string");
      char c = *p_++;
      if (c == '"') return true;
      unsigned char u = static_cast<unsigned char>(c);
      if (u < 0x20) return fail("control character in a string");
      if (u >= 0x80) {
        --p_;
        if (!utf8(out)) return fail("invalid UTF-8 in a string");
        continue;
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (p_ == end_) return fail("unterminated escape");
      char e = *p_++;
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (!hex4(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t lo = 0;
            if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') return fail("lone surrogate");
            p_ += 2;
            if (!hex4(&lo)) return false;
            if (lo < 0xDC00 || lo > 0xDFFF) return fail("invalid surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return fail("lone surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default:
          return fail("invalid escape");
      }
    }
  }

  bool number(Value* out) {
    const char* start = p_;
    bool integral = true;
    if (*p_ == '-') ++p_;
    if (p_ == end_) return fail("truncated number");
    if (*p_ == '0') {
      ++p_;
    } else if (*p_ >= '1' && *p_ <= '9') {
      while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    } else {
      return fail("invalid number");
    }
    if (p_ != end_ && *p_ == '.') {
      integral = false;
      ++p_;
      if (p_ == end_ || *p_ < '0' || *p_ > '9') return fail("invalid number");
      while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      integral = false;
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (p_ == end_ || *p_ < '0' || *p_ > '9') return fail("invalid number");
      while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    std::string lexeme(start, p_);
    out->kind = Value::Number;
    out->d = std::strtod(lexeme.c_str(), nullptr);
    if (integral) {
      errno = 0;
      long long v = std::strtoll(lexeme.c_str(), nullptr, 10);
      if (errno == 0) {
        out->is_int = true;
        out->i = static_cast<int64_t>(v);
      }
    }
    return true;
  }

  const char* p_;
  const char* end_;
  const char* begin_;
  std::string error_;
};

inline bool parse(const std::string& text, Value* out, std::string* error) {
  Parser parser(text.data(), text.size());
  return parser.parse(out, error);
}

}  // namespace json
}  // namespace mlso
