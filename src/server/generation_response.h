// How an API dialect answers a generation request. The server runs the generation (submission,
// the loop over its deltas, the writes); the dialect (openai_api, anthropic_api) decides every
// byte of the answer through a GenerationResponse. Neither dialect owns what is here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "server/api_error.h"
#include "text/text_generation.h"

namespace kiln::server {

struct TokenUsage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // of the prompt's, served from the prefix cache (known once admitted)
};

// A non-streamed generation run to its end: the whole text, its tokens, and the last delta (its
// finish reason stop or length).
struct WholeGeneration {
  std::string text;
  std::vector<GeneratedToken> tokens;
  TextDelta last;
};

// A request that ended without finishing ("cancelled" at shutdown, or a failed step) as the error
// its client sees.
ApiError generation_failure(const TextDelta& end);

// One request's answer in one dialect, of one or more choices (OpenAI's `n`, each its own
// generation; usage counts the prompt once and every choice's tokens). Each string a stream method
// returns is written on its own, in order; the server stops at the first write that fails (the
// client went away).
class GenerationResponse {
 public:
  virtual ~GenerationResponse() = default;
  // The body of a non-streamed response: each choice's generation, in index order.
  virtual nlohmann::ordered_json whole(std::span<const WholeGeneration> choices, const TokenUsage& usage) const = 0;
  // What a stream opens with, right after its 200 (no token generated yet).
  virtual std::vector<std::string> stream_start(const TokenUsage& usage) = 0;
  // What one delta of choice `choice` adds; its finished delta ends that choice (with an error
  // event when the generation did not end with stop or length, after which no other delta comes).
  virtual std::vector<std::string> stream_delta(size_t choice, const TextDelta& delta, const TokenUsage& usage) = 0;
  // What closes the stream once every choice has ended, or one failed.
  virtual std::vector<std::string> stream_end(const TokenUsage& usage) = 0;
  // What ends a stream that failed after its 200 went out: no status can be sent any more.
  virtual std::string stream_failure(const ApiError& failure) const = 0;
};

// A response id: `prefix` and 96 bits drawn from the system's entropy source.
std::string random_id(const char* prefix);
// Seconds since the Unix epoch (OpenAI's `created`).
int64_t unix_seconds();

}  // namespace kiln::server
