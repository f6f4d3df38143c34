// Token sampling: logit bias and penalties, then greedy, temperature, top-k, top-p, min-p, with a
// per-request seeded generator.
//
// The random stream belongs to the request (seeded by it), so a request's tokens do not depend on
// what else is being generated: the same seed gives the same tokens on every run.
//
// The order (vLLM's, and transformers' where it has the step): the raw f32 logits get the logit
// bias, then the repetition penalty, then the frequency and presence penalties; the processed row
// is then greedy's argmax, or is divided by the temperature and cut by top-k, top-p and min-p.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kiln {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::optional<uint64_t> seed;
  // OpenAI's penalties, over the tokens generated so far: a token's logit loses
  // frequency_penalty × its count and presence_penalty once if it occurred (each in [-2, 2]).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // transformers' RepetitionPenaltyLogitsProcessor (CTRL), over the prompt and the generated
  // tokens: a logit > 0 is divided by it, any other multiplied (> 0; 1 = off).
  float repetition_penalty = 1.0f;
  // OpenAI's logit_bias: added to the token's logit (each in [-100, 100]; one entry per token).
  std::vector<std::pair<int32_t, float>> logit_bias = {};

  // Throws kiln::Error naming the field when a value is out of range.
  void validate() const;
  // Whether the raw logits are changed before the choice (a bias or a penalty is set).
  bool processes_logits() const;
};

// The seed of choice `choice` of a request seeded with `seed` (OpenAI's `n`): choice 0 keeps the
// seed, so one choice is the request without `n`; the others get unrelated streams.
uint64_t choice_seed(uint64_t seed, uint64_t choice);

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // log-probability under the unmodified distribution (softmax of logits)
};

// What the penalties read of a request's tokens: for each token seen, how often it was generated
// and whether the prompt holds it.
class TokenHistory {
 public:
  struct Seen {
    int32_t generated = 0;
    bool in_prompt = false;
  };
  void add_prompt(std::span<const int32_t> prompt);
  void add_generated(int32_t token);
  const std::unordered_map<int32_t, Seen>& seen() const { return seen_; }

 private:
  std::unordered_map<int32_t, Seen> seen_;
};

// Applies `params`' logit bias and penalties to one row of raw logits, in place, in f32 (the order
// is the file comment's). Each token's result depends only on its own logit and history.
void process_logits(const SamplingParams& params, const TokenHistory& history, std::span<float> logits);

class Sampler {
 public:
  // `prompt`: the request's prompt, which the repetition penalty reads.
  explicit Sampler(const SamplingParams& params, std::span<const int32_t> prompt = {});

  // Picks a token from one row of raw logits: processed (process_logits) when the request has a
  // bias or a penalty; the logprob is the token's under the raw row's softmax all the same.
  SampledToken sample(std::span<const float> logits);
  // Records a token the request generated, whoever chose it (the penalties count it).
  void accept(int32_t token);

  const SamplingParams& params() const { return params_; }
  // The next draw of the request's random stream, in [0, 1) with 53 random bits. sample() takes
  // one per token when the temperature is not 0; the device sampler (GraphOps::sample_tokens)
  // takes it here instead, so a request's stream is the same whichever side samples.
  double next_uniform();
  // The draw `ahead` draws after the next one (0: what next_uniform() returns next), without taking
  // any: a verify step chooses its rows' tokens with the draws they take if emitted.
  double uniform_ahead(int64_t ahead) const;

 private:

  SamplingParams params_;
  uint64_t state_;  // splitmix64: fully specified, identical on every platform
  TokenHistory history_;            // kept only when a penalty reads it
  std::vector<float> processed_;    // the processed row (reused between tokens)
};

// The token `params` choose from one row of (already processed) logits when the random stream's
// draw is `uniform` (unused when the temperature is 0): Sampler::sample's rule after
// process_logits, for callers that hold the draw. Its logprob is under this row's softmax.
SampledToken choose_token(const SamplingParams& params, std::span<const float> logits, double uniform);

// Index of the largest logit (the lowest index among equals).
int32_t argmax(std::span<const float> logits);

// log-softmax of one entry, computed in double.
float log_probability(std::span<const float> logits, int32_t token);

}  // namespace kiln
