// The CUDA backend against the CPU backend, op by op (llama.cpp test-backend-ops style: a table of
// cases with odd sizes, GQA ratios and lengths crossing 64 and 256, each run on both backends from
// the same inputs), and the invariance contract on the GPU: a row's bits do not depend on the rows
// computed with it, the batch composition or the prefill chunking.
//
// Tolerances (‖cuda − cpu‖₂ / ‖cpu‖₂): F32 activations 1e-5 (both sides are f32 arithmetic in
// different orders); BF16 activations 1e-2 against the CPU run on the same bf16-rounded inputs
// (the CUDA side rounds to bf16 where transformers does, ≈ 2⁻⁹ relative per rounding).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "cuda_test_support.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;

enum class Role {
  Activation,  // in the backend's activation dtype (bf16-rounded values for a bf16 backend)
  Weight,      // in the case's weight dtype
  Index,       // I32 as given
  Float32,     // F32 as given (inv_freq)
};
struct Input {
  Tensor values;  // F32 host values (I32 for Role::Index)
  Role role;
};

// Runs an op on `backend` from the uploaded inputs (in case order) and returns its outputs.
using OpRun = std::function<std::vector<Tensor>(Backend& backend, std::vector<Tensor>& inputs)>;

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  OpRun run;
  std::vector<DType> f32_weight_dtypes{DType::F32};  // weight dtypes tried with F32 activations
  bool bf16 = true;  // whether the BF16 tensor-core path takes this case
  double f32_tolerance = kF32Tolerance;
};

std::vector<Tensor> upload_inputs(Backend& backend, const std::vector<Input>& inputs, DType activations,
                                  DType weights) {
  std::vector<Tensor> uploaded;
  for (const Input& input : inputs) {
    switch (input.role) {
      case Role::Activation: {
        // The CPU backend (f32) gets the same values the bf16 backend holds.
        const Tensor stored = f32_as(input.values, activations);
        uploaded.push_back(backend.upload(backend.activation_dtype() == DType::F32 ? as_f32(stored) : stored));
        break;
      }
      case Role::Weight: uploaded.push_back(backend.upload(f32_as(input.values, weights))); break;
      case Role::Index:
      case Role::Float32: uploaded.push_back(backend.upload(input.values)); break;
    }
  }
  return uploaded;
}

// The largest relative error over the case's outputs, CUDA (activations, weights) against CPU.
double cuda_vs_cpu(const OpCase& op, DType activations, DType weights) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, activations);
  std::vector<Tensor> cpu_inputs = upload_inputs(*cpu, op.inputs, activations, weights);
  std::vector<Tensor> cuda_inputs = upload_inputs(*cuda, op.inputs, activations, weights);
  const std::vector<Tensor> expected = op.run(*cpu, cpu_inputs);
  const std::vector<Tensor> actual = op.run(*cuda, cuda_inputs);
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    worst = std::max(worst, relative_error(cuda->download(actual[i]), cpu->download(expected[i])));
  return worst;
}

Tensor indices(const std::vector<int32_t>& values) {
  Tensor tensor = Tensor::empty({static_cast<int64_t>(values.size())}, DType::I32);
  std::copy(values.begin(), values.end(), tensor.data<int32_t>());
  return tensor;
}

std::vector<SequenceSpan> spans_of(const std::vector<std::array<int32_t, 3>>& slot_position_tokens) {
  std::vector<SequenceSpan> spans;
  int32_t first_token = 0;
  for (const auto& [slot, position, tokens] : slot_position_tokens) {
    spans.push_back({slot, first_token, tokens, position});
    first_token += tokens;
  }
  return spans;
}

int64_t span_tokens(const std::vector<SequenceSpan>& spans) {
  int64_t total = 0;
  for (const auto& span : spans) total += span.tokens;
  return total;
}

// --- the case table ---

std::vector<OpCase> matmul_cases(std::mt19937& random) {
  struct Shape {
    int64_t m, n, k;
    bool bias, f32_out;
  };
  // Row counts 1 and 3 take the decode kernel (8- or 16-column warps), the others the prefill
  // GEMM (64-row x tiles up to m = 64, then 128); k = 72, 200 end in a partial 32-element chunk.
  const std::vector<Shape> shapes = {{1, 64, 64, false, false},    {1, 512, 64, false, true},
                                     {3, 130, 72, true, false},    {8, 33, 200, false, false},
                                     {16, 300, 520, true, true},   {17, 96, 160, false, false},
                                     {64, 1000, 256, true, false}, {300, 96, 160, false, false},
                                     {129, 257, 520, true, true},  {5, 4100, 1024, false, false},
                                     {1, 8192, 512, false, false}, {200, 3000, 1024, true, false}};
  std::vector<OpCase> cases;
  for (const Shape& shape : shapes) {
    OpCase op;
    op.name = "matmul m=" + std::to_string(shape.m) + " n=" + std::to_string(shape.n) + " k=" +
              std::to_string(shape.k) + (shape.bias ? " bias" : "") + (shape.f32_out ? " f32-out" : "");
    op.inputs = {{random_f32({shape.m, shape.k}, random), Role::Activation},
                 {random_f32({shape.n, shape.k}, random, 1.0f / std::sqrt(static_cast<float>(shape.k))), Role::Weight}};
    if (shape.bias) op.inputs.push_back({random_f32({shape.n}, random), Role::Weight});
    op.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({shape.m, shape.n}, shape.f32_out ? DType::F32 : backend.activation_dtype());
      backend.matmul(in[0], in[1], shape.bias ? &in[2] : nullptr, out);
      return std::vector<Tensor>{out};
    };
    op.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
    cases.push_back(std::move(op));
  }
  // Groups (q/k/v-like and gate/up-like widths): decode rows and prefill rows, with and without bias.
  for (int64_t m : {1, 12, 40}) {
    OpCase group;
    group.name = "matmul_group m=" + std::to_string(m) + " n=640,128,136 k=256";
    const std::vector<int64_t> widths = {640, 128, 136};
    group.inputs = {{random_f32({m, 256}, random), Role::Activation}};
    for (int64_t n : widths) group.inputs.push_back({random_f32({n, 256}, random, 0.0625f), Role::Weight});
    group.inputs.push_back({random_f32({136}, random), Role::Weight});  // the third product's bias
    group.run = [m, widths](Backend& backend, std::vector<Tensor>& in) {
      std::vector<Tensor> outs;
      for (int64_t n : widths) outs.push_back(backend.alloc({m, n}, n == 128 ? DType::F32 : backend.activation_dtype()));
      const MatmulTarget targets[] = {{&in[1], nullptr, &outs[0]}, {&in[2], nullptr, &outs[1]}, {&in[3], &in[4], &outs[2]}};
      backend.matmul_group(in[0], targets);
      return outs;
    };
    group.f32_weight_dtypes = {DType::F32, DType::BF16};
    cases.push_back(std::move(group));
  }
  // K not a multiple of 8 (stories260K's down_proj has K = 172): the f32 path only.
  OpCase odd;
  odd.name = "matmul m=5 n=64 k=172";
  odd.inputs = {{random_f32({5, 172}, random), Role::Activation}, {random_f32({64, 172}, random, 0.08f), Role::Weight}};
  odd.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({5, 64}, backend.activation_dtype());
    backend.matmul(in[0], in[1], nullptr, out);
    return std::vector<Tensor>{out};
  };
  odd.bf16 = false;
  cases.push_back(std::move(odd));
  return cases;
}

std::vector<OpCase> norm_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  for (int64_t width : {16, 100, 1024, 1500, 4096})
    for (int64_t rows : {1, 7, 300})
      for (NormStyle style : {NormStyle::Plain, NormStyle::ZeroCentred}) {
        const std::string suffix = " rows=" + std::to_string(rows) + " width=" + std::to_string(width) +
                                   (style == NormStyle::Plain ? " plain" : " zero-centred");
        Tensor gain = random_f32({width}, random, 0.1f);
        if (style == NormStyle::Plain)
          for (int64_t i = 0; i < width; ++i) gain.data<float>()[i] += 1.0f;
        OpCase norm;
        norm.name = "rms_norm" + suffix;
        norm.inputs = {{random_f32({rows, width}, random), Role::Activation}, {gain, Role::Weight}};
        norm.run = [rows, width, style](Backend& backend, std::vector<Tensor>& in) {
          Tensor out = backend.alloc({rows, width}, backend.activation_dtype());
          backend.rms_norm(in[0], in[1], 1e-5f, style, out);
          return std::vector<Tensor>{out};
        };
        norm.f32_weight_dtypes = {DType::F32, DType::BF16};
        cases.push_back(norm);

        OpCase in_place = norm;  // Qwen3's q_norm/k_norm normalise q and k in place
        in_place.name = "rms_norm in place" + suffix;
        in_place.run = [style](Backend& backend, std::vector<Tensor>& in) {
          backend.rms_norm(in[0], in[1], 1e-5f, style, in[0]);
          return std::vector<Tensor>{in[0]};
        };
        cases.push_back(in_place);

        OpCase fused;
        fused.name = "add_rms_norm" + suffix;
        fused.inputs = {{random_f32({rows, width}, random), Role::Activation},
                        {random_f32({rows, width}, random), Role::Activation},
                        {gain, Role::Weight}};
        fused.run = [rows, width, style](Backend& backend, std::vector<Tensor>& in) {
          Tensor out = backend.alloc({rows, width}, backend.activation_dtype());
          backend.add_rms_norm(in[0], in[1], in[2], 1e-6f, style, out);
          return std::vector<Tensor>{in[0], out};
        };
        fused.f32_weight_dtypes = {DType::F32, DType::BF16};
        cases.push_back(fused);

        // The models' residual stream is f32 whatever the activations (model/model.h): the norm
        // reads it and writes the activation dtype.
        OpCase stream_norm = norm;
        stream_norm.name = "rms_norm f32 stream" + suffix;
        stream_norm.inputs[0].role = Role::Float32;
        cases.push_back(std::move(stream_norm));
        OpCase stream_fused = fused;
        stream_fused.name = "add_rms_norm f32 stream" + suffix;
        stream_fused.inputs[0].role = Role::Float32;
        stream_fused.inputs[1].role = Role::Float32;
        cases.push_back(std::move(stream_fused));
      }
  return cases;
}

std::vector<OpCase> elementwise_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  for (int64_t count : {1, 1000, 123457}) {
    OpCase add;
    add.name = "add n=" + std::to_string(count);
    add.inputs = {{random_f32({count}, random), Role::Activation}, {random_f32({count}, random), Role::Activation}};
    add.run = [](Backend& backend, std::vector<Tensor>& in) {
      backend.add(in[0], in[1]);
      return std::vector<Tensor>{in[0]};
    };
    cases.push_back(std::move(add));

    OpCase swiglu;
    swiglu.name = "swiglu n=" + std::to_string(count);
    swiglu.inputs = {{random_f32({count}, random, 3.0f), Role::Activation},
                     {random_f32({count}, random), Role::Activation}};
    swiglu.run = [count](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({count}, backend.activation_dtype());
      backend.swiglu(in[0], in[1], out);
      return std::vector<Tensor>{out};
    };
    cases.push_back(swiglu);
    swiglu.name = "swiglu in place n=" + std::to_string(count);
    swiglu.run = [](Backend& backend, std::vector<Tensor>& in) {
      backend.swiglu(in[0], in[1], in[0]);
      return std::vector<Tensor>{in[0]};
    };
    cases.push_back(std::move(swiglu));
  }

  for (int64_t width : {64, 100}) {
    OpCase embedding;
    embedding.name = "embedding width=" + std::to_string(width);
    std::vector<int32_t> ids(300);
    for (auto& id : ids) id = static_cast<int32_t>(random() % 37);
    embedding.inputs = {{random_f32({37, width}, random), Role::Weight}, {indices(ids), Role::Index}};
    embedding.run = [width](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({in[1].numel(), width}, backend.activation_dtype());
      backend.embedding(in[0], in[1], out);
      return std::vector<Tensor>{out};
    };
    embedding.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
    cases.push_back(embedding);
    embedding.name = "embedding into the f32 stream width=" + std::to_string(width);
    embedding.run = [width](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({in[1].numel(), width}, DType::F32);
      backend.embedding(in[0], in[1], out);
      return std::vector<Tensor>{out};
    };
    cases.push_back(std::move(embedding));
  }

  OpCase gather;
  gather.name = "gather_rows 5 of 300";
  gather.inputs = {{random_f32({300, 96}, random), Role::Activation}, {indices({299, 0, 17, 17, 64}), Role::Index}};
  gather.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({5, 96}, backend.activation_dtype());
    backend.gather_rows(in[0], in[1], out);
    return std::vector<Tensor>{out};
  };
  cases.push_back(std::move(gather));

  struct RopeShape {
    int64_t tokens, heads, head_dim, rotary_dim;
    double theta;
  };
  for (const RopeShape& shape : {RopeShape{1, 3, 16, 16, 10000.0}, RopeShape{70, 4, 64, 64, 500000.0},
                                 RopeShape{9, 2, 128, 32, 1e7}, RopeShape{33, 5, 24, 24, 10000.0}}) {
    OpCase rope;
    rope.name = "rope tokens=" + std::to_string(shape.tokens) + " head_dim=" + std::to_string(shape.head_dim) +
                " rotary=" + std::to_string(shape.rotary_dim);
    std::vector<int32_t> positions(shape.tokens);
    for (auto& position : positions) position = static_cast<int32_t>(random() % 5000);
    Tensor inv_freq = Tensor::empty({shape.rotary_dim / 2}, DType::F32);
    for (int64_t j = 0; j < shape.rotary_dim / 2; ++j)
      inv_freq.data<float>()[j] =
          static_cast<float>(1.0 / std::pow(shape.theta, 2.0 * j / static_cast<double>(shape.rotary_dim)));
    rope.inputs = {{random_f32({shape.tokens, shape.heads, shape.head_dim}, random), Role::Activation},
                   {indices(positions), Role::Index},
                   {inv_freq, Role::Float32}};
    rope.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      backend.rope(in[0], in[1], in[2], static_cast<int>(shape.rotary_dim));
      return std::vector<Tensor>{in[0]};
    };
    cases.push_back(std::move(rope));
  }

  // The fused attention inputs: two sequences (one prefill chunk, one decode token), GQA 2, full
  // and partial rotary dims, without and with per-head norms (Qwen3's plain ones, Qwen3.5's
  // zero-centred ones).
  for (int64_t rotary_dim : {64, 32}) {
    for (std::optional<NormStyle> norms : {std::optional<NormStyle>{}, std::optional{NormStyle::Plain},
                                           std::optional{NormStyle::ZeroCentred}}) {
      constexpr int64_t kHeads = 4, kKvHeads = 2, kHeadDim = 64;
      const std::vector<SequenceSpan> spans = spans_of({{1, 64, 70}, {0, 300, 1}});
      const int64_t tokens = span_tokens(spans);
      OpCase fused;
      fused.name = "rope_kv_write rotary=" + std::to_string(rotary_dim) +
                   (!norms ? "" : *norms == NormStyle::Plain ? " head norms" : " zero-centred head norms");
      Tensor inv_freq = Tensor::empty({rotary_dim / 2}, DType::F32);
      for (int64_t j = 0; j < rotary_dim / 2; ++j)
        inv_freq.data<float>()[j] =
            static_cast<float>(1.0 / std::pow(500000.0, 2.0 * j / static_cast<double>(rotary_dim)));
      fused.inputs = {{random_f32({tokens, kHeads, kHeadDim}, random), Role::Activation},
                      {random_f32({tokens, kKvHeads, kHeadDim}, random), Role::Activation},
                      {random_f32({tokens, kKvHeads, kHeadDim}, random), Role::Activation},
                      {inv_freq, Role::Float32},
                      {random_f32({kHeadDim}, random), Role::Weight},
                      {random_f32({kHeadDim}, random), Role::Weight}};
      fused.f32_weight_dtypes = {DType::F32, DType::BF16};
      fused.run = [spans, tokens, rotary_dim, norms](Backend& backend, std::vector<Tensor>& in) {
        Tensor k_cache = backend.alloc({2, 400, kKvHeads, kHeadDim}, backend.activation_dtype());
        Tensor v_cache = backend.alloc({2, 400, kKvHeads, kHeadDim}, backend.activation_dtype());
        backend.zero(k_cache);
        backend.zero(v_cache);
        const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(tokens, 0));
        const std::optional<HeadNorms> head_norms =
            norms ? std::optional<HeadNorms>(HeadNorms{in[4], in[5], 1e-6f, *norms}) : std::nullopt;
        backend.rope_kv_write(in[0], in[1], in[2], layout, in[3], static_cast<int>(rotary_dim),
                              head_norms ? &*head_norms : nullptr, k_cache, v_cache);
        return std::vector<Tensor>{in[0], in[1], k_cache, v_cache};
      };
      cases.push_back(std::move(fused));
    }
  }
  return cases;
}

// Fills each span's slot with K/V for positions [0, first_position + tokens) (one kv_write), then
// attends the spans' queries.
OpCase attention_case(int64_t heads, int64_t kv_heads, int64_t head_dim, const std::vector<SequenceSpan>& spans,
                      std::mt19937& random) {
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
  op.inputs = {{random_f32({filled, kv_heads, head_dim}, random), Role::Activation},
               {random_f32({filled, kv_heads, head_dim}, random), Role::Activation},
               {random_f32({tokens, heads, head_dim}, random), Role::Activation}};
  op.run = [=](Backend& backend, std::vector<Tensor>& in) {
    const DType act = backend.activation_dtype();
    Tensor k_cache = backend.alloc({slots, capacity, kv_heads, head_dim}, act);
    Tensor v_cache = backend.alloc({slots, capacity, kv_heads, head_dim}, act);
    backend.zero(k_cache);
    backend.zero(v_cache);
    const BatchLayout fill_layout = backend.make_layout(fill, std::vector<int32_t>(filled, 0));
    backend.kv_write(in[0], in[1], fill_layout, k_cache, v_cache);
    const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(tokens, 0));
    Tensor out = backend.alloc({tokens, heads, head_dim}, act);
    backend.attention(in[2], k_cache, v_cache, layout, 1.0f / std::sqrt(static_cast<float>(head_dim)), out);
    return std::vector<Tensor>{out};
  };
  // The BF16 tensor-core attention takes these head dims (cuda_backend.h); others are F32-only.
  op.bf16 = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
  return op;
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
      attention_case(3, 1, 24, spans_of({{0, 0, 40}, {1, 90, 2}}), random),                // f32 only
  };
}

// The Qwen3.5 hybrid ops (HybridOps). Recurrent-state cases mix a fresh sequence (position 0),
// continuations whose state is random (so the initial state matters) and spans crossing 64.
Tensor unit_rows(Tensor values) {
  const int64_t width = values.dim(-1);
  for (int64_t row = 0; row < values.numel() / width; ++row) {
    float* x = values.data<float>() + row * width;
    double norm = 0;
    for (int64_t i = 0; i < width; ++i) norm += static_cast<double>(x[i]) * x[i];
    for (int64_t i = 0; i < width; ++i) x[i] = static_cast<float>(x[i] / std::sqrt(norm));
  }
  return values;
}

Tensor uniform_f32(const Shape& shape, std::mt19937& random, float low, float high) {
  Tensor tensor = Tensor::empty(shape, DType::F32);
  std::uniform_real_distribution<float> uniform(low, high);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.data<float>()[i] = uniform(random);
  return tensor;
}

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
  return cases;
}

std::vector<OpCase> all_cases() {
  std::mt19937 random(20261202);
  std::vector<OpCase> cases;
  for (auto group : {matmul_cases(random), norm_cases(random), elementwise_cases(random), attention_cases(random),
                     hybrid_cases(random)})
    for (auto& op : group) cases.push_back(std::move(op));
  return cases;
}

TEST(CudaBackendOps, F32ActivationsMatchTheCpuBackend) {
  KILN_REQUIRE_CUDA();
  for (const OpCase& op : all_cases())
    for (DType weights : op.f32_weight_dtypes) {
      const double error = cuda_vs_cpu(op, DType::F32, weights);
      EXPECT_LE(error, op.f32_tolerance) << op.name << " (weights " << dtype_name(weights) << ")";
    }
}

TEST(CudaBackendOps, Bf16ActivationsMatchTheCpuBackendOnRoundedInputs) {
  KILN_REQUIRE_CUDA();
  for (const OpCase& op : all_cases()) {
    if (!op.bf16) continue;
    const double error = cuda_vs_cpu(op, DType::BF16, DType::BF16);
    EXPECT_LE(error, kBf16Tolerance) << op.name;
  }
}

TEST(CudaBackendOps, Bf16PathRejectsWhatItCannotComputeExactly) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(7);
  Tensor x = cuda->upload(f32_as(random_f32({2, 172}, random), DType::BF16));
  Tensor w = cuda->upload(f32_as(random_f32({8, 172}, random), DType::BF16));
  Tensor out = cuda->alloc({2, 8}, DType::BF16);
  EXPECT_THROW(cuda->matmul(x, w, nullptr, out), Error);  // K % 8 != 0
  Tensor x64 = cuda->upload(f32_as(random_f32({2, 64}, random), DType::BF16));
  Tensor w_f32 = cuda->upload(random_f32({8, 64}, random));
  EXPECT_THROW(cuda->matmul(x64, w_f32, nullptr, out), Error);  // f32 weights with bf16 activations
  Tensor x_f32 = cuda->upload(random_f32({2, 64}, random));
  EXPECT_THROW(cuda->matmul(x_f32, w_f32, nullptr, out), Error);  // f32 activations on a bf16 backend
}

// The fused ops' error paths name the op and what is wrong, before any launch.
TEST(CudaBackendOps, FusedOpsRejectWhatTheyCannotCompute) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  Tensor x = cuda->alloc({1, 64}, DType::BF16), w = cuda->alloc({8, 64}, DType::BF16);
  Tensor out = cuda->alloc({1, 8}, DType::BF16);
  const std::vector<MatmulTarget> five(5, MatmulTarget{&w, nullptr, &out});
  expect_error_mentions([&] { cuda->matmul_group(x, five); }, {"CUDA matmul_group: 5 products, it takes 1 to 4"});

  const BatchLayout one = cuda->make_layout({{0, 0, 1, 0}}, {0});
  Tensor q = cuda->alloc({1, 4, 16}, DType::BF16), k = cuda->alloc({1, 3, 16}, DType::BF16);
  Tensor v = cuda->alloc({1, 3, 16}, DType::BF16);
  Tensor k_cache = cuda->alloc({1, 8, 2, 16}, DType::BF16), v_cache = cuda->alloc({1, 8, 2, 16}, DType::BF16);
  Tensor inv_freq = cuda->alloc({8}, DType::F32);
  expect_error_mentions([&] { cuda->rope_kv_write(q, k, v, one, inv_freq, 16, nullptr, k_cache, v_cache); },
                        {"CUDA rope_kv_write: k has shape [1, 3, 16], expected [1, 2, 16]"});
  Tensor k2 = cuda->alloc({1, 2, 16}, DType::BF16), v2 = cuda->alloc({1, 2, 16}, DType::BF16);
  expect_error_mentions([&] { cuda->rope_kv_write(q, k2, v2, one, inv_freq, 12, nullptr, k_cache, v_cache); },
                        {"CUDA rope_kv_write: inv_freq has 8 entries, rotary_dim 12 needs 6"});
  Tensor gain = cuda->alloc({16}, DType::BF16), short_gain = cuda->alloc({12}, DType::BF16);
  const HeadNorms mismatched{gain, short_gain, 1e-6f, NormStyle::Plain};
  expect_error_mentions(
      [&] { cuda->rope_kv_write(q, k2, v2, one, inv_freq, 16, &mismatched, k_cache, v_cache); },
      {"CUDA rope_kv_write: k norm weight has shape [12], expected [16]"});
}

// The hybrid ops' error paths: each names the op and what is wrong, before any launch.
TEST(CudaBackendOps, HybridOpsRejectWhatTheyCannotCompute) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::F32);
  HybridOps& hybrid = *cuda->hybrid_ops();
  auto f32 = [&](const Shape& shape) { return cuda->alloc(shape, DType::F32); };
  const BatchLayout one = cuda->make_layout({{0, 0, 2, 0}}, {0, 0});

  // Key dims the delta-rule kernel is not built for (48), and a value/key head mismatch.
  Tensor q = f32({2, 1, 48}), v = f32({2, 2, 32}), gates = f32({2, 2}), out = f32({2, 2, 32});
  Tensor state = f32({1, 2, 48, 32});
  expect_error_mentions([&] { hybrid.gated_delta_rule(q, q, v, gates, gates, one, state, out); },
                        {"CUDA gated_delta_rule: key_dim 48 / value_dim 32 are not built"});
  Tensor q2 = f32({2, 2, 32}), v3 = f32({2, 3, 32}), gates3 = f32({2, 3}), out3 = f32({2, 3, 32});
  Tensor state3 = f32({1, 3, 32, 32});
  expect_error_mentions([&] { hybrid.gated_delta_rule(q2, q2, v3, gates3, gates3, one, state3, out3); },
                        {"3 value heads are not a multiple of 2 key heads"});

  // Two spans on one slot of the recurrent state (the shared span check).
  const BatchLayout shared_slot = cuda->make_layout({{0, 0, 1, 0}, {0, 1, 1, 0}}, {0, 0});
  Tensor x = f32({2, 8}), conv_out = f32({2, 8}), conv_state = f32({1, 3, 8}), weight = f32({8, 4});
  expect_error_mentions([&] { hybrid.causal_conv1d_silu(x, weight, shared_slot, conv_state, conv_out); },
                        {"CUDA causal_conv1d_silu: two spans of one batch use slot 0"});
  // A conv kernel size other than the one the kernels are built for.
  Tensor weight5 = f32({8, 5}), conv_state5 = f32({1, 4, 8});
  expect_error_mentions([&] { hybrid.causal_conv1d_silu(x, weight5, one, conv_state5, conv_out); },
                        {"CUDA causal_conv1d_silu: weight must be a float [8, 4] tensor"});
  // q/k/v must be f32 whatever the activations.
  std::unique_ptr<Backend> bf16 = make_cuda_backend(0, DType::BF16);
  Tensor qkv = bf16->alloc({2, 2 * 32 + 32}, DType::BF16);
  Tensor q_bf16 = bf16->alloc({2, 1, 32}, DType::BF16), k32 = bf16->alloc({2, 1, 32}, DType::F32);
  Tensor v32 = bf16->alloc({2, 1, 32}, DType::F32);
  expect_error_mentions([&] { bf16->hybrid_ops()->gated_delta_prepare_qkv(qkv, q_bf16, k32, v32); },
                        {"CUDA gated_delta_prepare_qkv: q has dtype BF16, expected F32"});
}

TEST(CudaBackendOps, OutOfRangeTokenIdIsReportedAtTheNextSynchronisation) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::F32);
  std::mt19937 random(9);
  Tensor table = cuda->upload(random_f32({10, 8}, random));
  Tensor ids = cuda->upload(indices({3, 10}));
  Tensor out = cuda->alloc({2, 8}, DType::F32);
  cuda->embedding(table, ids, out);
  EXPECT_THROW(cuda->synchronize(), Error);
  cuda->synchronize();  // the record was cleared with the report
}

// --- invariance on the GPU ---

class CudaInvariance : public ::testing::TestWithParam<DType> {};

// A device tensor holding rows [first, first + count) of a host tensor.
Tensor upload_rows(Backend& backend, const Tensor& host, int64_t first, int64_t count) {
  return backend.upload(host.slice_rows(first, count));
}

TEST_P(CudaInvariance, MatmulRowIsBitIdenticalAloneAndInAnyBatch) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(11);
  const int64_t rows = 300, k = 520;
  const Tensor x = f32_as(random_f32({rows, k}, random), act);
  // n = 1000 takes 8-column decode warps (and a partial last wgmma block at m = 300); n = 8192
  // takes 16-column decode warps.
  for (int64_t n : {1000, 8192}) {
    const Tensor w = cuda->upload(f32_as(random_f32({n, k}, random, 0.05f), act));
    const Tensor bias = cuda->upload(f32_as(random_f32({n}, random), act));
    auto product = [&](int64_t first, int64_t count) {
      Tensor out = cuda->alloc({count, n}, act);
      cuda->matmul(upload_rows(*cuda, x, first, count), w, &bias, out);
      return cuda->download(out);
    };
    const Tensor all = product(0, rows);
    for (auto [first, count] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {1, 1}, {150, 1}, {299, 1}, {100, 8}, {0, 16}, {7, 17}, {64, 64}, {200, 100}}) {
      const Tensor part = product(first, count);
      EXPECT_TRUE(same_rows(part, 0, all, first, count))
          << "n=" << n << " rows [" << first << ", " << first + count << ") differ from the same rows in m=" << rows;
    }
  }
}

// A matmul group's products are the separate matmuls' bits, on the decode and the prefill paths.
// The second width set at m = 200 is 140 + 140 + 2 prefill blocks: one shared launch on a
// 132-multiprocessor GPU (3 waves against 4.5 one by one), so that path is held to the same bits.
TEST_P(CudaInvariance, MatmulGroupEqualsOneMatmulPerProductBitForBit) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(13);
  const int64_t k = 1032;  // two segments, the second partial
  const std::vector<std::vector<int64_t>> width_sets = {{4096, 1024, 1024, 40}, {8960, 8960, 72}};
  for (const std::vector<int64_t>& widths : width_sets) {
    std::vector<Tensor> weights;
    for (int64_t n : widths) weights.push_back(cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), act)));
    const Tensor bias = cuda->upload(f32_as(random_f32({widths[1]}, random), act));
    for (int64_t m : {1, 8, 16, 17, 200}) {
      const Tensor x = cuda->upload(f32_as(random_f32({m, k}, random), act));
      std::vector<Tensor> grouped, separate;
      for (int64_t n : widths) {
        grouped.push_back(cuda->alloc({m, n}, act));
        separate.push_back(cuda->alloc({m, n}, act));
      }
      std::vector<MatmulTarget> targets;
      for (size_t t = 0; t < widths.size(); ++t) {
        targets.push_back({&weights[t], t == 1 ? &bias : nullptr, &grouped[t]});
        cuda->matmul(x, weights[t], t == 1 ? &bias : nullptr, separate[t]);
      }
      cuda->matmul_group(x, targets);
      for (size_t t = 0; t < widths.size(); ++t) {
        const Tensor a = cuda->download(grouped[t]), b = cuda->download(separate[t]);
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0)
            << "widths[0]=" << widths[0] << " m=" << m << " product " << t;
      }
    }
  }
}

// Every decode launch shape (the grid layout launch_matmul_bf16 picks by size) gives the bits of
// the backend's matmul, for one to kMatmulDecodeMaxRows rows and a group of two products. K of
// three segments runs three warps in every shape; nine segments give some warps two or three.
TEST(CudaDecodeShapes, EveryLaunchShapeGivesTheSameBits) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(15);
  const std::vector<int64_t> widths = {300, 40};
  for (int64_t k : {int64_t{2056}, int64_t{9224}}) {  // the last segment partial in both
    std::vector<Tensor> weights;
    for (int64_t n : widths) weights.push_back(cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), DType::BF16)));
    for (int64_t m : {int64_t{1}, int64_t{3}, cuda::kMatmulDecodeMaxRows}) {
      const Tensor x = cuda->upload(f32_as(random_f32({m, k}, random), DType::BF16));
      std::vector<Tensor> expected;
      for (size_t t = 0; t < widths.size(); ++t) {
        expected.push_back(cuda->alloc({m, widths[t]}, DType::BF16));
        cuda->matmul(x, weights[t], nullptr, expected[t]);
        expected[t] = cuda->download(expected[t]);
      }
      for (int shape = 0; shape < cuda::decode_launch_shape_count(); ++shape) {
        std::vector<Tensor> outs;
        std::vector<cuda::MatmulArgs> products;
        for (size_t t = 0; t < widths.size(); ++t) {
          outs.push_back(cuda->alloc({m, widths[t]}, DType::BF16));
          cuda::MatmulArgs args;
          args.x = x.raw();
          args.w = weights[t].raw();
          args.out = outs[t].raw();
          args.m = m, args.n = widths[t], args.k = k;
          args.x_dtype = args.w_dtype = args.out_dtype = DType::BF16;
          products.push_back(args);
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cuda::launch_matmul_bf16_decode(products.data(), 2, shape, nullptr), cudaSuccess)
            << "shape " << shape;
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        for (size_t t = 0; t < widths.size(); ++t) {
          const Tensor actual = cuda->download(outs[t]);
          EXPECT_EQ(std::memcmp(actual.raw(), expected[t].raw(), actual.nbytes()), 0)
              << "k=" << k << " m=" << m << " shape " << shape << " product " << t;
        }
      }
    }
  }
}

// The prefill GEMM's rows are the decode kernel's bits (each 16-row slice goes to the decode
// kernel), with bias, bf16 and f32 output: partial blocks in both directions, a partial last
// segment and chunk. The small grids split K across blocks (3 and 2 segments, kernels.h); the
// 9 × 16-block grid of the last shape fills the H200 and does not.
TEST(CudaPrefillGemm, RowsAreTheDecodeKernelsBits) {
  KILN_REQUIRE_CUDA();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(17);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {17, 40, 72}, {300, 200, 2056}, {130, 520, 1032}, {1100, 2000, 1032}};
  for (const auto& [m, n, k] : shapes) {
    const Tensor x = f32_as(random_f32({m, k}, random), DType::BF16);
    const Tensor w = cuda->upload(f32_as(random_f32({n, k}, random, 0.03f), DType::BF16));
    const Tensor bias = cuda->upload(f32_as(random_f32({n}, random), DType::BF16));
    for (DType out_dtype : {DType::BF16, DType::F32}) {
      Tensor all = cuda->alloc({m, n}, out_dtype);
      cuda->matmul(cuda->upload(x), w, &bias, all);
      all = cuda->download(all);
      for (int64_t first = 0; first < m; first += cuda::kMatmulDecodeMaxRows) {
        const int64_t count = std::min<int64_t>(cuda::kMatmulDecodeMaxRows, m - first);
        Tensor part = cuda->alloc({count, n}, out_dtype);
        cuda->matmul(upload_rows(*cuda, x, first, count), w, &bias, part);
        EXPECT_TRUE(same_rows(cuda->download(part), 0, all, first, count))
            << "m=" << m << " n=" << n << " k=" << k << " out " << dtype_name(out_dtype) << " rows [" << first << ", "
            << first + count << ")";
      }
    }
  }
}

// rope_kv_write gives the bits of rope(q), rope(k), kv_write(k, v) — and, with per-head norms, of
// rms_norm(q), rms_norm(k) before them — for decode steps (a head per block) and prefills (eight),
// full and partial rotary dims, head dims under and over the block's 64 threads per head.
TEST_P(CudaInvariance, RopeKvWriteEqualsItsOpsBitForBit) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(14);
  struct Case {
    std::vector<SequenceSpan> spans;
    int64_t head_dim, rotary_dim;
  };
  const std::vector<Case> cases = {{spans_of({{2, 0, 130}, {0, 17, 1}, {1, 255, 3}}), 128, 128},
                                   {spans_of({{2, 40, 1}, {0, 17, 1}, {1, 255, 1}}), 128, 128},
                                   {spans_of({{1, 3, 20}, {0, 9, 1}}), 80, 32},
                                   {spans_of({{0, 100, 1}}), 24, 24}};
  for (const Case& shape : cases) {
    const int64_t tokens = span_tokens(shape.spans), heads = 8, kv_heads = 2;
    const int64_t head_dim = shape.head_dim, rotary_dim = shape.rotary_dim;
    Tensor inv_freq_host = Tensor::empty({rotary_dim / 2}, DType::F32);
    for (int64_t j = 0; j < rotary_dim / 2; ++j)
      inv_freq_host.data<float>()[j] =
          static_cast<float>(1.0 / std::pow(10000.0, 2.0 * j / static_cast<double>(rotary_dim)));
    const Tensor inv_freq = cuda->upload(inv_freq_host);
    const Tensor q_host = f32_as(random_f32({tokens, heads, head_dim}, random), act);
    const Tensor k_host = f32_as(random_f32({tokens, kv_heads, head_dim}, random), act);
    const Tensor v = cuda->upload(f32_as(random_f32({tokens, kv_heads, head_dim}, random), act));
    const BatchLayout layout = cuda->make_layout(shape.spans, std::vector<int32_t>(tokens, 0));
    for (const DType gain_dtype : {act, DType::F32}) {
      const Tensor q_gain = cuda->upload(f32_as(random_f32({head_dim}, random), gain_dtype));
      const Tensor k_gain = cuda->upload(f32_as(random_f32({head_dim}, random), gain_dtype));
      for (std::optional<NormStyle> norms : {std::optional<NormStyle>{}, std::optional{NormStyle::Plain},
                                             std::optional{NormStyle::ZeroCentred}}) {
        const std::optional<HeadNorms> head_norms =
            norms ? std::optional<HeadNorms>(HeadNorms{q_gain, k_gain, 1e-6f, *norms}) : std::nullopt;
        auto run = [&](bool fused) {
          Tensor q = cuda->upload(q_host), k = cuda->upload(k_host);
          Tensor k_cache = cuda->alloc({3, 260, kv_heads, head_dim}, act);
          Tensor v_cache = cuda->alloc({3, 260, kv_heads, head_dim}, act);
          cuda->zero(k_cache);
          cuda->zero(v_cache);
          if (fused) {
            cuda->rope_kv_write(q, k, v, layout, inv_freq, static_cast<int>(rotary_dim),
                                head_norms ? &*head_norms : nullptr, k_cache, v_cache);
          } else {
            if (head_norms) {
              cuda->rms_norm(q, q_gain, head_norms->eps, head_norms->style, q);
              cuda->rms_norm(k, k_gain, head_norms->eps, head_norms->style, k);
            }
            cuda->rope(q, layout.positions, inv_freq, static_cast<int>(rotary_dim));
            cuda->rope(k, layout.positions, inv_freq, static_cast<int>(rotary_dim));
            cuda->kv_write(k, v, layout, k_cache, v_cache);
          }
          return std::vector<Tensor>{cuda->download(q), cuda->download(k), cuda->download(k_cache),
                                     cuda->download(v_cache)};
        };
        const std::vector<Tensor> fused = run(true), separate = run(false);
        for (size_t i = 0; i < fused.size(); ++i)
          EXPECT_EQ(std::memcmp(fused[i].raw(), separate[i].raw(), fused[i].nbytes()), 0)
              << "output " << i << ", " << tokens << " tokens, head_dim " << head_dim << ", rotary " << rotary_dim
              << ", gains " << dtype_name(gain_dtype) << ", norms "
              << (!norms ? "none" : *norms == NormStyle::Plain ? "plain" : "zero-centred");
      }
    }
  }
}

TEST_P(CudaInvariance, NormRowIsBitIdenticalAloneAndInAnyBatch) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(12);
  for (int64_t width : {100, 4096}) {
    const Tensor x = f32_as(random_f32({300, width}, random), act);
    const Tensor delta = f32_as(random_f32({300, width}, random), act);
    const Tensor gain = cuda->upload(f32_as(random_f32({width}, random), act));
    auto normed = [&](int64_t first, int64_t count) {
      Tensor residual = upload_rows(*cuda, x, first, count);
      Tensor out = cuda->alloc({count, width}, act);
      cuda->add_rms_norm(residual, upload_rows(*cuda, delta, first, count), gain, 1e-6f, NormStyle::Plain, out);
      return cuda->download(out);
    };
    const Tensor all = normed(0, 300);
    for (int64_t row : {0, 123, 299}) EXPECT_TRUE(same_rows(normed(row, 1), 0, all, row, 1)) << "width " << width;
  }
}

// Three sequences cached once; the reference attends every query of all three in one call. Each
// other call (alone, reordered batch, prefill chunks, single-token decode, multi-token append,
// decode batch) must reproduce the reference rows bit for bit.
TEST_P(CudaInvariance, AttentionRowIsBitIdenticalAloneBatchedChunkedAndDecoded) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(13);
  struct HeadShape {
    int64_t heads, kv_heads, head_dim;
  };
  for (const HeadShape shape : {HeadShape{8, 2, 64}, HeadShape{4, 1, 128}}) {
    const std::vector<int32_t> lengths = {300, 70, 1030};
    const int64_t capacity = 1100;
    std::vector<Tensor> queries;  // per slot [length, heads, head_dim], host, activation dtype
    Tensor k_cache = cuda->alloc({3, capacity, shape.kv_heads, shape.head_dim}, act);
    Tensor v_cache = cuda->alloc({3, capacity, shape.kv_heads, shape.head_dim}, act);
    const int32_t total = std::accumulate(lengths.begin(), lengths.end(), 0);
    {
      const BatchLayout fill = cuda->make_layout(spans_of({{0, 0, 300}, {1, 0, 70}, {2, 0, 1030}}),
                                                 std::vector<int32_t>(total, 0));
      const Tensor k = cuda->upload(f32_as(random_f32({total, shape.kv_heads, shape.head_dim}, random), act));
      const Tensor v = cuda->upload(f32_as(random_f32({total, shape.kv_heads, shape.head_dim}, random), act));
      cuda->kv_write(k, v, fill, k_cache, v_cache);
      for (int32_t length : lengths)
        queries.push_back(f32_as(random_f32({length, shape.heads, shape.head_dim}, random), act));
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    // Attends the given (slot, first position, tokens) spans; returns the host output.
    auto attend = [&](const std::vector<std::array<int32_t, 3>>& request) {
      const std::vector<SequenceSpan> spans = spans_of(request);
      const int64_t tokens = span_tokens(spans);
      Tensor q = Tensor::empty({tokens, shape.heads, shape.head_dim}, act);
      for (const SequenceSpan& span : spans) {
        const Tensor& source = queries[span.slot];
        const size_t row_bytes = source.nbytes() / source.dim(0);
        std::memcpy(static_cast<char*>(q.raw()) + span.first_token * row_bytes,
                    static_cast<const char*>(source.raw()) + span.first_position * row_bytes, span.tokens * row_bytes);
      }
      const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(tokens, 0));
      Tensor out = cuda->alloc({tokens, shape.heads, shape.head_dim}, act);
      cuda->attention(cuda->upload(q), k_cache, v_cache, layout, scale, out);
      return std::make_pair(spans, cuda->download(out));
    };
    const auto [reference_spans, reference] = attend({{0, 0, 300}, {1, 0, 70}, {2, 0, 1030}});
    auto reference_row = [&](int32_t slot, int32_t position) { return reference_spans[slot].first_token + position; };

    const std::vector<std::vector<std::array<int32_t, 3>>> requests = {
        {{0, 0, 300}}, {{1, 0, 70}}, {{2, 0, 1030}},                  // each alone
        {{1, 0, 70}, {0, 0, 300}},                                      // another batch order
        {{0, 0, 64}}, {{0, 64, 128}}, {{0, 192, 108}},                  // prefill chunks
        {{2, 0, 1}}, {{2, 63, 1}}, {{2, 64, 1}}, {{2, 255, 1}}, {{2, 256, 1}}, {{2, 511, 1}}, {{2, 512, 1}},
        {{2, 1029, 1}}, {{0, 299, 1}},                                  // single-token decode
        {{2, 1020, 5}, {1, 60, 10}},                                    // multi-token appends
        {{0, 299, 1}, {1, 69, 1}, {2, 1029, 1}},                        // decode batch
        {{2, 700, 40}},                                                 // mid-sequence chunk
    };
    for (const auto& request : requests) {
      const auto [spans, out] = attend(request);
      for (const SequenceSpan& span : spans)
        for (int32_t i = 0; i < span.tokens; ++i)
          ASSERT_TRUE(same_rows(out, span.first_token + i, reference, reference_row(span.slot, span.first_position + i), 1))
              << "head_dim " << shape.head_dim << ": slot " << span.slot << " position " << span.first_position + i
              << " differs from the one-call reference (request of " << spans.size() << " spans, first "
              << request.front()[1] << " ×" << request.front()[2] << ")";
    }
  }
}

// The GDN conv and delta rule of three sequences give the same bits for every position, and the
// same final states, under the schedules the contract names: one shot, alone, in another order and
// in prefill chunks of 64 all equal the one-shot batch (the conv also equals it token by token);
// appends of 1..16 tokens equal decoding token by token (whole aligned chunks take the chunked
// form, so token by token differs from one shot from position 64 on).
TEST_P(CudaInvariance, GatedDeltaRowsAreBitIdenticalUnderEverySchedule) {
  KILN_REQUIRE_CUDA();
  const DType act = GetParam();
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  HybridOps& hybrid = *cuda->hybrid_ops();
  std::mt19937 random(17);
  constexpr int64_t kKeyHeads = 2, kValueHeads = 4, kKeyDim = 64, kValueDim = 32;
  constexpr int64_t kChannels = 2 * kKeyHeads * kKeyDim + kValueHeads * kValueDim;
  const std::vector<int32_t> lengths = {150, 70, 40};
  struct Sequence {
    Tensor x, q, k, v, g, beta;  // host, [length, …]
  };
  std::vector<Sequence> sequences;
  for (int32_t length : lengths)
    sequences.push_back({f32_as(random_f32({length, kChannels}, random), act),
                         unit_rows(random_f32({length, kKeyHeads, kKeyDim}, random)),
                         unit_rows(random_f32({length, kKeyHeads, kKeyDim}, random)),
                         random_f32({length, kValueHeads, kValueDim}, random),
                         uniform_f32({length, kValueHeads}, random, -0.5f, -0.01f),
                         uniform_f32({length, kValueHeads}, random, 0.05f, 0.95f)});
  const Tensor weight = cuda->upload(f32_as(random_f32({kChannels, 4}, random, 0.5f), DType::BF16));

  struct Outputs {
    std::vector<Tensor> convolved, core;  // per sequence, host
    Tensor conv_state, state;
  };
  // Each step lists (slot, first position, tokens); a schedule covers every position in order.
  auto run = [&](const std::vector<std::vector<std::array<int32_t, 3>>>& steps) {
    Outputs result;
    for (size_t slot = 0; slot < lengths.size(); ++slot) {
      result.convolved.push_back(Tensor::empty({lengths[slot], kChannels}, act));
      result.core.push_back(Tensor::empty({lengths[slot], kValueHeads, kValueDim}, act));
    }
    Tensor conv_state = cuda->alloc({3, 3, kChannels}, DType::F32);
    Tensor state = cuda->alloc({3, kValueHeads, kKeyDim, kValueDim}, DType::F32);
    for (const auto& step : steps) {
      const std::vector<SequenceSpan> spans = spans_of(step);
      const int64_t tokens = span_tokens(spans);
      // Gathers rows [first_position, +tokens) of each span's sequence into one batch tensor.
      auto gather = [&](Tensor Sequence::*field) {
        const Tensor& first = sequences[0].*field;
        Shape shape = first.shape();
        shape[0] = tokens;
        Tensor batch = Tensor::empty(shape, first.dtype());
        for (const SequenceSpan& span : spans) {
          const Tensor& source = sequences[span.slot].*field;
          const size_t row_bytes = source.nbytes() / source.dim(0);
          std::memcpy(static_cast<char*>(batch.raw()) + span.first_token * row_bytes,
                      static_cast<const char*>(source.raw()) + span.first_position * row_bytes, span.tokens * row_bytes);
        }
        return cuda->upload(batch);
      };
      const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(tokens, 0));
      Tensor convolved = cuda->alloc({tokens, kChannels}, act);
      hybrid.causal_conv1d_silu(gather(&Sequence::x), weight, layout, conv_state, convolved);
      Tensor core = cuda->alloc({tokens, kValueHeads, kValueDim}, act);
      hybrid.gated_delta_rule(gather(&Sequence::q), gather(&Sequence::k), gather(&Sequence::v), gather(&Sequence::g),
                              gather(&Sequence::beta), layout, state, core);
      const Tensor convolved_host = cuda->download(convolved), core_host = cuda->download(core);
      for (const SequenceSpan& span : spans)
        for (const auto& [from, to] : {std::pair{&convolved_host, &result.convolved[span.slot]},
                                       std::pair{&core_host, &result.core[span.slot]}}) {
          const size_t row_bytes = from->nbytes() / from->dim(0);
          std::memcpy(static_cast<char*>(to->raw()) + span.first_position * row_bytes,
                      static_cast<const char*>(from->raw()) + span.first_token * row_bytes, span.tokens * row_bytes);
        }
    }
    result.conv_state = cuda->download(conv_state);
    result.state = cuda->download(state);
    return result;
  };

  const Outputs one_shot = run({{{0, 0, 150}, {1, 0, 70}, {2, 0, 40}}});
  std::vector<std::vector<std::array<int32_t, 3>>> one_by_one, appends;
  for (int32_t position = 0; position < 150; ++position) {
    std::vector<std::array<int32_t, 3>> step;
    for (int32_t slot = 0; slot < 3; ++slot)
      if (position < lengths[slot]) step.push_back({slot, position, 1});
    one_by_one.push_back(step);
  }
  for (int32_t position = 0, size = 1; position < 150; position += size, size = size % 16 + 1) {
    std::vector<std::array<int32_t, 3>> step;
    for (int32_t slot = 0; slot < 3; ++slot)
      if (position < lengths[slot]) step.push_back({slot, position, std::min(size, lengths[slot] - position)});
    appends.push_back(step);
  }
  const Outputs token_by_token = run(one_by_one);
  struct Schedule {
    std::string name;
    std::vector<std::vector<std::array<int32_t, 3>>> steps;
    const Outputs* reference;
  };
  const std::vector<Schedule> schedules = {
      {"alone", {{{0, 0, 150}}, {{1, 0, 70}}, {{2, 0, 40}}}, &one_shot},
      {"other order", {{{2, 0, 40}, {0, 0, 150}, {1, 0, 70}}}, &one_shot},
      {"chunks of 64", {{{0, 0, 64}, {1, 0, 64}}, {{0, 64, 64}, {1, 64, 6}, {2, 0, 40}}, {{0, 128, 22}}}, &one_shot},
      {"appends of 1..16", appends, &token_by_token},
  };
  auto expect_same = [&](const std::string& name, const Outputs& outputs, const Outputs& reference, bool core) {
    for (size_t slot = 0; slot < lengths.size(); ++slot)
      for (int32_t position = 0; position < lengths[slot]; ++position) {
        ASSERT_TRUE(same_rows(outputs.convolved[slot], position, reference.convolved[slot], position, 1))
            << name << ": conv output of sequence " << slot << " at position " << position;
        if (core) {
          ASSERT_TRUE(same_rows(outputs.core[slot], position, reference.core[slot], position, 1))
              << name << ": delta-rule output of sequence " << slot << " at position " << position;
        }
      }
    EXPECT_EQ(std::memcmp(outputs.conv_state.raw(), reference.conv_state.raw(), reference.conv_state.nbytes()), 0)
        << name;
    if (core) {
      EXPECT_EQ(std::memcmp(outputs.state.raw(), reference.state.raw(), reference.state.nbytes()), 0) << name;
    }
  };
  for (const Schedule& schedule : schedules) expect_same(schedule.name, run(schedule.steps), *schedule.reference, true);
  expect_same("token by token against one shot (conv only)", token_by_token, one_shot, false);
  // Sequence 2 (40 tokens) holds no whole chunk: it is recurrent in every schedule.
  for (int32_t position = 0; position < lengths[2]; ++position)
    ASSERT_TRUE(same_rows(token_by_token.core[2], position, one_shot.core[2], position, 1))
        << "token by token against one shot: delta-rule output of sequence 2 at position " << position;
}

INSTANTIATE_TEST_SUITE_P(Activations, CudaInvariance, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace kiln::testing
