// JSON schema → grammar of the JSON texts it allows, written compactly: no whitespace anywhere
// (`{"a":1,"b":[true,null]}`), object properties in the order the schema lists them.
//
// Supported: type (one or a list: object, array, string, number, integer, boolean, null), enum,
// const, anyOf and oneOf (as alternatives: oneOf's exclusivity is not enforced), allOf of one
// schema, $ref to "#", "#/$defs/NAME" or "#/definitions/NAME" (recursion allowed); objects:
// properties, required, additionalProperties (false; true or a schema allow further properties
// after the listed ones; absent means none when `properties` is given, any when it is not, the
// strict reading XGrammar's default also takes); arrays: items, minItems, maxItems; strings:
// minLength, maxLength (characters, escapes counting one), format date, time, date-time, uuid.
// Annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
// readOnly, writeOnly) are ignored. Any other keyword fails, naming it and where it is.
#pragma once

#include <nlohmann/json.hpp>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// Fails with a kiln::Error naming the unsupported keyword (or the malformed value) and its JSON
// pointer in the schema.
Grammar json_schema_grammar(const nlohmann::ordered_json& schema);
// The same rules added to `grammar` (a schema inside a larger grammar: a tool call's arguments);
// returns the rule of a whole JSON text. The size limit counts the whole grammar.
int32_t add_json_schema(Grammar& grammar, const nlohmann::ordered_json& schema);

// Any JSON object (OpenAI's response_format json_object), compact.
Grammar json_object_grammar();

}  // namespace kiln::grammar
