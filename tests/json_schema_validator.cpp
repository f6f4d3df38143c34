#include "json_schema_validator.h"

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

bool matches_format(const std::string& text, const std::string& format) {
  static const std::string date = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
  static const std::string time = R"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))";
  if (format == "date") return std::regex_match(text, std::regex(date));
  if (format == "time") return std::regex_match(text, std::regex(time));
  if (format == "date-time") return std::regex_match(text, std::regex(date + "T" + time));
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
  }
  return "";
}

}  // namespace kiln::testing
