#include "server/json_fields.h"

#include <cmath>

#include "server/api_error.h"

namespace kiln::server {

namespace {

// nlohmann's parser calls back with the number of containers open around each value; the callback
// throws `too_deep` before a container past the limit is built.
json parse_within_depth(std::string_view text, int max_depth, const ApiError& too_deep, bool allow_exceptions) {
  return json::parse(
      text,
      [&](int depth, json::parse_event_t, json&) {
        if (depth > max_depth) throw too_deep;
        return true;
      },
      allow_exceptions);
}

}  // namespace

json parse_request_json(std::string_view body) {
  json parsed;
  try {
    parsed = parse_within_depth(
        body, kMaxJsonDepth,
        ApiError(400, fmt::format("the request body nests JSON deeper than {} levels", kMaxJsonDepth)), true);
  } catch (const json::exception& error) {
    // The parser's message quotes the token it stopped in, which can be a whole long string.
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", quote_client_text(error.what())));
  }
  if (!parsed.is_object())
    throw ApiError(400, fmt::format("the request body must be a JSON object, got {}", json_type_name(parsed)));
  return parsed;
}

std::optional<json> parse_embedded_json(std::string_view text, int enclosing_containers, const std::string& param) {
  const int room = kMaxJsonDepth - enclosing_containers;
  json parsed = parse_within_depth(text, room,
                                   ApiError(400,
                                            fmt::format("`{}` holds JSON nested deeper than the {} levels left below "
                                                        "it (a request may nest {} levels in all)",
                                                        param, room, kMaxJsonDepth),
                                            param),
                                   false);
  if (parsed.is_discarded()) return std::nullopt;
  return parsed;
}

std::string quote_client_text(std::string_view text) {
  if (text.size() <= kMaxQuotedBytes) return std::string(text);
  size_t cut = kMaxQuotedBytes;
  // Back up over continuation bytes (10xxxxxx) to the start of the character the cut would split.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return fmt::format("{}… ({} bytes)", text.substr(0, cut), text.size());
}

std::string json_type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a binary value";
  }
}

JsonFields::JsonFields(const json& object, std::string path) : object_(object), path_(std::move(path)) {}

std::string JsonFields::param(const std::string& name) const { return path_.empty() ? name : path_ + "." + name; }

bool JsonFields::has(const std::string& name) const {
  const auto found = object_.find(name);
  return found != object_.end() && !found->is_null();
}

const json* JsonFields::lookup(const std::string& name) {
  known_.insert(name);
  const auto found = object_.find(name);
  if (found == object_.end() || found->is_null()) return nullptr;
  return &*found;
}

const json* JsonFields::value(const std::string& name) { return lookup(name); }

std::optional<std::string> JsonFields::string(const std::string& name) {
  const json* field = lookup(name);
  if (!field) return std::nullopt;
  if (!field->is_string())
    reject_field(param(name), "`{}` must be a string, got {}", param(name), json_type_name(*field));
  return field->get<std::string>();
}

std::optional<bool> JsonFields::boolean(const std::string& name) {
  const json* field = lookup(name);
  if (!field) return std::nullopt;
  if (!field->is_boolean())
    reject_field(param(name), "`{}` must be a boolean, got {}", param(name), json_type_name(*field));
  return field->get<bool>();
}

std::optional<double> JsonFields::number(const std::string& name, double min, double max) {
  const json* field = lookup(name);
  if (!field) return std::nullopt;
  if (!field->is_number())
    reject_field(param(name), "`{}` must be a number, got {}", param(name), json_type_name(*field));
  const double number = field->get<double>();
  if (!(number >= min && number <= max))
    reject_field(param(name), "`{}` must be between {} and {}, got {}", param(name), min, max, field->dump());
  return number;
}

std::optional<int64_t> JsonFields::integer(const std::string& name, int64_t min, int64_t max) {
  const json* field = lookup(name);
  if (!field) return std::nullopt;
  if (!field->is_number_integer())
    reject_field(param(name), "`{}` must be an integer, got {}", param(name), json_type_name(*field));
  // An unsigned value above INT64_MAX is out of every range this server accepts.
  const bool too_large = field->is_number_unsigned() && field->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t number = too_large ? INT64_MAX : field->get<int64_t>();
  if (too_large || number < min || number > max)
    reject_field(param(name), "`{}` must be between {} and {}, got {}", param(name), min, max, field->dump());
  return number;
}

const json* JsonFields::array(const std::string& name) {
  const json* field = lookup(name);
  if (field && !field->is_array())
    reject_field(param(name), "`{}` must be an array, got {}", param(name), json_type_name(*field));
  return field;
}

const json* JsonFields::object(const std::string& name) {
  const json* field = lookup(name);
  if (field && !field->is_object())
    reject_field(param(name), "`{}` must be an object, got {}", param(name), json_type_name(*field));
  return field;
}

void JsonFields::reject_unknown() const {
  for (const auto& [key, value] : object_.items())
    if (!known_.count(key)) {
      const std::string quoted = param(quote_client_text(key));
      reject_field(quoted, "unrecognized request argument `{}`", quoted);
    }
}

}  // namespace kiln::server
