#include "tokenizer/jinja_value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [name, value] : entries)
    if (name == key) return &value;
  return nullptr;
}

void Dict::set(std::string key, Value value) {
  for (auto& [name, existing] : entries) {
    if (name == key) {
      existing = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

Value Value::undefined(std::string description) {
  Value value;
  value.data_ = UndefinedData{std::move(description)};
  return value;
}

Value Value::none() {
  Value value;
  value.data_ = NoneData{};
  return value;
}

namespace {

void check_value_size(uint64_t bytes, std::string_view kind) {
  if (bytes > kMaxValueBytes)
    throw ValueLimitError(fmt::format("a {} of {} exceeds {}, the limit on a template value", kind,
                                      describe_bytes(bytes), describe_bytes(kMaxValueBytes)));
}

void check_value_depth(int depth, std::string_view kind) {
  if (depth > kMaxValueDepth)
    throw ValueLimitError(
        fmt::format("a {} nests deeper than {} levels, the limit on a template value", kind, kMaxValueDepth));
}

}  // namespace

Value::Value(std::string value) : bytes_(value.size()) {
  check_value_size(bytes_, "string");
  data_ = std::make_shared<const std::string>(std::move(value));
}

Value::Value(List value) : depth_(1), bytes_(value.size() * sizeof(Value)) {
  for (const Value& element : value) {
    depth_ = std::max(depth_, element.depth_ + 1);
    bytes_ += element.bytes_;
    holds_namespace_ = holds_namespace_ || element.holds_namespace_;
  }
  check_value_depth(depth_, "list");
  check_value_size(bytes_, "list");
  data_ = std::make_shared<const List>(std::move(value));
}

Value::Value(Dict value) : depth_(1), bytes_(0), holds_namespace_(value.is_namespace) {
  for (const auto& [key, element] : value.entries) {
    depth_ = std::max(depth_, element.depth_ + 1);
    bytes_ += sizeof(std::pair<std::string, Value>) + key.size() + element.bytes_;
    holds_namespace_ = holds_namespace_ || element.holds_namespace_;
  }
  check_value_depth(depth_, "dict");
  check_value_size(bytes_, "dict");
  data_ = std::make_shared<Dict>(std::move(value));
}

Value::Value(Function value) : data_(std::make_shared<const Function>(std::move(value))) {}

namespace {

// Recursion bounded by kMaxValueDepth, checked on the way down (before the stack is spent).
Value value_from_json(const nlohmann::ordered_json& json, int depth) {
  if (depth > kMaxValueDepth && (json.is_array() || json.is_object()))
    throw ValueLimitError(fmt::format("the JSON nests deeper than {} levels, the limit on a template value",
                                      kMaxValueDepth));
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto value = json.get<uint64_t>();
      if (value > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(value));
      return Value(static_cast<int64_t>(value));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List list;
      list.reserve(json.size());
      for (const auto& element : json) list.push_back(value_from_json(element, depth + 1));
      return Value(std::move(list));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [key, element] : json.items()) dict.entries.emplace_back(key, value_from_json(element, depth + 1));
      return Value(std::move(dict));
    }
    default:
      fail("chat template input: unsupported JSON value of type {}", json.type_name());
  }
}

}  // namespace

Value Value::from_json(const nlohmann::ordered_json& json) { return value_from_json(json, 1); }

int64_t Value::integer() const {
  if (is_bool()) return boolean() ? 1 : 0;
  return std::get<int64_t>(data_);
}

double Value::number() const {
  if (is_float()) return std::get<double>(data_);
  return static_cast<double>(integer());
}

bool Value::truthy() const {
  switch (kind()) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
      return boolean();
    case Kind::Int:
      return integer() != 0;
    case Kind::Float:
      return number() != 0.0;
    case Kind::String:
      return !string().empty();
    case Kind::List:
      return !list().empty();
    case Kind::Dict:
      return is_namespace() || !dict().entries.empty();
    case Kind::Function:
      return true;
  }
  return false;
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, then Python's layout: positional for exponents -4..15, else
  // scientific with at least two exponent digits (float_repr_style 'short').
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  std::string scientific(buffer, result.ptr);
  const bool negative = scientific[0] == '-';
  if (negative) scientific.erase(0, 1);
  const size_t e = scientific.find('e');
  std::string digits = scientific.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::stoi(scientific.substr(e + 1));
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out = "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    } else if (static_cast<size_t>(exponent) + 1 >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(exponent) + 1 - digits.size(), '0') + ".0";
    } else {
      out =
          digits.substr(0, static_cast<size_t>(exponent) + 1) + "." + digits.substr(static_cast<size_t>(exponent) + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  if (negative) out.insert(out.begin(), '-');
  return out;
}

namespace {

std::string python_string_repr(const std::string& text) {
  const bool has_single = text.find('\'') != std::string::npos;
  const bool has_double = text.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  size_t offset = 0;
  while (offset < text.size()) {
    const char32_t c = unicode::next_code_point(text, offset);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else {
      unicode::append_utf8(out, c);
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string Value::str() const {
  switch (kind()) {
    case Kind::Undefined:
      return "";
    case Kind::None:
      return "None";
    case Kind::Bool:
      return boolean() ? "True" : "False";
    case Kind::Int:
      return std::to_string(integer());
    case Kind::Float:
      return python_float_repr(number());
    case Kind::String:
      return string();
    case Kind::List: {
      std::string out = "[";
      for (size_t i = 0; i < list().size(); ++i) out += (i ? ", " : "") + list()[i].repr();
      return out + "]";
    }
    case Kind::Dict: {
      if (is_namespace()) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [key, value] : dict().entries) {
        out += (first ? "" : ", ") + python_string_repr(key) + ": " + value.repr();
        first = false;
      }
      return out + "}";
    }
    case Kind::Function:
      return "<function " + function().name + ">";
  }
  return "";
}

std::string Value::repr() const { return is_string() ? python_string_repr(string()) : str(); }

std::string Value::type_name() const {
  switch (kind()) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::None:
      return "NoneType";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return "str";
    case Kind::List:
      return "list";
    case Kind::Dict:
      return is_namespace() ? "Namespace" : "dict";
    case Kind::Function:
      return "function";
  }
  return "";
}

bool operator==(const Value& left, const Value& right) {
  if (left.is_number() && right.is_number()) {
    if (left.is_float() || right.is_float()) return left.number() == right.number();
    return left.integer() == right.integer();
  }
  if (left.kind() != right.kind()) return false;
  switch (left.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::String:
      return left.string() == right.string();
    case Value::Kind::List:
      return left.list() == right.list();
    case Value::Kind::Dict: {
      if (left.is_namespace() || right.is_namespace()) return &left.dict() == &right.dict();
      const auto& a = left.dict().entries;
      const auto& b = right.dict().entries;
      if (a.size() != b.size()) return false;
      for (const auto& [key, value] : a) {
        const Value* other = right.dict().find(key);
        if (!other || !(*other == value)) return false;
      }
      return true;
    }
    case Value::Kind::Function:
      return &left.function() == &right.function();
    default:
      return false;
  }
}

namespace {

void append_json_string(std::string& out, const std::string& text, bool ensure_ascii) {
  out += '"';
  size_t offset = 0;
  while (offset < text.size()) {
    const char32_t c = unicode::next_code_point(text, offset);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else if (ensure_ascii && c > 0x7F) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          }
        } else {
          unicode::append_utf8(out, c);
        }
    }
  }
  out += '"';
}

// Throws before the JSON text would pass kMaxValueBytes (the value's own size bounds it but for
// an indent, which repeats per level and line).
void check_json_growth(const std::string& out, uint64_t added) {
  if (added > kMaxValueBytes || out.size() > kMaxValueBytes - added)
    throw ValueLimitError(
        fmt::format("the JSON text would exceed {}, the limit on a template value", describe_bytes(kMaxValueBytes)));
}

void append_json(std::string& out, const Value& value, const JsonFormat& format, int depth) {
  const std::string item_separator =
      format.separators_given ? format.item_separator : (format.indent >= 0 ? "," : ", ");
  auto newline = [&](int level) {
    if (format.indent < 0) return;
    const uint64_t spaces = static_cast<uint64_t>(format.indent) * static_cast<uint64_t>(level);
    check_json_growth(out, spaces + 1);
    out += '\n';
    out.append(spaces, ' ');
  };
  switch (value.kind()) {
    case Value::Kind::None:
      out += "null";
      return;
    case Value::Kind::Bool:
      out += value.boolean() ? "true" : "false";
      return;
    case Value::Kind::Int:
      out += std::to_string(value.integer());
      return;
    case Value::Kind::Float: {
      const double number = value.number();
      if (std::isnan(number))
        out += "NaN";
      else if (std::isinf(number))
        out += number > 0 ? "Infinity" : "-Infinity";
      else
        out += python_float_repr(number);
      return;
    }
    case Value::Kind::String:
      // Escaping at most sextuples a string (\u0001), itself within kMaxValueBytes.
      append_json_string(out, value.string(), format.ensure_ascii);
      check_json_growth(out, 0);
      return;
    case Value::Kind::List: {
      const List& list = value.list();
      if (list.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < list.size(); ++i) {
        check_json_growth(out, item_separator.size());
        if (i) out += item_separator;
        newline(depth + 1);
        append_json(out, list[i], format, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::Dict: {
      // Python's json.dumps cannot serialize a Namespace either.
      if (value.is_namespace()) fail("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : value.dict().entries) entries.push_back(&entry);
      if (format.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      if (entries.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        check_json_growth(out, item_separator.size());
        if (i) out += item_separator;
        newline(depth + 1);
        append_json_string(out, entries[i]->first, format.ensure_ascii);
        check_json_growth(out, format.key_separator.size());
        out += format.key_separator;
        append_json(out, entries[i]->second, format, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::Undefined:
    case Value::Kind::Function:
      fail("Object of type {} is not JSON serializable", value.type_name());
  }
}

}  // namespace

std::string to_json(const Value& value, const JsonFormat& format) {
  std::string out;
  append_json(out, value, format, 0);
  return out;
}

}  // namespace kiln::jinja
