#include "server/request_fields.h"

#include <limits>

#include "server/api_error.h"

namespace kiln::server {

void check_model_field(JsonFields& fields, const std::string& served_model) {
  const auto model = fields.string("model");
  if (!model) reject_field("model", "`model` is required");
  if (*model != served_model)
    throw ApiError(404,
                   fmt::format("the model `{}` does not exist; this server serves `{}`", quote_client_text(*model),
                               served_model),
                   "model", "model_not_found");
}

void read_sampling(JsonFields& fields, double temperature_max, SamplingParams& sampling) {
  if (auto temperature = fields.number("temperature", 0.0, temperature_max))
    sampling.temperature = static_cast<float>(*temperature);
  if (auto top_p = fields.number("top_p", 0.0, 1.0)) {
    if (*top_p <= 0.0) reject_field(fields.param("top_p"), "`top_p` must be greater than 0, got {}", *top_p);
    sampling.top_p = static_cast<float>(*top_p);
  }
  // vLLM's convention: -1 (or 0) turns top-k off.
  if (auto top_k = fields.integer("top_k", -1, std::numeric_limits<int32_t>::max()))
    sampling.top_k = *top_k < 0 ? 0 : static_cast<int32_t>(*top_k);
  if (auto min_p = fields.number("min_p", 0.0, 1.0)) sampling.min_p = static_cast<float>(*min_p);
  if (auto seed = fields.integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
    sampling.seed = static_cast<uint64_t>(*seed);
}

std::vector<std::string> read_stop_strings(JsonFields& fields, const std::string& name, bool allow_single_string) {
  const json* value = fields.value(name);
  if (!value) return {};
  const std::string param = fields.param(name);
  std::vector<std::string> stops;
  if (value->is_string() && allow_single_string) {
    stops.push_back(value->get<std::string>());
  } else if (value->is_array()) {
    if (value->size() > kMaxStopStrings)
      reject_field(param, "`{}` may hold at most {} strings, got {}", param, kMaxStopStrings, value->size());
    for (size_t i = 0; i < value->size(); ++i) {
      if (!(*value)[i].is_string())
        reject_field(param, "`{}[{}]` must be a string, got {}", param, i, json_type_name((*value)[i]));
      stops.push_back((*value)[i].get<std::string>());
    }
  } else {
    reject_field(param, "`{}` must be {}an array of strings, got {}", param, allow_single_string ? "a string or " : "",
                 json_type_name(*value));
  }
  for (const auto& stop : stops) {
    if (stop.empty()) reject_field(param, "`{}` must not contain an empty string", param);
    if (stop.size() > kMaxStopBytes)
      reject_field(param, "each of `{}` may be at most {} bytes, got one of {}", param, kMaxStopBytes, stop.size());
  }
  return stops;
}

int64_t completion_budget(int64_t prompt_tokens, std::optional<int64_t> max_tokens, int64_t context_tokens,
                          const std::string& prompt_param, const std::string& max_tokens_param) {
  if (prompt_tokens >= context_tokens)
    throw ApiError(400,
                   fmt::format("the prompt has {} tokens but this model's context holds {} tokens (prompt and "
                               "completion together); shorten the prompt",
                               prompt_tokens, context_tokens),
                   prompt_param, "context_length_exceeded");
  const int64_t room = context_tokens - prompt_tokens;
  if (max_tokens && *max_tokens > room)
    throw ApiError(
        400,
        fmt::format("this model's context holds {} tokens, but {} were requested ({} in the prompt and "
                    "{} for the completion); reduce the prompt or `{}`",
                    context_tokens, prompt_tokens + *max_tokens, prompt_tokens, *max_tokens, max_tokens_param),
        max_tokens_param, "context_length_exceeded");
  return max_tokens ? *max_tokens : room;
}

}  // namespace kiln::server
