#include "io/config_fields.h"

#include <cmath>
#include <limits>

namespace kiln {

using nlohmann::json;

std::string json_kind(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

int64_t ConfigFields::integer(const std::string& key) const {
  if (!has(key)) fail_field(key, "is required");
  const json& value = raw(key);
  if (!value.is_number_integer()) fail_field(key, "is {}, not an integer", value.dump());
  if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    fail_field(key, "is {}, too large", value.dump());
  return value.get<int64_t>();
}

int64_t ConfigFields::positive_integer(const std::string& key) const {
  const int64_t value = integer(key);
  if (value <= 0) fail_field(key, "is {}, not positive", value);
  return value;
}

std::optional<int64_t> ConfigFields::optional_positive_integer(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return positive_integer(key);
}

double ConfigFields::number(const std::string& key) const {
  if (!has(key)) fail_field(key, "is required");
  const json& value = raw(key);
  if (!value.is_number()) fail_field(key, "is {}, not a number", value.dump());
  return value.get<double>();
}

double ConfigFields::positive_number(const std::string& key) const {
  const double value = number(key);
  if (!(value > 0) || !std::isfinite(value)) fail_field(key, "is {}, not a positive number", value);
  return value;
}

bool ConfigFields::boolean(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const json& value = raw(key);
  if (!value.is_boolean()) fail_field(key, "is {}, not true or false", value.dump());
  return value.get<bool>();
}

std::string ConfigFields::string(const std::string& key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  const json& value = raw(key);
  if (!value.is_string()) fail_field(key, "is {}, not a string", value.dump());
  return value.get<std::string>();
}

ConfigFields ConfigFields::object(const std::string& key) const {
  const json& value = raw(key);
  if (!value.is_object()) fail_field(key, "is a JSON {}, not an object", json_kind(value));
  return ConfigFields(value, source_, name(key) + ".");
}

std::vector<int64_t> ConfigFields::token_ids(const std::string& key) const {
  if (!has(key)) return {};
  const json& value = raw(key);
  std::vector<int64_t> ids;
  auto take = [&](const json& id) {
    const bool valid = id.is_number_unsigned()
                           ? id.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                           : id.is_number_integer() && id.get<int64_t>() >= 0;
    if (!valid) fail_field(key, "holds {}, not a non-negative token id", id.dump());
    ids.push_back(id.get<int64_t>());
  };
  if (value.is_array()) {
    for (const json& id : value) take(id);
  } else {
    take(value);
  }
  return ids;
}

}  // namespace kiln
