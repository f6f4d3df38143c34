#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"

namespace kiln {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) fail("temperature must be a finite number ≥ 0, got {}", temperature);
  if (top_k < 0) fail("top_k must be ≥ 0 (0 disables it), got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail("top_p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) fail("min_p must be in [0, 1], got {}", min_p);
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    fail("presence_penalty must be in [-2, 2], got {}", presence_penalty);
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    fail("frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    fail("repetition_penalty must be a finite number > 0 (1 disables it), got {}", repetition_penalty);
  std::vector<int32_t> biased;
  for (const auto& [token, bias] : logit_bias) {
    if (token < 0) fail("logit_bias names token id {}, which is negative", token);
    if (!(bias >= -100.0f && bias <= 100.0f)) fail("logit_bias for token {} must be in [-100, 100], got {}", token, bias);
    biased.push_back(token);
  }
  std::sort(biased.begin(), biased.end());
  if (auto repeated = std::adjacent_find(biased.begin(), biased.end()); repeated != biased.end())
    fail("logit_bias names token id {} twice", *repeated);
}

bool SamplingParams::processes_logits() const {
  return !logit_bias.empty() || presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
}

namespace {

// splitmix64's output function (Steele, Lea, Flood 2014).
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;

bool reads_history(const SamplingParams& params) {
  return params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f || params.repetition_penalty != 1.0f;
}

}  // namespace

// A seed + choice·γ state would make choice i's stream choice 0's shifted by i draws; the mixed
// value starts an unrelated one.
uint64_t choice_seed(uint64_t seed, uint64_t choice) {
  return choice == 0 ? seed : mix64(seed + choice * kGoldenGamma);
}

void TokenHistory::add_prompt(std::span<const int32_t> prompt) {
  for (int32_t token : prompt) seen_[token].in_prompt = true;
}

void TokenHistory::add_generated(int32_t token) { ++seen_[token].generated; }

void process_logits(const SamplingParams& params, const TokenHistory& history, std::span<float> logits) {
  for (const auto& [token, bias] : params.logit_bias) {
    if (static_cast<size_t>(token) >= logits.size())
      fail("logit_bias names token id {}, outside the vocabulary (size {})", token, logits.size());
    logits[token] += bias;
  }
  if (!reads_history(params)) return;
  const float repetition = params.repetition_penalty;
  for (const auto& [token, seen] : history.seen()) {
    float& logit = logits[static_cast<size_t>(token)];
    if (repetition != 1.0f) logit = logit > 0.0f ? logit / repetition : logit * repetition;
    if (seen.generated > 0) {
      logit -= params.frequency_penalty * static_cast<float>(seen.generated);
      logit -= params.presence_penalty;
    }
  }
}

int32_t argmax(std::span<const float> logits) {
  if (logits.empty()) fail("cannot take the argmax of an empty logit row");
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

float log_probability(std::span<const float> logits, int32_t token) {
  const double maximum = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - maximum);
  return static_cast<float>(static_cast<double>(logits[token]) - maximum - std::log(sum));
}

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt) : params_(params) {
  params_.validate();
  state_ = params.seed ? *params.seed : std::random_device{}() * kGoldenGamma + std::random_device{}();
  if (params_.repetition_penalty != 1.0f) history_.add_prompt(prompt);
}

double Sampler::next_uniform() {
  const double uniform = uniform_ahead(0);
  state_ += kGoldenGamma;
  return uniform;
}

double Sampler::uniform_ahead(int64_t ahead) const {
  // splitmix64 (Steele, Lea, Flood 2014): draw n mixes the state advanced n + 1 times.
  const uint64_t z = mix64(state_ + static_cast<uint64_t>(ahead + 1) * kGoldenGamma);
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

void Sampler::accept(int32_t token) {
  if (reads_history(params_)) history_.add_generated(token);
}

SampledToken Sampler::sample(std::span<const float> logits) {
  const double uniform = params_.temperature == 0.0f ? 0.0 : next_uniform();
  if (!params_.processes_logits()) return choose_token(params_, logits, uniform);
  processed_.assign(logits.begin(), logits.end());
  process_logits(params_, history_, processed_);
  SampledToken chosen = choose_token(params_, processed_, uniform);
  chosen.logprob = log_probability(logits, chosen.token);
  return chosen;
}

SampledToken choose_token(const SamplingParams& params, std::span<const float> logits, double uniform) {
  if (params.temperature == 0.0f) {
    const int32_t token = argmax(logits);
    return {token, log_probability(logits, token)};
  }
  // Candidates sorted by logit (descending, lower index first among equals).
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t keep_k = params.top_k > 0 ? std::min<size_t>(params.top_k, order.size()) : order.size();
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + keep_k, order.end(), by_logit);
  order.resize(keep_k);

  // Probabilities of the top-k candidates at this temperature (double: the order of this sum is fixed).
  const double maximum = logits[order.front()];
  std::vector<double> probabilities(order.size());
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    probabilities[i] = std::exp((static_cast<double>(logits[order[i]]) - maximum) / params.temperature);
    total += probabilities[i];
  }
  size_t kept = order.size();
  if (params.top_p < 1.0f) {  // the smallest prefix whose mass reaches top_p
    double mass = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      mass += probabilities[i] / total;
      if (mass >= params.top_p) {
        kept = i + 1;
        break;
      }
    }
  }
  if (params.min_p > 0.0f) {  // drop candidates below min_p × the top probability
    const double threshold = params.min_p * probabilities.front();
    size_t above = 1;
    while (above < kept && probabilities[above] >= threshold) ++above;
    kept = above;
  }
  double kept_total = 0.0;
  for (size_t i = 0; i < kept; ++i) kept_total += probabilities[i];
  const double target = uniform * kept_total;
  double cumulative = 0.0;
  size_t chosen = kept - 1;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += probabilities[i];
    if (target < cumulative) {
      chosen = i;
      break;
    }
  }
  const int32_t token = order[chosen];
  return {token, log_probability(logits, token)};
}

}  // namespace kiln
