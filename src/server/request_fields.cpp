#include "server/request_fields.h"

#include <limits>

#include "engine/speculative.h"
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

void read_penalties(JsonFields& fields, SamplingParams& sampling) {
  if (auto presence = fields.number("presence_penalty", -2.0, 2.0)) sampling.presence_penalty = static_cast<float>(*presence);
  if (auto frequency = fields.number("frequency_penalty", -2.0, 2.0))
    sampling.frequency_penalty = static_cast<float>(*frequency);
  if (auto repetition = fields.number("repetition_penalty", 0.0, std::numeric_limits<float>::max())) {
    if (*repetition <= 0.0)
      reject_field(fields.param("repetition_penalty"), "`repetition_penalty` must be greater than 0, got {}", *repetition);
    sampling.repetition_penalty = static_cast<float>(*repetition);
  }
  const json* bias = fields.object("logit_bias");
  if (!bias) return;
  const std::string param = fields.param("logit_bias");
  JsonFields entries(*bias, param);
  for (const auto& [key, value] : bias->items()) {
    const std::string entry_param = entries.param(quote_client_text(key));
    // A token id in decimal digits (OpenAI's keys), within int32.
    if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos ||
        std::stoll(key) > std::numeric_limits<int32_t>::max())
      reject_field(entry_param, "`{}` must be keyed by token ids (non-negative integers), got \"{}\"", param,
                   quote_client_text(key));
    if (const auto amount = entries.number(key, -100.0, 100.0))
      sampling.logit_bias.emplace_back(static_cast<int32_t>(std::stoll(key)), static_cast<float>(*amount));
  }
}

std::optional<GenerationFields::Speculative> read_speculative(JsonFields& fields) {
  const json* value = fields.value("speculative");
  if (!value || value->is_null()) return std::nullopt;
  const std::string param = fields.param("speculative");
  if (value->is_boolean()) {
    if (value->get<bool>()) reject_field(param, "`speculative` is false or an object {{\"method\", \"num_tokens\"}}");
    return GenerationFields::Speculative{true, std::nullopt, std::nullopt};
  }
  if (!value->is_object())
    reject_field(param, "`speculative` must be false or an object {{\"method\", \"num_tokens\"}}");
  JsonFields speculative(*value, param);
  GenerationFields::Speculative field;
  field.method = speculative.string("method");
  field.num_tokens = speculative.integer("num_tokens", 1, kMaxSpeculativeTokens);
  speculative.reject_unknown();
  return field;
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
