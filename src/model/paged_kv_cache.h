// The paged KV cache of a graph's attention layers (backend.h, model.h's ModelCache): per layer a
// pool of keys and one of values, [blocks, kKvBlockTokens, kv_heads, head_dim] in the activation
// dtype, and one block table I32 [slots, table_width] on the backend's device that every layer
// reads through. The caches of the dense and the hybrid graphs hold one each and forward
// ModelCache's block calls to it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"

namespace kiln {

class PagedKvCache {
 public:
  // Fails when slots, capacity or blocks is below 1. The table starts as Model::make_cache says.
  PagedKvCache(Backend& backend, int64_t layers, int64_t slots, int64_t capacity, int64_t blocks, int64_t kv_heads,
               int64_t head_dim);

  KvCacheView layer(size_t index) { return {keys_[index], values_[index], block_table_}; }
  int64_t blocks() const { return blocks_; }
  int64_t table_width() const { return table_width_; }
  // ModelCache::assign_blocks.
  void assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks);
  // The pools and the table.
  size_t bytes() const;

 private:
  // device_entries (a part of the table) ← host_entries, in stream order.
  void write_entries(const Tensor& host_entries, Tensor& device_entries);

  Backend& backend_;
  int64_t slots_, blocks_, table_width_;
  std::vector<Tensor> keys_, values_;
  Tensor block_table_;
};

}  // namespace kiln
