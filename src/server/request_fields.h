// Request fields the OpenAI and Anthropic endpoints share: the model, sampling, stop strings, token
// limits. Neither dialect owns them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/grammar/grammar.h"
#include "engine/sampler.h"
#include "server/json_fields.h"

namespace kiln::server {

struct GenerationFields {
  SamplingParams sampling;            // the server's defaults, with what the request sets over them
  std::optional<int64_t> max_tokens;  // as the request sets it
  // Where the request does not set max_tokens: the dialect's own default (legacy completions: 16),
  // or nothing: up to the end of the context. Either way bounded by the room the prompt leaves.
  std::optional<int64_t> default_max_tokens;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool stream = false;
  int32_t n = 1;  // choices (OpenAI's `n`), each its own generation
  std::optional<grammar::Grammar> grammar;  // structured output: the grammar the output must match
  std::string grammar_field;                 // the request field that set it (for errors)
  // Reasoning tokens before its close is forced (thinking_token_budget, thinking.budget_tokens).
  std::optional<int64_t> reasoning_budget;
  struct Speculative {
    bool disabled = false;
    std::optional<std::string> method;
    std::optional<int64_t> num_tokens;
  };
  std::optional<Speculative> speculative;  // kiln's `speculative` extension, as the request sets it
};

// Most stop strings one request may give (vLLM takes any number; a bound keeps matching cheap).
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopBytes = 256;
// The largest max_tokens a request may name before the context check (a sanity bound).
inline constexpr int64_t kMaxTokensLimit = int64_t{1} << 31;

// Checks the request's `model` (a string naming the served model; another name is a 404).
void check_model_field(JsonFields& fields, const std::string& served_model);
// temperature (0..temperature_max), top_p, top_k, min_p, seed, over the defaults already in
// `sampling`.
void read_sampling(JsonFields& fields, double temperature_max, SamplingParams& sampling);
// OpenAI's presence_penalty and frequency_penalty ([-2, 2]), vLLM's repetition_penalty (> 0) and
// OpenAI's logit_bias ({"token id": bias in [-100, 100]}; the ids are checked against the
// vocabulary when the request is submitted).
void read_penalties(JsonFields& fields, SamplingParams& sampling);
// kiln's extension `speculative` (docs/server.md): false, or {"method": NAME, "num_tokens": 1..16}
// with either left out. Which methods the server offers is checked when the request is submitted.
std::optional<GenerationFields::Speculative> read_speculative(JsonFields& fields);
// Most choices one request may ask for (`n`).
inline constexpr int64_t kMaxChoices = 128;
// A string or an array of strings (OpenAI's `stop`, Anthropic's `stop_sequences`).
std::vector<std::string> read_stop_strings(JsonFields& fields, const std::string& name, bool allow_single_string);

// The tokens a request may generate given its prompt: a 400 naming both lengths when the prompt
// does not fit the context, or when prompt + max_tokens exceeds it.
int64_t completion_budget(int64_t prompt_tokens, std::optional<int64_t> max_tokens, int64_t context_tokens,
                          const std::string& prompt_param, const std::string& max_tokens_param);

}  // namespace kiln::server
