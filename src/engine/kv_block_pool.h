// The host bookkeeping of a paged KV cache (issue 30): which of the cache's fixed-size blocks are
// free, which are held and by how many sequences, and which hold a prompt prefix that a later
// request may reuse (automatic prefix caching: vLLM's v1 KV cache manager, SGLang's radix cache).
// It knows block ids and token ids only; the engine moves the ids into the model cache's block
// tables (ModelCache::assign_blocks).
//
// A full block is cached under its place in a chain: the block before it (none for a sequence's
// first), its tokens and the pool's identity (the model and adapter whose rows it holds). Its key
// hashes the parent's key with the rest, but a lookup never trusts the key alone: it compares the
// block's tokens and its parent block, so by induction from the first block a matched run holds
// exactly the rows of the tokens asked for, whatever the hash does. Equal keys only cost a compare.
//
// Cached blocks nobody holds stay cached until allocate needs their room, then go least recently
// used first, and only as leaves: a block is evicted only when no cached block follows it. So the
// index is always a tree whose every block is reachable from a first block, no entry is left
// unreachable, and one eviction frees exactly one block. (Evicting an inner block would make its
// descendants unreachable; they would have to go with it, freeing more than asked, or stay as dead
// entries, as vLLM's hash map keeps them.) A sequence's blocks are released in one call, the last
// first, so a chain's tail is never more recent than its head and the leaves' order is the LRU order.
//
// Snapshot handles (a hybrid model's recurrent state after a block, kept by the engine) go with
// their block and are let go of when it is evicted; the engine, whose snapshot entries are fewer
// than the blocks, takes back the least recently used handle when it needs an entry.
//
// Threads: used from one thread (the scheduler's); nothing is locked.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <vector>

namespace kiln {

// The key of a full block's place in a chain: the first 8 bytes (little-endian) of the SHA-256 of
// the parent's key (0 for a sequence's first block) and the identity as 8 little-endian bytes each,
// then the tokens as 4 little-endian bytes each. A fixed function of the chain, not of the process,
// so a key means the same thing wherever it travels. Exactness does not rest on it (lookups compare
// the tokens); 64 bits make unequal chains under one key rare, and SHA-256 (core/sha256.h, no new
// dependency) makes them hard to craft. A block's 272 bytes hash in 2 to 4 µs (plain C++ SHA-256),
// little beside the prefill of its 64 tokens.
uint64_t kv_block_key(uint64_t parent_key, uint64_t identity, std::span<const int32_t> tokens);

using KvBlockKeyFunction =
    std::function<uint64_t(uint64_t parent_key, uint64_t identity, std::span<const int32_t> tokens)>;

struct KvBlockPoolOptions {
  int64_t blocks = 0;
  // Tokens per block. 64: the splits at which a chunked prefill is bit-identical to a one-shot one
  // (GenerationCore::kPrefixBlock), so reusing whole blocks keeps a cached answer exact.
  int64_t block_tokens = 64;
  // The model and adapter whose rows the blocks hold (e.g. their fingerprint): part of every key.
  uint64_t identity = 0;
  // Told each snapshot handle the pool lets go of (its block evicted, or a handle cache_block did
  // not keep), for the engine to free in its snapshot store. Needed only by a caller that passes them.
  std::function<void(int32_t snapshot)> on_snapshot_freed;
  // The key function; a test passes one that collides.
  KvBlockKeyFunction key_function = kv_block_key;
};

struct KvBlockPoolStats {
  int64_t total_blocks = 0;
  int64_t free_blocks = 0;                 // hold nothing
  int64_t cached_unreferenced_blocks = 0;  // cached, held by no sequence: reusable, or evicted on demand
  int64_t in_use_blocks = 0;               // held by at least one sequence
  int64_t prefix_query_tokens = 0;         // tokens passed to match_prefix
  int64_t prefix_hit_tokens = 0;           // of them, matched by cached blocks
  int64_t evicted_blocks = 0;
  int64_t snapshots = 0;                   // cached blocks with a snapshot handle
};

// What a matched run must end with for the caller to resume after it: any cached block (attention
// rows alone resume at any block boundary), or a block with a recurrent-state snapshot (a hybrid
// model's recurrent layers resume only from their state there).
enum class PrefixResume { kAnyBlock, kSnapshotBlock };

struct PrefixMatch {
  std::vector<int32_t> blocks;      // the run, in order, each now referenced for the caller
  std::optional<int32_t> snapshot;  // the last block's snapshot handle, if it has one
};

class KvBlockPool {
 public:
  explicit KvBlockPool(KvBlockPoolOptions options);

  int64_t block_tokens() const { return block_tokens_; }

  // `count` free blocks, each referenced once, evicting cached unreferenced blocks when too few are
  // free. Nothing (and nothing evicted) when even that is too few: the caller preempts.
  std::optional<std::vector<int32_t>> allocate(int64_t count);
  // Drops one reference on each block, the last first, so a sequence releases its table in table
  // order in one call: a cached block may not be let go while a block cached after it is held. A
  // block no one holds becomes free, or stays cached until evicted.
  void release(std::span<const int32_t> blocks);

  // Caches `block`, which the caller holds and whose rows hold `tokens` (block_tokens of them),
  // as the block after `parent` (a cached block the caller holds; none for a sequence's first).
  // `snapshot`: a handle for the recurrent state after this block, now the pool's to free.
  // Returns the block cached at this place: `block`, or the one cached there before it, which
  // then holds the caller's reference instead of `block` (`block` is released): the caller puts
  // the returned block in its table and names it as the next block's parent. Of two snapshot
  // handles for one block the first stays; the other is freed at once.
  int32_t cache_block(std::optional<int32_t> parent, int32_t block, std::span<const int32_t> tokens,
                      std::optional<int32_t> snapshot = std::nullopt);

  // The longest run of cached blocks that begins `tokens`, at most `max_tokens` tokens long, and
  // for kSnapshotBlock cut back to its last block with a snapshot; each block is referenced for
  // the caller. A snapshot matched counts as used (drop_least_recently_used_snapshot); its handle
  // stays valid until the block is evicted or that drops it: the caller resumes from it at once.
  PrefixMatch match_prefix(std::span<const int32_t> tokens, int64_t max_tokens,
                           PrefixResume resume = PrefixResume::kAnyBlock);

  // Gives a cached block that the caller holds `snapshot`, the handle of the recurrent state after
  // it, now the pool's to free (cache_block's `snapshot`, for a block cached before its state was
  // taken). A block that has a handle already keeps it; the new one is freed at once.
  void add_snapshot(int32_t block, int32_t snapshot);
  // The snapshot handle of a cached block, if it has one.
  std::optional<int32_t> snapshot(int32_t block) const;
  // Lets go of the snapshot handle least recently given (cache_block) or matched (match_prefix),
  // telling on_snapshot_freed; its block stays cached without one. False when no block has one.
  bool drop_least_recently_used_snapshot();

  // The key a cached block is indexed under; nothing for a block that is not cached.
  std::optional<uint64_t> block_key(int32_t block) const;
  int32_t references(int32_t block) const;
  KvBlockPoolStats stats() const;

 private:
  struct Block {
    int32_t references = 0;
    bool cached = false;
    // While cached:
    uint64_t key = 0;
    std::optional<int32_t> parent;
    int32_t cached_children = 0;
    int32_t referenced_children = 0;  // cached children someone holds: the block may not be let go
    std::optional<int32_t> snapshot;
    uint64_t last_used = 0;           // when its last reference was dropped
    uint64_t snapshot_last_used = 0;  // when its snapshot was given or last matched
  };

  void check_block(int32_t block, const char* what) const;
  std::span<const int32_t> tokens_of(int32_t block) const;
  std::optional<int32_t> find_cached(uint64_t key, std::optional<int32_t> parent,
                                     std::span<const int32_t> tokens) const;
  void reference(int32_t block);
  void drop_reference(int32_t block);
  void evict_least_recently_used();
  void keep_snapshot(int32_t block, std::optional<int32_t> snapshot);
  void touch_snapshot(int32_t block);
  void drop_snapshot(int32_t block);

  int64_t block_tokens_;
  uint64_t identity_;
  std::function<void(int32_t)> on_snapshot_freed_;
  KvBlockKeyFunction key_function_;
  std::vector<Block> blocks_;
  std::vector<int32_t> cached_tokens_;  // block b's tokens at [b · block_tokens, (b + 1) · block_tokens)
  std::vector<int32_t> free_;
  std::unordered_multimap<uint64_t, int32_t> index_;  // key → cached block (several on a collision)
  std::set<std::pair<uint64_t, int32_t>> evictable_;  // (last_used, block) of unreferenced cached leaves
  std::set<std::pair<uint64_t, int32_t>> snapshots_by_use_;  // (snapshot_last_used, block) of blocks with one
  uint64_t clock_ = 0;
  int64_t cached_unreferenced_ = 0;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
  int64_t evicted_ = 0;
};

}  // namespace kiln
