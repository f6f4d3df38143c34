// The host sampler's logit processing (engine/sampler.h): each penalty and the bias against
// hand-computed values, their order, the logprob of the raw row, the history a Sampler keeps, and
// the per-choice seeds of `n`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "engine/sampler.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

TokenHistory history_of(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  TokenHistory history;
  history.add_prompt(prompt);
  for (int32_t token : generated) history.add_generated(token);
  return history;
}

std::vector<float> processed(const SamplingParams& params, const TokenHistory& history, std::vector<float> logits) {
  process_logits(params, history, logits);
  return logits;
}

// Every value below is exact in f32, so the expectations are exact.
TEST(ProcessLogits, AllPenaltiesAndTheBiasByHand) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 0.5f;
  params.presence_penalty = 0.25f;
  params.logit_bias = {{4, 1.5f}, {1, -1.0f}};
  const TokenHistory history = history_of({0, 1}, {3, 3, 2});
  // 0: in the prompt, 2 / 2 = 1. 1: biased to -2, in the prompt, -2 · 2 = -4. 2: generated once,
  // 0.5 / 2 - 0.5 · 1 - 0.25 = -0.5. 3: generated twice, 3 / 2 - 0.5 · 2 - 0.25 = 0.25. 4: unseen,
  // 0 + 1.5.
  EXPECT_EQ(processed(params, history, {2.0f, -1.0f, 0.5f, 3.0f, 0.0f}),
            (std::vector<float>{1.0f, -4.0f, -0.5f, 0.25f, 1.5f}));
}

TEST(ProcessLogits, PresenceAndFrequencyReadOnlyTheGeneratedTokens) {
  const TokenHistory history = history_of({0, 1, 1}, {1, 2, 2, 2});
  SamplingParams presence;
  presence.presence_penalty = 1.5f;
  EXPECT_EQ(processed(presence, history, {1.0f, 1.0f, 1.0f, 1.0f}), (std::vector<float>{1.0f, -0.5f, -0.5f, 1.0f}));
  SamplingParams frequency;
  frequency.frequency_penalty = 0.5f;
  EXPECT_EQ(processed(frequency, history, {1.0f, 1.0f, 1.0f, 1.0f}), (std::vector<float>{1.0f, 0.5f, -0.5f, 1.0f}));
  SamplingParams negative;  // OpenAI's range reaches -2: repetition is encouraged
  negative.presence_penalty = -2.0f;
  EXPECT_EQ(processed(negative, history, {0.0f, 0.0f, 0.0f, 0.0f}), (std::vector<float>{0.0f, 2.0f, 2.0f, 0.0f}));
}

TEST(ProcessLogits, RepetitionReadsThePromptAndTheGeneratedTokens) {
  SamplingParams params;
  params.repetition_penalty = 4.0f;
  const TokenHistory history = history_of({0, 1}, {2});
  // transformers: a positive logit is divided, a negative one multiplied (both made less likely).
  EXPECT_EQ(processed(params, history, {8.0f, -8.0f, 2.0f, 8.0f}), (std::vector<float>{2.0f, -32.0f, 0.5f, 8.0f}));
  params.repetition_penalty = 0.5f;  // below 1 it favours the tokens seen
  EXPECT_EQ(processed(params, history, {8.0f, -8.0f, 2.0f, 8.0f}), (std::vector<float>{16.0f, -4.0f, 4.0f, 8.0f}));
}

// The bias is added to the raw logit before the repetition penalty scales it (vLLM's order).
TEST(ProcessLogits, TheBiasComesBeforeTheRepetitionPenalty) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.logit_bias = {{0, 1.0f}};
  EXPECT_EQ(processed(params, history_of({0}, {}), {1.0f, 0.0f}), (std::vector<float>{1.0f, 0.0f}));
  params.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(processed(params, history_of({}, {}), {1.0f, 0.0f}), (std::vector<float>{1.0f, -100.0f}));
}

TEST(Sampler, PenaltiesChooseTheTokenAndTheLogprobIsTheRawRows) {
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
  SamplingParams params;
  params.temperature = 0.0f;
  params.presence_penalty = 2.0f;
  params.logit_bias = {{4, 1.5f}};
  Sampler sampler(params);
  // Raw argmax 3 (3.0); biased, token 4 (1.5) still loses to 3 until 3 has been generated.
  SampledToken first = sampler.sample(logits);
  EXPECT_EQ(first.token, 3);
  EXPECT_EQ(first.logprob, log_probability(logits, 3));
  sampler.accept(first.token);
  SampledToken second = sampler.sample(logits);  // 3 - 2 = 1 < 2.0 (token 0)
  EXPECT_EQ(second.token, 0);
  EXPECT_EQ(second.logprob, log_probability(logits, 0)) << "the logprob is under the unprocessed row";
  sampler.accept(second.token);
  EXPECT_EQ(sampler.sample(logits).token, 4) << "0 and 3 penalised (0, 1), the biased 4 (1.5) wins";
}

TEST(Sampler, RepetitionPenaltyReadsThePromptGivenAtConstruction) {
  const std::vector<float> logits = {2.0f, 1.5f};
  SamplingParams params;
  params.temperature = 0.0f;
  params.repetition_penalty = 2.0f;
  EXPECT_EQ(Sampler(params).sample(logits).token, 0);
  const std::vector<int32_t> prompt = {0};
  EXPECT_EQ(Sampler(params, prompt).sample(logits).token, 1) << "2 / 2 = 1 < 1.5";
}

// Processing changes the row, not the stream: a sampled token still takes exactly one draw, so a
// penalised request and its unpenalised twin stay in step.
TEST(Sampler, ProcessingTakesNoExtraDraw) {
  std::mt19937 random(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(200);
  for (float& logit : logits) logit = normal(random);
  SamplingParams plain{0.9f, 0, 1.0f, 0.0f, 11};
  SamplingParams penalised = plain;
  penalised.frequency_penalty = 0.7f;
  penalised.repetition_penalty = 1.3f;
  Sampler a(plain), b(penalised, std::vector<int32_t>{1, 2, 3});
  for (int i = 0; i < 10; ++i) {
    a.accept(a.sample(logits).token);
    b.accept(b.sample(logits).token);
  }
  EXPECT_EQ(a.next_uniform(), b.next_uniform());
}

// The same penalised request gives the same tokens every time (its own history and stream).
TEST(Sampler, APenalisedSeededRequestRepeats) {
  std::mt19937 random(8);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::vector<float>> rows(30, std::vector<float>(100));
  for (auto& row : rows)
    for (float& logit : row) logit = normal(random);
  SamplingParams params{0.8f, 20, 0.95f, 0.0f, 5};
  params.presence_penalty = 0.5f;
  params.frequency_penalty = 0.3f;
  params.repetition_penalty = 1.2f;
  params.logit_bias = {{7, 3.0f}};
  auto run = [&] {
    Sampler sampler(params, std::vector<int32_t>{7, 8});
    std::vector<int32_t> tokens;
    for (const auto& row : rows) {
      tokens.push_back(sampler.sample(row).token);
      sampler.accept(tokens.back());
    }
    return tokens;
  };
  EXPECT_EQ(run(), run());
}

TEST(SamplingParams, PenaltiesAndBiasAreRangeChecked) {
  auto invalid = [](auto change, std::vector<std::string> fragments) {
    SamplingParams params;
    change(params);
    expect_error_mentions([&] { params.validate(); }, fragments);
  };
  invalid([](SamplingParams& p) { p.presence_penalty = 2.5f; }, {"presence_penalty", "[-2, 2]"});
  invalid([](SamplingParams& p) { p.frequency_penalty = -3.0f; }, {"frequency_penalty"});
  invalid([](SamplingParams& p) { p.frequency_penalty = NAN; }, {"frequency_penalty"});
  invalid([](SamplingParams& p) { p.repetition_penalty = 0.0f; }, {"repetition_penalty", "> 0"});
  invalid([](SamplingParams& p) { p.repetition_penalty = INFINITY; }, {"repetition_penalty"});
  invalid([](SamplingParams& p) { p.logit_bias = {{3, 101.0f}}; }, {"logit_bias", "token 3", "[-100, 100]"});
  invalid([](SamplingParams& p) { p.logit_bias = {{-1, 1.0f}}; }, {"logit_bias", "-1"});
  invalid([](SamplingParams& p) { p.logit_bias = {{5, 1.0f}, {2, 0.0f}, {5, -1.0f}}; }, {"token id 5 twice"});
  SamplingParams off;
  EXPECT_FALSE(off.processes_logits());
  off.logit_bias = {{0, 0.0f}};
  EXPECT_TRUE(off.processes_logits());
}

TEST(SamplingParams, ABiasPastTheVocabularyIsAnError) {
  SamplingParams params;
  params.logit_bias = {{9, 1.0f}};
  std::vector<float> logits(4, 0.0f);
  expect_error_mentions([&] { process_logits(params, TokenHistory(), logits); }, {"logit_bias", "token id 9"});
}

TEST(ChoiceSeed, ChoiceZeroKeepsTheSeedAndTheOthersDiffer) {
  EXPECT_EQ(choice_seed(42, 0), 42u);
  EXPECT_EQ(choice_seed(42, 3), choice_seed(42, 3));
  std::vector<uint64_t> seeds;
  for (uint64_t choice = 0; choice < 8; ++choice) seeds.push_back(choice_seed(42, choice));
  std::sort(seeds.begin(), seeds.end());
  EXPECT_EQ(std::adjacent_find(seeds.begin(), seeds.end()), seeds.end());
  // Not a shifted copy of choice 0's stream: choice 1's first draw is none of choice 0's first ones.
  Sampler zero(SamplingParams{1.0f, 0, 1.0f, 0.0f, 42});
  Sampler one(SamplingParams{1.0f, 0, 1.0f, 0.0f, choice_seed(42, 1)});
  const double first = one.next_uniform();
  for (int i = 0; i < 100; ++i) EXPECT_NE(zero.next_uniform(), first);
}

}  // namespace
}  // namespace kiln::testing
