#include "server/openai_embeddings.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/request_fields.h"

namespace kiln::server {
namespace {

constexpr const char* kInputForms =
    "a string, an array of strings, an array of token ids or an array of arrays of token ids";

int32_t token_id(const json& value, const std::string& param, int64_t vocab_size) {
  if (!value.is_number_integer()) reject_field(param, "`{}` must be a token id, got {}", param, json_type_name(value));
  const bool too_large = value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t id = too_large ? INT64_MAX : value.get<int64_t>();
  if (id < 0 || id >= vocab_size)
    reject_field(param, "token id {} is outside the vocabulary (0 to {})", value.dump(), vocab_size - 1);
  return static_cast<int32_t>(id);
}

std::vector<int32_t> token_ids(const json& array, const std::string& param, int64_t vocab_size) {
  if (array.empty()) reject_field(param, "`{}` must not be an empty array of token ids", param);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < array.size(); ++i) ids.push_back(token_id(array[i], fmt::format("{}[{}]", param, i), vocab_size));
  return ids;
}

EmbeddingInput text_input(const json& value, const std::string& param) {
  if (!value.is_string()) reject_field(param, "`{}` must be a string, got {}", param, json_type_name(value));
  std::string text = value.get<std::string>();
  if (text.empty()) reject_field(param, "`{}` must not be an empty string", param);
  return {std::move(text), {}, param};
}

std::vector<EmbeddingInput> read_inputs(const json& input, int64_t vocab_size) {
  if (input.is_string()) return {text_input(input, "input")};
  if (!input.is_array()) reject_field("input", "`input` must be {}, got {}", kInputForms, json_type_name(input));
  if (input.empty()) reject_field("input", "`input` must not be an empty array");
  // One array of token ids is one input.
  if (input[0].is_number_integer()) return {{std::nullopt, token_ids(input, "input", vocab_size), "input"}};
  if (input.size() > kMaxEmbeddingInputs)
    reject_field("input", "`input` holds {} inputs; at most {} are embedded per request", input.size(),
                 kMaxEmbeddingInputs);
  std::vector<EmbeddingInput> inputs;
  const bool texts = input[0].is_string();
  for (size_t i = 0; i < input.size(); ++i) {
    const json& item = input[i];
    const std::string param = fmt::format("input[{}]", i);
    if (texts) {
      inputs.push_back(text_input(item, param));
    } else if (item.is_array()) {
      inputs.push_back({std::nullopt, token_ids(item, param, vocab_size), param});
    } else {
      reject_field(param, "`input` must be {}; `{}` is {}", kInputForms, param, json_type_name(item));
    }
  }
  return inputs;
}

}  // namespace

EmbeddingRequest parse_embedding_request(const json& body, const std::string& served_model, int64_t vocab_size,
                                         int64_t hidden_size) {
  EmbeddingRequest request;
  JsonFields fields(body, "");
  check_model_field(fields, served_model);
  const json* input = fields.value("input");
  if (!input) reject_field("input", "`input` is required");
  request.inputs = read_inputs(*input, vocab_size);
  if (const auto encoding = fields.string("encoding_format")) {
    if (*encoding == "base64")
      request.encoding = EmbeddingEncoding::Base64;
    else if (*encoding != "float")
      reject_field("encoding_format", "`encoding_format` must be \"float\" or \"base64\", got \"{}\"",
                   quote_client_text(*encoding));
  }
  request.dimensions = fields.integer("dimensions", 1, hidden_size);
  fields.string("user");
  fields.reject_unknown();
  return request;
}

std::string base64_f32(std::span<const float> values) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes;
  bytes.reserve(values.size() * 4);
  for (float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    for (int shift = 0; shift < 32; shift += 8) bytes.push_back(static_cast<char>((bits >> shift) & 0xFF));
  }
  std::string encoded;
  encoded.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t count = std::min<size_t>(3, bytes.size() - i);
    uint32_t group = 0;
    for (size_t j = 0; j < 3; ++j)
      group = (group << 8) | (j < count ? static_cast<unsigned char>(bytes[i + j]) : 0u);
    for (size_t j = 0; j < 4; ++j)
      encoded.push_back(j <= count ? kAlphabet[(group >> (18 - 6 * j)) & 0x3F] : '=');
  }
  return encoded;
}

json embeddings_body(const std::vector<std::vector<float>>& embeddings, EmbeddingEncoding encoding,
                     const std::string& served_model, int64_t prompt_tokens) {
  json data = json::array();
  for (size_t index = 0; index < embeddings.size(); ++index) {
    const std::vector<float>& values = embeddings[index];
    data.push_back({{"object", "embedding"},
                    {"index", index},
                    {"embedding", encoding == EmbeddingEncoding::Base64 ? json(base64_f32(values)) : json(values)}});
  }
  return {{"object", "list"},
          {"data", std::move(data)},
          {"model", served_model},
          {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

}  // namespace kiln::server
