// What the prefix-cache tests share (tests/prefix_cache_test.cpp on the CPU,
// tests/cuda/prefix_cache_test.cpp on the GPU): a request's events compared bit for bit, and the
// scenarios every family runs on a warm scheduler against a cold one — a prompt's prefix, a hit
// that leaves one prompt token, a chat's next turns, a hit in a batch with others, evictions — with
// the hits each must get, so that a cache that reuses nothing fails them; and a hybrid cache's
// snapshot put back into another slot against a one-shot prefill, logit row by row.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/generation.h"
#include "engine/scheduler.h"
#include "model_test_support.h"
#include "tensor_test_support.h"

namespace kiln::testing {

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

inline Answer collect(RequestStream& stream) {
  using namespace std::chrono_literals;
  Answer answer;
  for (;;) {
    auto event = stream.next(60s);
    if (!event) {
      ADD_FAILURE() << "no event within 60 s";
      return answer;
    }
    answer.events.push_back(*event);
    if (event->finished) break;
  }
  answer.cached = stream.cached_tokens();
  return answer;
}

inline Answer run(Scheduler& scheduler, const GenerationRequest& request) {
  return collect(*scheduler.submit(request));
}

inline GenerationRequest request_for(std::vector<int32_t> prompt, int64_t max_tokens, float temperature = 0.0f) {
  GenerationRequest request;
  request.prompt = std::move(prompt);
  request.max_tokens = max_tokens;
  request.sampling.temperature = temperature;
  request.sampling.seed = 7;
  request.top_logprobs = 5;  // the alternatives come from the whole logit row: a changed bit shows
  return request;
}

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The same tokens, logprobs and top alternatives, bit for bit.
inline void expect_identical(const Answer& warm, const Answer& cold, const std::string& what) {
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

inline SchedulerOptions prefix_options(int32_t slots, bool prefix_cache = true, int64_t prefill_chunk = 64) {
  SchedulerOptions options;
  options.max_batch = slots;
  options.context_tokens = 512;
  options.prefill_chunk = prefill_chunk;
  options.prefix_cache = prefix_cache;
  return options;
}

inline std::vector<int32_t> slice(const std::vector<int32_t>& ids, size_t begin, size_t end) {
  return {ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.begin() + static_cast<std::ptrdiff_t>(end)};
}

inline std::vector<int32_t> joined(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A model whose cache resumes at any position (attention only), on 2 slots: every full block a
// request wrote is reused, those its decode steps wrote included. Needs a prompt of 300 tokens.
inline void expect_attention_hits_give_the_cold_answers(Model& model, const std::vector<int32_t>& prompt) {
  Scheduler cold(model, prefix_options(2, false));
  Scheduler warm(model, prefix_options(2));

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

// A hybrid model (its Gated DeltaNet state resumes only from a snapshot at a block boundary that a
// prefill chunk ended at), on 2 slots with room for every snapshot the scenario takes. The cold
// scheduler prefills in chunks of 64, the warm one in chunks of 256, which it ends at each
// prompt's last boundary to keep the state there: a hit gives the cold answer whatever the chunks,
// as long as they end at multiples of 64. Needs a prompt of 300 tokens.
inline void expect_hybrid_hits_give_the_cold_answers(Model& model, const std::vector<int32_t>& prompt) {
  Scheduler cold(model, prefix_options(2, false));
  SchedulerOptions warm_options = prefix_options(2, true, 256);
  warm_options.prefix_snapshots = 16;
  Scheduler warm(model, warm_options);
  int64_t hits = 0;
  const auto expect_hit = [&](const GenerationRequest& request, int64_t cached, const std::string& what) {
    const Answer warm_answer = run(warm, request);
    EXPECT_EQ(warm_answer.cached, cached) << what;
    hits += warm_answer.cached;
    expect_identical(warm_answer, run(cold, request), what);
    return warm_answer;
  };

  // A 150-token prompt keeps the state at 128, its last boundary; a prompt sharing its first 130
  // tokens resumes there: a hit that ends inside the prompt at a block boundary.
  expect_hit(request_for(slice(prompt, 0, 150), 4), 0, "a first prompt");
  expect_hit(request_for(joined(slice(prompt, 0, 130), slice(prompt, 250, 290)), 12, 0.8f), 128,
             "a prompt's prefix");
  expect_hit(request_for(slice(prompt, 0, 129), 8), 128, "one prompt token left");
  // A prompt that ends at a boundary keeps the state there too: its repeat resumes from the
  // boundary before (at least one token is left to run), a longer prompt from its end.
  expect_hit(request_for(slice(prompt, 0, 192), 6), 128, "a prompt of whole blocks");
  expect_hit(request_for(slice(prompt, 0, 192), 6), 128, "its repeat");
  expect_hit(request_for(joined(slice(prompt, 0, 192), slice(prompt, 200, 230)), 6), 192, "a longer prompt");

  // A chat: each turn's prompt is the last one's, its answer and more. A turn resumes from the last
  // boundary of the turn before's prompt: the first turn's rows 64..99 ran token by token at the
  // end of its prompt and 100..127 were written by its decode steps, so its block 1, full when it
  // ends, is never reused.
  const GenerationRequest turn1 = request_for(slice(prompt, 100, 200), 40);
  const Answer answer1 = expect_hit(turn1, 0, "a first turn");
  const GenerationRequest turn2 =
      request_for(joined(joined(turn1.prompt, answer1.tokens()), slice(prompt, 10, 40)), 20, 0.8f);
  ASSERT_EQ(turn2.prompt.size(), 170u);
  const Answer answer2 = expect_hit(turn2, 64, "a second turn");
  const GenerationRequest turn3 =
      request_for(joined(joined(turn2.prompt, answer2.tokens()), slice(prompt, 40, 60)), 10);
  expect_hit(turn3, 128, "a third turn");

  // A hit while another request runs in the other slot (the hit's prefill steps carry the other's
  // decodes), and the other's answer too.
  const GenerationRequest busy_request = request_for(slice(prompt, 150, 300), 30);
  auto busy = warm.submit(busy_request);
  const GenerationRequest again = request_for(joined(slice(turn3.prompt, 0, 170), slice(prompt, 60, 70)), 10);
  const Answer batched = run(warm, again);
  const Answer busy_answer = collect(*busy);  // the two schedulers share the model: one runs at a time
  EXPECT_EQ(batched.cached, 128);
  hits += batched.cached;
  expect_identical(batched, run(cold, again), "a hit in a batch");
  expect_identical(busy_answer, run(cold, busy_request), "the request beside it");

  // No hit: a prompt shorter than a block, twice; a prompt whose shared block has no snapshot
  // (the prompts above kept none at 64).
  expect_hit(request_for(slice(prompt, 0, 50), 6), 0, "a short prompt");
  expect_hit(request_for(slice(prompt, 0, 50), 6), 0, "its repeat");
  expect_hit(request_for(joined(slice(prompt, 0, 70), slice(prompt, 200, 260)), 6), 0,
             "no snapshot to resume from");

  const SchedulerStats stats = warm.stats();
  EXPECT_EQ(stats.prefix_hit_tokens, hits);
  EXPECT_GT(stats.prefix_query_tokens, stats.prefix_hit_tokens);
  EXPECT_EQ(cold.stats().prefix_hit_tokens, 0);
}

// A hybrid model under memory pressure, on 1 slot: with one snapshot entry, each new prompt's
// snapshot takes the last one's; with a pool of 8 blocks, a block's eviction takes its snapshot
// with it. Every answer stays the cold one. Needs a prompt of 300 tokens.
inline void expect_hybrid_evictions_keep_the_cold_answers(Model& model, const std::vector<int32_t>& prompt) {
  Scheduler cold(model, prefix_options(1, false));
  const std::vector<int32_t> x = slice(prompt, 0, 150), y = slice(prompt, 150, 300);
  const auto expect_hit = [&](Scheduler& warm, const GenerationRequest& request, int64_t cached,
                              const std::string& what) {
    const Answer warm_answer = run(warm, request);
    EXPECT_EQ(warm_answer.cached, cached) << what;
    expect_identical(warm_answer, run(cold, request), what);
  };
  {
    SchedulerOptions one_snapshot = prefix_options(1, true, 256);
    one_snapshot.prefix_snapshots = 1;
    Scheduler warm(model, one_snapshot);
    expect_hit(warm, request_for(x, 4), 0, "x");
    expect_hit(warm, request_for(y, 4), 0, "y, whose snapshot takes x's entry");
    expect_hit(warm, request_for(joined(x, slice(prompt, 10, 20)), 4), 0, "x again, its blocks cached alone");
    expect_hit(warm, request_for(joined(x, slice(prompt, 20, 30)), 4), 128, "x once more, from its new snapshot");
    expect_hit(warm, request_for(joined(y, slice(prompt, 20, 30)), 4), 0, "y, its snapshot given up for x's");
  }
  SchedulerOptions small_pool = prefix_options(1, true, 256);
  small_pool.kv_cache_tokens = 512;
  small_pool.prefix_snapshots = 4;  // an entry for every snapshot: only the pool evicts
  Scheduler warm(model, small_pool);
  expect_hit(warm, request_for(x, 4), 0, "x in a small pool");  // caches 2 blocks, a snapshot on the second
  expect_hit(warm, request_for(y, 4), 0, "y in a small pool");  // 2 more: 4 cached, 4 free
  // 5 blocks for 300 prompt tokens and 4 generated: the 4 free ones and x's last block, the least
  // recently used leaf, with its snapshot.
  expect_hit(warm, request_for(joined(slice(prompt, 290, 300), slice(prompt, 1, 291)), 4), 0, "a prompt that evicts");
  expect_hit(warm, request_for(joined(y, slice(prompt, 5, 10)), 4), 128, "y stays cached");
  expect_hit(warm, request_for(joined(slice(x, 0, 130), slice(prompt, 5, 10)), 4), 0,
             "x's first block stays, but its snapshot went with its second");
  EXPECT_GT(warm.stats().prefix_snapshots, 0);
}

// A hybrid cache's snapshot (ModelCache::save_snapshot) of the state a chunk left at 128, put back
// into another slot whose table starts with the same blocks, continues with the logits of a
// one-shot prefill of the whole prompt, every row bit for bit, as does the slot it was taken from;
// both then decode the same bits. Needs a prompt of 200 tokens.
inline void expect_a_snapshot_resumes_with_the_one_shot_logits(Model& model, std::vector<int32_t> prompt) {
  prompt.resize(200);
  const Tensor one_shot = logits_with_cuts(model, prompt, {});
  auto cache = model.make_cache(2, 256);  // slot s holds blocks 4s .. 4s + 3
  cache->allocate_snapshots(2);
  EXPECT_EQ(cache->snapshots(), 2);
  run_step(model, *cache, {SequenceStep{0, 0, slice(prompt, 0, 128), true}});
  cache->save_snapshot(0, 1);
  const std::vector<int32_t> shared{0, 1};
  cache->assign_blocks(1, 0, shared);
  cache->restore_snapshot(1, 1);
  const Tensor resumed = run_step(model, *cache, {SequenceStep{1, 128, slice(prompt, 128, 200), true}});
  const Tensor continued = run_step(model, *cache, {SequenceStep{0, 128, slice(prompt, 128, 200), true}});
  for (int64_t row = 0; row < 72; ++row) {
    EXPECT_TRUE(same_rows(resumed, row, one_shot, 128 + row, 1)) << "position " << 128 + row << ", resumed";
    EXPECT_TRUE(same_rows(continued, row, one_shot, 128 + row, 1)) << "position " << 128 + row << ", continued";
  }
  const Tensor decoded_resumed = run_step(model, *cache, {SequenceStep{1, 200, {prompt[7]}}});
  const Tensor decoded_continued = run_step(model, *cache, {SequenceStep{0, 200, {prompt[7]}}});
  EXPECT_TRUE(same_rows(decoded_resumed, 0, decoded_continued, 0, 1)) << "a decode after";
  EXPECT_THROW(cache->save_snapshot(0, 2), Error) << "snapshot 2 of 2";
  EXPECT_THROW(cache->restore_snapshot(0, 2), Error) << "slot 2 of 2";
}

}  // namespace kiln::testing
