// Paged KV caches for the op tests (tests/op_table, the backend and CUDA tests): one layer's pools
// and block table (backend.h's KvCacheView), with a slot's blocks contiguous or scattered over the
// pool.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"

namespace kiln::testing {

// Blocks of pool a test cache holds beyond its slots' own, so that a scattered table leaves some
// unused and block ids are not a permutation of the table's entries alone.
constexpr int64_t kSpareKvBlocks = 3;

// A host block table I32 [slots, width] over a pool of `blocks` ≥ slots · width blocks: slot s's
// entries are blocks s·width + i, or, `scattered`, a fixed shuffle of the pool (each block used
// once), so that a slot's blocks are neither contiguous nor in order.
inline Tensor kv_block_table(int64_t slots, int64_t width, int64_t blocks, bool scattered) {
  std::vector<int32_t> pool(static_cast<size_t>(blocks));
  std::iota(pool.begin(), pool.end(), 0);
  if (scattered) {
    // Fisher–Yates from a fixed seed, written out so that every build draws the same table.
    std::mt19937 random(20240530);
    for (size_t i = pool.size(); i > 1; --i) std::swap(pool[i - 1], pool[random() % i]);
  }
  Tensor table = Tensor::empty({slots, width}, DType::I32);
  std::copy(pool.begin(), pool.begin() + slots * width, table.data<int32_t>());
  return table;
}

// One layer's cache on `backend`: zeroed pools of slots · kv_table_width(capacity) + kSpareKvBlocks
// blocks, and the table kv_block_table gives, uploaded.
struct TestKvCache {
  Tensor keys, values, block_table;

  TestKvCache(Backend& backend, int64_t slots, int64_t capacity, int64_t kv_heads, int64_t head_dim, bool scattered) {
    const int64_t width = kv_table_width(capacity);
    const int64_t blocks = slots * width + kSpareKvBlocks;
    keys = backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype());
    values = backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype());
    backend.zero(keys);
    backend.zero(values);
    block_table = backend.upload(kv_block_table(slots, width, blocks, scattered));
  }
  KvCacheView view() { return {keys, values, block_table}; }
};

}  // namespace kiln::testing
