// CudaBackend's ops that every family uses: embedding, the matmuls, norms, rope, the KV cache and
// attention, and their argument checks. The kernels are in the .cu file of each op group.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"

namespace kiln {

void CudaBackend::embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  require_device(table, "embedding", "table");
  require_device(ids, "embedding", "ids");
  require_device(out, "embedding", "out");
  if (table.ndim() != 2 || !is_float(table.dtype()))
    fail("CUDA embedding: table must be a 2-d float tensor, got {} {}", dtype_name(table.dtype()),
         shape_string(table.shape()));
  require_dtype(ids, DType::I32, "embedding", "ids");
  require_stream(out, "embedding", "out");
  const int64_t width = table.dim(1);
  if (out.numel() != ids.numel() * width)
    fail("CUDA embedding: out {} does not hold {} rows of width {}", shape_string(out.shape()), ids.numel(), width);
  activate();
  launched(cuda::launch_embedding(table.raw(), table.dtype(), table.dim(0), width, ids.data<int32_t>(), ids.numel(),
                                  out.raw(), out.dtype(), errors_, stream_),
           "embedding");
}

void CudaBackend::matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) {
  cuda::MatmulArgs args = matmul_args(x, w, bias, out);
  activate();
  if (activations_ == DType::F32) {
    launched(cuda::launch_matmul_f32(args, stream_), "matmul (f32)");
    return;
  }
  const Tensor partials = split_scratch(&args, 1);
  launched(cuda::launch_matmul_bf16(args, stream_), "matmul (bf16)");
}

void CudaBackend::matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) {
  static_assert(cuda::kMatmulGroupMax == kMaxMatmulGroup);
  if (targets.empty() || targets.size() > kMaxMatmulGroup)
    fail("{} matmul_group: {} products, it takes 1 to {}", name(), targets.size(), kMaxMatmulGroup);
  cuda::MatmulArgs products[kMaxMatmulGroup];
  for (size_t t = 0; t < targets.size(); ++t)
    products[t] = matmul_args(x, *targets[t].w, targets[t].bias, *targets[t].out);
  activate();
  if (activations_ == DType::F32) {
    for (size_t t = 0; t < targets.size(); ++t) launched(cuda::launch_matmul_f32(products[t], stream_), "matmul (f32)");
    return;
  }
  const Tensor partials = split_scratch(products, static_cast<int>(targets.size()));
  launched(cuda::launch_matmul_bf16_group(products, static_cast<int>(targets.size()), stream_),
           "matmul_group (bf16)");
}

// The scratch a split prefill GEMM adds its segments from (kernels.h), lent to the products;
// the caller keeps it until the launches are queued (the allocator orders its reuse on the stream).
Tensor CudaBackend::split_scratch(cuda::MatmulArgs* products, int count) {
  const int64_t floats = cuda::matmul_bf16_partials_floats(products, count);
  if (floats == 0) return Tensor();
  Tensor partials = alloc({floats}, DType::F32);
  for (int t = 0; t < count; ++t) products[t].partials = partials.data<float>();
  return partials;
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) {
  cuda::NormArgs args = norm_args(x, weight, eps, style, out, "rms_norm");
  args.x = x.raw();
  activate();
  launched(cuda::launch_rms_norm(args, stream_), "rms_norm");
}

void CudaBackend::add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                               Tensor& out) {
  cuda::NormArgs args = norm_args(residual, weight, eps, style, out, "add_rms_norm");
  require_device(delta, "add_rms_norm", "delta");
  if (delta.dtype() != residual.dtype() || delta.numel() != residual.numel())
    fail("CUDA add_rms_norm: delta {} {} does not match residual {} {}", dtype_name(delta.dtype()),
         shape_string(delta.shape()), dtype_name(residual.dtype()), shape_string(residual.shape()));
  args.residual = residual.raw();
  args.delta = delta.raw();
  activate();
  launched(cuda::launch_add_rms_norm(args, stream_), "add_rms_norm");
}

void CudaBackend::add(Tensor& a, const Tensor& b) {
  require_device(a, "add", "a");
  require_device(b, "add", "b");
  require_activation(a, "add", "a");
  if (a.dtype() != b.dtype() || a.numel() != b.numel())
    fail("CUDA add: b {} {} does not match a {} {}", dtype_name(b.dtype()), shape_string(b.shape()),
         dtype_name(a.dtype()), shape_string(a.shape()));
  activate();
  launched(cuda::launch_add(a.raw(), b.raw(), a.numel(), a.dtype(), stream_), "add");
}

void CudaBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  require_device(x, "gather_rows", "x");
  require_device(rows, "gather_rows", "rows");
  require_device(out, "gather_rows", "out");
  require_dtype(rows, DType::I32, "gather_rows", "rows");
  if (x.ndim() < 1 || out.dtype() != x.dtype())
    fail("CUDA gather_rows: x {} {} and out {} {} must share a dtype", dtype_name(x.dtype()),
         shape_string(x.shape()), dtype_name(out.dtype()), shape_string(out.shape()));
  const int64_t x_rows = x.dim(0);
  const int64_t row_elements = x_rows ? x.numel() / x_rows : 0;
  if (out.numel() != rows.numel() * row_elements)
    fail("CUDA gather_rows: out {} does not hold {} rows of x {}", shape_string(out.shape()), rows.numel(),
         shape_string(x.shape()));
  activate();
  launched(cuda::launch_gather_rows(x.raw(), x_rows, row_elements * static_cast<int64_t>(dtype_size(x.dtype())),
                                    rows.data<int32_t>(), rows.numel(), out.raw(), errors_, stream_),
           "gather_rows");
}

void CudaBackend::rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  check_rope(x, positions, inv_freq, rotary_dim, "rope", "x");
  activate();
  launched(cuda::launch_rope(x.raw(), x.dtype(), x.dim(0), x.dim(1), x.dim(2), rotary_dim,
                             positions.data<int32_t>(), inv_freq.data<float>(), stream_),
           "rope");
}

void CudaBackend::rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout,
                                const Tensor& inv_freq, int rotary_dim, const HeadNorms* head_norms, Tensor& k_cache,
                                Tensor& v_cache) {
  constexpr const char* op = "rope_kv_write";
  check_rope(q, layout.positions, inv_freq, rotary_dim, op, "q");
  check_rope(k, layout.positions, inv_freq, rotary_dim, op, "k");
  require_device(v, op, "v");
  const CacheShape cache = cache_shape(k_cache, v_cache, op);
  if (k.dim(1) != cache.kv_heads || k.dim(2) != cache.head_dim || v.shape() != k.shape() ||
      k.dtype() != cache.dtype || v.dtype() != cache.dtype || q.dtype() != cache.dtype || q.dim(0) != k.dim(0) ||
      q.dim(2) != k.dim(2))
    fail("CUDA {}: q {} {}, k {} {} and v {} {} must be [tokens, heads, {}] in the cache dtype {} ({} kv heads)",
         op, dtype_name(q.dtype()), shape_string(q.shape()), dtype_name(k.dtype()), shape_string(k.shape()),
         dtype_name(v.dtype()), shape_string(v.shape()), cache.head_dim, dtype_name(cache.dtype), cache.kv_heads);
  check_layout(layout, k.dim(0), cache, op);
  cuda::RopeKvWriteArgs args;
  args.q = q.raw();
  args.k = k.raw();
  args.v = v.raw();
  args.k_cache = k_cache.raw();
  args.v_cache = v_cache.raw();
  args.positions = layout.positions.data<int32_t>();
  args.slots = layout.slots.data<int32_t>();
  args.inv_freq = inv_freq.data<float>();
  args.tokens = k.dim(0);
  args.q_heads = q.dim(1);
  args.kv_heads = cache.kv_heads;
  args.head_dim = cache.head_dim;
  args.rotary_dim = rotary_dim;
  args.capacity = cache.capacity;
  args.dtype = cache.dtype;
  if (head_norms) {
    const Tensor& q_weight = head_norms->q_weight;
    const Tensor& k_weight = head_norms->k_weight;
    require_device(q_weight, op, "q norm weight");
    require_device(k_weight, op, "k norm weight");
    if (q_weight.ndim() != 1 || k_weight.ndim() != 1 || q_weight.dim(0) != cache.head_dim ||
        k_weight.dim(0) != cache.head_dim || !is_float(q_weight.dtype()) || k_weight.dtype() != q_weight.dtype())
      fail("CUDA {}: the q and k norm weights {} {} and {} {} must be [{}] in one float dtype", op,
           dtype_name(q_weight.dtype()), shape_string(q_weight.shape()), dtype_name(k_weight.dtype()),
           shape_string(k_weight.shape()), cache.head_dim);
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
  require_device(gate, "swiglu", "gate");
  require_device(up, "swiglu", "up");
  require_device(out, "swiglu", "out");
  require_activation(gate, "swiglu", "gate");
  if (up.dtype() != gate.dtype() || out.dtype() != gate.dtype() || up.numel() != gate.numel() ||
      out.numel() != gate.numel())
    fail("CUDA swiglu: gate {} {}, up {} {} and out {} {} must match", dtype_name(gate.dtype()),
         shape_string(gate.shape()), dtype_name(up.dtype()), shape_string(up.shape()), dtype_name(out.dtype()),
         shape_string(out.shape()));
  activate();
  launched(cuda::launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.numel(), gate.dtype(), stream_), "swiglu");
}

void CudaBackend::kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, Tensor& k_cache,
                           Tensor& v_cache) {
  require_device(k, "kv_write", "k");
  require_device(v, "kv_write", "v");
  require_device(k_cache, "kv_write", "k_cache");
  require_device(v_cache, "kv_write", "v_cache");
  require_activation(k, "kv_write", "k");
  const CacheShape cache = cache_shape(k_cache, v_cache, "kv_write");
  if (k.ndim() != 3 || k.dim(1) != cache.kv_heads || k.dim(2) != cache.head_dim || v.shape() != k.shape() ||
      k.dtype() != cache.dtype || v.dtype() != cache.dtype)
    fail("CUDA kv_write: k {} {} and v {} {} must be [tokens, {}, {}] in the cache dtype {}", dtype_name(k.dtype()),
         shape_string(k.shape()), dtype_name(v.dtype()), shape_string(v.shape()), cache.kv_heads, cache.head_dim,
         dtype_name(cache.dtype));
  check_layout(layout, k.dim(0), cache, "kv_write");
  activate();
  launched(cuda::launch_kv_write(k.raw(), v.raw(), k.dim(0), cache.kv_heads * cache.head_dim *
                                                                 static_cast<int64_t>(dtype_size(cache.dtype)),
                                 layout.slots.data<int32_t>(), layout.positions.data<int32_t>(), cache.capacity,
                                 k_cache.raw(), v_cache.raw(), stream_),
           "kv_write");
}

void CudaBackend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const BatchLayout& layout,
                            float scale, Tensor& out) {
  require_device(q, "attention", "q");
  require_device(k_cache, "attention", "k_cache");
  require_device(v_cache, "attention", "v_cache");
  require_device(out, "attention", "out");
  require_activation(q, "attention", "q");
  const CacheShape cache = cache_shape(k_cache, v_cache, "attention");
  if (q.ndim() != 3 || q.dim(2) != cache.head_dim || q.dtype() != cache.dtype)
    fail("CUDA attention: q {} {} must be [tokens, heads, {}] in the cache dtype {}", dtype_name(q.dtype()),
         shape_string(q.shape()), cache.head_dim, dtype_name(cache.dtype));
  const int64_t heads = q.dim(1);
  if (heads == 0 || cache.kv_heads == 0 || heads % cache.kv_heads != 0)
    fail("CUDA attention: {} query heads are not a multiple of {} kv heads", heads, cache.kv_heads);
  if (out.shape() != q.shape() || out.dtype() != q.dtype())
    fail("CUDA attention: out {} {} must match q {} {}", dtype_name(out.dtype()), shape_string(out.shape()),
         dtype_name(q.dtype()), shape_string(q.shape()));
  check_layout(layout, q.dim(0), cache, "attention");
  if (q.dtype() == DType::BF16 && !cuda::attention_bf16_supports_head_dim(cache.head_dim))
    fail("CUDA attention: the BF16 path supports head_dim 16, 32, 64, 128 or 256, got {}", cache.head_dim);

  cuda::AttentionArgs args;
  args.q = q.raw();
  args.k_cache = k_cache.raw();
  args.v_cache = v_cache.raw();
  args.out = out.raw();
  args.spans = layout.spans_device.data<int32_t>();
  args.slots = layout.slots.data<int32_t>();
  args.positions = layout.positions.data<int32_t>();
  args.tokens = q.dim(0);
  args.heads = heads;
  args.kv_heads = cache.kv_heads;
  args.head_dim = cache.head_dim;
  args.capacity = cache.capacity;
  args.span_count = static_cast<int64_t>(layout.spans.size());
  for (const SequenceSpan& span : layout.spans) {
    args.max_span_tokens = std::max<int64_t>(args.max_span_tokens, span.tokens);
    args.max_position = std::max<int64_t>(args.max_position, span.first_position + span.tokens - 1);
  }
  // Captured work replays at later positions: size the key splits for the whole cache (the
  // kernels skip splits past each row's own position, read from the layout's device tensors).
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

// x [tokens, heads, head_dim] in the activation dtype, one I32 position per token, f32 inv_freq
// of rotary_dim / 2 entries, rotary_dim even and within head_dim.
void CudaBackend::check_rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim,
                             const char* op, const char* name) const {
  require_device(x, op, name);
  require_device(positions, op, "positions");
  require_device(inv_freq, op, "inv_freq");
  require_activation(x, op, name);
  require_dtype(positions, DType::I32, op, "positions");
  require_dtype(inv_freq, DType::F32, op, "inv_freq");
  if (x.ndim() != 3) fail("CUDA {}: {} must be [tokens, heads, head_dim], got {}", op, name, shape_string(x.shape()));
  const int64_t head_dim = x.dim(2);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    fail("CUDA {}: rotary_dim {} must be even and within head_dim {}", op, rotary_dim, head_dim);
  if (positions.numel() != x.dim(0)) fail("CUDA {}: {} positions for {} tokens", op, positions.numel(), x.dim(0));
  if (inv_freq.numel() != rotary_dim / 2)
    fail("CUDA {}: inv_freq has {} entries, rotary_dim {} needs {}", op, inv_freq.numel(), rotary_dim,
         rotary_dim / 2);
}

// Validates one product and describes it for the kernels (both matmul paths).
cuda::MatmulArgs CudaBackend::matmul_args(const Tensor& x, const Tensor& w, const Tensor* bias,
                                          const Tensor& out) const {
  require_device(x, "matmul", "x");
  require_device(w, "matmul", "w");
  require_device(out, "matmul", "out");
  if (w.ndim() != 2 || !is_float(w.dtype()))
    fail("CUDA matmul: w must be a 2-d float tensor, got {} {}", dtype_name(w.dtype()), shape_string(w.shape()));
  require_activation(x, "matmul", "x");
  const int64_t n = w.dim(0), k = w.dim(1);
  if (k == 0 || x.numel() % k != 0)
    fail("CUDA matmul: x {} is not a whole number of rows of w's width {}", shape_string(x.shape()), k);
  const int64_t m = x.numel() / k;
  if (out.numel() != m * n)
    fail("CUDA matmul: out {} does not hold [{}, {}] (x {}, w {})", shape_string(out.shape()), m, n,
         shape_string(x.shape()), shape_string(w.shape()));
  if (out.dtype() != DType::F32 && out.dtype() != activations_)
    fail("CUDA matmul: out dtype {} is neither F32 nor the activation dtype {}", dtype_name(out.dtype()),
         dtype_name(activations_));
  if (bias) {
    require_device(*bias, "matmul", "bias");
    if (!is_float(bias->dtype()) || bias->numel() != n)
      fail("CUDA matmul: bias {} {} is not {} floats", dtype_name(bias->dtype()), shape_string(bias->shape()), n);
  }
  cuda::MatmulArgs args;
  args.x = x.raw();
  args.w = w.raw();
  args.bias = bias ? bias->raw() : nullptr;
  args.out = out.raw();
  args.m = m;
  args.n = n;
  args.k = k;
  args.x_dtype = x.dtype();
  args.w_dtype = w.dtype();
  args.bias_dtype = bias ? bias->dtype() : DType::F32;
  args.out_dtype = out.dtype();
  args.multiprocessors = multiprocessors_;
  if (activations_ == DType::F32) return args;
  if (w.dtype() != DType::BF16)
    fail("CUDA matmul: BF16 activations need BF16 weights, got {} w {} (construct the backend with F32 "
         "activations for {} checkpoints)", dtype_name(w.dtype()), shape_string(w.shape()), dtype_name(w.dtype()));
  if (k % 8 != 0)
    fail("CUDA matmul: the BF16 tensor-core path needs K to be a multiple of 8 (16-byte rows), got w {}",
         shape_string(w.shape()));
  if (k > cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments)
    fail("CUDA matmul: the BF16 path takes K up to {}, got w {}", cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments,
         shape_string(w.shape()));
  if (reinterpret_cast<uintptr_t>(x.raw()) % 16 || reinterpret_cast<uintptr_t>(w.raw()) % 16)
    fail("CUDA matmul: x and w must be 16-byte aligned for the BF16 path (x {}, w {})", shape_string(x.shape()),
         shape_string(w.shape()));
  return args;
}

cuda::NormArgs CudaBackend::norm_args(const Tensor& x, const Tensor& weight, float eps, NormStyle style,
                                      const Tensor& out, const char* op) const {
  require_device(x, op, "x");
  require_device(weight, op, "weight");
  require_device(out, op, "out");
  require_stream(x, op, "x");
  require_activation(out, op, "out");
  if (weight.ndim() != 1 || !is_float(weight.dtype()))
    fail("CUDA {}: weight must be a 1-d float tensor, got {} {}", op, dtype_name(weight.dtype()),
         shape_string(weight.shape()));
  const int64_t width = weight.dim(0);
  if (width == 0 || x.numel() % width != 0)
    fail("CUDA {}: x {} is not a whole number of rows of width {}", op, shape_string(x.shape()), width);
  if (out.numel() != x.numel() || (out.raw() == x.raw() && out.dtype() != x.dtype()))
    fail("CUDA {}: out {} {} must hold x {} {} (in place only in one dtype)", op, dtype_name(out.dtype()),
         shape_string(out.shape()), dtype_name(x.dtype()), shape_string(x.shape()));
  cuda::NormArgs args;
  args.weight = weight.raw();
  args.out = out.raw();
  args.rows = x.numel() / width;
  args.width = width;
  args.eps = eps;
  args.zero_centred = style == NormStyle::ZeroCentred;
  args.act_dtype = out.dtype();
  args.stream_dtype = x.dtype();
  args.weight_dtype = weight.dtype();
  return args;
}

CudaBackend::CacheShape CudaBackend::cache_shape(const Tensor& k_cache, const Tensor& v_cache, const char* op) {
  if (k_cache.ndim() != 4 || v_cache.shape() != k_cache.shape() || v_cache.dtype() != k_cache.dtype())
    fail("CUDA {}: caches must be two equal [slots, capacity, kv_heads, head_dim] tensors, got {} {} and {} {}", op,
         dtype_name(k_cache.dtype()), shape_string(k_cache.shape()), dtype_name(v_cache.dtype()),
         shape_string(v_cache.shape()));
  return {k_cache.dim(0), k_cache.dim(1), k_cache.dim(2), k_cache.dim(3), k_cache.dtype()};
}

void CudaBackend::check_layout(const BatchLayout& layout, int64_t tokens, const CacheShape& cache, const char* op) {
  if (layout.total_tokens != tokens)
    fail("CUDA {}: the layout has {} tokens but the inputs have {}", op, layout.total_tokens, tokens);
  if (layout.slots.device() != Device::CUDA || layout.positions.device() != Device::CUDA ||
      layout.spans_device.device() != Device::CUDA)
    fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
  for (size_t index = 0; index < layout.spans.size(); ++index) {
    const SequenceSpan& span = layout.spans[index];
    if (span.slot < 0 || span.slot >= cache.slots)
      fail("CUDA {}: span {} uses slot {} but the cache has {} slots", op, index, span.slot, cache.slots);
    if (span.first_position < 0 || span.first_position + span.tokens > cache.capacity)
      fail("CUDA {}: span {} covers positions [{}, {}) but the cache holds {} per slot", op, index,
           span.first_position, span.first_position + span.tokens, cache.capacity);
  }
}

}  // namespace kiln
