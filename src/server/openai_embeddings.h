// OpenAI's /v1/embeddings (served by kiln serve --embeddings): the request's parsing and
// validation, and the "list" of "embedding" objects it is answered with.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kiln::server {

using json = nlohmann::ordered_json;

// Most inputs one request may embed (OpenAI's limit).
inline constexpr size_t kMaxEmbeddingInputs = 2048;

// One input: a text (tokenised with the tokenizer's specials, as its post-processor adds them) or
// token ids as given.
struct EmbeddingInput {
  std::optional<std::string> text;
  std::vector<int32_t> ids;
  std::string param;  // the request field it came from ("input", "input[3]"), for errors
};

enum class EmbeddingEncoding {
  Float,   // a JSON array of numbers
  Base64,  // the little-endian f32 bytes, base64-encoded (OpenAI's "base64")
};

struct EmbeddingRequest {
  std::vector<EmbeddingInput> inputs;
  EmbeddingEncoding encoding = EmbeddingEncoding::Float;
  std::optional<int64_t> dimensions;  // keep this many leading values (Matryoshka), before normalising
};

// `input` is a non-empty string, an array of them, an array of token ids, or an array of arrays
// of token ids (each id within `vocab_size`, each array non-empty), at most kMaxEmbeddingInputs
// inputs; `encoding_format` "float" or "base64"; `dimensions` 1 to `hidden_size`; `user` is
// accepted. `model` must name the served model (else 404); any other field, a wrong type or a value
// out of range is a 400 naming the field.
EmbeddingRequest parse_embedding_request(const json& body, const std::string& served_model, int64_t vocab_size,
                                         int64_t hidden_size);

// The values' little-endian f32 bytes in base64 (RFC 4648, padded), as OpenAI encodes them.
std::string base64_f32(std::span<const float> values);

// {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": …}], "model", "usage":
// {"prompt_tokens", "total_tokens"}}, embedding i the request's input i.
json embeddings_body(const std::vector<std::vector<float>>& embeddings, EmbeddingEncoding encoding,
                     const std::string& served_model, int64_t prompt_tokens);

}  // namespace kiln::server
