// Row gathers: embedding (rows of a table in its stored dtype, widened to f32), gather_rows, and a
// mixture's routing and combine (each token's expert rows summed with their routing weights).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/checks.h"
#include "backend/moe_routing.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {

void embedding(const Weight& table, const Tensor& ids, Tensor& out) {
  const EmbeddingDims dims = check_embedding(kCpuOps, table, ids, out);
  const int64_t vocab = dims.vocab, hidden = dims.hidden, tokens = dims.tokens;
  const int32_t* token_ids = ids.data<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    if (token_ids[t] < 0 || token_ids[t] >= vocab)
      fail("cpu embedding: token id {} (at index {}) is outside the vocabulary of {} tokens", token_ids[t], t, vocab);
  float* rows = out.data<float>();
  ThreadPool::global().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (table.quantized())
        decode_rows(table, token_ids[t], token_ids[t] + 1, rows + t * hidden);
      else
        widen_to_f32(table.values().raw(), table.values().dtype(), token_ids[t] * hidden, hidden, rows + t * hidden);
    }
  });
}

void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  const GatherDims dims = check_gather_rows(kCpuOps, x, rows, out);
  const int64_t available = dims.available, width = dims.row_elements;
  const int32_t* indices = rows.data<int32_t>();
  for (int64_t r = 0; r < rows.dim(0); ++r)
    if (indices[r] < 0 || indices[r] >= available)
      fail("cpu gather_rows: row index {} (at {}) is outside x's {} rows", indices[r], r, available);
  for (int64_t r = 0; r < rows.dim(0); ++r)
    std::memcpy(out.data<float>() + r * width, x.data<float>() + indices[r] * width,
                static_cast<size_t>(width) * sizeof(float));
}

void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts, Tensor& weights) {
  const RouteDims dims = check_moe_route(kCpuOps, logits, shared_logits, experts, weights);
  ThreadPool::global().parallel_for(dims.tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TokenRoute route = route_token(logits.data<float>() + t * dims.experts, dims.experts, dims.top_k, normalize);
      std::copy(route.experts.begin(), route.experts.end(), experts.data<int32_t>() + t * dims.top_k);
      float* row = weights.data<float>() + t * dims.terms;
      std::copy(route.weights.begin(), route.weights.end(), row);
      if (shared_logits) row[dims.top_k] = routing::sigmoid(shared_logits->data<float>()[t]);
    }
  });
}

void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) {
  const CombineDims dims = check_moe_combine(kCpuOps, routed, shared, weights, out);
  const float* scales = weights.data<float>();
  float* sums = out.data<float>();
  ThreadPool::global().parallel_for(dims.tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < dims.width; ++h) {
        float acc = 0.0f;
        for (int64_t s = 0; s < dims.terms; ++s) {
          const float term = s < dims.top_k ? routed.data<float>()[(t * dims.top_k + s) * dims.width + h]
                                            : shared->data<float>()[t * dims.width + h];
          acc = std::fma(scales[t * dims.terms + s], term, acc);
        }
        sums[t * dims.width + h] = acc;
      }
  });
}

}  // namespace kiln::cpu
