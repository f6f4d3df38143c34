// The op table's attention and hybrid cases: causal GQA attention over caches filled by kv_write
// (prefill crossing 64 and 256, decode batches, appends, GQA 1 to 8, every head size), the CPU's
// attention cases checked against exact arithmetic, and the Gated DeltaNet / gated-attention ops.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kv_cache_support.h"
#include "op_table/op_table.h"
#include "tensor_test_support.h"

namespace kiln::testing {
namespace {

// Fills each span's slot with K/V for positions [0, first_position + tokens) (one kv_write), then
// attends the spans' queries. The slots' blocks are scattered over the pool (kv_cache_support.h).
// `keys` and `values` hold the K/V rows of every filled position (span by span), `queries` the
// spans' queries.
OpCase attention_case(int64_t heads, int64_t kv_heads, int64_t head_dim, const std::vector<SequenceSpan>& spans,
                      const Tensor& keys, const Tensor& values, const Tensor& queries) {
  std::vector<SequenceSpan> fill;
  int32_t filled = 0;
  int64_t slots = 0, capacity = 0;
  for (const SequenceSpan& span : spans) {
    fill.push_back({span.slot, filled, span.first_position + span.tokens, 0});
    filled += span.first_position + span.tokens;
    slots = std::max<int64_t>(slots, span.slot + 1);
    capacity = std::max<int64_t>(capacity, span.first_position + span.tokens);
  }
  const int64_t tokens = span_tokens(spans);
  OpCase op;
  op.name = "attention heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) + " head_dim=" +
            std::to_string(head_dim) + " spans=";
  for (const SequenceSpan& span : spans)
    op.name += "[slot " + std::to_string(span.slot) + " @" + std::to_string(span.first_position) + " ×" +
               std::to_string(span.tokens) + "]";
  const int64_t width = kv_table_width(capacity), blocks = slots * width + kSpareKvBlocks;
  op.inputs = {{keys, Role::Activation},
               {values, Role::Activation},
               {queries, Role::Activation},
               {kv_block_table(slots, width, blocks, true), Role::Index}};
  op.run = [=](Backend& backend, std::vector<Tensor>& in) {
    const DType act = backend.activation_dtype();
    Tensor k_cache = backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, act);
    Tensor v_cache = backend.alloc({blocks, kKvBlockTokens, kv_heads, head_dim}, act);
    backend.zero(k_cache);
    backend.zero(v_cache);
    const KvCacheView cache{k_cache, v_cache, in[3]};
    const BatchLayout fill_layout = backend.make_layout(fill, std::vector<int32_t>(filled, 0));
    backend.kv_write(in[0], in[1], fill_layout, cache);
    const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(tokens, 0));
    Tensor out = backend.alloc({tokens, heads, head_dim}, act);
    backend.attention(in[2], cache, layout, 1.0f / std::sqrt(static_cast<float>(head_dim)), out);
    return std::vector<Tensor>{out};
  };
  // The BF16 tensor-core attention takes head dims that are multiples of 8 up to 256 (cuda/kernels.h).
  op.bf16 = head_dim % 8 == 0 && head_dim <= 256;
  return op;
}

// The same with K, V and queries drawn from N(0, 1).
OpCase attention_case(int64_t heads, int64_t kv_heads, int64_t head_dim, const std::vector<SequenceSpan>& spans,
                      std::mt19937& random) {
  int64_t filled = 0;
  for (const SequenceSpan& span : spans) filled += span.first_position + span.tokens;
  const Tensor keys = random_f32({filled, kv_heads, head_dim}, random);
  const Tensor values = random_f32({filled, kv_heads, head_dim}, random);
  const Tensor queries = random_f32({span_tokens(spans), heads, head_dim}, random);
  return attention_case(heads, kv_heads, head_dim, spans, keys, values, queries);
}

std::vector<OpCase> attention_cases(std::mt19937& random) {
  return {
      attention_case(4, 2, 16, spans_of({{0, 0, 300}}), random),                          // prefill across 64/256
      attention_case(6, 2, 32, spans_of({{1, 200, 70}, {0, 64, 1}, {2, 256, 1}}), random),  // mixed, GQA 3
      attention_case(8, 1, 64, spans_of({{0, 0, 1}, {1, 255, 1}, {2, 700, 1}}), random),    // decode batch
      attention_case(4, 4, 128, spans_of({{0, 510, 5}}), random),                          // multi-token append
      attention_case(16, 2, 256, spans_of({{0, 0, 20}, {1, 300, 1}}), random),
      attention_case(12, 4, 128, spans_of({{0, 0, 130}, {1, 1000, 3}}), random),
      attention_case(5, 1, 64, spans_of({{0, 0, 80}}), random),                            // GQA 5
      attention_case(3, 1, 24, spans_of({{0, 0, 40}, {1, 90, 2}}), random),                // bf16 padded to 32
      attention_case(4, 2, 80, spans_of({{0, 0, 130}, {1, 70, 1}}), random),               // bf16 padded to 128
      attention_case(2, 1, 200, spans_of({{0, 0, 65}, {1, 300, 2}}), random),              // bf16 padded to 256
  };
}


// The CPU's attention cases: two sequences from position 0 (70 and 3 tokens, in slots 1 and 0),
// GQA ratios 1, 2, 3, 4, 5 and 8, head sizes with and without a remainder of 16 lanes.
constexpr double kUnitRoundoff = 1.0 / (1 << 24);  // f32 rounding to nearest: relative error ≤ 2^-24

Tensor seeded_uniform(const Shape& shape, uint32_t seed, float low, float high) {
  std::mt19937 random(seed);
  return uniform_f32(shape, random, low, high);
}

// The rows of `parts` one after another.
Tensor concatenated_rows(const std::vector<Tensor>& parts) {
  Shape shape = parts.front().shape();
  shape[0] = 0;
  for (const Tensor& part : parts) shape[0] += part.dim(0);
  Tensor joined = Tensor::empty(shape, DType::F32);
  size_t offset = 0;
  for (const Tensor& part : parts) {
    std::memcpy(static_cast<char*>(joined.raw()) + offset, part.raw(), part.nbytes());
    offset += part.nbytes();
  }
  return joined;
}

OpCase exact_attention_case(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const std::vector<std::array<int32_t, 3>> sequences = {{1, 0, 70}, {0, 0, 3}};
  const std::vector<SequenceSpan> spans = spans_of(sequences);
  std::vector<Tensor> q, k, v;
  for (uint32_t s = 0; s < sequences.size(); ++s) {
    const int64_t length = sequences[s][2];
    q.push_back(seeded_uniform({length, heads, head_dim}, 30 + s, -2.0f, 2.0f));
    k.push_back(seeded_uniform({length, kv_heads, head_dim}, 40 + s, -2.0f, 2.0f));
    v.push_back(seeded_uniform({length, kv_heads, head_dim}, 50 + s, -1.0f, 1.0f));
  }
  const Tensor keys = concatenated_rows(k), values = concatenated_rows(v), queries = concatenated_rows(q);
  // From position 0 the cache is filled with the spans' own rows, in the same order.
  OpCase op = attention_case(heads, kv_heads, head_dim, spans, keys, values, queries);
  op.name = "attention (exact) heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
            " head_dim=" + std::to_string(head_dim) + " sequences of 70 and 3";
  op.exact = [=](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
    const double scale = 1.0 / std::sqrt(double(head_dim));
    const int64_t group = heads / kv_heads;
    for (const SequenceSpan& span : spans)
      for (int64_t t = 0; t < span.tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = span.first_token + t;
          const float* query = in[2].data<float>() + (row * heads + h) * head_dim;
          std::vector<double> scores(static_cast<size_t>(t + 1));
          double max_score = -INFINITY;
          double score_error = 0;  // a bound on any f32 score's error: its dot's, its scaling's
          for (int64_t j = 0; j <= t; ++j) {
            const float* key = in[0].data<float>() + ((span.first_token + j) * kv_heads + h / group) * head_dim;
            double dot = 0, dot_magnitude = 0;
            for (int64_t d = 0; d < head_dim; ++d) {
              dot += double(query[d]) * key[d];
              dot_magnitude += std::abs(double(query[d]) * key[d]);
            }
            scores[j] = scale * dot;
            max_score = std::max(max_score, scores[j]);
            score_error = std::max(score_error, double(head_dim + 2) * kUnitRoundoff * scale * dot_magnitude +
                                                    2 * kUnitRoundoff * std::abs(scores[j]));
          }
          double total = 0;
          for (double& score : scores) total += (score = std::exp(score - max_score));
          for (int64_t d = 0; d < head_dim; ++d) {
            double exact = 0, magnitude = 0;
            for (int64_t j = 0; j <= t; ++j) {
              const double value =
                  in[1].data<float>()[((span.first_token + j) * kv_heads + h / group) * head_dim + d];
              exact += scores[j] / total * value;
              magnitude += scores[j] / total * std::abs(value);
            }
            // A weight e^(s_j - max) moves by ≤ 2·score_error relatively (plus expf's ulp), the
            // normalisation doubles that, and the sums over keys add ≤ (keys + 4)·u.
            const double bound = (4 * score_error + double(t + 12) * kUnitRoundoff) * magnitude;
            const float got = out[0].data<float>()[(row * heads + h) * head_dim + d];
            ASSERT_LE(std::abs(got - exact), bound) << "slot " << span.slot << " t " << t << " h " << h << " d " << d;
          }
        }
  };
  return op;
}

std::vector<OpCase> exact_attention_cases() {
  struct HeadShape {
    int64_t heads, kv_heads, head_dim;
  };
  std::vector<OpCase> cases;
  for (const HeadShape& shape : {HeadShape{4, 4, 8}, HeadShape{4, 2, 16}, HeadShape{8, 2, 64}, HeadShape{4, 1, 128},
                                 HeadShape{6, 2, 24}, HeadShape{10, 2, 40}, HeadShape{8, 1, 80}})
    cases.push_back(exact_attention_case(shape.heads, shape.kv_heads, shape.head_dim));
  return cases;
}

// The Qwen3.5 hybrid ops (HybridOps). Recurrent-state cases mix a fresh sequence (position 0),
// continuations whose state is random (so the initial state matters) and spans crossing 64.
OpCase delta_rule_case(int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
                       const std::vector<SequenceSpan>& spans, std::mt19937& random) {
  const int64_t tokens = span_tokens(spans);
  int64_t slots = 0;
  for (const SequenceSpan& span : spans) slots = std::max<int64_t>(slots, span.slot + 1);
  OpCase op;
  op.name = "gated_delta_rule Hk=" + std::to_string(key_heads) + " Hv=" + std::to_string(value_heads) + " dk=" +
            std::to_string(key_dim) + " dv=" + std::to_string(value_dim) + " spans=";
  for (const SequenceSpan& span : spans)
    op.name += "[slot " + std::to_string(span.slot) + " @" + std::to_string(span.first_position) + " ×" +
               std::to_string(span.tokens) + "]";
  op.inputs = {{unit_rows(random_f32({tokens, key_heads, key_dim}, random)), Role::Float32},
               {unit_rows(random_f32({tokens, key_heads, key_dim}, random)), Role::Float32},
               {random_f32({tokens, value_heads, value_dim}, random), Role::Float32},
               {uniform_f32({tokens, value_heads}, random, -0.5f, -0.01f), Role::Float32},
               {uniform_f32({tokens, value_heads}, random, 0.05f, 0.95f), Role::Float32},
               {random_f32({slots, value_heads, key_dim, value_dim}, random, 0.1f), Role::Float32}};
  op.run = [=](Backend& backend, std::vector<Tensor>& in) {
    const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(tokens, 0));
    Tensor out = backend.alloc({tokens, value_heads, value_dim}, backend.activation_dtype());
    backend.hybrid_ops()->gated_delta_rule(in[0], in[1], in[2], in[3], in[4], layout, in[5], out);
    return std::vector<Tensor>{out, in[5]};
  };
  return op;
}

std::vector<OpCase> hybrid_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  OpCase split;
  split.name = "split_query_gate 5×3×16";
  split.inputs = {{random_f32({5, 3, 32}, random), Role::Activation}};
  split.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor query = backend.alloc({5, 3, 16}, backend.activation_dtype());
    Tensor gate = backend.alloc({5, 3, 16}, backend.activation_dtype());
    backend.hybrid_ops()->split_query_gate(in[0], query, gate);
    return std::vector<Tensor>{query, gate};
  };
  cases.push_back(std::move(split));

  OpCase gate;
  gate.name = "sigmoid_gate 7×40";
  gate.inputs = {{random_f32({7, 40}, random), Role::Activation}, {random_f32({7, 40}, random), Role::Activation}};
  gate.run = [](Backend& backend, std::vector<Tensor>& in) {
    backend.hybrid_ops()->sigmoid_gate(in[0], in[1]);
    return std::vector<Tensor>{in[0]};
  };
  cases.push_back(std::move(gate));

  const std::vector<SequenceSpan> conv_spans = spans_of({{0, 0, 70}, {2, 130, 3}, {1, 63, 1}});
  OpCase conv;
  conv.name = "causal_conv1d_silu C=96 spans=[0 @0 ×70][2 @130 ×3][1 @63 ×1]";
  conv.inputs = {{random_f32({74, 96}, random), Role::Activation},
                 {random_f32({96, 4}, random, 0.5f), Role::Weight},
                 {random_f32({3, 3, 96}, random), Role::Float32}};
  conv.run = [conv_spans](Backend& backend, std::vector<Tensor>& in) {
    const BatchLayout layout = backend.make_layout(conv_spans, std::vector<int32_t>(74, 0));
    Tensor out = backend.alloc({74, 96}, backend.activation_dtype());
    backend.hybrid_ops()->causal_conv1d_silu(in[0], in[1], layout, in[2], out);
    return std::vector<Tensor>{out, in[2]};
  };
  conv.f32_weight_dtypes = {DType::F32, DType::BF16};
  cases.push_back(std::move(conv));

  OpCase prepare;
  prepare.name = "gated_delta_prepare_qkv Hk=2 dk=32 Hv=4 dv=32";
  prepare.inputs = {{random_f32({6, 2 * 2 * 32 + 4 * 32}, random), Role::Activation}};
  prepare.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor q = backend.alloc({6, 2, 32}, DType::F32), k = backend.alloc({6, 2, 32}, DType::F32);
    Tensor v = backend.alloc({6, 4, 32}, DType::F32);
    backend.hybrid_ops()->gated_delta_prepare_qkv(in[0], q, k, v);
    return std::vector<Tensor>{q, k, v};
  };
  cases.push_back(std::move(prepare));

  OpCase gates;
  gates.name = "gated_delta_gates 9×4";
  gates.inputs = {{random_f32({9, 4}, random, 3.0f), Role::Activation},
                  {random_f32({9, 4}, random, 3.0f), Role::Activation},
                  {random_f32({4}, random), Role::Weight},
                  {random_f32({4}, random), Role::Weight}};
  gates.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor beta = backend.alloc({9, 4}, DType::F32), g = backend.alloc({9, 4}, DType::F32);
    backend.hybrid_ops()->gated_delta_gates(in[0], in[1], in[2], in[3], beta, g);
    return std::vector<Tensor>{beta, g};
  };
  gates.f32_weight_dtypes = {DType::F32, DType::BF16};
  cases.push_back(std::move(gates));

  OpCase norm;
  norm.name = "rms_norm_gated 5×4×32";
  norm.inputs = {{random_f32({5, 4, 32}, random), Role::Activation},
                 {random_f32({5, 4, 32}, random), Role::Activation},
                 {random_f32({32}, random), Role::Weight}};
  norm.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({5, 4, 32}, backend.activation_dtype());
    backend.hybrid_ops()->rms_norm_gated(in[0], in[1], in[2], 1e-6f, out);
    return std::vector<Tensor>{out};
  };
  norm.f32_weight_dtypes = {DType::F32, DType::BF16};
  cases.push_back(std::move(norm));

  // No whole aligned 64-token chunk: the CPU runs these recurrently too.
  cases.push_back(delta_rule_case(2, 4, 32, 32, spans_of({{0, 0, 40}, {1, 60, 10}, {2, 200, 1}}), random));
  cases.push_back(delta_rule_case(1, 2, 128, 128, spans_of({{1, 5, 3}, {0, 0, 1}}), random));
  // Whole aligned chunks, which both backends compute in the chunked form, with recurrent heads
  // and tails around them; the 128 × 128 heads are Qwen3.5's, in four 32-column tiles.
  OpCase chunked = delta_rule_case(2, 4, 64, 32, spans_of({{0, 0, 130}, {1, 64, 64}}), random);
  chunked.f32_tolerance = 1e-4;
  cases.push_back(std::move(chunked));
  OpCase qwen_heads = delta_rule_case(1, 2, 128, 128, spans_of({{1, 5, 200}, {0, 0, 64}, {2, 100, 3}}), random);
  qwen_heads.f32_tolerance = 1e-4;
  cases.push_back(std::move(qwen_heads));
  OpCase odd_columns = delta_rule_case(1, 1, 32, 40, spans_of({{0, 0, 70}}), random);
  odd_columns.f32_tolerance = 1e-4;
  cases.push_back(std::move(odd_columns));
  // Key dims the CUDA kernels run zero-padded to the next built one (16, 32, 64, 128): the tiny
  // Qwen3.5-MoE fixture's 16 / 24, and 24 and 40 through recurrent and chunked tokens alike.
  for (const auto& [key_dim, value_dim] : {std::pair<int64_t, int64_t>{16, 24}, {24, 40}, {40, 16}}) {
    cases.push_back(delta_rule_case(1, 2, key_dim, value_dim, spans_of({{0, 3, 9}, {1, 0, 1}}), random));
    OpCase padded = delta_rule_case(2, 2, key_dim, value_dim, spans_of({{0, 0, 150}, {1, 60, 70}}), random);
    padded.f32_tolerance = 1e-4;
    cases.push_back(std::move(padded));
  }
  return cases;
}

}  // namespace

std::vector<OpCase> attention_and_hybrid_op_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  for (auto group : {attention_cases(random), hybrid_cases(random), exact_attention_cases()})
    for (auto& op : group) cases.push_back(std::move(op));
  return cases;
}

}  // namespace kiln::testing
