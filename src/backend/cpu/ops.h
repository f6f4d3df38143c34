// The CPU implementations of the Backend ops (internal to backend/cpu; CpuBackend forwards here).
// Every op validates its arguments and splits work over independent outputs only, through
// kiln::ThreadPool::global(); no reduction is ever divided between threads.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/matmul_kernels.h"
#include "core/tensor.h"

namespace kiln::cpu {

// Buffers a matmul reuses between calls: x in the kernels' packed layout, and a widened bias.
struct MatmulScratch {
  Tensor packed_x;
  std::vector<float> bias;
};

void matmul(const MatmulKernels& kernels, const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out,
            MatmulScratch& scratch);

void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out);
void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                  Tensor& out);

void add(Tensor& a, const Tensor& b);
void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts, Tensor& weights);
void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out);
void swiglu(const Tensor& gate, const Tensor& up, Tensor& out);

void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim);

void embedding(const Weight& table, const Tensor& ids, Tensor& out);
void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out);

BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids);
void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache);
void attention(const AttentionKernels& kernels, const Tensor& q, const KvCacheView& cache, const BatchLayout& layout,
               float scale, Tensor& out);

// Gated attention (spec A.5): split per-head [query | gate], and x ← x · sigmoid(gate).
void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate);
void sigmoid_gate(Tensor& x, const Tensor& gate);

}  // namespace kiln::cpu
