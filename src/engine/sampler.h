// Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.
//
// The random stream belongs to the request (seeded by it), so a request's tokens do not depend on
// what else is being generated: the same seed gives the same tokens on every run.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace kiln {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::optional<uint64_t> seed;

  // Throws kiln::Error naming the field when a value is out of range.
  void validate() const;
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // log-probability under the unmodified distribution (softmax of logits)
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // Picks a token from one row of logits.
  SampledToken sample(std::span<const float> logits);

  const SamplingParams& params() const { return params_; }
  // The next draw of the request's random stream, in [0, 1) with 53 random bits. sample() takes
  // one per token when the temperature is not 0; the device sampler (GraphOps::sample_tokens)
  // takes it here instead, so a request's stream is the same whichever side samples.
  double next_uniform();

 private:

  SamplingParams params_;
  uint64_t state_;  // splitmix64: fully specified, identical on every platform
};

// The token `params` choose from one row of logits when the random stream's draw is `uniform`
// (unused when the temperature is 0): Sampler::sample's rule, for callers that hold the draw.
SampledToken choose_token(const SamplingParams& params, std::span<const float> logits, double uniform);

// Index of the largest logit (the lowest index among equals).
int32_t argmax(std::span<const float> logits);

// log-softmax of one entry, computed in double.
float log_probability(std::span<const float> logits, int32_t token);

}  // namespace kiln
