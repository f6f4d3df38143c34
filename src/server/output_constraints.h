// The fields that hold a reply to a grammar (structured output), read into GenerationFields'
// grammar. OpenAI's endpoints take, at most one of them per request:
//   response_format      {"type": "json_object"} or {"type": "json_schema", "json_schema": {name, schema, …}}
//   grammar              a GBNF grammar (llama.cpp's server field; engine/grammar/gbnf.h)
//   structured_outputs   vLLM's: {"json": schema} | {"regex": …} | {"choice": [strings]} | {"grammar": GBNF}
//                        | {"json_object": true}
//   guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older spellings of the same
//                        (its guided_decoding_backend is accepted and changes nothing)
// A regex matches the whole reply (engine/grammar/regex.h), a choice is one of its strings exactly.
// Two constraints in one request, a malformed regex or grammar (with its position) or a schema
// the compiler refuses (naming the keyword) are a 400 naming the field.
// Anthropic's output_config.format {"type": "json_schema", "schema": …} is read here too.
#pragma once

#include "server/json_fields.h"
#include "server/request_fields.h"

namespace kiln::server {

void read_openai_output_constraints(JsonFields& fields, GenerationFields& generation);
void read_anthropic_output_config(JsonFields& fields, GenerationFields& generation);

}  // namespace kiln::server
