// kv_write and causal GQA attention over the f32 paged KV cache (backend.h: a pool of blocks read
// through per-slot block tables).
//
// attention computes each (token, head) pair alone: scores in key order with a fixed-order dot,
// an exact two-pass softmax (max, then Σ exp(s − max) in key order), and Σ_j e_j · v_j in key
// order divided by Σ e_j (attention_kernels.h). Nothing depends on the other tokens of the batch,
// the threads, or the instruction set.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/reductions.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

// The CPU's own layout rule: its kernels read the layout's host slot and position of every token
// and the host block table, so each is checked against the cache (the contract checks the spans
// they were made from). `reads_prefix`: the op reads positions 0..position of the token's slot
// (attention), not only the token's own row (kv_write).
void check_token_rows(std::string_view op, const BatchLayout& layout, int64_t tokens, const KvCacheView& view,
                      const CacheDims& cache, bool reads_prefix) {
  require_cpu(layout.slots, op, "layout.slots");
  require_cpu(layout.positions, op, "layout.positions");
  require_cpu(view.block_table, op, "block_table");
  if (layout.slots.dtype() != DType::I32 || layout.positions.dtype() != DType::I32 ||
      layout.slots.shape() != Shape{tokens} || layout.positions.shape() != Shape{tokens})
    fail("cpu {}: layout.slots {} {} and layout.positions {} {} must be I32 [{}]", op,
         dtype_name(layout.slots.dtype()), shape_string(layout.slots.shape()), dtype_name(layout.positions.dtype()),
         shape_string(layout.positions.shape()), tokens);
  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  // The last position each slot's tokens read, to check the slot's table entries up to it once.
  std::vector<int64_t> last_read(static_cast<size_t>(cache.slots), -1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= cache.slots)
      fail("cpu {}: token {} is in slot {}, but the block table has {} slots", op, t, slots[t], cache.slots);
    if (positions[t] < 0 || positions[t] >= cache.capacity)
      fail("cpu {}: token {} is at position {}, but the block table holds {} positions per slot", op, t, positions[t],
           cache.capacity);
    int64_t& slot_read = last_read[static_cast<size_t>(slots[t])];
    if (reads_prefix)
      slot_read = std::max<int64_t>(slot_read, positions[t]);
    else
      check_block_ids(kCpuOps, op, view.block_table, slots[t], positions[t], positions[t], cache);
  }
  for (int64_t slot = 0; slot < cache.slots; ++slot)
    if (last_read[static_cast<size_t>(slot)] >= 0)
      check_block_ids(kCpuOps, op, view.block_table, slot, 0, last_read[static_cast<size_t>(slot)], cache);
}

// The offset of position p of `slot` in a pool of rows of `row` floats (backend.h).
int64_t pool_offset(const int32_t* block_table, const CacheDims& cache, int64_t slot, int64_t position, int64_t row) {
  const int64_t block = block_table[slot * cache.table_width + position / kKvBlockTokens];
  return (block * kKvBlockTokens + position % kKvBlockTokens) * row;
}

void scalar_group_scores(const float* q, int64_t heads, const float* keys, int64_t key_stride, int64_t count,
                         int64_t head_dim, float scale, float* scores, int64_t score_stride) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t g = 0; g < heads; ++g)
      scores[g * score_stride + j] = scale * dot_fixed_order(q + g * head_dim, keys + j * key_stride, head_dim);
}

void scalar_group_weighted_sums(const float* weights, int64_t weight_stride, int64_t heads, const float* values,
                                int64_t value_stride, int64_t count, int64_t head_dim, float* sums) {
  for (int64_t j = 0; j < count; ++j) {
    const float* row = values + j * value_stride;
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t d = 0; d < head_dim; ++d) sums[g * head_dim + d] += weights[g * weight_stride + j] * row[d];
  }
}

}  // namespace

const AttentionKernels& attention_kernels_scalar() {
  static const AttentionKernels kernels{&scalar_group_scores, &scalar_group_weighted_sums};
  return kernels;
}

void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& view) {
  constexpr std::string_view op = "kv_write";
  const CacheDims cache = check_kv_write(kCpuOps, k, v, layout, view);
  const int64_t row = cache.kv_heads * cache.head_dim;
  const int64_t tokens = layout.total_tokens;
  check_token_rows(op, layout, tokens, view, cache, false);
  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  const int32_t* block_table = view.block_table.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t offset = pool_offset(block_table, cache, slots[t], positions[t], row);
    std::memcpy(view.keys.data<float>() + offset, k.data<float>() + t * row, static_cast<size_t>(row) * sizeof(float));
    std::memcpy(view.values.data<float>() + offset, v.data<float>() + t * row,
                static_cast<size_t>(row) * sizeof(float));
  }
}

void attention(const AttentionKernels& kernels, const Tensor& q, const KvCacheView& view, const BatchLayout& layout,
               float scale, Tensor& out) {
  constexpr std::string_view op = "attention";
  const AttentionDims dims = check_attention(kCpuOps, q, view, layout, out);
  const CacheDims& cache = dims.cache;
  const int64_t tokens = dims.tokens;
  const int64_t heads = dims.heads;
  const int64_t head_dim = cache.head_dim;
  const int64_t group = heads / cache.kv_heads;
  check_token_rows(op, layout, tokens, view, cache, true);

  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  const int32_t* block_table = view.block_table.data<int32_t>();
  const float* queries = q.data<float>();
  const float* keys = view.keys.data<float>();
  const float* values = view.values.data<float>();
  float* outputs = out.data<float>();
  const int64_t key_stride = cache.kv_heads * head_dim;
  // A task is one token and one kv head with its group of query heads, which read the same key and
  // value rows. Tasks are visited as tokens 0, T-1, 1, T-2, ...: in a causal prefill a later token
  // reads more keys, so alternating ends gives each thread's contiguous block a similar load.
  ThreadPool::global().parallel_for(tokens * cache.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    std::vector<float> totals(static_cast<size_t>(group));
    std::vector<float> sums(static_cast<size_t>(group * head_dim));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t rank = task / cache.kv_heads;
      const int64_t t = rank % 2 == 0 ? rank / 2 : tokens - 1 - rank / 2;
      const int64_t kv_head = task % cache.kv_heads;
      const int64_t first_head = kv_head * group;
      const int64_t key_count = int64_t{positions[t]} + 1;
      // The keys of block i of the slot: positions [64·i, 64·i + 64) (the last block's up to the
      // token's own), each block's rows contiguous in the pool. Per key and per output element the
      // kernels do what they did over one contiguous slot: scores are independent per key, and the
      // weighted sums are added in key order across the calls.
      auto for_each_block = [&](const auto& visit) {
        for (int64_t first_key = 0; first_key < key_count; first_key += kKvBlockTokens)
          visit(first_key, std::min(kKvBlockTokens, key_count - first_key),
                pool_offset(block_table, cache, slots[t], first_key, key_stride) + kv_head * head_dim);
      };

      weights.resize(static_cast<size_t>(group * key_count));
      const float* query = queries + (t * heads + first_head) * head_dim;
      for_each_block([&](int64_t first_key, int64_t count, int64_t offset) {
        kernels.group_scores(query, group, keys + offset, key_stride, count, head_dim, scale,
                             weights.data() + first_key, key_count);
      });
      for (int64_t g = 0; g < group; ++g) {
        float* head_weights = weights.data() + g * key_count;
        const float max_score = *std::max_element(head_weights, head_weights + key_count);
        float total = 0.0f;
        for (int64_t j = 0; j < key_count; ++j) {
          head_weights[j] = std::exp(head_weights[j] - max_score);
          total += head_weights[j];
        }
        totals[g] = total;
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for_each_block([&](int64_t first_key, int64_t count, int64_t offset) {
        kernels.group_weighted_sums(weights.data() + first_key, key_count, group, values + offset, key_stride, count,
                                    head_dim, sums.data());
      });
      for (int64_t g = 0; g < group; ++g) {
        float* output = outputs + (t * heads + first_head + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) output[d] = sums[g * head_dim + d] / totals[g];
      }
    }
  });
}

}  // namespace kiln::cpu
