#include "server/output_constraints.h"

#include <fmt/ranges.h>

#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "engine/grammar/gbnf.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex.h"
#include "server/api_error.h"

namespace kiln::server {

namespace {

// A compiler's refusal as a 400 naming the field.
template <typename Compile>
grammar::Grammar compiled(const std::string& param, const char* code, Compile compile) {
  try {
    return compile();
  } catch (const Error& error) {
    throw ApiError(400, quote_client_text(error.what()), param, code);
  }
}

grammar::Grammar schema_grammar(const json& schema, const std::string& param) {
  return compiled(param, "unsupported_schema", [&] { return grammar::json_schema_grammar(schema); });
}

// A schema given as an object, or as a JSON string holding one (vLLM takes both).
grammar::Grammar schema_field(const json& value, const std::string& param) {
  if (value.is_object()) return schema_grammar(value, param);
  if (value.is_string()) {
    // The string sits in the body, maybe inside structured_outputs: two containers at most.
    const std::optional<json> schema = parse_embedded_json(value.get<std::string>(), 2, param);
    if (schema && (schema->is_object() || schema->is_boolean())) return schema_grammar(*schema, param);
  }
  reject_field(param, "`{}` must be a JSON schema (an object, or a string holding one)", param);
}

grammar::Grammar regex_field(const json& value, const std::string& param) {
  if (!value.is_string()) reject_field(param, "`{}` must be a string, got {}", param, json_type_name(value));
  return compiled(param, "invalid_regex", [&] { return grammar::regex_grammar(value.get<std::string>()); });
}

grammar::Grammar gbnf_field(const json& value, const std::string& param) {
  if (!value.is_string()) reject_field(param, "`{}` must be a string, got {}", param, json_type_name(value));
  return compiled(param, "invalid_grammar", [&] { return grammar::gbnf_grammar(value.get<std::string>()); });
}

// The reply is exactly one of the strings.
grammar::Grammar choice_field(const json& value, const std::string& param) {
  if (!value.is_array() || value.empty()) reject_field(param, "`{}` must be a non-empty array of strings", param);
  grammar::Grammar rules;
  const int32_t choice = rules.add_rule("choice");
  for (const json& each : value) {
    if (!each.is_string()) reject_field(param, "`{}` must be a non-empty array of strings", param);
    rules.add_alternative(choice, grammar::literal(each.get<std::string>()));
  }
  rules.set_root(choice);
  if (rules.positions() > grammar::kMaxRequestGrammarPositions)
    reject_field(param, "`{}` is too large: its grammar has {} positions, at most {} are supported", param,
                 rules.positions(), grammar::kMaxRequestGrammarPositions);
  return rules;
}

// response_format: text (no constraint), json_object or json_schema ({name, schema, strict, description}).
std::optional<grammar::Grammar> response_format(JsonFields& fields) {
  const json* format = fields.object("response_format");
  if (!format) return std::nullopt;
  JsonFields format_fields(*format, "response_format");
  const auto type = format_fields.string("type");
  if (!type) reject_field("response_format.type", "`response_format.type` is required");
  std::optional<grammar::Grammar> grammar;
  if (*type == "json_object") {
    grammar = grammar::json_object_grammar();
  } else if (*type == "json_schema") {
    const json* spec = format_fields.object("json_schema");
    if (!spec) reject_field("response_format.json_schema", "`response_format.json_schema` is required");
    JsonFields spec_fields(*spec, "response_format.json_schema");
    const auto name = spec_fields.string("name");
    if (!name || name->empty())
      reject_field(spec_fields.param("name"), "`{}` must be a non-empty string", spec_fields.param("name"));
    spec_fields.string("description");
    // kiln always holds the output to the schema: strict or not changes nothing.
    spec_fields.boolean("strict");
    const json* schema = spec_fields.object("schema");
    if (!schema) reject_field(spec_fields.param("schema"), "`{}` is required", spec_fields.param("schema"));
    spec_fields.reject_unknown();
    grammar = schema_grammar(*schema, spec_fields.param("schema"));
  } else if (*type != "text") {
    reject_field("response_format.type", "`response_format.type` must be text, json_object or json_schema; got \"{}\"",
                 quote_client_text(*type));
  }
  format_fields.reject_unknown();
  return grammar;
}

// vLLM's structured_outputs: exactly one of its constraint fields.
grammar::Grammar structured_outputs(const json& value) {
  JsonFields fields(value, "structured_outputs");
  std::vector<std::string> given;
  for (const char* name : {"json", "regex", "choice", "grammar", "json_object"})
    if (fields.has(name)) given.push_back(fields.param(name));
  if (given.size() != 1)
    reject_field("structured_outputs", "`structured_outputs` must hold exactly one of json, regex, choice, grammar and "
                                       "json_object{}",
                 given.empty() ? "" : fmt::format("; it holds {}", fmt::join(given, ", ")));
  std::optional<grammar::Grammar> grammar;
  if (const json* schema = fields.value("json")) grammar = schema_field(*schema, fields.param("json"));
  if (const json* regex = fields.value("regex")) grammar = regex_field(*regex, fields.param("regex"));
  if (const json* choice = fields.value("choice")) grammar = choice_field(*choice, fields.param("choice"));
  if (const json* gbnf = fields.value("grammar")) grammar = gbnf_field(*gbnf, fields.param("grammar"));
  if (const auto json_object = fields.boolean("json_object")) {
    if (!*json_object) reject_field(fields.param("json_object"), "`{}` must be true when given", fields.param("json_object"));
    grammar = grammar::json_object_grammar();
  }
  fields.reject_unknown();
  return std::move(*grammar);
}

}  // namespace

void read_openai_output_constraints(JsonFields& fields, GenerationFields& generation) {
  // Every constraint field present, in a fixed order, with what compiles it.
  std::vector<std::string_view> given;  // the fields' names (string literals)
  std::optional<grammar::Grammar> grammar = response_format(fields);
  if (grammar) given.push_back("response_format");
  const auto take = [&](const char* name, const auto& compile) {
    const json* value = fields.value(name);
    if (!value) return;
    given.push_back(name);
    if (given.size() > 1)
      reject_field(name, "`{}` and `{}` cannot be combined: send one output constraint", given.front(), name);
    grammar = compile(*value, name);
  };
  take("grammar", gbnf_field);
  take("structured_outputs", [](const json& value, const std::string& param) {
    if (!value.is_object()) reject_field(param, "`{}` must be an object, got {}", param, json_type_name(value));
    return structured_outputs(value);
  });
  take("guided_json", schema_field);
  take("guided_regex", regex_field);
  take("guided_choice", choice_field);
  take("guided_grammar", gbnf_field);
  // vLLM's choice of grammar engine: kiln has one, and the texts allowed are the same.
  fields.string("guided_decoding_backend");
  if (grammar) {
    generation.grammar = std::move(grammar);
    generation.grammar_field = given.front();
  }
}

void read_anthropic_output_config(JsonFields& fields, GenerationFields& generation) {
  const json* config = fields.object("output_config");
  if (!config) return;
  JsonFields config_fields(*config, "output_config");
  if (const json* format = config_fields.object("format")) {
    JsonFields format_fields(*format, config_fields.param("format"));
    const auto type = format_fields.string("type");
    if (type != "json_schema")
      reject_field(format_fields.param("type"), "`{}` must be \"json_schema\"", format_fields.param("type"));
    const json* schema = format_fields.object("schema");
    if (!schema) reject_field(format_fields.param("schema"), "`{}` is required", format_fields.param("schema"));
    format_fields.reject_unknown();
    generation.grammar = schema_grammar(*schema, format_fields.param("schema"));
    generation.grammar_field = config_fields.param("format");
  }
  config_fields.reject_unknown();
}

}  // namespace kiln::server
