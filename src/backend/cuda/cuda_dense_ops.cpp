// CudaBackend's ops that every family uses: embedding, the matmuls, norms, rope, the KV cache and
// attention, and their argument checks. The kernels are in the .cu file of each op group.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <utility>

#include "backend/op_contract.h"
#include "core/error.h"

namespace kiln {

cuda::QuantizedWeightArgs quantized_weight_args(const Weight& w) {
  cuda::QuantizedWeightArgs args;
  args.format = w.format() == WeightFormat::Affine ? cuda::QuantizedFormat::Affine : cuda::QuantizedFormat::Fp8Block;
  args.values = w.values().raw();
  args.scales = w.scales().raw();
  args.biases = w.format() == WeightFormat::Affine ? w.biases().raw() : nullptr;
  args.scale_dtype = w.scales().dtype();
  args.n = w.dim(0);
  args.k = w.dim(1);
  args.scale_columns = w.scales().dim(1);
  args.bits = w.bits();
  args.group_size = w.group_size();
  args.block_rows = w.block_rows();
  args.block_columns = w.block_columns();
  args.fragment_order = w.code_order() == CodeOrder::Fragment;
  return args;
}

namespace {

// The scratch's parts start on 256-byte boundaries (the allocator's own alignment).
constexpr uint64_t kScratchAlignment = 256;

static_assert(cuda::kKvBlockRows == kKvBlockTokens, "the kernels' cache block is backend.h's");

// The block table as the kernels read it (its dtype and shape checked by the op contract).
cuda::KvBlockTable block_table(const KvCacheView& kv, const CacheDims& cache) {
  return {kv.block_table.data<int32_t>(), cache.table_width};
}

}  // namespace

void CudaBackend::embedding(const Weight& table, const Tensor& ids, Tensor& out) {
  const EmbeddingDims dims = check_embedding(contract(), table, ids, out);
  activate();
  if (table.quantized()) {
    launched(cuda::launch_embedding_quantized(quantized_weight_args(table), ids.data<int32_t>(), dims.tokens, out.raw(),
                                              out.dtype(), errors_, stream_),
             "embedding (quantized)");
    return;
  }
  launched(cuda::launch_embedding(table.values().raw(), table.values().dtype(), dims.vocab, dims.hidden, ids.data<int32_t>(),
                                  dims.tokens, out.raw(), out.dtype(), errors_, stream_),
           "embedding");
}

void CudaBackend::matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) {
  cuda::MatmulArgs args = matmul_args(x, w, bias, out);
  const MatmulTarget target{&w, bias, &out};
  run_matmuls({&target, 1}, &args);
}

void CudaBackend::matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) {
  static_assert(cuda::kMatmulGroupMax == kMaxMatmulGroup);
  check_matmul_group(contract(), x, targets);
  cuda::MatmulArgs products[kMaxMatmulGroup];
  for (size_t t = 0; t < targets.size(); ++t)
    products[t] = matmul_args(x, *targets[t].w, targets[t].bias, *targets[t].out);
  run_matmuls(targets, products);
}

CudaBackend::MatmulScratch CudaBackend::matmul_scratch(std::span<const MatmulTarget> targets,
                                                       const cuda::MatmulArgs* products) const {
  MatmulScratch scratch;
  cuda::MatmulArgs plain[kMaxMatmulGroup];
  int plain_count = 0;
  for (size_t t = 0; t < targets.size(); ++t) {
    const Weight& w = *targets[t].w;
    if (w.quantized()) {
      scratch.fused[t] = activations_ == DType::BF16 && products[t].m <= cuda::kQuantizedDecodeMaxRows &&
                         cuda::quantized_decode_fused(quantized_weight_args(w));
      if (scratch.fused[t]) continue;
      const uint64_t bytes = static_cast<uint64_t>(w.dim(0)) * static_cast<uint64_t>(w.dim(1)) * dtype_size(activations_);
      scratch.decoded_bytes[t] = (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
      scratch.decoded_total += scratch.decoded_bytes[t];
    }
    plain[plain_count++] = products[t];
  }
  if (activations_ == DType::BF16 && plain_count > 0)
    scratch.partial_floats = cuda::matmul_bf16_partials_floats(plain, plain_count);
  return scratch;
}

uint64_t CudaBackend::matmul_scratch_bytes(const Tensor& x, std::span<const MatmulTarget> targets) const {
  check_matmul_group(contract(), x, targets);
  cuda::MatmulArgs products[kMaxMatmulGroup];
  for (size_t t = 0; t < targets.size(); ++t) {
    const MatmulDims dims = check_matmul(contract(), x, *targets[t].w, targets[t].bias, *targets[t].out);
    products[t].m = dims.rows;
    products[t].n = dims.n;
    products[t].k = dims.k;
    products[t].multiprocessors = multiprocessors_;
  }
  return matmul_scratch(targets, products).bytes();
}

void CudaBackend::run_matmuls(std::span<const MatmulTarget> targets, cuda::MatmulArgs* products) {
  const MatmulScratch layout = matmul_scratch(targets, products);
  Tensor scratch;
  if (layout.bytes() > 0) scratch = alloc({static_cast<int64_t>(layout.bytes() / sizeof(float))}, DType::F32);
  uint8_t* decoded = static_cast<uint8_t*>(scratch.defined() ? scratch.raw() : nullptr);
  float* partials = layout.partial_floats > 0 ? reinterpret_cast<float*>(decoded + layout.decoded_total) : nullptr;
  activate();
  cuda::MatmulArgs plain[kMaxMatmulGroup];
  int plain_count = 0;
  for (size_t t = 0; t < targets.size(); ++t) {
    if (layout.fused[t]) {
      launched(cuda::launch_matmul_quantized_decode(products[t], quantized_weight_args(*targets[t].w), stream_),
               "matmul (quantized decode)");
      continue;
    }
    if (layout.decoded_bytes[t] > 0) {
      launched(cuda::launch_dequantize(quantized_weight_args(*targets[t].w), decoded, activations_, stream_),
               "dequantize");
      products[t].w = decoded;
      decoded += layout.decoded_bytes[t];
    }
    products[t].partials = partials;
    plain[plain_count++] = products[t];
  }
  if (plain_count == 0) return;
  if (activations_ == DType::F32) {
    for (int t = 0; t < plain_count; ++t) launched(cuda::launch_matmul_f32(plain[t], stream_), "matmul (f32)");
    return;
  }
  launched(cuda::launch_matmul_bf16_group(plain, plain_count, stream_),
           plain_count == 1 ? "matmul (bf16)" : "matmul_group (bf16)");
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) {
  cuda::NormArgs args = norm_args(check_rms_norm(contract(), x, weight, out), x, weight, eps, style, out, "rms_norm");
  args.x = x.raw();
  activate();
  launched(cuda::launch_rms_norm(args, stream_), "rms_norm");
}

void CudaBackend::add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                               Tensor& out) {
  cuda::NormArgs args = norm_args(check_add_rms_norm(contract(), residual, delta, weight, out), residual, weight, eps,
                                  style, out, "add_rms_norm");
  args.residual = residual.raw();
  args.delta = delta.raw();
  activate();
  launched(cuda::launch_add_rms_norm(args, stream_), "add_rms_norm");
}

void CudaBackend::add(Tensor& a, const Tensor& b) {
  const int64_t count = check_add(contract(), a, b);
  activate();
  launched(cuda::launch_add(a.raw(), b.raw(), count, a.dtype(), stream_), "add");
}

void CudaBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  const GatherDims dims = check_gather_rows(contract(), x, rows, out);
  activate();
  launched(cuda::launch_gather_rows(x.raw(), dims.available,
                                    dims.row_elements * static_cast<int64_t>(dtype_size(x.dtype())),
                                    rows.data<int32_t>(), dims.rows, out.raw(), errors_, stream_),
           "gather_rows");
}

void CudaBackend::rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  const RopeDims dims = check_rope(contract(), "rope", "x", x, positions, inv_freq, rotary_dim);
  activate();
  launched(cuda::launch_rope(x.raw(), x.dtype(), dims.tokens, dims.heads, dims.head_dim, rotary_dim,
                             positions.data<int32_t>(), inv_freq.data<float>(), stream_),
           "rope");
}

void CudaBackend::rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout,
                                const Tensor& inv_freq, int rotary_dim, const HeadNorms* head_norms,
                                const KvCacheView& kv) {
  constexpr const char* op = "rope_kv_write";
  const RopeKvWriteDims dims =
      check_rope_kv_write(contract(), q, k, v, layout, inv_freq, rotary_dim, head_norms, kv);
  const CacheDims& cache = dims.cache;
  require_device_layout(layout, op);
  cuda::RopeKvWriteArgs args;
  args.q = q.raw();
  args.k = k.raw();
  args.v = v.raw();
  args.k_cache = kv.keys.raw();
  args.v_cache = kv.values.raw();
  args.table = block_table(kv, cache);
  args.positions = layout.positions.data<int32_t>();
  args.slots = layout.slots.data<int32_t>();
  args.inv_freq = inv_freq.data<float>();
  args.tokens = dims.tokens;
  args.q_heads = dims.q_heads;
  args.kv_heads = cache.kv_heads;
  args.head_dim = cache.head_dim;
  args.rotary_dim = rotary_dim;
  args.dtype = activations_;
  if (head_norms) {
    const Tensor& q_weight = head_norms->q_weight;
    const Tensor& k_weight = head_norms->k_weight;
    // The fused kernel reads both gains in one dtype.
    if (k_weight.dtype() != q_weight.dtype())
      fail("CUDA {}: the q and k norm weights are {} and {}; the fused kernel takes them in one dtype", op,
           dtype_name(q_weight.dtype()), dtype_name(k_weight.dtype()));
    if (cache.head_dim > cuda::kNormWarpRowMaxWidth)
      fail("CUDA {}: per-head norms take heads of at most {} dims, not {}", op, cuda::kNormWarpRowMaxWidth,
           cache.head_dim);
    args.q_norm = q_weight.raw();
    args.k_norm = k_weight.raw();
    args.norm_dtype = q_weight.dtype();
    args.norm_eps = head_norms->eps;
    args.norm_zero_centred = head_norms->style == NormStyle::ZeroCentred;
  }
  activate();
  launched(cuda::launch_rope_kv_write(args, stream_), op);
}

void CudaBackend::swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  const int64_t count = check_swiglu(contract(), gate, up, out);
  activate();
  launched(cuda::launch_swiglu(gate.raw(), up.raw(), out.raw(), count, gate.dtype(), stream_), "swiglu");
}

void CudaBackend::kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& kv) {
  const CacheDims cache = check_kv_write(contract(), k, v, layout, kv);
  require_device_layout(layout, "kv_write");
  activate();
  launched(cuda::launch_kv_write(k.raw(), v.raw(), layout.total_tokens,
                                 cache.kv_heads * cache.head_dim * static_cast<int64_t>(dtype_size(activations_)),
                                 layout.slots.data<int32_t>(), layout.positions.data<int32_t>(), block_table(kv, cache),
                                 kv.keys.raw(), kv.values.raw(), stream_),
           "kv_write");
}

void CudaBackend::attention(const Tensor& q, const KvCacheView& kv, const BatchLayout& layout, float scale,
                            Tensor& out) {
  const AttentionDims dims = check_attention(contract(), q, kv, layout, out);
  const CacheDims& cache = dims.cache;
  const int64_t heads = dims.heads;
  require_device_layout(layout, "attention");
  if (q.dtype() == DType::BF16 && !cuda::attention_bf16_supports_head_dim(cache.head_dim))
    fail("CUDA attention: the BF16 path supports head_dim a multiple of 8 up to 256, got {}", cache.head_dim);

  cuda::AttentionArgs args;
  args.q = q.raw();
  args.k_cache = kv.keys.raw();
  args.v_cache = kv.values.raw();
  args.table = block_table(kv, cache);
  args.out = out.raw();
  args.spans = layout.spans_device.data<int32_t>();
  args.slots = layout.slots.data<int32_t>();
  args.positions = layout.positions.data<int32_t>();
  args.tokens = dims.tokens;
  args.heads = heads;
  args.kv_heads = cache.kv_heads;
  args.head_dim = cache.head_dim;
  args.span_count = static_cast<int64_t>(layout.spans.size());
  for (const SequenceSpan& span : layout.spans) {
    args.max_span_tokens = std::max<int64_t>(args.max_span_tokens, span.tokens);
    args.max_position = std::max<int64_t>(args.max_position, span.first_position + span.tokens - 1);
  }
  // Captured work replays at later positions: size the key splits for every position the block
  // table holds (the kernels skip splits past each row's own position, read from the layout's
  // device tensors).
  if (graph_mode_) args.max_position = cache.capacity - 1;
  args.scale = scale;
  args.dtype = q.dtype();
  Tensor partials;
  if (const int64_t floats = cuda::attention_partials_floats(args); floats > 0) {
    partials = alloc({floats}, DType::F32);
    args.partials = partials.data<float>();
  }
  activate();
  launched(cuda::launch_attention(args, stream_), "attention");
}

// Validates one product and describes it for the kernels (both matmul paths).
cuda::MatmulArgs CudaBackend::matmul_args(const Tensor& x, const Weight& w, const Tensor* bias,
                                          const Tensor& out) const {
  const MatmulDims dims = check_matmul(contract(), x, w, bias, out);
  return product_args("matmul", x, w, bias, out, dims.rows, dims.n, dims.k);
}

cuda::MatmulArgs CudaBackend::product_args(const char* op, const Tensor& x, const Weight& w, const Tensor* bias,
                                           const Tensor& out, int64_t m, int64_t n, int64_t k) const {
  cuda::MatmulArgs args;
  args.x = x.raw();
  // A quantized weight is decoded into the activation dtype: run_matmuls sets w where it decodes
  // into scratch; the fused decode kernel reads the packed parts.
  args.w = w.quantized() ? nullptr : w.values().raw();
  args.bias = bias ? bias->raw() : nullptr;
  args.out = out.raw();
  args.m = m;
  args.n = n;
  args.k = k;
  args.x_dtype = x.dtype();
  args.w_dtype = w.quantized() ? activations_ : w.values().dtype();
  args.bias_dtype = bias ? bias->dtype() : DType::F32;
  args.out_dtype = out.dtype();
  args.multiprocessors = multiprocessors_;
  if (activations_ == DType::F32) return args;
  if (args.w_dtype != DType::BF16)
    fail("CUDA {}: BF16 activations need BF16 weights, got {} w {} (construct the backend with F32 "
         "activations for {} checkpoints)", op, dtype_name(args.w_dtype), shape_string(w.shape()), dtype_name(args.w_dtype));
  if (k % 8 != 0)
    fail("CUDA {}: the BF16 tensor-core path needs K to be a multiple of 8 (16-byte rows), got w {}", op,
         shape_string(w.shape()));
  if (k > cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments)
    fail("CUDA {}: the BF16 path takes K up to {}, got w {}", op, cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments,
         shape_string(w.shape()));
  if (reinterpret_cast<uintptr_t>(x.raw()) % 16 || reinterpret_cast<uintptr_t>(w.values().raw()) % 16)
    fail("CUDA {}: x and w must be 16-byte aligned for the BF16 path (x {}, w {})", op, shape_string(x.shape()),
         shape_string(w.shape()));
  return args;
}

cuda::NormArgs CudaBackend::norm_args(const NormDims& dims, const Tensor& x, const Tensor& weight, float eps,
                                      NormStyle style, const Tensor& out, const char* op) const {
  cuda::NormArgs args;
  args.weight = weight.raw();
  args.out = out.raw();
  args.rows = dims.rows;
  args.width = dims.width;
  args.eps = eps;
  args.zero_centred = style == NormStyle::ZeroCentred;
  args.act_dtype = out.dtype();
  args.stream_dtype = x.dtype();
  args.weight_dtype = weight.dtype();
  return args;
}

// The layout's device tensors, which the kernels read, come from this backend's make_layout.
void CudaBackend::require_device_layout(const BatchLayout& layout, const char* op) {
  if (layout.slots.device() != Device::CUDA || layout.positions.device() != Device::CUDA ||
      layout.spans_device.device() != Device::CUDA)
    fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
}

}  // namespace kiln
