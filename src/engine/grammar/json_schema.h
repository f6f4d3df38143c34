// JSON schema → grammar of the JSON texts it allows, written compactly: no whitespace anywhere
// (`{"a":1,"b":[true,null]}`), object properties in the order the schema lists them.
//
// Supported: type (one or a list: object, array, string, number, integer, boolean, null), enum,
// const, anyOf and oneOf (as alternatives: oneOf's exclusivity is not enforced), allOf of one
// schema, $ref to "#", "#/$defs/NAME" or "#/definitions/NAME" (recursion allowed); objects:
// properties, required, additionalProperties (false; true or a schema allow further properties
// after the listed ones; absent means none when `properties` is given, any when it is not, the
// strict reading XGrammar's default also takes); arrays: items, minItems, maxItems; strings:
// minLength, maxLength (characters, escapes counting one), pattern (engine/grammar/regex.h, over
// the string's characters and, as JSON Schema reads it, unanchored: "abc" allows any string
// containing abc), format date and date-time (days that exist: February 29 in leap years only),
// time, uuid, ipv4, email (a dot-atom local part and a domain of two or more letter-digit-hyphen
// labels); integers: minimum, maximum, exclusiveMinimum, exclusiveMaximum (exact digit grammars,
// within ±10^18).
// Annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
// readOnly, writeOnly) are ignored. Any other keyword fails, naming it and where it is.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// Fails with a kiln::Error naming the unsupported keyword (or the malformed value) and its JSON
// pointer in the schema.
Grammar json_schema_grammar(const nlohmann::ordered_json& schema);
// The same rules added to `grammar` (a schema inside a larger grammar: a tool call's arguments);
// returns the rule of a whole JSON text. The size limit counts the whole grammar. `markup_safe`
// writes <, > and & in strings as \u003c, \u003e and \u0026, so that the JSON text never holds a
// closing tag or a CDATA end (a value inside XML-like tool-call markup).
int32_t add_json_schema(Grammar& grammar, const nlohmann::ordered_json& schema, bool markup_safe = false);

// The regex of a supported string `format`'s text (the string's characters, not its JSON), or
// nothing for a format the compiler does not support.
std::optional<std::string> string_format_regex(std::string_view format);

// Any JSON object (OpenAI's response_format json_object), compact.
Grammar json_object_grammar();

}  // namespace kiln::grammar
