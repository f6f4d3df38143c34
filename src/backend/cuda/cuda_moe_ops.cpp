// CudaBackend's mixture-of-experts ops (cuda_backend_impl.h): the routing, the expert products and
// the weighted sum, all on the device so that MoE decode steps are captured like any other.
#include <algorithm>

#include "backend/cuda/cuda_backend_impl.h"
#include "core/error.h"

namespace kiln {
namespace {

constexpr uint64_t kScratchAlignment = 256;

uint64_t aligned(uint64_t bytes) { return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment; }

// The device path takes an expert's pairs eight at a time, each pass a stream of its matrix
// through the mma.sync decode kernel; a direct call with more pairs than this per expert on
// average runs them on the host-sorted path instead, whose experts with many rows take the prefill
// GEMM (wgmma) with its many times the throughput per weight byte. Both give the same bits, so
// the bound only moves time: 16 (two passes) is a first choice, not yet measured against the other
// path.
constexpr int64_t kDevicePairsPerExpert = 16;

// The experts every product's weight has (the routing's ids must lie below all of them).
int64_t shared_experts(const ExpertMatmulDims& dims, size_t count) {
  return *std::min_element(dims.experts, dims.experts + count);
}

}  // namespace

void CudaBackend::moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                            Tensor& weights) {
  const RouteDims dims = check_moe_route(contract(), logits, shared_logits, experts, weights);
  if (dims.experts > cuda::kMoeRouteMaxExperts)
    fail("CUDA moe_route: logits has {} experts, the kernel takes up to {}", dims.experts, cuda::kMoeRouteMaxExperts);
  activate();
  launched(cuda::launch_moe_route(logits.data<float>(), shared_logits ? shared_logits->data<float>() : nullptr,
                                  dims.tokens, dims.experts, dims.top_k, normalize, experts.data<int32_t>(),
                                  weights.data<float>(), stream_),
           "moe_route");
}

CudaBackend::ExpertScratch CudaBackend::expert_scratch(const ExpertMatmulDims& dims,
                                                       std::span<const MatmulTarget> targets) const {
  const int64_t pairs = dims.tokens * dims.top_k;
  const int64_t experts = shared_experts(dims, targets.size());
  const int64_t slots = cuda::expert_slots(experts, pairs);
  ExpertScratch scratch;
  scratch.group_bytes = aligned(static_cast<uint64_t>(cuda::expert_groups_ints(experts, pairs)) * sizeof(int32_t));
  for (size_t t = 0; t < targets.size(); ++t)
    if (targets[t].w->quantized())
      scratch.decoded_bytes[t] =
          aligned(static_cast<uint64_t>(slots * dims.n[t] * dims.k) * dtype_size(activations_));
  return scratch;
}

void CudaBackend::expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                                Tensor* experts_read) {
  static_assert(cuda::kMatmulGroupMax == kMaxMatmulGroup);
  const ExpertMatmulDims dims = check_expert_matmul(contract(), x, experts, targets, experts_read);
  const int64_t pairs = dims.tokens * dims.top_k;
  const int64_t count = shared_experts(dims, targets.size());
  if (!graph_mode_ && pairs > kDevicePairsPerExpert * count) {
    expert_matmul_on_host(x, experts, targets, experts_read);
    return;
  }
  if (pairs == 0) return;
  const int64_t slots = cuda::expert_slots(count, pairs);
  if (slots > 65535)
    fail("CUDA expert_matmul: {} experts for {} pairs: the kernels take up to 65535 experts a call", count, pairs);
  cuda::MatmulArgs products[kMaxMatmulGroup];
  for (size_t t = 0; t < targets.size(); ++t)
    products[t] = product_args("expert_matmul", x, *targets[t].w, nullptr, *targets[t].out, dims.x_rows, dims.n[t],
                               dims.k);
  const ExpertScratch layout = expert_scratch(dims, targets);
  Tensor scratch = alloc({static_cast<int64_t>(layout.bytes() / sizeof(float))}, DType::F32);
  uint8_t* bytes = static_cast<uint8_t*>(scratch.raw());
  int32_t* groups = reinterpret_cast<int32_t*>(bytes);
  cuda::ExpertRouting routing;
  routing.groups = groups;
  routing.slots = slots;
  routing.pairs = pairs;
  routing.top_k = dims.top_k;
  routing.x_per_pair = dims.x_rows == pairs;
  // A token's experts are distinct (moe_route's top k), so an expert has at most a pair per token.
  routing.rows_per_pass = static_cast<int>(std::min<int64_t>(cuda::kExpertPassRows, dims.tokens));
  activate();
  launched(cuda::launch_group_experts(experts.data<int32_t>(), pairs, count, groups,
                                      experts_read ? experts_read->data<uint32_t>() : nullptr, errors_, stream_),
           "expert_matmul (grouping)");
  uint8_t* decoded = bytes + layout.group_bytes;
  for (size_t t = 0; t < targets.size(); ++t) {
    if (layout.decoded_bytes[t] == 0) continue;
    launched(cuda::launch_dequantize_experts(quantized_weight_args(*targets[t].w), dims.n[t], routing, decoded,
                                             activations_, stream_),
             "expert_matmul (dequantize)");
    products[t].w = decoded;
    routing.slot_weights |= 1u << t;
    decoded += layout.decoded_bytes[t];
  }
  if (activations_ == DType::F32) {
    for (size_t t = 0; t < targets.size(); ++t) {
      cuda::ExpertRouting one = routing;
      one.slot_weights = routing.slot_weights >> t & 1u;
      launched(cuda::launch_expert_matmul_f32(products[t], one, stream_), "expert_matmul (f32)");
    }
    return;
  }
  launched(cuda::launch_expert_matmul_bf16(products, static_cast<int>(targets.size()), routing, stream_),
           "expert_matmul (bf16)");
}

uint64_t CudaBackend::expert_matmul_scratch_bytes(const Tensor& x, const Tensor& experts,
                                                  std::span<const MatmulTarget> targets) const {
  const ExpertMatmulDims dims = check_expert_matmul(contract(), x, experts, targets, nullptr);
  const int64_t pairs = dims.tokens * dims.top_k;
  if (pairs == 0) return 0;
  const uint64_t device = expert_scratch(dims, targets).bytes();
  if (pairs <= kDevicePairsPerExpert * shared_experts(dims, targets.size())) return device;
  // The host path's blocks (Backend::expert_matmul_on_host), each as the allocator rounds it: x's
  // rows gathered, each product's rows in expert order, the two row maps, the counter's copy, and
  // the most that one expert's matmul_group takes for itself (matmul_scratch: a quantized weight's
  // matrix decoded, a split prefill GEMM's partial sums), whatever its rows.
  uint64_t host = allocation_bytes(static_cast<uint64_t>(pairs * dims.k) * dtype_size(activations_)) +
                  2 * allocation_bytes(static_cast<uint64_t>(pairs) * sizeof(int32_t)) +
                  allocation_bytes(sizeof(uint32_t));
  cuda::MatmulArgs products[kMaxMatmulGroup];
  uint64_t decoded = 0;
  for (size_t t = 0; t < targets.size(); ++t) {
    host += allocation_bytes(static_cast<uint64_t>(pairs * dims.n[t]) * dtype_size(targets[t].out->dtype()));
    if (targets[t].w->quantized())
      decoded += aligned(static_cast<uint64_t>(dims.n[t] * dims.k) * dtype_size(activations_));
    products[t].n = dims.n[t];
    products[t].k = dims.k;
    products[t].multiprocessors = multiprocessors_;
  }
  uint64_t partials = 0;
  if (activations_ == DType::BF16)
    partials = static_cast<uint64_t>(
                   cuda::matmul_bf16_most_partials_floats(products, static_cast<int>(targets.size()), pairs)) *
               sizeof(float);
  host += allocation_bytes(decoded + partials);
  return std::max(device, host);
}

void CudaBackend::moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) {
  const CombineDims dims = check_moe_combine(contract(), routed, shared, weights, out);
  activate();
  launched(cuda::launch_moe_combine(routed.data<float>(), shared ? shared->data<float>() : nullptr,
                                    weights.data<float>(), dims.tokens, dims.top_k, dims.terms, dims.width,
                                    out.data<float>(), stream_),
           "moe_combine");
}

}  // namespace kiln
