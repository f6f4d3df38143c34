// The paged KV cache and its prefix cache (GenerationCore): a request whose prompt begins with
// cached blocks prefills only the rest, and its tokens, log-probabilities and top alternatives are
// bit-identical to the same request on a cold scheduler: after a prompt, after a multi-turn history
// (whose rows, on an attention model, were written by decode steps), in a batch with others, for a
// hit that leaves one prompt token; cached blocks are evicted least recently used first when the
// pool is short; requests preempted for blocks get their solo answers. A hybrid model resumes from
// snapshots of its recurrent state at block boundaries: the same answers, with snapshots and blocks
// evicted, and a snapshot put back into another slot gives the logits of a one-shot prefill.
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "model_test_support.h"
#include "prefix_cache_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

SchedulerOptions options(int32_t slots, bool prefix_cache = true) { return prefix_options(slots, prefix_cache); }

class PrefixCache : public ::testing::TestWithParam<const char*> {};

TEST_P(PrefixCache, HitsGiveTheColdAnswerBitForBit) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  expect_attention_hits_give_the_cold_answers(*loaded.model, fixture_prompt(fixture));
}

INSTANTIATE_TEST_SUITE_P(Families, PrefixCache, ::testing::Values("llama3-tiny", "qwen3-tiny", "qwen3-moe-tiny"));

class HybridPrefixCache : public ::testing::TestWithParam<const char*> {};

TEST_P(HybridPrefixCache, HitsResumeFromSnapshotsWithTheColdAnswerBitForBit) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  expect_hybrid_hits_give_the_cold_answers(*loaded.model, fixture_prompt(fixture));
}

TEST_P(HybridPrefixCache, EvictedSnapshotsAndBlocksLeaveTheColdAnswers) {
  const auto fixture = fixtures_dir() / GetParam();
  TestModel loaded = open_cpu_model(fixture / "f32");
  expect_hybrid_evictions_keep_the_cold_answers(*loaded.model, fixture_prompt(fixture));
}

INSTANTIATE_TEST_SUITE_P(Families, HybridPrefixCache, ::testing::Values("qwen3_5-text-tiny", "qwen3_5-moe-tiny"));

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

// Without snapshot entries a hybrid model reuses nothing (its state cannot resume mid-history),
// and stays exact.
TEST(PrefixCacheSlots, AHybridModelWithoutSnapshotsNeverReuses) {
  const auto fixture = fixtures_dir() / "qwen3_5-text-tiny";
  TestModel loaded = open_cpu_model(fixture / "f32");
  const std::vector<int32_t> prompt = fixture_prompt(fixture);
  Scheduler cold(*loaded.model, options(1, false));
  SchedulerOptions no_snapshots = options(1);
  no_snapshots.prefix_snapshots = 0;
  Scheduler warm(*loaded.model, no_snapshots);
  const GenerationRequest request = request_for(slice(prompt, 0, 150), 6);
  run(warm, request);
  const Answer again = run(warm, request);
  EXPECT_EQ(again.cached, 0);
  expect_identical(again, run(cold, request), "a hybrid model's repeat");
  EXPECT_EQ(warm.stats().prefix_snapshots, 0);
}

// The cache's snapshot itself (ModelCache::save_snapshot): put back into another slot, it gives
// the one-shot logits bit for bit.
TEST(PrefixCacheSlots, ASnapshotPutBackInAnotherSlotGivesTheOneShotLogits) {
  for (const char* name : {"qwen3_5-text-tiny", "qwen3_5-moe-tiny"}) {
    SCOPED_TRACE(name);
    const auto fixture = fixtures_dir() / name;
    TestModel loaded = open_cpu_model(fixture / "f32");
    expect_a_snapshot_resumes_with_the_one_shot_logits(*loaded.model, fixture_prompt(fixture));
  }
}

}  // namespace
