// The KV block pool (engine/kv_block_pool.h): references, the prefix index and its chains, the
// identity in every key, least-recently-used eviction of leaves, exactness under colliding keys,
// recurrent-state snapshot handles, the stats, and allocation failing without side effects.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/sha256.h"
#include "engine/kv_block_pool.h"

namespace kiln::testing {
namespace {

constexpr int64_t kBlockTokens = 64;

// One block's tokens, different for every `seed`.
std::vector<int32_t> block_of(int32_t seed) {
  std::vector<int32_t> tokens(kBlockTokens);
  for (int64_t i = 0; i < kBlockTokens; ++i) tokens[i] = seed * 1000 + static_cast<int32_t>(i);
  return tokens;
}

// The tokens of the blocks `seeds`, one after the other, then `extra` more that fill no block.
std::vector<int32_t> prompt_of(std::initializer_list<int32_t> seeds, int64_t extra = 0) {
  std::vector<int32_t> tokens;
  for (int32_t seed : seeds) {
    const std::vector<int32_t> block = block_of(seed);
    tokens.insert(tokens.end(), block.begin(), block.end());
  }
  for (int64_t i = 0; i < extra; ++i) tokens.push_back(7);
  return tokens;
}

KvBlockPoolOptions options_with(int64_t blocks) {
  KvBlockPoolOptions options;
  options.blocks = blocks;
  return options;
}

// What the engine does for a sequence that prefills `seeds`: allocates its blocks and caches each
// after the one before, taking the block the pool hands back. The table it then holds.
std::vector<int32_t> prefill(KvBlockPool& pool, std::initializer_list<int32_t> seeds,
                             std::vector<std::optional<int32_t>> snapshots = {}) {
  std::optional<std::vector<int32_t>> table = pool.allocate(static_cast<int64_t>(seeds.size()));
  EXPECT_TRUE(table.has_value()) << "no room to prefill";
  if (!table) return {};
  std::optional<int32_t> parent;
  size_t i = 0;
  for (int32_t seed : seeds) {
    const std::optional<int32_t> snapshot = i < snapshots.size() ? snapshots[i] : std::nullopt;
    (*table)[i] = pool.cache_block(parent, (*table)[i], block_of(seed), snapshot);
    parent = (*table)[i];
    ++i;
  }
  return *table;
}

// The blocks a match finds, released again at once (a query that leaves no reference behind).
std::vector<int32_t> peek(KvBlockPool& pool, const std::vector<int32_t>& tokens,
                          PrefixResume resume = PrefixResume::kAnyBlock) {
  PrefixMatch match = pool.match_prefix(tokens, static_cast<int64_t>(tokens.size()), resume);
  pool.release(match.blocks);
  return match.blocks;
}

TEST(KvBlockPool, AllocatesDistinctBlocksEachReferencedOnce) {
  KvBlockPool pool(options_with(8));
  const std::vector<int32_t> first = pool.allocate(3).value();
  const std::vector<int32_t> second = pool.allocate(5).value();
  std::vector<int32_t> all = first;
  all.insert(all.end(), second.begin(), second.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  for (int32_t block : all) EXPECT_EQ(pool.references(block), 1) << "block " << block;
  EXPECT_FALSE(pool.allocate(1).has_value()) << "every block is held";
  EXPECT_TRUE(pool.allocate(0).value().empty());

  pool.release(first);
  for (int32_t block : first) EXPECT_EQ(pool.references(block), 0);
  const KvBlockPoolStats stats = pool.stats();
  EXPECT_EQ(stats.free_blocks, 3);
  EXPECT_EQ(stats.in_use_blocks, 5);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 0) << "uncached blocks go straight back to the free list";
  const std::vector<int32_t> again = pool.allocate(3).value();
  EXPECT_EQ(std::set<int32_t>(again.begin(), again.end()), std::set<int32_t>(first.begin(), first.end()));
}

TEST(KvBlockPool, ACachedBlockIsInUseUntilItsLastHolderReleasesIt) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> table = prefill(pool, {1});
  PrefixMatch shared = pool.match_prefix(prompt_of({1}, 5), 64);
  ASSERT_EQ(shared.blocks, table);
  EXPECT_EQ(pool.references(table[0]), 2);

  pool.release(table);
  EXPECT_EQ(pool.references(table[0]), 1);
  EXPECT_EQ(pool.stats().in_use_blocks, 1);
  pool.release(shared.blocks);
  EXPECT_EQ(pool.references(table[0]), 0);
  EXPECT_EQ(pool.stats().in_use_blocks, 0);
  EXPECT_EQ(pool.stats().cached_unreferenced_blocks, 1);
  EXPECT_TRUE(pool.block_key(table[0]).has_value()) << "released, the block stays cached";
  EXPECT_EQ(peek(pool, prompt_of({1})), table) << "and is found again";
  EXPECT_THROW(pool.release(table), Error) << "released once too often";
}

TEST(KvBlockPool, MatchesTheLongestCachedRunOfFullBlocks) {
  KvBlockPool pool(options_with(8));
  const std::vector<int32_t> table = prefill(pool, {1, 2, 3});
  const std::vector<int32_t> first_two(table.begin(), table.begin() + 2);

  EXPECT_EQ(peek(pool, prompt_of({1, 2, 3}, 10)), table);
  EXPECT_EQ(peek(pool, prompt_of({1, 2, 3, 4})), table) << "block 4 was never cached";
  EXPECT_EQ(peek(pool, prompt_of({1, 2, 9})), first_two);
  EXPECT_EQ(peek(pool, prompt_of({1, 2}, 63)), first_two) << "a partial block never matches";
  EXPECT_TRUE(peek(pool, prompt_of({9, 2, 3})).empty()) << "a run begins the prompt";
  std::vector<int32_t> changed_last_token = prompt_of({1});
  changed_last_token.back() += 1;
  EXPECT_TRUE(peek(pool, changed_last_token).empty());

  // The caller's cap: a prompt of three whole blocks that must leave one token to prefill.
  const std::vector<int32_t> prompt = prompt_of({1, 2, 3});
  PrefixMatch capped = pool.match_prefix(prompt, static_cast<int64_t>(prompt.size()) - 1);
  EXPECT_EQ(capped.blocks, first_two);
  EXPECT_EQ(pool.references(table[2]), 1) << "the block past the cap is not taken";
  pool.release(capped.blocks);
  EXPECT_TRUE(pool.match_prefix(prompt, 0).blocks.empty());
}

TEST(KvBlockPool, TheSameTokensAfterAnotherBlockAreAnotherBlock) {
  KvBlockPool pool(options_with(8));
  const std::vector<int32_t> one_two = prefill(pool, {1, 2});
  const std::vector<int32_t> three = prefill(pool, {3});
  EXPECT_EQ(peek(pool, prompt_of({3, 2})), three) << "block 2 is cached after block 1 only";

  const std::vector<int32_t> three_two = prefill(pool, {3, 2});
  EXPECT_EQ(three_two[0], three[0]) << "block 3 was cached already";
  EXPECT_NE(three_two[1], one_two[1]) << "block 2 after block 3 is a block of its own";
  EXPECT_NE(pool.block_key(three_two[1]), pool.block_key(one_two[1]));
  EXPECT_EQ(peek(pool, prompt_of({3, 2})), three_two);
  EXPECT_EQ(peek(pool, prompt_of({1, 2})), one_two);
}

TEST(KvBlockPool, TheIdentityIsPartOfEveryKey) {
  auto keys_for = [](uint64_t identity) {
    KvBlockPoolOptions options = options_with(4);
    options.identity = identity;
    KvBlockPool pool(options);
    std::vector<uint64_t> keys;
    for (int32_t block : prefill(pool, {1, 2})) keys.push_back(pool.block_key(block).value());
    return keys;
  };
  const std::vector<uint64_t> model = keys_for(11), adapter = keys_for(12);
  EXPECT_NE(model[0], adapter[0]);
  EXPECT_NE(model[1], adapter[1]);
  EXPECT_EQ(keys_for(11), model) << "a key is a function of the chain and the identity alone";
}

TEST(KvBlockKey, IsTheFirst8BytesOfTheSha256OfTheChain) {
  const std::vector<int32_t> tokens = {1, -2, 0x01020304};
  const uint8_t bytes[] = {
      0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // the parent's key
      0x0d, 0x0c, 0x0b, 0x0a, 0, 0, 0, 0,              // the identity
      1, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff, 0x04, 0x03, 0x02, 0x01,
  };
  Sha256 hash;
  hash.update(bytes, sizeof bytes);
  const std::array<uint8_t, 32> digest = hash.finish();
  uint64_t expected = 0;
  for (int i = 7; i >= 0; --i) expected = (expected << 8) | digest[i];
  EXPECT_EQ(kv_block_key(0x1122334455667788, 0x0a0b0c0d, tokens), expected);
}

TEST(KvBlockPool, EvictsTheLeastRecentlyUsedLeafFirstAndForgetsIt) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> chain = prefill(pool, {1, 2});  // released first: the oldest
  pool.release(chain);
  const std::vector<int32_t> other = prefill(pool, {3});
  pool.release(other);
  pool.release(pool.match_prefix(prompt_of({1}), 64).blocks);  // block 1 used again, block 2 not

  // One block free; the second comes from evicting the oldest leaf, block 2 (after block 1).
  // (A match marks what it finds as used, so only block 1's chain, the newest, is looked up here.)
  std::vector<int32_t> held = pool.allocate(2).value();
  EXPECT_EQ(pool.stats().evicted_blocks, 1);
  EXPECT_FALSE(pool.block_key(chain[1]).has_value());
  EXPECT_TRUE(pool.block_key(other[0]).has_value());
  EXPECT_EQ(peek(pool, prompt_of({1, 2})), std::vector<int32_t>{chain[0]});

  // Block 1, a leaf now, was used after block 3: block 3 goes first.
  const std::vector<int32_t> next = pool.allocate(1).value();
  EXPECT_EQ(next, other);
  EXPECT_TRUE(peek(pool, prompt_of({3})).empty());
  EXPECT_EQ(peek(pool, prompt_of({1})), std::vector<int32_t>{chain[0]});
  const std::vector<int32_t> last = pool.allocate(1).value();
  EXPECT_EQ(last, std::vector<int32_t>{chain[0]});
  EXPECT_TRUE(peek(pool, prompt_of({1})).empty());
  EXPECT_EQ(pool.stats().evicted_blocks, 3);
  EXPECT_FALSE(pool.allocate(1).has_value());

  // The blocks come back with other tokens; nothing of the old chains is found through them.
  pool.release(held);
  pool.release(next);
  pool.release(last);
  const std::vector<int32_t> reused = prefill(pool, {4, 5, 6, 7});
  EXPECT_TRUE(peek(pool, prompt_of({1, 2})).empty());
  EXPECT_EQ(peek(pool, prompt_of({4, 5, 6, 7})), reused);
}

TEST(KvBlockPool, AChainReleasedTogetherLosesItsTailFirst) {
  KvBlockPool pool(options_with(3));
  const std::vector<int32_t> chain = prefill(pool, {1, 2, 3});
  pool.release(chain);
  const std::vector<int32_t> taken = pool.allocate(1).value();
  EXPECT_EQ(taken, std::vector<int32_t>{chain[2]});
  EXPECT_EQ(peek(pool, prompt_of({1, 2, 3})), std::vector<int32_t>(chain.begin(), chain.begin() + 2));
}

TEST(KvBlockPool, AHeldBlockIsNeverEvicted) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> chain = prefill(pool, {1, 2});
  pool.release(chain);
  const std::vector<int32_t> newer = prefill(pool, {3});
  pool.release(newer);
  PrefixMatch head = pool.match_prefix(prompt_of({1}), 64);  // holds block 1; block 2 is cached, unheld
  ASSERT_EQ(head.blocks, std::vector<int32_t>{chain[0]});
  const std::vector<int32_t> taken = pool.allocate(2).value();  // the free block, then block 2 evicted
  EXPECT_FALSE(pool.block_key(chain[1]).has_value());
  // Block 1 is a leaf now and older than block 3, but held.
  EXPECT_EQ(pool.allocate(1).value(), newer);
  EXPECT_FALSE(pool.allocate(1).has_value());
  EXPECT_TRUE(pool.block_key(chain[0]).has_value());
  pool.release(head.blocks);
  EXPECT_EQ(pool.allocate(1).value(), std::vector<int32_t>{chain[0]});
}

TEST(KvBlockPool, CollidingKeysNeverMatchAnotherBlock) {
  KvBlockPoolOptions options = options_with(6);
  options.key_function = [](uint64_t, uint64_t, std::span<const int32_t>) -> uint64_t { return 42; };
  KvBlockPool pool(options);
  const std::vector<int32_t> one_two = prefill(pool, {1, 2});
  const std::vector<int32_t> three_two = prefill(pool, {3, 2});
  EXPECT_EQ(pool.block_key(one_two[1]), pool.block_key(three_two[1])) << "the test's keys all collide";
  EXPECT_NE(one_two[1], three_two[1]);

  EXPECT_EQ(peek(pool, prompt_of({1, 2})), one_two);
  EXPECT_EQ(peek(pool, prompt_of({3, 2})), three_two);
  EXPECT_EQ(peek(pool, prompt_of({3, 1})), std::vector<int32_t>{three_two[0]});
  EXPECT_EQ(peek(pool, prompt_of({1, 3})), std::vector<int32_t>{one_two[0]});
  EXPECT_TRUE(peek(pool, prompt_of({2})).empty()) << "block 2 is cached only after another block";
  EXPECT_TRUE(peek(pool, prompt_of({4})).empty());
  const std::vector<int32_t> again = prefill(pool, {1});
  EXPECT_EQ(again, std::vector<int32_t>{one_two[0]}) << "an equal chain is still recognized";
  pool.release(again);

  // Evicting one of the colliding entries takes out that one only: {1, 2} goes, {3, 2} stays.
  pool.release(one_two);
  pool.release(three_two);
  pool.allocate(4).value();
  EXPECT_EQ(pool.stats().evicted_blocks, 2);
  EXPECT_TRUE(peek(pool, prompt_of({1})).empty());
  EXPECT_EQ(peek(pool, prompt_of({3, 2})), three_two);
}

TEST(KvBlockPool, ATwinBlockIsSwappedForTheCachedOne) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> first = prefill(pool, {1, 2});
  // A second sequence that prefilled the same prompt beside the first.
  const std::vector<int32_t> own = pool.allocate(2).value();
  const int32_t head = pool.cache_block(std::nullopt, own[0], block_of(1));
  EXPECT_EQ(head, first[0]);
  EXPECT_EQ(pool.references(first[0]), 2);
  EXPECT_EQ(pool.references(own[0]), 0) << "the twin is released";
  EXPECT_EQ(pool.stats().free_blocks, 1);
  const int32_t tail = pool.cache_block(head, own[1], block_of(2));
  EXPECT_EQ(tail, first[1]);
  EXPECT_FALSE(pool.block_key(own[1]).has_value());
  EXPECT_EQ(pool.stats().free_blocks, 2);
}

TEST(KvBlockPool, SnapshotHandlesAreMatchedAndFreedWithTheirBlock) {
  std::vector<int32_t> freed;
  KvBlockPoolOptions options = options_with(4);
  options.on_snapshot_freed = [&freed](int32_t snapshot) { freed.push_back(snapshot); };
  KvBlockPool pool(options);
  const std::vector<int32_t> chain = prefill(pool, {1, 2, 3}, {std::nullopt, 11, std::nullopt});

  PrefixMatch resumable = pool.match_prefix(prompt_of({1, 2, 3}, 1), 193, PrefixResume::kSnapshotBlock);
  EXPECT_EQ(resumable.blocks, std::vector<int32_t>(chain.begin(), chain.begin() + 2));
  EXPECT_EQ(resumable.snapshot, 11);
  EXPECT_EQ(pool.references(chain[2]), 1) << "the block past the snapshot is not taken";
  pool.release(resumable.blocks);
  PrefixMatch any = pool.match_prefix(prompt_of({1, 2, 3}, 1), 193);
  EXPECT_EQ(any.blocks, chain);
  EXPECT_EQ(any.snapshot, std::nullopt);
  pool.release(any.blocks);
  PrefixMatch none = pool.match_prefix(prompt_of({1}, 1), 65, PrefixResume::kSnapshotBlock);
  EXPECT_TRUE(none.blocks.empty());
  EXPECT_EQ(none.snapshot, std::nullopt);

  // A handle for a block that has one already is freed at once; one for a block without is kept.
  EXPECT_EQ(pool.cache_block(chain[0], chain[1], block_of(2), 12), chain[1]);
  EXPECT_EQ(freed, std::vector<int32_t>{12});
  const std::vector<int32_t> twin = pool.allocate(1).value();
  EXPECT_EQ(pool.cache_block(std::nullopt, twin[0], block_of(1), 13), chain[0]);
  EXPECT_EQ(freed, std::vector<int32_t>{12});
  pool.release(std::vector<int32_t>{chain[0]});  // the twin's reference, now on chain[0]

  pool.release(chain);
  pool.allocate(4).value();
  EXPECT_EQ(freed, (std::vector<int32_t>{12, 11, 13})) << "evicted tail first: block 3, then 2, then 1";
}

// The engine's snapshot entries are fewer than the blocks: it takes back the handle least recently
// given or matched, whose block stays cached (and matchable by a run that needs no snapshot).
TEST(KvBlockPool, TheLeastRecentlyUsedSnapshotIsDroppedFirst) {
  std::vector<int32_t> freed;
  KvBlockPoolOptions options = options_with(6);
  options.on_snapshot_freed = [&freed](int32_t snapshot) { freed.push_back(snapshot); };
  KvBlockPool pool(options);
  const std::vector<int32_t> x = prefill(pool, {1, 2}, {21, 22});
  const std::vector<int32_t> y = prefill(pool, {3}, {23});
  EXPECT_EQ(pool.stats().snapshots, 3);
  EXPECT_EQ(pool.snapshot(x[1]), 22);
  PrefixMatch used = pool.match_prefix(prompt_of({1}, 1), 65, PrefixResume::kSnapshotBlock);
  EXPECT_EQ(used.snapshot, 21);
  pool.release(used.blocks);

  ASSERT_TRUE(pool.drop_least_recently_used_snapshot());
  EXPECT_EQ(freed, std::vector<int32_t>{22}) << "21 was matched since";
  EXPECT_EQ(pool.snapshot(x[1]), std::nullopt);
  EXPECT_EQ(peek(pool, prompt_of({1, 2}, 1)), x) << "the block stays cached";
  EXPECT_EQ(peek(pool, prompt_of({1, 2}, 1), PrefixResume::kSnapshotBlock), std::vector<int32_t>{x[0]});
  ASSERT_TRUE(pool.drop_least_recently_used_snapshot());
  ASSERT_TRUE(pool.drop_least_recently_used_snapshot());
  EXPECT_EQ(freed, (std::vector<int32_t>{22, 23, 21}));
  EXPECT_FALSE(pool.drop_least_recently_used_snapshot());
  EXPECT_EQ(pool.stats().snapshots, 0);

  // A cached block without one takes a new handle, one that has one frees the new one at once, a
  // block that is not cached takes none; an eviction frees the block's.
  pool.add_snapshot(y[0], 24);
  EXPECT_EQ(pool.snapshot(y[0]), 24);
  pool.add_snapshot(y[0], 25);
  EXPECT_EQ(pool.snapshot(y[0]), 24);
  const std::vector<int32_t> uncached = pool.allocate(1).value();
  EXPECT_THROW(pool.add_snapshot(uncached[0], 26), Error);
  pool.release(uncached);
  pool.release(x);
  pool.release(y);
  pool.allocate(6).value();
  EXPECT_EQ(freed, (std::vector<int32_t>{22, 23, 21, 25, 24}));
  EXPECT_EQ(pool.stats().snapshots, 0);
}

TEST(KvBlockPool, StatsCountEveryStateAndTheQueries) {
  KvBlockPool pool(options_with(6));
  const std::vector<int32_t> chain = prefill(pool, {1, 2, 3});
  const std::vector<int32_t> scratch = pool.allocate(1).value();
  KvBlockPoolStats stats = pool.stats();
  EXPECT_EQ(stats.total_blocks, 6);
  EXPECT_EQ(stats.in_use_blocks, 4);
  EXPECT_EQ(stats.free_blocks, 2);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 0);

  pool.release(chain);
  stats = pool.stats();
  EXPECT_EQ(stats.in_use_blocks, 1);
  EXPECT_EQ(stats.free_blocks, 2);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 3);

  const std::vector<int32_t> prompt = prompt_of({1, 2, 9}, 5);
  PrefixMatch match = pool.match_prefix(prompt, static_cast<int64_t>(prompt.size()) - 1);
  stats = pool.stats();
  EXPECT_EQ(stats.prefix_query_tokens, 3 * 64 + 5);
  EXPECT_EQ(stats.prefix_hit_tokens, 2 * 64);
  EXPECT_EQ(stats.in_use_blocks, 3);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 1);

  EXPECT_FALSE(pool.allocate(4).has_value()) << "two free and one cached unreferenced";
  const std::vector<int32_t> more = pool.allocate(3).value();
  stats = pool.stats();
  EXPECT_EQ(stats.evicted_blocks, 1);
  EXPECT_EQ(stats.in_use_blocks, 6);
  EXPECT_EQ(stats.free_blocks, 0);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 0);
  pool.release(match.blocks);
  pool.release(more);
  pool.release(scratch);
  stats = pool.stats();
  EXPECT_EQ(stats.free_blocks, 4);
  EXPECT_EQ(stats.cached_unreferenced_blocks, 2);
}

TEST(KvBlockPool, AllocationThatCannotSucceedEvictsNothing) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> cached = prefill(pool, {1, 2});
  pool.release(cached);
  const std::vector<int32_t> held = pool.allocate(2).value();
  EXPECT_FALSE(pool.allocate(3).has_value());
  EXPECT_EQ(pool.stats().evicted_blocks, 0);
  EXPECT_EQ(peek(pool, prompt_of({1, 2})), cached) << "the cache is untouched";

  const std::vector<int32_t> rest = pool.allocate(2).value();
  EXPECT_EQ(pool.stats().evicted_blocks, 2);
  EXPECT_FALSE(pool.allocate(1).has_value()) << "every block is referenced";
}

TEST(KvBlockPool, RefusesMisuse) {
  KvBlockPool pool(options_with(4));
  const std::vector<int32_t> chain = prefill(pool, {1, 2});
  const std::vector<int32_t> spare = pool.allocate(1).value();
  const std::vector<int32_t> short_block(kBlockTokens - 1, 5);

  EXPECT_THROW(pool.release(std::vector<int32_t>{4}), Error) << "outside the pool";
  EXPECT_THROW(pool.allocate(-1), Error);
  EXPECT_THROW(pool.match_prefix(prompt_of({1}), -1), Error);
  EXPECT_THROW(pool.cache_block(std::nullopt, spare[0], short_block), Error) << "not a full block";
  EXPECT_THROW(pool.cache_block(std::nullopt, 3, block_of(9)), Error) << "block 3 is free, held by no one";
  EXPECT_THROW(pool.cache_block(spare[0], chain[1], block_of(9)), Error) << "the parent is not cached";
  EXPECT_THROW(pool.cache_block(chain[1], chain[0], block_of(1)), Error) << "cached at another place";
  EXPECT_THROW(pool.cache_block(std::nullopt, spare[0], block_of(9), 5), Error) << "no one to free the snapshot";
  EXPECT_THROW(pool.release(std::vector<int32_t>{chain[0]}), Error) << "block 2, after it, is still held";
  EXPECT_EQ(pool.references(chain[0]), 1) << "a refused release keeps the reference";
  EXPECT_THROW(pool.release(std::vector<int32_t>{chain[1], chain[0]}), Error) << "the tail must go first";

  KvBlockPoolOptions no_blocks = options_with(0);
  EXPECT_THROW(KvBlockPool{no_blocks}, Error);
}

}  // namespace
}  // namespace kiln::testing
