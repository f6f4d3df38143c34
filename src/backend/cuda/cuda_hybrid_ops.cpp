// CudaBackend's HybridOps: the Gated DeltaNet and gated-attention ops of Qwen3.5 and Qwen3-Next
// (gated_delta.cu), and the check of a recurrent-state batch layout.
#include "backend/cuda/cuda_backend_impl.h"

#include <string>

#include "core/error.h"

namespace kiln {

void CudaBackend::split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  constexpr const char* op = "split_query_gate";
  require_device(query_and_gate, op, "query_and_gate");
  require_device(query, op, "query");
  require_device(gate, op, "gate");
  require_activation(query_and_gate, op, "query_and_gate");
  require_activation(query, op, "query");
  require_activation(gate, op, "gate");
  if (query.ndim() != 3 || gate.shape() != query.shape() || query_and_gate.numel() != 2 * query.numel())
    fail("CUDA {}: query must be [T, heads, head_dim] like gate and query_and_gate twice its size, got {}, {} and {}",
         op, shape_string(query.shape()), shape_string(gate.shape()), shape_string(query_and_gate.shape()));
  activate();
  launched(cuda::launch_split_query_gate(query_and_gate.raw(), query.raw(), gate.raw(), query.numel() / query.dim(2),
                                         query.dim(2), activations_, stream_),
           op);
}

void CudaBackend::sigmoid_gate(Tensor& x, const Tensor& gate) {
  constexpr const char* op = "sigmoid_gate";
  require_device(x, op, "x");
  require_device(gate, op, "gate");
  require_activation(x, op, "x");
  require_activation(gate, op, "gate");
  if (gate.numel() != x.numel())
    fail("CUDA {}: x {} and gate {} differ in size", op, shape_string(x.shape()), shape_string(gate.shape()));
  activate();
  launched(cuda::launch_sigmoid_gate(x.raw(), gate.raw(), x.numel(), activations_, stream_), op);
}

void CudaBackend::causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout,
                                     Tensor& conv_state, Tensor& out) {
  constexpr const char* op = "causal_conv1d_silu";
  require_device(x, op, "x");
  require_device(weight, op, "weight");
  require_device(conv_state, op, "conv_state");
  require_device(out, op, "out");
  require_activation(x, op, "x");
  require_activation(out, op, "out");
  require_dtype(conv_state, DType::F32, op, "conv_state");
  if (x.ndim() != 2 || out.shape() != x.shape())
    fail("CUDA {}: x must be [T, C] and out the same, got {} and {}", op, shape_string(x.shape()),
         shape_string(out.shape()));
  const int64_t channels = x.dim(1);
  if (weight.shape() != Shape{channels, cuda::kGatedDeltaConvKernel} || !is_float(weight.dtype()))
    fail("CUDA {}: weight must be a float [{}, {}] tensor (the kernel size this backend is built for), got {} {}",
         op, channels, cuda::kGatedDeltaConvKernel, dtype_name(weight.dtype()), shape_string(weight.shape()));
  if (conv_state.ndim() != 3 || conv_state.dim(1) != cuda::kGatedDeltaConvKernel - 1 || conv_state.dim(2) != channels)
    fail("CUDA {}: conv_state must be [slots, {}, {}], got {}", op, cuda::kGatedDeltaConvKernel - 1, channels,
         shape_string(conv_state.shape()));
  check_state_layout(layout, x.dim(0), conv_state.dim(0), op);
  cuda::ConvArgs args;
  args.x = x.raw();
  args.weight = weight.raw();
  args.spans = layout.spans_device.data<int32_t>();
  args.conv_state = conv_state.data<float>();
  args.out = out.raw();
  args.span_count = static_cast<int64_t>(layout.spans.size());
  args.channels = channels;
  args.kernel = cuda::kGatedDeltaConvKernel;
  args.dtype = activations_;
  args.weight_dtype = weight.dtype();
  activate();
  launched(cuda::launch_causal_conv1d_silu(args, stream_), op);
}

void CudaBackend::gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  constexpr const char* op = "gated_delta_prepare_qkv";
  require_device(qkv, op, "qkv");
  require_device(q, op, "q");
  require_device(k, op, "k");
  require_device(v, op, "v");
  require_activation(qkv, op, "qkv");
  for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}})
    require_dtype(*tensor, DType::F32, op, name);
  if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || qkv.ndim() != 2 || v.dim(0) != q.dim(0) ||
      qkv.dim(0) != q.dim(0) || qkv.dim(1) != 2 * q.dim(1) * q.dim(2) + v.dim(1) * v.dim(2))
    fail("CUDA {}: qkv {} does not split into q {}, k {} and v {}", op, shape_string(qkv.shape()),
         shape_string(q.shape()), shape_string(k.shape()), shape_string(v.shape()));
  // HF-Q35 multiplies by the python float 1/sqrt(dk), which torch applies as an f32 scalar.
  const float query_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.dim(2))));
  activate();
  launched(cuda::launch_gated_delta_prepare_qkv(qkv.raw(), activations_, q.dim(0), q.dim(1), q.dim(2),
                                                v.dim(1) * v.dim(2), query_scale, kGatedDeltaL2NormEps,
                                                q.data<float>(), k.data<float>(), v.data<float>(), stream_),
           op);
}

void CudaBackend::gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                    Tensor& beta, Tensor& g) {
  constexpr const char* op = "gated_delta_gates";
  for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&b, "b"}, {&a, "a"}, {&a_log, "A_log"},
                                     {&dt_bias, "dt_bias"}, {&beta, "beta"}, {&g, "g"}})
    require_device(*tensor, op, name);
  require_activation(b, op, "b");
  require_activation(a, op, "a");
  require_dtype(beta, DType::F32, op, "beta");
  require_dtype(g, DType::F32, op, "g");
  if (b.ndim() != 2 || a.shape() != b.shape() || beta.shape() != b.shape() || g.shape() != b.shape())
    fail("CUDA {}: b, a, beta and g must be equal [T, value_heads] tensors, got {}, {}, {} and {}", op,
         shape_string(b.shape()), shape_string(a.shape()), shape_string(beta.shape()), shape_string(g.shape()));
  const int64_t heads = b.dim(1);
  if (a_log.shape() != Shape{heads} || dt_bias.shape() != Shape{heads} || a_log.dtype() != dt_bias.dtype() ||
      !is_float(a_log.dtype()))
    fail("CUDA {}: A_log and dt_bias must be float [{}] tensors of one dtype, got {} {} and {} {}", op, heads,
         dtype_name(a_log.dtype()), shape_string(a_log.shape()), dtype_name(dt_bias.dtype()),
         shape_string(dt_bias.shape()));
  activate();
  launched(cuda::launch_gated_delta_gates(b.raw(), a.raw(), activations_, a_log.raw(), dt_bias.raw(), a_log.dtype(),
                                          b.numel(), heads, beta.data<float>(), g.data<float>(), stream_),
           op);
}

void CudaBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, const BatchLayout& layout, Tensor& state, Tensor& out) {
  constexpr const char* op = "gated_delta_rule";
  for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"},
                                     {&g, "g"}, {&beta, "beta"}, {&state, "state"}}) {
    require_device(*tensor, op, name);
    require_dtype(*tensor, DType::F32, op, name);
  }
  require_device(out, op, "out");
  require_activation(out, op, "out");
  if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || v.dim(0) != q.dim(0) || out.shape() != v.shape())
    fail("CUDA {}: q {}, k {}, v {} and out {} do not fit together", op, shape_string(q.shape()),
         shape_string(k.shape()), shape_string(v.shape()), shape_string(out.shape()));
  const int64_t tokens = q.dim(0), key_heads = q.dim(1), key_dim = q.dim(2);
  const int64_t value_heads = v.dim(1), value_dim = v.dim(2);
  if (value_heads % key_heads != 0)
    fail("CUDA {}: {} value heads are not a multiple of {} key heads", op, value_heads, key_heads);
  if (g.shape() != Shape{tokens, value_heads} || beta.shape() != g.shape())
    fail("CUDA {}: g {} and beta {} must be [{}, {}]", op, shape_string(g.shape()), shape_string(beta.shape()),
         tokens, value_heads);
  if (state.ndim() != 4 || state.dim(1) != value_heads || state.dim(2) != key_dim || state.dim(3) != value_dim)
    fail("CUDA {}: state must be [slots, {}, {}, {}], got {}", op, value_heads, key_dim, value_dim,
         shape_string(state.shape()));
  if ((key_dim != 32 && key_dim != 64 && key_dim != 128) || value_dim > cuda::kGatedDeltaMaxValueDim)
    fail("CUDA {}: key_dim {} / value_dim {} are not built (key_dim 32, 64 or 128; value_dim ≤ {})", op, key_dim,
         value_dim, cuda::kGatedDeltaMaxValueDim);
  check_state_layout(layout, tokens, state.dim(0), op);
  cuda::DeltaRuleArgs args;
  args.q = q.data<float>();
  args.k = k.data<float>();
  args.v = v.data<float>();
  args.g = g.data<float>();
  args.beta = beta.data<float>();
  args.spans = layout.spans_device.data<int32_t>();
  args.states = state.data<float>();
  args.out = out.raw();
  args.span_count = static_cast<int64_t>(layout.spans.size());
  args.key_heads = key_heads;
  args.value_heads = value_heads;
  args.key_dim = key_dim;
  args.value_dim = value_dim;
  args.dtype = activations_;
  static_assert(cuda::kGatedDeltaChunkTokens == kGatedDeltaChunk);
  args.whole_chunks = std::any_of(layout.spans.begin(), layout.spans.end(), [](const SequenceSpan& span) {
    return span.tokens - gated_delta_head_tokens(span) >= kGatedDeltaChunk;
  });
  activate();
  launched(cuda::launch_gated_delta_rule(args, stream_), op);
}

void CudaBackend::rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) {
  constexpr const char* op = "rms_norm_gated";
  require_device(x, op, "x");
  require_device(z, op, "z");
  require_device(weight, op, "weight");
  require_device(out, op, "out");
  require_activation(x, op, "x");
  require_activation(z, op, "z");
  require_activation(out, op, "out");
  if (weight.ndim() != 1 || weight.numel() == 0 || !is_float(weight.dtype()))
    fail("CUDA {}: weight must be a non-empty float vector, got {} {}", op, dtype_name(weight.dtype()),
         shape_string(weight.shape()));
  const int64_t width = weight.numel();
  if (x.numel() % width != 0 || z.numel() != x.numel() || out.numel() != x.numel())
    fail("CUDA {}: x {}, z {} and out {} must be equal whole rows of width {}", op, shape_string(x.shape()),
         shape_string(z.shape()), shape_string(out.shape()), width);
  activate();
  launched(cuda::launch_rms_norm_gated(x.raw(), z.raw(), activations_, weight.raw(), weight.dtype(),
                                       x.numel() / width, width, eps, out.raw(), stream_),
           op);
}

// A recurrent-state op's layout: made by this backend, spans inside the batch with one distinct
// slot each, inside the state.
void CudaBackend::check_state_layout(const BatchLayout& layout, int64_t tokens, int64_t slots, const char* op) {
  if (layout.total_tokens != tokens)
    fail("CUDA {}: the layout has {} tokens but the inputs have {}", op, layout.total_tokens, tokens);
  if (layout.spans_device.device() != Device::CUDA)
    fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
  check_recurrent_spans(layout.spans, tokens, slots, std::string("CUDA ") + op);
}

}  // namespace kiln
