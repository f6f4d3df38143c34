#include "json_schema_validator.h"

#include <cctype>
#include <cmath>
#include <regex>

namespace kiln::testing {

using json = nlohmann::ordered_json;

size_t utf8_length(const std::string& text) {
  size_t characters = 0;
  for (unsigned char c : text) characters += (c & 0xC0) != 0x80;
  return characters;
}

namespace {

bool has_type(const json& value, const std::string& type) {
  if (type == "object") return value.is_object();
  if (type == "array") return value.is_array();
  if (type == "string") return value.is_string();
  if (type == "number") return value.is_number();
  // JSON Schema: a number with no fractional part (one past int64 parses as a double here).
  if (type == "integer")
    return value.is_number_integer() || (value.is_number_float() && std::floor(value.get<double>()) == value.get<double>());
  if (type == "boolean") return value.is_boolean();
  if (type == "null") return value.is_null();
  return false;
}

const json& resolve(const std::string& reference, const json& root) {
  if (reference == "#") return root;
  const auto slash = reference.rfind('/');
  const std::string container = reference.substr(2, slash - 2);
  return root.at(container).at(reference.substr(slash + 1));
}

// RFC 3339 full-date: the day must exist in its month (the proleptic Gregorian calendar).
bool is_date(const std::string& text) {
  if (!std::regex_match(text, std::regex(R"(\d{4}-\d\d-\d\d)"))) return false;
  const int year = std::stoi(text.substr(0, 4)), month = std::stoi(text.substr(5, 2)), day = std::stoi(text.substr(8, 2));
  const bool leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
  static const int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  if (month < 1 || month > 12 || day < 1) return false;
  return day <= kDays[month - 1] + (month == 2 && leap ? 1 : 0);
}

// RFC 5321/5322's dot-atom addresses with a host name of two or more labels.
bool is_email(const std::string& text) {
  const size_t at = text.find('@');
  if (at == std::string::npos || text.find('@', at + 1) != std::string::npos) return false;
  const std::string local = text.substr(0, at), domain = text.substr(at + 1);
  const std::string atext = "!#$%&'*+/=?^_`{|}~-";
  if (local.empty() || local.front() == '.' || local.back() == '.' || local.find("..") != std::string::npos)
    return false;
  for (char c : local)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && atext.find(c) == std::string::npos) return false;
  size_t labels = 0, start = 0;
  while (true) {
    const size_t dot = domain.find('.', start);
    const std::string label = domain.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty() || label.front() == '-' || label.back() == '-') return false;
    for (char c : label)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    ++labels;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return labels >= 2;
}

// Four decimal octets, 0 to 255, without leading zeros.
bool is_ipv4(const std::string& text) {
  if (!std::regex_match(text, std::regex(R"((\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3}))"))) return false;
  size_t start = 0;
  for (int octet = 0; octet < 4; ++octet) {
    const size_t dot = text.find('.', start);
    const std::string digits = text.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if ((digits.size() > 1 && digits[0] == '0') || std::stoi(digits) > 255) return false;
    start = dot + 1;
  }
  return true;
}

bool matches_format(const std::string& text, const std::string& format) {
  static const std::string time = R"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))";
  if (format == "date") return is_date(text);
  if (format == "time") return std::regex_match(text, std::regex(time));
  if (format == "date-time") {
    const size_t t = text.find('T');
    return t != std::string::npos && is_date(text.substr(0, t)) && std::regex_match(text.substr(t + 1), std::regex(time));
  }
  if (format == "email") return is_email(text);
  if (format == "ipv4") return is_ipv4(text);
  if (format == "uuid") return std::regex_match(text, std::regex("[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}"));
  return false;
}

}  // namespace

std::string schema_violation(const json& value, const json& schema, const json& root) {
  if (schema.is_boolean()) return schema.get<bool>() ? "" : "false schema";
  if (schema.contains("$ref")) return schema_violation(value, resolve(schema["$ref"], root), root);
  if (schema.contains("const") && value != schema["const"]) return "not the const " + schema["const"].dump();
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& option : schema["enum"]) found = found || option == value;
    if (!found) return value.dump() + " is not in the enum";
  }
  for (const char* combinator : {"anyOf", "oneOf", "allOf"}) {
    if (!schema.contains(combinator)) continue;
    size_t valid = 0;
    std::string reasons;
    for (const json& option : schema[combinator]) {
      const std::string why = schema_violation(value, option, root);
      valid += why.empty();
      reasons += why + "; ";
    }
    if (std::string(combinator) == "allOf" ? valid != schema[combinator].size() : valid == 0)
      return std::string(combinator) + " fails: " + reasons;
  }
  if (schema.contains("type")) {
    const json types = schema["type"].is_array() ? schema["type"] : json::array({schema["type"]});
    bool typed = false;
    for (const json& type : types) typed = typed || has_type(value, type);
    if (!typed) return value.dump() + " is not of type " + schema["type"].dump();
  }
  if (value.is_object()) {
    const json properties = schema.value("properties", json::object());
    for (const json& name : schema.value("required", json::array()))
      if (!value.contains(name.get<std::string>())) return "missing required property " + name.dump();
    for (const auto& [name, member] : value.items()) {
      if (properties.contains(name)) {
        const std::string why = schema_violation(member, properties[name], root);
        if (!why.empty()) return name + ": " + why;
      } else if (schema.contains("additionalProperties")) {
        const std::string why = schema_violation(member, schema["additionalProperties"], root);
        if (!why.empty()) return "additional property " + name + ": " + why;
      }
    }
  }
  if (value.is_array()) {
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>()) return "too few items";
    if (schema.contains("maxItems") && value.size() > schema["maxItems"].get<size_t>()) return "too many items";
    if (schema.contains("items"))
      for (const json& item : value) {
        const std::string why = schema_violation(item, schema["items"], root);
        if (!why.empty()) return "item: " + why;
      }
  }
  if (value.is_string()) {
    const size_t length = utf8_length(value.get<std::string>());
    if (schema.contains("minLength") && length < schema["minLength"].get<size_t>()) return "string too short";
    if (schema.contains("maxLength") && length > schema["maxLength"].get<size_t>()) return "string too long";
    if (schema.contains("format") && !matches_format(value.get<std::string>(), schema["format"]))
      return value.dump() + " is not a " + schema["format"].get<std::string>();
    // JSON Schema patterns are ECMAScript regexes, unanchored.
    if (schema.contains("pattern") &&
        !std::regex_search(value.get<std::string>(), std::regex(schema["pattern"].get<std::string>())))
      return value.dump() + " does not match the pattern " + schema["pattern"].dump();
  }
  if (value.is_number()) {
    // Integers compare exactly (doubles lose them past 2^53); anything else as doubles.
    const auto compare = [&](const json& bound) {
      if (value.is_number_integer() && bound.is_number_integer()) {
        const int64_t a = value.get<int64_t>(), b = bound.get<int64_t>();
        return a < b ? -1 : a > b ? 1 : 0;
      }
      const double a = value.get<double>(), b = bound.get<double>();
      return a < b ? -1 : a > b ? 1 : 0;
    };
    if (schema.contains("minimum") && compare(schema["minimum"]) < 0) return value.dump() + " is below minimum";
    if (schema.contains("maximum") && compare(schema["maximum"]) > 0) return value.dump() + " is above maximum";
    if (schema.contains("exclusiveMinimum") && compare(schema["exclusiveMinimum"]) <= 0)
      return value.dump() + " is not above exclusiveMinimum";
    if (schema.contains("exclusiveMaximum") && compare(schema["exclusiveMaximum"]) >= 0)
      return value.dump() + " is not below exclusiveMaximum";
  }
  return "";
}

}  // namespace kiln::testing
