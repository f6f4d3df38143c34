// The op table's quantized-weight cases: matmul, matmul_group, embedding and a mixture's expert
// products with MLX affine and FP8 block weights (core/weight.h), built inside each run from their
// stored parts (Role::Stored) and handed to the backend's upload_weight as a model's weights are
// (which may rearrange their codes: CodeOrder), at decode and prefill row counts.
#include <cstdint>
#include <string>
#include <vector>

#include "op_table/op_table.h"
#include "tensor_test_support.h"

namespace kiln::testing {
namespace {

// The stored parts of a random affine weight [n, k]: packed codes, then scales and biases in
// `scale_dtype` (biases near −scale · 2^(bits−1), as MLX makes them).
std::vector<Input> affine_parts(int64_t n, int64_t k, int bits, int group, DType scale_dtype, std::mt19937& random) {
  Tensor values = Tensor::empty({n, k * bits / 32}, DType::U32);
  for (int64_t i = 0; i < values.numel(); ++i) values.data<uint32_t>()[i] = static_cast<uint32_t>(random());
  const float unit = 1.0f / static_cast<float>(1 << bits) / 8.0f;
  const Tensor scales = uniform_f32({n, k / group}, random, 0.5f * unit, 1.5f * unit);
  Tensor biases = uniform_f32({n, k / group}, random, -0.01f, 0.01f);
  for (int64_t i = 0; i < biases.numel(); ++i)
    biases.data<float>()[i] -= scales.data<float>()[i] * static_cast<float>(1 << (bits - 1));
  return {{values, Role::Stored}, {f32_as(scales, scale_dtype), Role::Stored}, {f32_as(biases, scale_dtype), Role::Stored}};
}

// The stored parts of a random FP8 weight [n, k] in 128×128 blocks: e4m3 values (no NaN), then
// its scale_inv in `scale_dtype`.
std::vector<Input> fp8_parts(int64_t n, int64_t k, DType scale_dtype, std::mt19937& random) {
  const Tensor values = random_fp8_codes(n, k, random);
  const Tensor scales = uniform_f32({(n + 127) / 128, (k + 127) / 128}, random, 1e-4f, 1e-3f);
  return {{values, Role::Stored}, {f32_as(scales, scale_dtype), Role::Stored}};
}

// How a case builds its weight from the uploaded parts that start at inputs[first].
struct QuantizedLayout {
  WeightFormat format;
  int bits = 0, group = 0;  // Affine
  int parts() const { return format == WeightFormat::Affine ? 3 : 2; }
  std::string name() const {
    return format == WeightFormat::Affine ? "affine " + std::to_string(bits) + "-bit g" + std::to_string(group)
                                          : std::string("fp8 128x128");
  }
  Weight build(Backend& backend, const std::vector<Tensor>& in, size_t first) const {
    if (format == WeightFormat::Affine)
      return backend.upload_weight(Weight::affine(in[first], in[first + 1], in[first + 2], bits, group));
    return backend.upload_weight(Weight::fp8_block(in[first], in[first + 1], 128, 128));
  }
};

std::vector<Input> parts(const QuantizedLayout& layout, int64_t n, int64_t k, DType scale_dtype, std::mt19937& random) {
  if (layout.format == WeightFormat::Affine) return affine_parts(n, k, layout.bits, layout.group, scale_dtype, random);
  return fp8_parts(n, k, scale_dtype, random);
}

}  // namespace

std::vector<OpCase> quantized_op_cases(std::mt19937& random) {
  std::vector<OpCase> cases;
  struct MatmulShape {
    int64_t m, n, k;
    QuantizedLayout layout;
    DType scale_dtype;
  };
  // On the CUDA backend, 4- and 8-bit and FP8 with K a multiple of 16 take the fused decode kernel
  // at m ≤ 8 (their codes in the fragment order); 3- and 6-bit, FP8 with K = 328 and every m
  // above 8 read a decoded scratch matrix.
  const std::vector<MatmulShape> shapes = {{1, 130, 256, {WeightFormat::Affine, 4, 64}, DType::BF16},
                                           {3, 96, 512, {WeightFormat::Affine, 8, 32}, DType::F16},
                                           {64, 130, 256, {WeightFormat::Affine, 4, 64}, DType::BF16},
                                           {3, 72, 384, {WeightFormat::Affine, 3, 128}, DType::F32},
                                           {80, 64, 192, {WeightFormat::Affine, 6, 64}, DType::BF16},
                                           {1, 200, 336, {WeightFormat::Fp8Block}, DType::F32},
                                           {4, 200, 328, {WeightFormat::Fp8Block}, DType::BF16},
                                           {300, 136, 1152, {WeightFormat::Fp8Block}, DType::F32}};
  for (const MatmulShape& shape : shapes) {
    OpCase op;
    op.name = "matmul m=" + std::to_string(shape.m) + " n=" + std::to_string(shape.n) + " k=" +
              std::to_string(shape.k) + " " + shape.layout.name() + " scales " +
              std::string(dtype_name(shape.scale_dtype));
    op.inputs = {{random_f32({shape.m, shape.k}, random), Role::Activation}};
    for (Input& part : parts(shape.layout, shape.n, shape.k, shape.scale_dtype, random)) op.inputs.push_back(part);
    op.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      Tensor out = backend.alloc({shape.m, shape.n}, backend.activation_dtype());
      backend.matmul(in[0], shape.layout.build(backend, in, 1), nullptr, out);
      return std::vector<Tensor>{out};
    };
    op.same_bits_on_every_cpu = false;  // matmul_kernels.h: block sizes and FMA differ by instruction set
    cases.push_back(std::move(op));
  }
  // A group of mixed formats (4-bit, dense, FP8 with a bias), at decode and prefill rows.
  for (int64_t m : {1, 40}) {
    OpCase group;
    group.name = "matmul_group m=" + std::to_string(m) + " affine 4-bit g64, dense, fp8 k=256";
    const QuantizedLayout affine{WeightFormat::Affine, 4, 64}, fp8{WeightFormat::Fp8Block};
    group.inputs = {{random_f32({m, 256}, random), Role::Activation}};
    for (Input& part : parts(affine, 160, 256, DType::BF16, random)) group.inputs.push_back(part);
    group.inputs.push_back({random_f32({96, 256}, random, 0.0625f), Role::Weight});
    for (Input& part : parts(fp8, 136, 256, DType::F32, random)) group.inputs.push_back(part);
    group.inputs.push_back({random_f32({136}, random), Role::Weight});
    group.run = [m, affine, fp8](Backend& backend, std::vector<Tensor>& in) {
      std::vector<Tensor> outs;
      for (int64_t n : {160, 96, 136}) outs.push_back(backend.alloc({m, n}, backend.activation_dtype()));
      const Weight weights[] = {affine.build(backend, in, 1), in[4], fp8.build(backend, in, 5)};
      const MatmulTarget targets[] = {
          {&weights[0], nullptr, &outs[0]}, {&weights[1], nullptr, &outs[1]}, {&weights[2], &in[7], &outs[2]}};
      backend.matmul_group(in[0], targets);
      return outs;
    };
    group.same_bits_on_every_cpu = false;
    cases.push_back(std::move(group));
  }
  // Embedding rows decoded, into the activation dtype and into the f32 stream.
  for (const QuantizedLayout& layout : {QuantizedLayout{WeightFormat::Affine, 8, 64}, QuantizedLayout{WeightFormat::Affine, 5, 32},
                                        QuantizedLayout{WeightFormat::Fp8Block}}) {
    for (DType stream : {DType::BF16, DType::F32}) {
      OpCase embedding;
      embedding.name = "embedding " + layout.name() + (stream == DType::F32 ? " into the f32 stream" : "");
      std::vector<int32_t> ids(60);
      for (auto& id : ids) id = static_cast<int32_t>(random() % 37);
      embedding.inputs = parts(layout, 37, 192, DType::BF16, random);
      embedding.inputs.push_back({indices(ids), Role::Index});
      embedding.run = [layout, stream](Backend& backend, std::vector<Tensor>& in) {
        const Tensor& tokens = in[static_cast<size_t>(layout.parts())];
        Tensor out = backend.alloc({tokens.numel(), 192}, stream == DType::F32 ? DType::F32 : backend.activation_dtype());
        backend.embedding(layout.build(backend, in, 0), tokens, out);
        return std::vector<Tensor>{out};
      };
      cases.push_back(std::move(embedding));
    }
  }
  // A mixture's expert products with stacked quantized experts: on CUDA the used experts are decoded
  // (the rows kernel for 4-bit and FP8, the element kernel for 3-bit) and multiplied on the device,
  // and a call with many pairs per expert runs each expert's rows as a matmul (fused 4-bit decode
  // for up to 8 rows).
  struct ExpertShape {
    int64_t tokens, experts, top_k, n, k;
    QuantizedLayout layout;
  };
  for (const ExpertShape& shape : {ExpertShape{1, 4, 2, 64, 256, {WeightFormat::Affine, 4, 64}},
                                   ExpertShape{6, 4, 2, 48, 384, {WeightFormat::Affine, 3, 128}},
                                   ExpertShape{3, 3, 2, 128, 256, {WeightFormat::Fp8Block}},
                                   ExpertShape{40, 2, 2, 64, 256, {WeightFormat::Affine, 4, 64}}}) {
    OpCase product;
    product.name = "expert_matmul tokens=" + std::to_string(shape.tokens) + " experts=" +
                   std::to_string(shape.experts) + " k=" + std::to_string(shape.top_k) + " n=" +
                   std::to_string(shape.n) + " K=" + std::to_string(shape.k) + " " + shape.layout.name();
    std::vector<int32_t> chosen;
    for (int64_t t = 0; t < shape.tokens; ++t) {
      const int32_t first = static_cast<int32_t>(random() % static_cast<uint32_t>(shape.experts - 1));
      chosen.push_back(first);
      chosen.push_back(first + 1 + static_cast<int32_t>(random() % static_cast<uint32_t>(shape.experts - 1 - first)));
    }
    product.inputs = {{random_f32({shape.tokens, shape.k}, random), Role::Activation}, {indices(chosen), Role::Index}};
    for (Input& part : parts(shape.layout, shape.experts * shape.n, shape.k, DType::BF16, random))
      product.inputs.push_back(part);
    product.run = [shape](Backend& backend, std::vector<Tensor>& in) {
      const Weight weight = shape.layout.build(backend, in, 2);
      Tensor out = backend.alloc({shape.tokens * shape.top_k, shape.n}, backend.activation_dtype());
      const MatmulTarget target{&weight, nullptr, &out};
      backend.expert_matmul(in[0], in[1].reshape({shape.tokens, shape.top_k}), {&target, 1}, nullptr);
      return std::vector<Tensor>{out};
    };
    product.same_bits_on_every_cpu = false;
    cases.push_back(std::move(product));
  }
  return cases;
}

}  // namespace kiln::testing
