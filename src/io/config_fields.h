// Typed, strict access to the fields of one config.json object, shared by the common parsing
// (io/config.cpp) and the fields a family reads for itself (its spec, model/family.h). Errors read
// "<config.json>: field '<prefix><key>': <what is wrong>".
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln {

// "integer", "number", "array", …: how an error names a JSON value's kind.
std::string json_kind(const nlohmann::json& value);

class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& object, const std::filesystem::path& source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  // Present and not null (transformers writes absent optional values as null).
  bool has(const std::string& key) const { return object_.contains(key) && !object_[key].is_null(); }
  const nlohmann::json& raw(const std::string& key) const { return object_.at(key); }
  const nlohmann::json& raw_object() const { return object_; }
  std::string name(const std::string& key) const { return prefix_ + key; }
  const std::filesystem::path& source() const { return source_; }

  template <typename... Args>
  [[noreturn]] void fail_field(const std::string& key, fmt::format_string<Args...> format, Args&&... args) const {
    fail("{}: field '{}': {}", source_.string(), name(key), fmt::format(format, std::forward<Args>(args)...));
  }

  int64_t integer(const std::string& key) const;
  int64_t positive_integer(const std::string& key) const;
  std::optional<int64_t> optional_positive_integer(const std::string& key) const;
  double number(const std::string& key) const;
  double positive_number(const std::string& key) const;
  bool boolean(const std::string& key, bool fallback) const;
  std::string string(const std::string& key, const std::string& fallback) const;
  ConfigFields object(const std::string& key) const;
  // A token id field: an integer, a list of integers, or absent/null.
  std::vector<int64_t> token_ids(const std::string& key) const;

 private:
  const nlohmann::json& object_;
  const std::filesystem::path& source_;
  std::string prefix_;
};

}  // namespace kiln
