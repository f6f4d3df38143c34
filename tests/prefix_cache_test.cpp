// The paged KV cache and its prefix cache (GenerationCore): a request whose prompt begins with
// cached blocks prefills only the rest, and its tokens, log-probabilities and top alternatives are
// bit-identical to the same request on a cold scheduler: after a prompt, after a multi-turn history
// whose rows were written by decode steps, in a batch with others, for a hit that leaves one prompt
// token; cached blocks are evicted least recently used first when the pool is short; requests
// preempted for blocks get their solo answers; a hybrid model never reuses.
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine/scheduler.h"
#include "model_test_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

struct Answer {
  std::vector<TokenEvent> events;
  int64_t cached = 0;
  std::vector<int32_t> tokens() const {
    std::vector<int32_t> ids;
    for (const TokenEvent& event : events)
      if (event.token >= 0) ids.push_back(event.token);
    return ids;
  }
};

Answer collect(RequestStream& stream) {
  Answer answer;
  for (;;) {
    auto event = stream.next(30s);
    if (!event) {
      ADD_FAILURE() << "no event within 30 s";
      return answer;
    }
    answer.events.push_back(*event);
    if (event->finished) break;
  }
  answer.cached = stream.cached_tokens();
  return answer;
}

Answer run(Scheduler& scheduler, const GenerationRequest& request) { return collect(*scheduler.submit(request)); }

GenerationRequest request_for(std::vector<int32_t> prompt, int64_t max_tokens, float temperature = 0.0f) {
  GenerationRequest request;
  request.prompt = std::move(prompt);
  request.max_tokens = max_tokens;
  request.sampling.temperature = temperature;
  request.sampling.seed = 7;
  request.top_logprobs = 5;  // the alternatives come from the whole logit row: a changed bit shows
  return request;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_identical(const Answer& warm, const Answer& cold, const std::string& what) {
  ASSERT_EQ(warm.events.size(), cold.events.size()) << what;
  for (size_t i = 0; i < cold.events.size(); ++i) {
    const TokenEvent &a = warm.events[i], &b = cold.events[i];
    EXPECT_EQ(a.token, b.token) << what << ", event " << i;
    EXPECT_TRUE(same_bits(a.logprob, b.logprob)) << what << ", event " << i;
    ASSERT_EQ(a.top_logprobs.size(), b.top_logprobs.size()) << what;
    for (size_t k = 0; k < b.top_logprobs.size(); ++k) {
      EXPECT_EQ(a.top_logprobs[k].first, b.top_logprobs[k].first) << what << ", event " << i;
      EXPECT_TRUE(same_bits(a.top_logprobs[k].second, b.top_logprobs[k].second)) << what << ", event " << i;
    }
  }
}

SchedulerOptions options(int32_t slots, bool prefix_cache = true) {
  SchedulerOptions options;
  options.max_batch = slots;
  options.context_tokens = 512;
  options.prefill_chunk = 64;
  options.prefix_cache = prefix_cache;
  return options;
}

std::vector<int32_t> slice(const std::vector<int32_t>& ids, size_t begin, size_t end) {
  return {ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.begin() + static_cast<std::ptrdiff_t>(end)};
}

std::vector<int32_t> joined(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class PrefixCache : public ::testing::TestWithParam<const char*> {};

TEST_P(PrefixCache, HitsGiveTheColdAnswerBitForBit) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  Scheduler cold(*loaded.model, options(2, false));
  Scheduler warm(*loaded.model, options(2));

  // A prompt sharing its first 130 tokens with one served before: 128 of them are reused.
  const GenerationRequest first = request_for(joined(slice(prompt, 0, 130), slice(prompt, 250, 290)), 6);
  const GenerationRequest second = request_for(slice(prompt, 0, 200), 12, 0.8f);
  EXPECT_EQ(run(warm, first).cached, 0);
  const Answer hit = run(warm, second);
  EXPECT_EQ(hit.cached, 128);
  expect_identical(hit, run(cold, second), "a prompt's prefix");

  // A hit that leaves a single prompt token (129 tokens, 128 of them held).
  const GenerationRequest short_prompt = request_for(slice(prompt, 0, 129), 8);
  const Answer one_left = run(warm, short_prompt);
  EXPECT_EQ(one_left.cached, 128);
  expect_identical(one_left, run(cold, short_prompt), "one prompt token left");

  // A second turn: the first turn's prompt, its answer and more; rows 100..127 were written by
  // decode steps.
  const GenerationRequest turn1 = request_for(slice(prompt, 0, 100), 40);
  const Answer answer1 = run(warm, turn1);
  std::vector<int32_t> history = joined(slice(prompt, 0, 100), answer1.tokens());
  history = joined(history, slice(prompt, 140, 170));
  const GenerationRequest turn2 = request_for(history, 10);
  const Answer answer2 = run(warm, turn2);
  EXPECT_EQ(answer2.cached, 128);
  expect_identical(answer2, run(cold, turn2), "a second turn");

  // A hit on the second turn's slot while another request runs in the other slot.
  auto busy = warm.submit(request_for(slice(prompt, 150, 300), 30));
  const GenerationRequest again = request_for(joined(slice(history, 0, 150), slice(prompt, 10, 20)), 10);
  const Answer batched = run(warm, again);
  EXPECT_EQ(batched.cached, 128);
  collect(*busy);  // the two schedulers share the model: one runs at a time
  expect_identical(batched, run(cold, again), "a hit in a batch");
  const SchedulerStats stats = warm.stats();
  EXPECT_GE(stats.prefix_hit_tokens, 128 * 4);
  EXPECT_GT(stats.prefix_query_tokens, stats.prefix_hit_tokens);
  EXPECT_EQ(cold.stats().prefix_hit_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, PrefixCache, ::testing::Values("llama3-tiny", "qwen3-tiny", "qwen3-moe-tiny"));

// A pool of 8 blocks (one context of 512 tokens): what a new prompt needs is taken from the cached
// blocks nobody holds, the least recently used first; the answers stay exact.
TEST(PrefixCachePool, TheLeastRecentlyUsedCachedBlocksAreEvictedFirst) {
  const auto fixture = fixtures_dir() / "llama3-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  SchedulerOptions small = options(1);
  small.kv_cache_tokens = 512;
  Scheduler scheduler(*loaded.model, small);
  Scheduler cold(*loaded.model, options(1, false));
  const auto x = slice(prompt, 0, 140), y = slice(prompt, 140, 280);
  run(scheduler, request_for(x, 2));  // leaves 2 full blocks cached
  run(scheduler, request_for(y, 2));  // 2 more: 4 cached, 4 free
  // The stats are published after the step that ended y, which may follow y's last event.
  SchedulerStats stats = scheduler.stats();
  for (int wait = 0; wait < 500 && stats.kv_blocks_used > 0; ++wait) {
    std::this_thread::sleep_for(10ms);
    stats = scheduler.stats();
  }
  EXPECT_EQ(stats.kv_blocks_cached, 4);
  EXPECT_EQ(stats.kv_blocks_free, 4);
  // A prompt that shares no block with them needs 5 blocks for its 300 tokens and 4 generated: the 4
  // free ones and x's last block, the least recently used leaf.
  const GenerationRequest unrelated = request_for(joined(slice(prompt, 290, 300), slice(prompt, 1, 291)), 4);
  expect_identical(run(scheduler, unrelated), run(cold, unrelated), "a prompt that evicts");
  EXPECT_EQ(run(scheduler, request_for(joined(y, slice(prompt, 5, 10)), 2)).cached, 128) << "y stays cached";
  const GenerationRequest x_again = request_for(joined(slice(x, 0, 130), slice(prompt, 5, 10)), 3);
  const Answer x_hit = run(scheduler, x_again);
  EXPECT_EQ(x_hit.cached, 64) << "x's first block stays, its second was evicted";
  expect_identical(x_hit, run(cold, x_again), "a hit on what eviction left");
}

// More requests than the pool holds at once: each step that needs more blocks than are free takes
// back the latest request's, which runs again later (recomputing its prompt and what it had
// generated) and still gives its solo answer, greedy or sampled, on a plain and a hybrid model.
TEST(PrefixCachePool, RequestsPreemptedForBlocksGetTheirSoloAnswers) {
  for (const char* name : {"llama3-tiny", "qwen3_5-text-tiny"}) {
    SCOPED_TRACE(name);
    const auto fixture = fixtures_dir() / name;
    TestModel loaded = open_cpu_model(fixture / "f32");
    const std::vector<int32_t> prompt = fixture_prompt(fixture);
    std::vector<GenerationRequest> requests;
    for (size_t i = 0; i < 4; ++i)
      requests.push_back(request_for(slice(prompt, 20 * i, 20 * i + 100), 150, i % 2 ? 0.8f : 0.0f));
    std::vector<Answer> solo;
    {
      Scheduler cold(*loaded.model, options(1, false));
      for (const GenerationRequest& request : requests) solo.push_back(run(cold, request));
    }
    SchedulerOptions small = options(4);
    small.kv_cache_tokens = 512;  // 8 blocks; each request grows to 4
    Scheduler scheduler(*loaded.model, small);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const GenerationRequest& request : requests) streams.push_back(scheduler.submit(request));
    for (size_t i = 0; i < requests.size(); ++i)
      expect_identical(collect(*streams[i]), solo[i], "request " + std::to_string(i));
    EXPECT_GT(scheduler.stats().preemptions, 0) << "the pool was short: someone was preempted";
  }
}

TEST(PrefixCacheSlots, AHybridModelNeverReusesAndStaysExact) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  Scheduler cold(*loaded.model, options(1, false));
  Scheduler warm(*loaded.model, options(1));
  const GenerationRequest request = request_for(slice(prompt, 0, 150), 6);
  run(warm, request);
  const Answer again = run(warm, request);
  EXPECT_EQ(again.cached, 0) << "a Gated DeltaNet state cannot resume mid-history";
  expect_identical(again, run(cold, request), "a hybrid model's repeat");
}

}  // namespace
