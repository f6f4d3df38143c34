#include "engine/kv_block_pool.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/sha256.h"

namespace kiln {
namespace {

void append_little_endian(std::vector<uint8_t>& bytes, uint64_t value, int size) {
  for (int i = 0; i < size; ++i) bytes.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

}  // namespace

uint64_t kv_block_key(uint64_t parent_key, uint64_t identity, std::span<const int32_t> tokens) {
  std::vector<uint8_t> bytes;
  bytes.reserve(16 + 4 * tokens.size());
  append_little_endian(bytes, parent_key, 8);
  append_little_endian(bytes, identity, 8);
  for (int32_t token : tokens) append_little_endian(bytes, static_cast<uint32_t>(token), 4);
  Sha256 hash;
  hash.update(bytes.data(), bytes.size());
  const std::array<uint8_t, 32> digest = hash.finish();
  uint64_t key = 0;
  for (int i = 0; i < 8; ++i) key |= uint64_t{digest[i]} << (8 * i);
  return key;
}

KvBlockPool::KvBlockPool(KvBlockPoolOptions options)
    : block_tokens_(options.block_tokens),
      identity_(options.identity),
      on_snapshot_freed_(std::move(options.on_snapshot_freed)),
      key_function_(std::move(options.key_function)) {
  if (options.blocks < 1 || options.blocks > std::numeric_limits<int32_t>::max())
    fail("a KV block pool needs 1 to {} blocks, got {}", std::numeric_limits<int32_t>::max(), options.blocks);
  if (block_tokens_ < 1) fail("a KV block holds at least one token, got {}", block_tokens_);
  if (!key_function_) fail("a KV block pool needs a key function");
  blocks_.resize(options.blocks);
  cached_tokens_.resize(options.blocks * block_tokens_);
  // Handed out from the back: block 0 first.
  free_.reserve(options.blocks);
  for (int64_t block = options.blocks - 1; block >= 0; --block) free_.push_back(static_cast<int32_t>(block));
}

std::optional<std::vector<int32_t>> KvBlockPool::allocate(int64_t count) {
  if (count < 0) fail("cannot allocate {} KV blocks", count);
  // Every unreferenced cached block can be evicted, leaves first: what follows it is unreferenced
  // too, since a held block's parent is held (drop_reference refuses to break that).
  if (count > static_cast<int64_t>(free_.size()) + cached_unreferenced_) return std::nullopt;
  while (static_cast<int64_t>(free_.size()) < count) evict_least_recently_used();
  std::vector<int32_t> allocated(free_.end() - count, free_.end());
  std::reverse(allocated.begin(), allocated.end());
  free_.resize(free_.size() - count);
  for (int32_t block : allocated) blocks_[block].references = 1;
  return allocated;
}

void KvBlockPool::release(std::span<const int32_t> blocks) {
  for (int32_t block : blocks) check_block(block, "release");
  for (auto block = blocks.rbegin(); block != blocks.rend(); ++block) drop_reference(*block);
}

int32_t KvBlockPool::cache_block(std::optional<int32_t> parent, int32_t block, std::span<const int32_t> tokens,
                                 std::optional<int32_t> snapshot) {
  check_block(block, "cache_block");
  if (blocks_[block].references == 0) fail("cache_block: block {} is not held by anyone", block);
  if (static_cast<int64_t>(tokens.size()) != block_tokens_)
    fail("cache_block: block {} is given {} tokens; only a full block of {} is cached", block, tokens.size(),
         block_tokens_);
  if (parent) {
    check_block(*parent, "cache_block's parent");
    if (!blocks_[*parent].cached || blocks_[*parent].references == 0)
      fail("cache_block: the parent of block {}, block {}, is not a cached block the caller holds", block, *parent);
  }
  if (snapshot && !on_snapshot_freed_) fail("cache_block: a snapshot handle needs on_snapshot_freed to be freed");

  if (blocks_[block].cached) {
    if (blocks_[block].parent != parent || !std::ranges::equal(tokens_of(block), tokens))
      fail("cache_block: block {} is already cached at another place", block);
    keep_snapshot(block, snapshot);
    return block;
  }
  const uint64_t key = key_function_(parent ? blocks_[*parent].key : 0, identity_, tokens);
  if (std::optional<int32_t> earlier = find_cached(key, parent, tokens)) {
    reference(*earlier);
    drop_reference(block);
    keep_snapshot(*earlier, snapshot);
    return *earlier;
  }
  Block& entry = blocks_[block];
  entry.cached = true;
  entry.key = key;
  entry.parent = parent;
  keep_snapshot(block, snapshot);
  std::ranges::copy(tokens, cached_tokens_.begin() + block * block_tokens_);
  index_.emplace(key, block);
  if (parent) {
    ++blocks_[*parent].cached_children;
    ++blocks_[*parent].referenced_children;
  }
  return block;
}

PrefixMatch KvBlockPool::match_prefix(std::span<const int32_t> tokens, int64_t max_tokens, PrefixResume resume) {
  if (max_tokens < 0) fail("match_prefix: at most {} tokens cannot be reused", max_tokens);
  prefix_query_tokens_ += static_cast<int64_t>(tokens.size());
  const int64_t whole_blocks = std::min(static_cast<int64_t>(tokens.size()), max_tokens) / block_tokens_;
  PrefixMatch match;
  std::optional<int32_t> parent;
  for (int64_t i = 0; i < whole_blocks; ++i) {
    const std::span<const int32_t> block_tokens = tokens.subspan(i * block_tokens_, block_tokens_);
    const uint64_t key = key_function_(parent ? blocks_[*parent].key : 0, identity_, block_tokens);
    parent = find_cached(key, parent, block_tokens);
    if (!parent) break;
    match.blocks.push_back(*parent);
  }
  if (resume == PrefixResume::kSnapshotBlock)
    while (!match.blocks.empty() && !blocks_[match.blocks.back()].snapshot) match.blocks.pop_back();
  // Head first: each block's parent is already held when it is (drop_reference's rule).
  for (int32_t block : match.blocks) reference(block);
  if (!match.blocks.empty()) match.snapshot = blocks_[match.blocks.back()].snapshot;
  if (match.snapshot) touch_snapshot(match.blocks.back());
  prefix_hit_tokens_ += static_cast<int64_t>(match.blocks.size()) * block_tokens_;
  return match;
}

std::optional<uint64_t> KvBlockPool::block_key(int32_t block) const {
  check_block(block, "block_key");
  if (!blocks_[block].cached) return std::nullopt;
  return blocks_[block].key;
}

void KvBlockPool::add_snapshot(int32_t block, int32_t snapshot) {
  check_block(block, "add_snapshot");
  if (!blocks_[block].cached || blocks_[block].references == 0)
    fail("add_snapshot: block {} is not a cached block the caller holds", block);
  if (!on_snapshot_freed_) fail("add_snapshot: a snapshot handle needs on_snapshot_freed to be freed");
  keep_snapshot(block, snapshot);
}

std::optional<int32_t> KvBlockPool::snapshot(int32_t block) const {
  check_block(block, "snapshot");
  return blocks_[block].snapshot;
}

bool KvBlockPool::drop_least_recently_used_snapshot() {
  if (snapshots_by_use_.empty()) return false;
  const int32_t block = snapshots_by_use_.begin()->second;
  const int32_t snapshot = *blocks_[block].snapshot;
  drop_snapshot(block);
  on_snapshot_freed_(snapshot);
  return true;
}

int32_t KvBlockPool::references(int32_t block) const {
  check_block(block, "references");
  return blocks_[block].references;
}

KvBlockPoolStats KvBlockPool::stats() const {
  KvBlockPoolStats stats;
  stats.total_blocks = static_cast<int64_t>(blocks_.size());
  stats.free_blocks = static_cast<int64_t>(free_.size());
  stats.cached_unreferenced_blocks = cached_unreferenced_;
  stats.in_use_blocks = stats.total_blocks - stats.free_blocks - stats.cached_unreferenced_blocks;
  stats.prefix_query_tokens = prefix_query_tokens_;
  stats.prefix_hit_tokens = prefix_hit_tokens_;
  stats.evicted_blocks = evicted_;
  stats.snapshots = static_cast<int64_t>(snapshots_by_use_.size());
  return stats;
}

void KvBlockPool::check_block(int32_t block, const char* what) const {
  if (block < 0 || block >= static_cast<int64_t>(blocks_.size()))
    fail("{}: block {} is outside the pool's {} blocks", what, block, blocks_.size());
}

std::span<const int32_t> KvBlockPool::tokens_of(int32_t block) const {
  return std::span<const int32_t>(cached_tokens_).subspan(block * block_tokens_, block_tokens_);
}

std::optional<int32_t> KvBlockPool::find_cached(uint64_t key, std::optional<int32_t> parent,
                                                std::span<const int32_t> tokens) const {
  const auto [first, last] = index_.equal_range(key);
  for (auto entry = first; entry != last; ++entry) {
    const int32_t block = entry->second;
    if (blocks_[block].parent == parent && std::ranges::equal(tokens_of(block), tokens)) return block;
  }
  return std::nullopt;
}

void KvBlockPool::reference(int32_t block) {
  Block& entry = blocks_[block];
  if (entry.references++ > 0 || !entry.cached) return;
  --cached_unreferenced_;
  if (entry.cached_children == 0) evictable_.erase({entry.last_used, block});
  if (entry.parent) ++blocks_[*entry.parent].referenced_children;
}

void KvBlockPool::drop_reference(int32_t block) {
  Block& entry = blocks_[block];
  if (entry.references == 0) fail("release: block {} is not held", block);
  // Otherwise the block could be evicted while the held child's rows still depend on it, and the
  // pool could not tell how many blocks eviction can free.
  if (entry.references == 1 && entry.referenced_children > 0)
    fail("release: block {} is released while a block cached after it is still held", block);
  if (--entry.references > 0) return;
  if (!entry.cached) {
    free_.push_back(block);
    return;
  }
  entry.last_used = ++clock_;
  ++cached_unreferenced_;
  if (entry.parent) --blocks_[*entry.parent].referenced_children;
  if (entry.cached_children == 0) evictable_.emplace(entry.last_used, block);
}

void KvBlockPool::evict_least_recently_used() {
  const int32_t block = evictable_.begin()->second;
  evictable_.erase(evictable_.begin());
  Block& entry = blocks_[block];
  const auto [first, last] = index_.equal_range(entry.key);
  index_.erase(std::find_if(first, last, [block](const auto& indexed) { return indexed.second == block; }));
  if (entry.parent) {
    Block& parent = blocks_[*entry.parent];
    if (--parent.cached_children == 0 && parent.references == 0) evictable_.emplace(parent.last_used, *entry.parent);
  }
  if (const std::optional<int32_t> snapshot = entry.snapshot) {
    drop_snapshot(block);
    on_snapshot_freed_(*snapshot);
  }
  entry = Block{};
  free_.push_back(block);
  --cached_unreferenced_;
  ++evicted_;
}

void KvBlockPool::keep_snapshot(int32_t block, std::optional<int32_t> snapshot) {
  if (!snapshot) return;
  std::optional<int32_t>& kept = blocks_[block].snapshot;
  if (!kept) {
    kept = snapshot;
    blocks_[block].snapshot_last_used = ++clock_;
    snapshots_by_use_.emplace(blocks_[block].snapshot_last_used, block);
  } else if (*kept != *snapshot) {
    on_snapshot_freed_(*snapshot);
  }
}

void KvBlockPool::touch_snapshot(int32_t block) {
  Block& entry = blocks_[block];
  snapshots_by_use_.erase({entry.snapshot_last_used, block});
  entry.snapshot_last_used = ++clock_;
  snapshots_by_use_.emplace(entry.snapshot_last_used, block);
}

void KvBlockPool::drop_snapshot(int32_t block) {
  Block& entry = blocks_[block];
  snapshots_by_use_.erase({entry.snapshot_last_used, block});
  entry.snapshot.reset();
  entry.snapshot_last_used = 0;
}

}  // namespace kiln
