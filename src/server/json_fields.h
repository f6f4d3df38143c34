// Strict, typed reading of a JSON request object. Each accessor checks the type (and range) of one
// field and remembers that the field is known; reject_unknown() then refuses any field nobody asked
// about. A JSON null counts as absent, as OpenAI's API treats it. Every failure is a 400 ApiError
// whose param names the field (with its path, e.g. "messages[2].content").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>

namespace kiln::server {

using json = nlohmann::ordered_json;

// Parses a request body: malformed JSON, nesting deeper than kMaxJsonDepth (which would make any
// recursive walk of it expensive) or a top level that is not an object is a 400.
json parse_request_json(std::string_view body);
// The most containers (objects, arrays) that may enclose any value of a request, counted from the
// top of the body; JSON embedded in a string of the body counts the containers around the string.
inline constexpr int kMaxJsonDepth = 64;

// Parses a JSON document a client embedded in the string field `param` (tool-call arguments), which
// sits inside `enclosing_containers` containers of the body: nullopt when the text is not JSON, a
// 400 naming `param` when the document would nest past kMaxJsonDepth counted from the body's top.
// The parse stops at the limit, so no deep value is ever built (copying, dumping or rendering one
// recurses once per level and overflows the stack).
std::optional<json> parse_embedded_json(std::string_view text, int enclosing_containers, const std::string& param);

// Client text quoted in an error message (a model name, a field name, a role, a path): at most
// kMaxQuotedBytes of it, cut on a UTF-8 character boundary, with "…" where it was cut, so that an
// 8 MB model name is not echoed whole.
inline constexpr size_t kMaxQuotedBytes = 256;
std::string quote_client_text(std::string_view text);

// Serialises a response: invalid UTF-8 in generated text (a model can emit any byte) becomes
// U+FFFD instead of an exception.
inline std::string dump_json(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

// The type a JSON value has, as an error message names it ("a string", "an array", ...).
std::string json_type_name(const json& value);

class JsonFields {
 public:
  // `object` must outlive this reader; `path` prefixes field names in errors ("" at the top).
  JsonFields(const json& object, std::string path);

  bool has(const std::string& name) const;  // present and not null
  std::optional<std::string> string(const std::string& name);
  std::optional<bool> boolean(const std::string& name);
  std::optional<double> number(const std::string& name, double min, double max);
  std::optional<int64_t> integer(const std::string& name, int64_t min, int64_t max);
  const json* array(const std::string& name);
  const json* object(const std::string& name);
  // Any present value, unchecked (the caller checks its type).
  const json* value(const std::string& name);
  // The full name of a field in errors ("messages[0].role").
  std::string param(const std::string& name) const;
  // A 400 for the first field (in key order) that no accessor has asked for.
  void reject_unknown() const;

 private:
  const json* lookup(const std::string& name);

  const json& object_;
  std::string path_;
  std::set<std::string> known_;
};

}  // namespace kiln::server
