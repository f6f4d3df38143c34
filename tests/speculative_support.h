// What the speculative-decoding tests share (tests/speculative_test.cpp on the CPU,
// tests/cuda/speculative_test.cpp on the GPU): a run of generate() with its logprobs, bit-for-bit
// comparison, a proposer that is wrong on purpose, and the check that every proposer gives the
// plain run.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/generation.h"
#include "engine/speculative.h"

namespace kiln::testing {

inline constexpr int64_t kGeneratedTokens = 256;

struct GeneratedRun {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  SpeculationCounts counts;
};

inline GeneratedRun run_generate(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& options) {
  GeneratedRun run;
  const GenerationResult result = generate(model, prompt, options, [&](const SampledToken& token) {
    run.logprobs.push_back(token.logprob);
    return true;
  });
  run.tokens = result.tokens;
  run.counts = result.speculation;
  return run;
}

// Bit for bit: the same tokens, and logprobs of the same bits.
inline void expect_same_run(const GeneratedRun& speculative, const GeneratedRun& plain, const std::string& what) {
  ASSERT_EQ(speculative.tokens, plain.tokens) << what;
  ASSERT_EQ(speculative.logprobs.size(), plain.logprobs.size()) << what;
  for (size_t i = 0; i < plain.logprobs.size(); ++i)
    EXPECT_EQ(std::memcmp(&speculative.logprobs[i], &plain.logprobs[i], sizeof(float)), 0)
        << what << ": the logprob of token " << i << " differs";
}

// Proposes the plain run's continuation with some tokens wrong: at each call the first
// `(generated % period)` proposals are right and the next one is off by one, so proposals are
// rejected at every depth and rollbacks of every length happen.
class AdversarialProposer final : public Proposer {
 public:
  AdversarialProposer(std::vector<int32_t> prompt, std::vector<int32_t> continuation, int32_t vocab, size_t period)
      : prompt_(std::move(prompt)), continuation_(std::move(continuation)), vocab_(vocab), period_(period) {}
  std::string name() const override { return "adversarial"; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override {
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), prompt_.begin(), prompt_.end()));
    return std::make_unique<Sequence>(*this);
  }

 private:
  class Sequence final : public SequenceProposer {
   public:
    explicit Sequence(const AdversarialProposer& owner) : owner_(owner) {}
    std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
      const size_t generated = tokens.size() - owner_.prompt_.size();
      // The tokens seen so far must be the plain run's: a rejected proposal never reaches them.
      EXPECT_TRUE(std::equal(tokens.begin() + static_cast<std::ptrdiff_t>(owner_.prompt_.size()), tokens.end(),
                             owner_.continuation_.begin()));
      const size_t right = generated % owner_.period_;
      std::vector<int32_t> proposal;
      for (size_t i = 0; i < static_cast<size_t>(count) && generated + i < owner_.continuation_.size(); ++i) {
        const int32_t truth = owner_.continuation_[generated + i];
        proposal.push_back(i < right ? truth : (truth + 1) % owner_.vocab_);
      }
      return proposal;
    }

   private:
    const AdversarialProposer& owner_;
  };

  std::vector<int32_t> prompt_, continuation_;
  int32_t vocab_;
  size_t period_;
};

inline GenerationOptions plain_options(float temperature) {
  GenerationOptions options;
  options.max_tokens = kGeneratedTokens;
  options.sampling.temperature = temperature;
  options.sampling.seed = 20261207;
  options.prefill_chunk = 64;
  return options;
}

inline GenerationOptions with_speculation(GenerationOptions options, std::shared_ptr<Proposer> proposer, int32_t tokens) {
  options.speculation.proposer = std::move(proposer);
  options.speculation.tokens = tokens;
  return options;
}

// With n-gram proposals, adversarial ones (rejected at every depth, so the KV rows are cut and a
// hybrid state is restored and run again) and the oracle's, greedy and seeded: the plain run of
// `model` on `prompt`, tokens and logprob bits, every time.
inline void expect_speculation_gives_the_plain_run(Model& model, const std::vector<int32_t>& prompt) {
  const auto vocab = static_cast<int32_t>(model.config().vocab_size);
  for (const float temperature : {0.0f, 0.8f}) {
    const std::string at = "temperature " + std::to_string(temperature);
    const GeneratedRun plain = run_generate(model, prompt, plain_options(temperature));
    ASSERT_EQ(plain.tokens.size(), static_cast<size_t>(kGeneratedTokens)) << at;
    EXPECT_EQ(plain.counts.verify_steps, 0);

    const auto ngram_proposer = std::make_shared<NgramProposer>();
    const GeneratedRun ngram = run_generate(model, prompt, with_speculation(plain_options(temperature), ngram_proposer, 4));
    expect_same_run(ngram, plain, at + ", ngram");
    EXPECT_GT(ngram.counts.verify_steps, 0) << at;

    for (const size_t period : {3u, 5u}) {
      auto adversary = std::make_shared<AdversarialProposer>(prompt, plain.tokens, vocab, period);
      const GeneratedRun checked =
          run_generate(model, prompt, with_speculation(plain_options(temperature), adversary, 4));
      expect_same_run(checked, plain, at + ", adversarial period " + std::to_string(period));
      EXPECT_GT(checked.counts.accepted, 0) << at;
      EXPECT_LT(checked.counts.accepted, checked.counts.proposed) << at << ": nothing was rolled back";
    }

    auto oracle = std::make_shared<ReplayProposer>(prompt, plain.tokens);
    const GeneratedRun replayed = run_generate(model, prompt, with_speculation(plain_options(temperature), oracle, 7));
    expect_same_run(replayed, plain, at + ", oracle");
    EXPECT_EQ(replayed.counts.accepted, replayed.counts.proposed) << at;
    // Each verify step emits its 7 proposals and the target's next token (the last steps fewer).
    EXPECT_LE(replayed.counts.verify_steps, kGeneratedTokens / 8 + 2) << at;
  }
}

}  // namespace kiln::testing
