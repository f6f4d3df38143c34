// kv_write and causal GQA attention over the f32 KV cache.
//
// attention computes each (token, head) pair alone: scores in key order with a fixed-order dot,
// an exact two-pass softmax (max, then Σ exp(s − max) in key order), and Σ_j e_j · v_j in key
// order divided by Σ e_j. Nothing depends on the other tokens of the batch or on the threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/checks.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/reductions.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

struct CacheShape {
  int64_t slots, capacity, kv_heads, head_dim;
};

CacheShape check_caches(std::string_view op, const Tensor& k_cache, const Tensor& v_cache) {
  require_dtype(k_cache, DType::F32, op, "k_cache");
  require_dtype(v_cache, DType::F32, op, "v_cache");
  if (k_cache.ndim() != 4)
    fail("{}: k_cache has shape {}, expected [slots, capacity, kv_heads, head_dim]", op,
         shape_string(k_cache.shape()));
  require_shape(v_cache, k_cache.shape(), op, "v_cache");
  return {k_cache.dim(0), k_cache.dim(1), k_cache.dim(2), k_cache.dim(3)};
}

// The layout's host slot and position of every token, each checked against the cache.
void check_layout(std::string_view op, const BatchLayout& layout, int64_t tokens, const CacheShape& cache) {
  require_dtype(layout.slots, DType::I32, op, "layout.slots");
  require_dtype(layout.positions, DType::I32, op, "layout.positions");
  require_shape(layout.slots, {tokens}, op, "layout.slots");
  require_shape(layout.positions, {tokens}, op, "layout.positions");
  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= cache.slots)
      fail("{}: token {} is in slot {}, but the cache has {} slots", op, t, slots[t], cache.slots);
    if (positions[t] < 0 || positions[t] >= cache.capacity)
      fail("{}: token {} is at position {}, but the cache holds {} positions per slot", op, t, positions[t],
           cache.capacity);
  }
}

}  // namespace

void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, Tensor& k_cache, Tensor& v_cache) {
  constexpr std::string_view op = "kv_write";
  const CacheShape cache = check_caches(op, k_cache, v_cache);
  const int64_t row = cache.kv_heads * cache.head_dim;
  require_dtype(k, DType::F32, op, "k");
  require_dtype(v, DType::F32, op, "v");
  const int64_t tokens = layout.total_tokens;
  require_shape(k, {tokens, cache.kv_heads, cache.head_dim}, op, "k");
  require_shape(v, {tokens, cache.kv_heads, cache.head_dim}, op, "v");
  check_layout(op, layout, tokens, cache);
  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t offset = (slots[t] * cache.capacity + positions[t]) * row;
    std::memcpy(k_cache.data<float>() + offset, k.data<float>() + t * row, static_cast<size_t>(row) * sizeof(float));
    std::memcpy(v_cache.data<float>() + offset, v.data<float>() + t * row, static_cast<size_t>(row) * sizeof(float));
  }
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const BatchLayout& layout,
               float scale, Tensor& out) {
  constexpr std::string_view op = "attention";
  const CacheShape cache = check_caches(op, k_cache, v_cache);
  require_dtype(q, DType::F32, op, "q");
  if (q.ndim() != 3 || q.dim(2) != cache.head_dim)
    fail("attention: q has shape {}, expected [T, heads, head_dim = {}]", shape_string(q.shape()), cache.head_dim);
  const int64_t tokens = q.dim(0);
  const int64_t heads = q.dim(1);
  const int64_t head_dim = cache.head_dim;
  if (cache.kv_heads == 0 || heads % cache.kv_heads != 0)
    fail("attention: {} query heads are not a multiple of {} kv heads", heads, cache.kv_heads);
  const int64_t group = heads / cache.kv_heads;
  require_dtype(out, DType::F32, op, "out");
  require_shape(out, q.shape(), op, "out");
  if (layout.total_tokens != tokens)
    fail("attention: q has {} tokens, but the layout has {}", tokens, layout.total_tokens);
  check_layout(op, layout, tokens, cache);

  const int32_t* slots = layout.slots.data<int32_t>();
  const int32_t* positions = layout.positions.data<int32_t>();
  const float* queries = q.data<float>();
  const float* keys = k_cache.data<float>();
  const float* values = v_cache.data<float>();
  float* outputs = out.data<float>();
  const int64_t key_stride = cache.kv_heads * head_dim;
  // Pairs are visited as tokens 0, T-1, 1, T-2, ...: in a causal prefill a later token reads more
  // keys, so alternating ends gives each thread's contiguous block a similar amount of work.
  ThreadPool::global().parallel_for(tokens * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    std::vector<float> sums(static_cast<size_t>(head_dim));
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t rank = pair / heads;
      const int64_t t = rank % 2 == 0 ? rank / 2 : tokens - 1 - rank / 2;
      const int64_t head = pair % heads;
      const int64_t kv_head = head / group;
      const float* query = queries + (t * heads + head) * head_dim;
      const int64_t slot_offset = slots[t] * cache.capacity * key_stride + kv_head * head_dim;
      const float* key = keys + slot_offset;
      const float* value = values + slot_offset;
      const int64_t key_count = int64_t{positions[t]} + 1;

      weights.resize(static_cast<size_t>(key_count));
      float max_score = -INFINITY;
      for (int64_t j = 0; j < key_count; ++j) {
        weights[j] = scale * dot_fixed_order(query, key + j * key_stride, head_dim);
        max_score = std::max(max_score, weights[j]);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < key_count; ++j) {
        weights[j] = std::exp(weights[j] - max_score);
        total += weights[j];
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t j = 0; j < key_count; ++j) {
        const float* value_row = value + j * key_stride;
        for (int64_t d = 0; d < head_dim; ++d) sums[d] += weights[j] * value_row[d];
      }
      float* output = outputs + (t * heads + head) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) output[d] = sums[d] / total;
    }
  });
}

}  // namespace kiln::cpu
