// CudaBackend's HybridOps: the Gated DeltaNet and gated-attention ops of Qwen3.5 and Qwen3-Next
// (gated_delta.cu), and the check of a recurrent-state batch layout.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "backend/op_contract.h"
#include "core/error.h"

namespace kiln {

void CudaBackend::split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  constexpr const char* op = "split_query_gate";
  check_split_query_gate(contract(), query_and_gate, query, gate);
  activate();
  launched(cuda::launch_split_query_gate(query_and_gate.raw(), query.raw(), gate.raw(), query.numel() / query.dim(2),
                                         query.dim(2), activations_, stream_),
           op);
}

void CudaBackend::sigmoid_gate(Tensor& x, const Tensor& gate) {
  constexpr const char* op = "sigmoid_gate";
  const int64_t count = check_sigmoid_gate(contract(), x, gate);
  activate();
  launched(cuda::launch_sigmoid_gate(x.raw(), gate.raw(), count, activations_, stream_), op);
}

void CudaBackend::causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout,
                                     Tensor& conv_state, Tensor& out) {
  constexpr const char* op = "causal_conv1d_silu";
  const ConvDims dims = check_causal_conv1d_silu(contract(), x, weight, layout.spans, conv_state, out);
  const int64_t channels = dims.channels;
  if (dims.kernel != cuda::kGatedDeltaConvKernel)
    fail("CUDA {}: weight must be a float [{}, {}] tensor (the kernel size this backend is built for), got {} {}",
         op, channels, cuda::kGatedDeltaConvKernel, dtype_name(weight.dtype()), shape_string(weight.shape()));
  require_state_layout(layout, dims.tokens, op);
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
  const PrepareQkvDims dims = check_gated_delta_prepare_qkv(contract(), qkv, q, k, v);
  // HF-Q35 multiplies by the python float 1/sqrt(dk), which torch applies as an f32 scalar.
  const float query_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.key_dim)));
  activate();
  launched(cuda::launch_gated_delta_prepare_qkv(qkv.raw(), activations_, dims.tokens, dims.key_heads, dims.key_dim,
                                                dims.value_heads * dims.value_dim, query_scale, kGatedDeltaL2NormEps,
                                                q.data<float>(), k.data<float>(), v.data<float>(), stream_),
           op);
}

void CudaBackend::gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                    Tensor& beta, Tensor& g) {
  constexpr const char* op = "gated_delta_gates";
  const GatesDims dims = check_gated_delta_gates(contract(), b, a, a_log, dt_bias, beta, g);
  // The kernel reads both per-head parameters in one dtype.
  if (a_log.dtype() != dt_bias.dtype())
    fail("CUDA {}: A_log is {} and dt_bias {}; the kernel takes them in one dtype", op, dtype_name(a_log.dtype()),
         dtype_name(dt_bias.dtype()));
  activate();
  launched(cuda::launch_gated_delta_gates(b.raw(), a.raw(), activations_, a_log.raw(), dt_bias.raw(), a_log.dtype(),
                                          dims.tokens * dims.heads, dims.heads, beta.data<float>(), g.data<float>(),
                                          stream_),
           op);
}

void CudaBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, const BatchLayout& layout, Tensor& state, Tensor& out) {
  constexpr const char* op = "gated_delta_rule";
  const DeltaRuleDims dims = check_gated_delta_rule(contract(), op, q, k, v, g, beta, layout.spans, state, out);
  const int64_t key_heads = dims.key_heads, key_dim = dims.key_dim;
  const int64_t value_heads = dims.value_heads, value_dim = dims.value_dim;
  if (!cuda::gated_delta_supports_key_dim(key_dim) || value_dim > cuda::kGatedDeltaMaxValueDim)
    fail("CUDA {}: key_dim {} / value_dim {} are not built (key_dim a multiple of 8 up to {}; value_dim ≤ {})", op,
         key_dim, value_dim, cuda::kGatedDeltaMaxKeyDim, cuda::kGatedDeltaMaxValueDim);
  require_state_layout(layout, dims.tokens, op);
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
  const NormDims dims = check_rms_norm_gated(contract(), x, z, weight, out);
  activate();
  launched(cuda::launch_rms_norm_gated(x.raw(), z.raw(), activations_, weight.raw(), weight.dtype(), dims.rows,
                                       dims.width, eps, out.raw(), stream_),
           op);
}

// A recurrent-state op's layout: made by this backend (the kernels read its device spans) and
// describing the op's tokens (the contract checks the spans themselves).
void CudaBackend::require_state_layout(const BatchLayout& layout, int64_t tokens, const char* op) {
  if (layout.total_tokens != tokens)
    fail("CUDA {}: the layout has {} tokens but the inputs have {}", op, layout.total_tokens, tokens);
  if (layout.spans_device.device() != Device::CUDA)
    fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
}

}  // namespace kiln
