#include "model/paged_kv_cache.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace kiln {

PagedKvCache::PagedKvCache(Backend& backend, int64_t layers, int64_t slots, int64_t capacity, int64_t blocks,
                           int64_t kv_heads, int64_t head_dim)
    : backend_(backend), slots_(slots), blocks_(blocks), table_width_(kv_table_width(capacity)) {
  if (slots < 1 || capacity < 1 || blocks < 1)
    fail("KV cache: slots ({}), capacity ({}) and blocks ({}) must each be at least 1", slots, capacity, blocks);
  for (int64_t layer = 0; layer < layers; ++layer) {
    keys_.push_back(backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype()));
    values_.push_back(backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype()));
  }
  block_table_ = backend.alloc({slots, table_width_}, DType::I32);
  // A dry run (the memory plan) has a table without storage, which nothing reads.
  if (!backend.computes_values()) return;
  const int64_t entries = slots * table_width_;
  const bool static_blocks = blocks >= entries;
  if (static_blocks && entries - 1 > std::numeric_limits<int32_t>::max())
    fail("KV cache: {} slots of {} blocks need block ids beyond the block table's 32-bit entries", slots,
         table_width_);
  Tensor host = Tensor::empty({slots, table_width_}, DType::I32);
  int32_t* ids = host.data<int32_t>();
  for (int64_t entry = 0; entry < entries; ++entry) ids[entry] = static_blocks ? static_cast<int32_t>(entry) : 0;
  write_entries(host, block_table_);
}

void PagedKvCache::assign_blocks(int32_t slot, int64_t first_entry, std::span<const int32_t> blocks) {
  const auto count = static_cast<int64_t>(blocks.size());
  if (slot < 0 || slot >= slots_) fail("KV cache: slot {} out of range (the cache has {} slots)", slot, slots_);
  if (first_entry < 0 || first_entry + count > table_width_)
    fail("KV cache: slot {} block table entries [{}, {}) out of range (a slot has {} entries of {} positions)", slot,
         first_entry, first_entry + count, table_width_, kKvBlockTokens);
  for (int64_t i = 0; i < count; ++i)
    if (blocks[static_cast<size_t>(i)] < 0 || blocks[static_cast<size_t>(i)] >= blocks_)
      fail("KV cache: slot {} block table entry {} given block {}, but the pool has {} blocks", slot, first_entry + i,
           blocks[static_cast<size_t>(i)], blocks_);
  if (count == 0) return;
  Tensor host = Tensor::empty({count}, DType::I32);
  std::copy(blocks.begin(), blocks.end(), host.data<int32_t>());
  Tensor entries = block_table_.slice_rows(slot, 1).reshape({table_width_}).slice_rows(first_entry, count);
  write_entries(host, entries);
}

size_t PagedKvCache::bytes() const {
  size_t total = block_table_.nbytes();
  for (const auto* pools : {&keys_, &values_})
    for (const Tensor& pool : *pools) total += pool.nbytes();
  return total;
}

void PagedKvCache::write_entries(const Tensor& host_entries, Tensor& device_entries) {
  // A device copies from the host in stream order (from pageable memory the copy is staged before
  // upload_into returns, so `host_entries` may go at once); on the CPU, upload hands the host tensor
  // back and copy writes it.
  if (GraphOps* graph = backend_.graph_ops())
    graph->upload_into(host_entries, device_entries);
  else
    backend_.copy(backend_.upload(host_entries), device_entries);
}

}  // namespace kiln
