// A small JSON schema validator for the subset engine/grammar/json_schema.h compiles, written
// from the JSON Schema specification (not from the compiler), so tests can check that constrained
// output satisfies its schema. Returns an empty string when `value` is valid, else why not.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kiln::testing {

std::string schema_violation(const nlohmann::ordered_json& value, const nlohmann::ordered_json& schema,
                             const nlohmann::ordered_json& root);

inline std::string schema_violation(const nlohmann::ordered_json& value, const nlohmann::ordered_json& schema) {
  return schema_violation(value, schema, schema);
}

// Characters of a UTF-8 string (for minLength / maxLength).
size_t utf8_length(const std::string& text);

}  // namespace kiln::testing
