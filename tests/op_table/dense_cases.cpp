// The op table's dense cases: matmul and matmul_group, the norms, add, swiglu, embedding,
// gather_rows, a mixture's moe_route, expert_matmul and moe_combine, rope and rope_kv_write (odd
// sizes, every weight dtype, both norm styles, partial rotary dims, in-place calls and the f32
// residual stream), and the CPU's cases checked against exact arithmetic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kv_cache_support.h"
#include "op_table/op_table.h"
#include "tensor_test_support.h"

namespace kiln::testing {
namespace {

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
    op.same_bits_on_every_cpu = false;  // matmul_kernels.h: block sizes and FMA differ by instruction set
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
      for (int64_t n : widths)
        outs.push_back(backend.alloc({m, n}, n == 128 ? DType::F32 : backend.activation_dtype()));
      const Weight weights[] = {in[1], in[2], in[3]};
      const MatmulTarget targets[] = {
          {&weights[0], nullptr, &outs[0]}, {&weights[1], nullptr, &outs[1]}, {&weights[2], &in[4], &outs[2]}};
      backend.matmul_group(in[0], targets);
      return outs;
    };
    group.f32_weight_dtypes = {DType::F32, DType::BF16};
    group.same_bits_on_every_cpu = false;
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
  odd.same_bits_on_every_cpu = false;
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

  // A mixture's combine: 4 tokens, 2 routed terms each, without and with a shared expert's term;
  // checked on the CPU against the fma chain it promises.
  for (const bool shared : {false, true}) {
    OpCase combine;
    combine.name = std::string("moe_combine 4 tokens x 2 experts") + (shared ? " + shared" : "");
    const int64_t terms = shared ? 3 : 2;
    combine.inputs = {{random_f32({8, 72}, random), Role::Float32}, {random_f32({4, terms}, random), Role::Float32}};
    if (shared) combine.inputs.push_back({random_f32({4, 72}, random), Role::Float32});
    combine.run = [shared](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({4, 72}, DType::F32);
      backend.moe_combine(in[0], shared ? &in[2] : nullptr, in[1], out);
      return std::vector<Tensor>{out};
    };
    combine.exact = [terms](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
      for (int64_t t = 0; t < 4; ++t)
        for (int64_t h = 0; h < 72; ++h) {
          float acc = 0.0f;
          for (int64_t s = 0; s < terms; ++s) {
            const float term = s < 2 ? in[0].data<float>()[(t * 2 + s) * 72 + h] : in[2].data<float>()[t * 72 + h];
            acc = std::fma(in[1].data<float>()[t * terms + s], term, acc);
          }
          ASSERT_EQ(out[0].data<float>()[t * 72 + h], acc) << "token " << t << " column " << h;
        }
    };
    combine.same_bits_on_every_backend = true;
    cases.push_back(std::move(combine));
  }

  // A mixture's routing (backend/moe_routing.h): the same bits on every backend, ties included.
  // Rows of exact ties (all equal; two at the top; a tie across the k-th place, which the lower
  // expert id wins), logits far apart (probabilities that underflow to subnormals and zeros, which
  // then tie), shared-expert gates far into both tails, and 64 and 128 experts (lanes that take
  // several candidates each) with logits on a coarse grid, so that ties fall anywhere.
  struct RouteShape {
    int64_t tokens, experts, top_k;
    bool normalize, shared;
    std::vector<float> rows;  // fixed logits, then random ones
  };
  const std::vector<RouteShape> routes = {
      {6, 8, 3, true, false, {1, 1, 1, 1, 1, 1, 1, 1,   0.5f, 2, -1, 1.5f, 2, 0, -3, 1,
                              3, 1, 2, 2, 0, 2, -1, 0,   0, -90, -95, -100, -105, -110, -200, -87.5f}},
      {40, 64, 8, false, true, {}},
      {5, 128, 8, true, true, {}},
      {3, 8, 8, true, false, {}}};
  for (const RouteShape& shape : routes) {
    OpCase route;
    route.name = "moe_route tokens=" + std::to_string(shape.tokens) + " experts=" + std::to_string(shape.experts) +
                 " k=" + std::to_string(shape.top_k) + (shape.normalize ? " normalized" : "") +
                 (shape.shared ? " shared" : "");
    Tensor logits = random_f32({shape.tokens, shape.experts}, random, 2.0f);
    for (int64_t i = 0; i < logits.numel(); ++i) {
      float& logit = logits.data<float>()[i];
      if (i < static_cast<int64_t>(shape.rows.size()))
        logit = shape.rows[static_cast<size_t>(i)];
      else if (shape.experts > 8)
        logit = std::round(logit * 2.0f) / 2.0f;
    }
    route.inputs = {{logits, Role::Float32}};
    if (shape.shared) {
      Tensor gates = random_f32({shape.tokens, 1}, random, 4.0f);
      gates.data<float>()[0] = -120.0f;
      gates.data<float>()[1] = 95.0f;
      route.inputs.push_back({gates, Role::Float32});
    }
    route.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      Tensor experts = backend.alloc({shape.tokens, shape.top_k}, DType::I32);
      Tensor weights = backend.alloc({shape.tokens, shape.top_k + (shape.shared ? 1 : 0)}, DType::F32);
      backend.moe_route(in[0], shape.shared ? &in[1] : nullptr, shape.normalize, experts, weights);
      return std::vector<Tensor>{experts, weights};
    };
    route.same_bits_on_every_backend = true;
    cases.push_back(std::move(route));
  }

  // The products of each token's experts: gate/up-like pairs of products over a token's row and a
  // down-like product over each pair's own row, with the tokens' experts overlapping; 40 tokens of
  // 8 experts give an expert more pairs than one pass of the CUDA kernel takes, and 100 tokens of 4
  // more pairs per expert than its device path takes (the pairs then sorted on the host).
  struct ExpertShape {
    int64_t tokens, experts, top_k, n, k;
    bool per_pair;
  };
  for (const ExpertShape& shape : {ExpertShape{1, 4, 2, 40, 72, false}, ExpertShape{5, 4, 2, 40, 72, false},
                                   ExpertShape{5, 4, 2, 72, 40, true}, ExpertShape{40, 8, 2, 48, 200, false},
                                   ExpertShape{40, 8, 2, 200, 48, true}, ExpertShape{100, 4, 2, 48, 136, false}}) {
    const int64_t pairs = shape.tokens * shape.top_k;
    const int64_t rows = shape.per_pair ? pairs : shape.tokens;
    const int products = shape.per_pair ? 1 : 2;
    OpCase product;
    product.name = "expert_matmul tokens=" + std::to_string(shape.tokens) + " experts=" +
                   std::to_string(shape.experts) + " k=" + std::to_string(shape.top_k) + " n=" +
                   std::to_string(shape.n) + " K=" + std::to_string(shape.k) +
                   (shape.per_pair ? " (a row per pair, f32 out)" : " (gate/up)");
    // Each token's experts distinct and ascending, as moe_route gives them.
    std::vector<int32_t> chosen;
    for (int64_t t = 0; t < shape.tokens; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(shape.experts));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), random);
      all.resize(static_cast<size_t>(shape.top_k));
      std::sort(all.begin(), all.end());
      chosen.insert(chosen.end(), all.begin(), all.end());
    }
    product.inputs = {{random_f32({rows, shape.k}, random), Role::Activation}, {indices(chosen), Role::Index}};
    for (int p = 0; p < products; ++p)
      product.inputs.push_back(
          {random_f32({shape.experts * shape.n, shape.k}, random, 1.0f / std::sqrt(static_cast<float>(shape.k))),
           Role::Weight});
    product.run = [shape, pairs, products](Backend& backend, std::vector<Tensor>& in) {
      const DType out_dtype = shape.per_pair ? DType::F32 : backend.activation_dtype();
      std::vector<Tensor> outs;
      std::vector<Weight> weights;
      for (int p = 0; p < products; ++p) {
        outs.push_back(backend.alloc({pairs, shape.n}, out_dtype));
        weights.push_back(in[2 + p]);
      }
      std::vector<MatmulTarget> targets;
      for (int p = 0; p < products; ++p) targets.push_back({&weights[p], nullptr, &outs[p]});
      backend.expert_matmul(in[0], in[1].reshape({shape.tokens, shape.top_k}), targets, nullptr);
      return outs;
    };
    product.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
    product.same_bits_on_every_cpu = false;  // matmul's, whose block sizes and FMA differ by instruction set
    cases.push_back(std::move(product));
  }

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
  // zero-centred ones), into a cache whose slots' blocks are scattered over the pool.
  for (int64_t rotary_dim : {64, 32}) {
    for (std::optional<NormStyle> norms : {std::optional<NormStyle>{}, std::optional{NormStyle::Plain},
                                           std::optional{NormStyle::ZeroCentred}}) {
      constexpr int64_t kHeads = 4, kKvHeads = 2, kHeadDim = 64;
      constexpr int64_t kBlocks = 2 * kv_table_width(400) + kSpareKvBlocks;
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
                      {random_f32({kHeadDim}, random), Role::Weight},
                      {kv_block_table(2, kv_table_width(400), kBlocks, true), Role::Index}};
      fused.f32_weight_dtypes = {DType::F32, DType::BF16};
      fused.run = [spans, tokens, rotary_dim, norms](Backend& backend, std::vector<Tensor>& in) {
        Tensor k_cache = backend.alloc({kBlocks, kKvBlockTokens, kKvHeads, kHeadDim}, backend.activation_dtype());
        Tensor v_cache = backend.alloc({kBlocks, kKvBlockTokens, kKvHeads, kHeadDim}, backend.activation_dtype());
        backend.zero(k_cache);
        backend.zero(v_cache);
        const BatchLayout layout = backend.make_layout(spans, std::vector<int32_t>(tokens, 0));
        const std::optional<HeadNorms> head_norms =
            norms ? std::optional<HeadNorms>(HeadNorms{in[4], in[5], 1e-6f, *norms}) : std::nullopt;
        backend.rope_kv_write(in[0], in[1], in[2], layout, in[3], static_cast<int>(rotary_dim),
                              head_norms ? &*head_norms : nullptr, KvCacheView{k_cache, v_cache, in[6]});
        return std::vector<Tensor>{in[0], in[1], k_cache, v_cache};
      };
      cases.push_back(std::move(fused));
    }
  }
  return cases;
}

// --- the CPU's cases, with exact references ---

constexpr double kUnitRoundoff = 1.0 / (1 << 24);  // f32 rounding to nearest: relative error ≤ 2^-24

// Values drawn uniformly from [low, high) by a generator of its own seed (the CPU's cases keep
// their inputs whatever the cases before them draw).
Tensor seeded_uniform(const Shape& shape, uint32_t seed, float low = -1.0f, float high = 1.0f) {
  std::mt19937 random(seed);
  return uniform_f32(shape, random, low, high);
}

double value_at(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype()) {
    case DType::BF16: return bf16_to_f32(tensor.data<uint16_t>()[index]);
    case DType::F16: return f16_to_f32(tensor.data<uint16_t>()[index]);
    case DType::I32: return tensor.data<int32_t>()[index];
    case DType::U32: return tensor.data<uint32_t>()[index];
    case DType::F8E4M3: return fp8_e4m3_to_f32(tensor.data<uint8_t>()[index]);
    case DType::F32: break;
  }
  return tensor.data<float>()[index];
}

bool same_bits(const float* a, const float* b, int64_t count) {
  return std::memcmp(a, b, static_cast<size_t>(count) * sizeof(float)) == 0;
}

std::vector<OpCase> exact_matmul_cases() {
  struct Shape {
    int64_t rows, k, n;
    bool bias;
  };
  std::vector<OpCase> cases;
  for (const Shape& shape : {Shape{1, 17, 3, false}, Shape{5, 67, 130, true}, Shape{64, 1000, 1, false},
                             Shape{65, 64, 33, true}, Shape{3, 32, 7, false}, Shape{1, 1000, 130, true},
                             Shape{7, 16, 13, false}, Shape{2, 1, 5, true}}) {
    OpCase op;
    op.name = "matmul (exact) T=" + std::to_string(shape.rows) + " K=" + std::to_string(shape.k) +
              " N=" + std::to_string(shape.n) + (shape.bias ? " bias" : "");
    op.inputs = {{seeded_uniform({shape.rows, shape.k}, 1), Role::Activation},
                 {seeded_uniform({shape.n, shape.k}, 2), Role::Weight}};
    if (shape.bias) op.inputs.push_back({seeded_uniform({shape.n}, 3), Role::Weight});
    op.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({shape.rows, shape.n}, backend.activation_dtype());
      backend.matmul(in[0], in[1], shape.bias ? &in[2] : nullptr, out);
      return std::vector<Tensor>{out};
    };
    op.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
    op.bf16 = shape.k % 8 == 0;  // the tensor-core path's 16-byte rows
    op.same_bits_on_every_cpu = false;  // matmul_kernels.h: block sizes and FMA differ by instruction set
    op.exact = [shape](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
      for (int64_t t = 0; t < shape.rows; ++t)
        for (int64_t n = 0; n < shape.n; ++n) {
          double exact = shape.bias ? value_at(in[2], n) : 0.0;
          double magnitude = std::abs(exact);
          for (int64_t k = 0; k < shape.k; ++k) {
            const double product = value_at(in[0], t * shape.k + k) * value_at(in[1], n * shape.k + k);
            exact += product;
            magnitude += std::abs(product);
          }
          // The classic bound for a sum of K + 1 f32 terms, whatever the order: (K + 2)·u·Σ|terms|.
          const double bound = double(shape.k + 2) * kUnitRoundoff * magnitude;
          ASSERT_LE(std::abs(value_at(out[0], t * shape.n + n) - exact), bound) << "t=" << t << " n=" << n;
        }
    };
    cases.push_back(std::move(op));
  }
  return cases;
}

std::vector<OpCase> exact_norm_cases() {
  struct NormShape {
    kiln::Shape shape;
    int64_t width;
  };
  std::vector<OpCase> cases;
  for (const NormShape& c : {NormShape{{5, 67}, 67}, NormShape{{3, 4, 16}, 16}, NormShape{{65, 1000}, 1000},
                             NormShape{{1, 8}, 8}, NormShape{{2, 3, 128}, 128}})
    for (NormStyle style : {NormStyle::Plain, NormStyle::ZeroCentred}) {
      OpCase op;
      op.name = "rms_norm (exact) " + shape_string(c.shape) + (style == NormStyle::Plain ? " plain" : " zero-centred");
      op.inputs = {{seeded_uniform(c.shape, 11, -3.0f, 3.0f), Role::Activation},
                   {seeded_uniform({c.width}, 12, -0.5f, 1.5f), Role::Weight}};
      constexpr float kEps = 1e-6f;
      op.run = [c, style](Backend& backend, std::vector<Tensor>& in) {
        Tensor out = backend.alloc(c.shape, backend.activation_dtype());
        backend.rms_norm(in[0], in[1], kEps, style, out);
        return std::vector<Tensor>{out};
      };
      op.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
      op.exact = [c, style](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        for (int64_t row = 0; row < in[0].numel() / c.width; ++row) {
          const float* x = in[0].data<float>() + row * c.width;
          double squares = 0;
          for (int64_t i = 0; i < c.width; ++i) squares += double(x[i]) * x[i];
          const double inverse_rms = 1.0 / std::sqrt(squares / c.width + kEps);
          for (int64_t i = 0; i < c.width; ++i) {
            // The gain 1 + w is itself an f32 sum, so the reference rounds it as the contract says.
            const double gain =
                style == NormStyle::Plain ? value_at(in[1], i) : double(1.0f + float(value_at(in[1], i)));
            const double exact = gain * x[i] * inverse_rms;
            const double bound = double(c.width + 8) * kUnitRoundoff * std::abs(exact) + 1e-30;
            ASSERT_LE(std::abs(value_at(out[0], row * c.width + i) - exact), bound) << "row " << row << " i " << i;
          }
        }
      };
      cases.push_back(std::move(op));
    }
  return cases;
}

std::vector<float> inverse_frequencies(int64_t rotary_dim, double theta) {
  std::vector<float> frequencies(static_cast<size_t>(rotary_dim / 2));
  for (int64_t j = 0; j < rotary_dim / 2; ++j)
    frequencies[j] = static_cast<float>(1.0 / std::pow(theta, 2.0 * j / static_cast<double>(rotary_dim)));
  return frequencies;
}

std::vector<OpCase> exact_rope_cases() {
  struct RopeCase {
    int64_t tokens, heads, head_dim, rotary_dim;
    double theta;
  };
  const std::vector<int32_t> position_values = {0, 1, 17, 4095, 131071};
  std::vector<OpCase> cases;
  for (const RopeCase& c : {RopeCase{5, 3, 64, 64, 10000.0}, RopeCase{4, 2, 128, 32, 1e6},
                            RopeCase{3, 1, 8, 8, 500000.0}, RopeCase{2, 4, 16, 4, 10000.0}}) {
    OpCase op;
    op.name = "rope (exact) head_dim=" + std::to_string(c.head_dim) + " rotary=" + std::to_string(c.rotary_dim);
    const std::vector<float> frequencies = inverse_frequencies(c.rotary_dim, c.theta);
    Tensor inv_freq = Tensor::empty({c.rotary_dim / 2}, DType::F32);
    std::copy(frequencies.begin(), frequencies.end(), inv_freq.data<float>());
    op.inputs = {{seeded_uniform({c.tokens, c.heads, c.head_dim}, 21), Role::Activation},
                 {indices(std::vector<int32_t>(position_values.begin(), position_values.begin() + c.tokens)),
                  Role::Index},
                 {inv_freq, Role::Float32}};
    op.run = [c](Backend& backend, std::vector<Tensor>& in) {
      backend.rope(in[0], in[1], in[2], static_cast<int>(c.rotary_dim));
      return std::vector<Tensor>{in[0]};
    };
    op.exact = [c](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
      const int64_t half = c.rotary_dim / 2;
      for (int64_t t = 0; t < c.tokens; ++t)
        for (int64_t h = 0; h < c.heads; ++h) {
          const float* x = in[0].data<float>() + (t * c.heads + h) * c.head_dim;
          const float* got = out[0].data<float>() + (t * c.heads + h) * c.head_dim;
          for (int64_t j = 0; j < half; ++j) {
            const float angle = float(in[1].data<int32_t>()[t]) * in[2].data<float>()[j];
            const double cosine = std::cos(double(angle)), sine = std::sin(double(angle));
            const double first = x[j] * cosine - x[j + half] * sine;
            const double second = x[j + half] * cosine + x[j] * sine;
            // cos/sin within an ulp (2u relative) of the f32 angle's, then a multiply each and a sum.
            const double bound = 6 * kUnitRoundoff * (std::abs(x[j]) + std::abs(x[j + half]));
            ASSERT_LE(std::abs(got[j] - first), bound) << "t " << t << " j " << j;
            ASSERT_LE(std::abs(got[j + half] - second), bound) << "t " << t << " j " << j;
          }
          EXPECT_TRUE(same_bits(x + c.rotary_dim, got + c.rotary_dim, c.head_dim - c.rotary_dim));
        }
    };
    cases.push_back(std::move(op));
  }
  return cases;
}

std::vector<OpCase> exact_elementwise_cases() {
  std::vector<OpCase> cases;
  const std::vector<Input> gate_and_up = {{seeded_uniform({7, 133}, 24, -100.0f, 100.0f), Role::Activation},
                                          {seeded_uniform({7, 133}, 25, -2.0f, 2.0f), Role::Activation}};
  OpCase swiglu;
  swiglu.name = "swiglu (exact) 7×133, gates in [-100, 100)";
  swiglu.inputs = gate_and_up;
  swiglu.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({7, 133}, backend.activation_dtype());
    backend.swiglu(in[0], in[1], out);
    return std::vector<Tensor>{out};
  };
  swiglu.exact = [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
    for (int64_t i = 0; i < in[0].numel(); ++i) {
      const double g = in[0].data<float>()[i];
      const double exact = g / (1.0 + std::exp(-g)) * in[1].data<float>()[i];
      // expf within an ulp, then an add, a divide and a multiply; e^-g overflows for g < -88.72,
      // where f32 gives 0 and the exact |g·u| / (1 + e^-g) is below 88.8 · 2 / FLT_MAX < 1e-36.
      ASSERT_LE(std::abs(out[0].data<float>()[i] - exact), 8 * kUnitRoundoff * std::abs(exact) + 1e-36) << i;
    }
  };
  cases.push_back(std::move(swiglu));

  OpCase add;
  add.name = "add (exact) 7×133";
  add.inputs = gate_and_up;
  add.run = [](Backend& backend, std::vector<Tensor>& in) {
    backend.add(in[0], in[1]);
    return std::vector<Tensor>{in[0]};
  };
  add.exact = [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
    for (int64_t i = 0; i < in[0].numel(); ++i)
      ASSERT_EQ(out[0].data<float>()[i], in[0].data<float>()[i] + in[1].data<float>()[i]) << i;
  };
  cases.push_back(std::move(add));

  OpCase embedding;
  embedding.name = "embedding (exact) 11×37";
  const std::vector<int32_t> ids = {3, 0, 10, 3};
  embedding.inputs = {{seeded_uniform({11, 37}, 27), Role::Weight}, {indices(ids), Role::Index}};
  embedding.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({4, 37}, backend.activation_dtype());
    backend.embedding(in[0], in[1], out);
    return std::vector<Tensor>{out};
  };
  embedding.f32_weight_dtypes = {DType::F32, DType::BF16, DType::F16};
  embedding.exact = [ids](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t i = 0; i < 37; ++i)
        ASSERT_EQ(out[0].data<float>()[t * 37 + i], float(value_at(in[0], ids[t] * 37 + i))) << t << ", " << i;
  };
  cases.push_back(std::move(embedding));

  OpCase gather;
  gather.name = "gather_rows (exact) rows 5, 0, 5 of 6";
  const std::vector<int32_t> rows = {5, 0, 5};
  gather.inputs = {{seeded_uniform({6, 5}, 29), Role::Activation}, {indices(rows), Role::Index}};
  gather.run = [](Backend& backend, std::vector<Tensor>& in) {
    Tensor out = backend.alloc({3, 5}, backend.activation_dtype());
    backend.gather_rows(in[0], in[1], out);
    return std::vector<Tensor>{out};
  };
  gather.exact = [rows](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
    for (int64_t r = 0; r < 3; ++r)
      EXPECT_TRUE(same_bits(out[0].data<float>() + r * 5, in[0].data<float>() + rows[r] * 5, 5)) << "row " << r;
  };
  cases.push_back(std::move(gather));
  return cases;
}

}  // namespace

std::vector<OpCase> dense_op_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  for (auto group : {matmul_cases(random), norm_cases(random), elementwise_cases(random), exact_matmul_cases(),
                     exact_norm_cases(), exact_rope_cases(), exact_elementwise_cases()})
    for (auto& op : group) cases.push_back(std::move(op));
  return cases;
}

}  // namespace kiln::testing
