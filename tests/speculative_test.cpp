// Exact speculative decoding (engine/speculative.h): with any proposer — n-gram, a draft model, one
// that proposes wrong tokens on purpose — a request's tokens and logprobs are those of its plain
// run, bit for bit, alone and among plain requests, on every family of the test data.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/draft_proposer.h"
#include "engine/generation.h"
#include "engine/generation_core.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "engine/step_plan.h"
#include "model_test_support.h"
#include "speculative_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// The prompt of a model of the test data: the first 40 tokens of a fixture's own, or for stories260K
// the opening of its greedy story (models/stories260K/ref_greedy.json), which it then tells on.
std::vector<int32_t> test_prompt(const std::filesystem::path& dir) {
  if (dir == stories_dir()) return {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421};
  std::vector<int32_t> prompt = fixture_prompt(dir.parent_path());
  prompt.resize(40);
  return prompt;
}

// Every model of the test data: the dense fixtures, the hybrid one and the trained stories260K.
std::vector<std::filesystem::path> test_models() {
  return {fixtures_dir() / "llama3-tiny" / "f32", fixtures_dir() / "qwen3-tiny" / "f32",
          fixtures_dir() / "qwen3_5-text-tiny" / "f32", stories_dir()};
}

class SpeculativeDecoding : public ::testing::TestWithParam<std::filesystem::path> {};

// n-gram proposals and adversarial ones (rejected at every depth, so the KV rows are cut and the
// hybrid state restored and run again), greedy and seeded sampling: the plain run every time.
TEST_P(SpeculativeDecoding, GivesThePlainRunBitForBit) {
  TestModel opened = open_cpu_model(GetParam());
  expect_speculation_gives_the_plain_run(*opened.model, test_prompt(GetParam()));
}

// A model drafting for itself proposes the target's own greedy tokens: at temperature 0 every
// proposal is accepted; sampled, some are not. Either way the output is the plain run's.
TEST_P(SpeculativeDecoding, DraftModelGivesThePlainRun) {
  TestModel target = open_cpu_model(GetParam());
  TestModel draft = open_cpu_model(GetParam());
  const std::vector<int32_t> prompt = test_prompt(GetParam());
  if (!draft.model->make_cache(1, 8)->resumes_at_any_position()) {
    EXPECT_THROW(DraftModelProposer(*draft.model, 1, 512), Error);
    return;
  }
  check_draft_model(target.model->config(), *draft.model);
  for (const float temperature : {0.0f, 0.8f}) {
    const GeneratedRun plain = run_generate(*target.model, prompt, plain_options(temperature));
    auto proposer = std::make_shared<DraftModelProposer>(*draft.model, 1, 512);
    const GeneratedRun drafted =
        run_generate(*target.model, prompt, with_speculation(plain_options(temperature), proposer, 4));
    expect_same_run(drafted, plain, "draft at temperature " + std::to_string(temperature));
    if (temperature == 0.0f) {
      EXPECT_EQ(drafted.counts.accepted, drafted.counts.proposed);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryFamily, SpeculativeDecoding, ::testing::ValuesIn(test_models()),
                         [](const auto& info) {
                           std::string name = info.param == stories_dir() ? "stories260K"
                                                                          : info.param.parent_path().filename().string();
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

std::vector<int32_t> event_tokens(const std::vector<TokenEvent>& events) {
  std::vector<int32_t> tokens;
  for (const TokenEvent& event : events)
    if (event.token >= 0) tokens.push_back(event.token);
  return tokens;
}

// Speculative requests (n-gram greedy, adversarial sampled, penalised n-gram) share the scheduler's
// batch with plain ones; each gets its plain solo run's tokens. On the hybrid model too, where one
// sequence's state is restored while the others in its batch keep theirs.
TEST(SpeculativeScheduling, SpeculativeAndPlainRequestsShareABatch) {
  for (const auto& dir : {stories_dir(), fixtures_dir() / "qwen3_5-text-tiny" / "f32"}) {
    TestModel opened = open_cpu_model(dir);
    Model& model = *opened.model;
    const std::vector<int32_t> prompt = test_prompt(dir);
    const auto vocab = static_cast<int32_t>(model.config().vocab_size);
    std::vector<int32_t> long_prompt = prompt;
    while (long_prompt.size() < 150) long_prompt.insert(long_prompt.end(), prompt.begin(), prompt.end());

    std::vector<GenerationRequest> requests(5);
    requests[0].prompt = prompt;  // plain, greedy
    requests[0].sampling.temperature = 0;
    requests[1].prompt = prompt;  // n-gram, greedy
    requests[1].sampling.temperature = 0;
    requests[1].speculation = {std::make_shared<NgramProposer>(), 5};
    requests[2].prompt = long_prompt;  // plain, sampled, prefilled in chunks beside the others' decodes
    requests[2].sampling.temperature = 0.8f;
    requests[2].sampling.seed = 3;
    requests[3].prompt = prompt;  // adversarial, sampled
    requests[3].sampling.temperature = 0.8f;
    requests[3].sampling.seed = 11;
    requests[4].prompt = long_prompt;  // n-gram with penalties and logprobs
    requests[4].sampling.temperature = 0.8f;
    requests[4].sampling.seed = 5;
    requests[4].sampling.repetition_penalty = 1.1f;
    requests[4].sampling.frequency_penalty = 0.3f;
    requests[4].top_logprobs = 2;
    requests[4].speculation = {std::make_shared<NgramProposer>(2, 3), 3};
    for (auto& request : requests) request.max_tokens = 200;

    std::vector<GeneratedRun> solo;
    for (const auto& request : requests) {
      GenerationOptions options;
      options.max_tokens = request.max_tokens;
      options.sampling = request.sampling;
      options.prefill_chunk = 64;
      solo.push_back(run_generate(model, request.prompt, options));
    }
    requests[3].speculation = {std::make_shared<AdversarialProposer>(prompt, solo[3].tokens, vocab, 4), 4};

    const std::vector<std::vector<TokenEvent>> events = scheduled_events(model, requests, 512);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(event_tokens(events[i]), solo[i].tokens) << dir << " request " << i;
      for (size_t t = 0; t < events[i].size() && t < solo[i].logprobs.size(); ++t)
        EXPECT_EQ(std::memcmp(&events[i][t].logprob, &solo[i].logprobs[t], sizeof(float)), 0)
            << dir << " request " << i << " token " << t;
    }
  }
}

// The scheduler tests' request sets — top-k, top-p, min-p, logprobs, bias and penalties, stop ids,
// reasoning budgets (whose requests decode plainly) — each with n-gram speculation: every request
// gets its plain solo run, on a dense and on the hybrid fixture.
TEST(SpeculativeScheduling, EveryKindOfRequestGetsItsPlainRun) {
  for (const char* fixture : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    TestModel opened = open_cpu_model(fixtures_dir() / fixture / "f32");
    const std::vector<int32_t> prompt = fixture_prompt(fixtures_dir() / fixture);
    for (auto requests : {penalised_scheduler_requests(prompt, 40), budgeted_scheduler_requests(prompt, 40)}) {
      const std::vector<std::vector<int32_t>> solo = solo_tokens(*opened.model, requests);
      for (auto& request : requests) request.speculation = {std::make_shared<NgramProposer>(), 3};
      expect_solo_results(scheduled_events(*opened.model, requests, 512), requests, solo);
    }
  }
}

// Requests drafting together (one batched draft step per token) propose what each proposes alone:
// the scheduler's counts are the sum of the solo runs', and every request gets its plain run.
TEST(SpeculativeScheduling, DraftsOfABatchAreThoseOfEachRequestAlone) {
  TestModel target = open_cpu_model(stories_dir());
  TestModel draft = open_cpu_model(stories_dir());
  const std::vector<int32_t> prompt = test_prompt(stories_dir());
  std::vector<GenerationRequest> requests(3);
  for (size_t i = 0; i < requests.size(); ++i) {
    // Prompts of different lengths: the drafts catch up on them in chunks of different sizes.
    for (size_t copy = 0; copy <= i * 6; ++copy)
      requests[i].prompt.insert(requests[i].prompt.end(), prompt.begin(), prompt.end());
    requests[i].max_tokens = 60 + 10 * static_cast<int64_t>(i);
    requests[i].sampling.temperature = i == 1 ? 0.8f : 0.0f;
    requests[i].sampling.seed = 9;
  }
  SpeculationCounts solo_counts;
  std::vector<GeneratedRun> solo;
  for (const auto& request : requests) {
    GenerationOptions options;
    options.max_tokens = request.max_tokens;
    options.sampling = request.sampling;
    options.prefill_chunk = 64;
    solo.push_back(run_generate(*target.model, request.prompt, options));
    const GeneratedRun drafted = run_generate(
        *target.model, request.prompt,
        with_speculation(options, std::make_shared<DraftModelProposer>(*draft.model, 1, 512, 64), 3));
    expect_same_run(drafted, solo.back(), "alone");
    solo_counts.verify_steps += drafted.counts.verify_steps;
    solo_counts.proposed += drafted.counts.proposed;
    solo_counts.accepted += drafted.counts.accepted;
  }
  auto proposer = std::make_shared<DraftModelProposer>(*draft.model, 3, 512, 64);
  for (auto& request : requests) request.speculation = {proposer, 3};
  SchedulerOptions options;
  options.max_batch = 3;
  options.context_tokens = 512;
  options.prefill_chunk = 64;
  Scheduler scheduler(*target.model, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& request : requests) streams.push_back(scheduler.submit(request));
  for (size_t i = 0; i < streams.size(); ++i) {
    std::vector<int32_t> tokens;
    for (;;) {
      std::optional<TokenEvent> event = streams[i]->next(std::chrono::seconds(60));
      ASSERT_TRUE(event.has_value());
      if (event->token >= 0) tokens.push_back(event->token);
      if (event->finished) break;
    }
    EXPECT_EQ(tokens, solo[i].tokens) << "request " << i;
  }
  scheduler.shutdown(true);
  const SpeculationCounts counts = scheduler.stats().speculation;
  EXPECT_EQ(counts.verify_steps, solo_counts.verify_steps);
  EXPECT_EQ(counts.proposed, solo_counts.proposed);
  EXPECT_EQ(counts.accepted, solo_counts.accepted);
}

// The scheduler publishes its counts: the oracle's proposals are all accepted.
TEST(SpeculativeScheduling, PublishesItsCounts) {
  TestModel opened = open_cpu_model(stories_dir());
  const std::vector<int32_t> prompt = test_prompt(stories_dir());
  const GeneratedRun plain = run_generate(*opened.model, prompt, plain_options(0));
  SchedulerOptions options;
  options.max_batch = 2;
  options.context_tokens = 512;
  options.prefill_chunk = 64;
  Scheduler scheduler(*opened.model, options);
  GenerationRequest request;
  request.prompt = prompt;
  request.max_tokens = kGeneratedTokens;
  request.sampling.temperature = 0;
  request.speculation = {std::make_shared<ReplayProposer>(prompt, plain.tokens), 4};
  auto stream = scheduler.submit(request);
  std::vector<int32_t> tokens;
  for (;;) {
    std::optional<TokenEvent> event = stream->next(std::chrono::seconds(60));
    ASSERT_TRUE(event.has_value());
    if (event->token >= 0) tokens.push_back(event->token);
    if (event->finished) break;
  }
  EXPECT_EQ(tokens, plain.tokens);
  scheduler.shutdown(true);
  const SpeculationCounts counts = scheduler.stats().speculation;
  EXPECT_GT(counts.verify_steps, 0);
  EXPECT_EQ(counts.accepted, counts.proposed);
  // The first token comes from the prefill, each verify step emits its accepted proposals and one
  // more, and the last token may come from a plain decode (no room is left to propose).
  EXPECT_GE(counts.verify_steps + counts.accepted, kGeneratedTokens - 2);
  EXPECT_LE(counts.verify_steps + counts.accepted, kGeneratedTokens - 1);
}

// A proposer that answers more tokens than asked, and ids outside the vocabulary: the core keeps at
// most the count asked, up to the first invalid id, and the output is still the plain run's.
class UnrulyProposer final : public Proposer {
 public:
  explicit UnrulyProposer(std::vector<int32_t> continuation) : continuation_(std::move(continuation)) {}
  std::string name() const override { return "unruly"; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override {
    return std::make_unique<Sequence>(prompt.size(), continuation_);
  }

 private:
  class Sequence final : public SequenceProposer {
   public:
    Sequence(size_t prompt_length, const std::vector<int32_t>& continuation)
        : prompt_length_(prompt_length), continuation_(continuation) {}
    std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t count) override {
      const size_t generated = tokens.size() - prompt_length_;
      ++calls_;
      std::vector<int32_t> proposal;
      for (size_t i = 0; i < static_cast<size_t>(count) + 3 && generated + i < continuation_.size(); ++i)
        proposal.push_back(continuation_[generated + i]);
      // Every third call, an id past the vocabulary after the first two right tokens.
      if (calls_ % 3 == 0 && proposal.size() > 2) proposal[2] = 1 << 30;
      return proposal;
    }

   private:
    size_t prompt_length_;
    const std::vector<int32_t>& continuation_;
    int calls_ = 0;
  };
  std::vector<int32_t> continuation_;
};

TEST(SpeculativeRequests, AProposalIsCutToItsCountAndTheVocabulary) {
  TestModel opened = open_cpu_model(stories_dir());
  const std::vector<int32_t> prompt = test_prompt(stories_dir());
  const GeneratedRun plain = run_generate(*opened.model, prompt, plain_options(0));
  const auto unruly = std::make_shared<UnrulyProposer>(plain.tokens);
  const GeneratedRun cut = run_generate(*opened.model, prompt, with_speculation(plain_options(0), unruly, 4));
  expect_same_run(cut, plain, "unruly proposals");
  // Every proposal kept was the plain run's: all accepted, never more than 4 a step, and fewer on
  // the steps whose proposal held an invalid id.
  EXPECT_EQ(cut.counts.accepted, cut.counts.proposed);
  EXPECT_LT(cut.counts.proposed, 4 * cut.counts.verify_steps);
  EXPECT_GT(cut.counts.proposed, 2 * cut.counts.verify_steps);
}

TEST(SpeculativeRequests, RefuseATokenCountOutOfRange) {
  for (const int32_t tokens : {0, 17, -1}) {
    GenerationRequest request;
    request.prompt = {1, 2, 3};
    request.speculation = {std::make_shared<NgramProposer>(), tokens};
    expect_error_mentions([&] { bound_request(request, 64, 512); }, {"speculative tokens", "1..16"});
  }
  GenerationRequest request;
  request.prompt = {1, 2, 3};
  request.speculation = {std::make_shared<NgramProposer>(), 16};
  bound_request(request, 64, 512);
}

TEST(SpeculativeRequests, ADraftWithAnotherVocabularyIsRefused) {
  TestModel target = open_cpu_model(fixtures_dir() / "llama3-tiny" / "f32");
  TestModel draft = open_cpu_model(stories_dir());
  ModelConfig config = target.model->config();
  config.vocab_size = 1000;
  expect_error_mentions([&] { check_draft_model(config, *draft.model); }, {"vocabulary", "1000", "tokenizer"});
}

TEST(NgramProposal, ProposesWhatFollowedTheLatestLongestMatch) {
  const std::vector<int32_t> tokens{5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7};
  // "5 6 7" occurred at the start (followed by 8 1 6); a 3-gram beats the later "6 7" (then 9).
  EXPECT_EQ(ngram_proposal(tokens, 3, 1, 4), (std::vector<int32_t>{8, 1, 6}));
  // Only 2-grams allowed: the latest "6 7" is followed by 9 2 5 6.
  EXPECT_EQ(ngram_proposal(tokens, 4, 1, 2), (std::vector<int32_t>{9, 2, 5, 6}));
  // The continuation stops at the end of the sequence.
  EXPECT_EQ(ngram_proposal(std::vector<int32_t>{4, 4}, 5, 1, 4), (std::vector<int32_t>{4}));
  // No match at least min_match long: nothing.
  EXPECT_TRUE(ngram_proposal(std::vector<int32_t>{1, 2, 3, 4}, 3, 1, 4).empty());
  EXPECT_TRUE(ngram_proposal(std::vector<int32_t>{1, 2, 9, 2}, 3, 2, 4).empty());
  EXPECT_EQ(ngram_proposal(std::vector<int32_t>{1, 2, 9, 2}, 3, 1, 4), (std::vector<int32_t>{9, 2}));
  EXPECT_TRUE(ngram_proposal(std::vector<int32_t>{}, 3, 1, 4).empty());
}

TEST(StepPlanWithVerify, GivesAVerifyItsWholeRowSet) {
  const std::vector<SequenceProgress> sequences{{10, 10, 5}, {10, 10, 1}, {100, 0, 1}};
  const StepPlan plan = plan_step(sequences, 64, 70);
  ASSERT_EQ(plan.work.size(), 3u);
  EXPECT_EQ(plan.work[0].tokens(), 5);
  EXPECT_EQ(plan.work[1].tokens(), 1);
  EXPECT_EQ(plan.work[2].tokens(), 64);
  EXPECT_EQ(plan.tokens, 70);
  EXPECT_FALSE(plan.every_sequence_decodes);
  // Without the prefill, a verify still keeps the step off the one-token decode graph.
  const std::vector<SequenceProgress> decoding{{10, 10, 3}, {10, 10, 1}};
  EXPECT_FALSE(plan_step(decoding, 64, 64).every_sequence_decodes);
  const std::vector<SequenceProgress> plain{{10, 10, 1}, {10, 10, 1}};
  EXPECT_TRUE(plan_step(plain, 64, 64).every_sequence_decodes);
  // A verify that does not fit what the budget leaves waits; the next sequence's decode goes on.
  const StepPlan tight = plan_step(decoding, 64, 2);
  ASSERT_EQ(tight.work.size(), 1u);
  EXPECT_EQ(tight.work[0].sequence, 1u);
}

}  // namespace
