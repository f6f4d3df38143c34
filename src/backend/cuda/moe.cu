// A mixture of experts' routing, the grouping of its (token, expert) pairs by expert, and the
// weighted sum of each token's expert outputs (the ops' rules: backend.h; the expert products
// themselves are matmul.cu's). The routing's arithmetic is backend/moe_routing.h's, shared with the
// CPU's route_token: this kernel only spreads the independent parts (each exponential, each
// candidate of the top-k search) over a warp and keeps every sum sequential.
#include <cmath>
#include <cstdint>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/moe_routing.h"

namespace kiln::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ void record_error(DeviceErrorRecord* errors, int32_t code, int32_t value, int32_t limit) {
  if (atomicCAS(&errors->code, 0, code) == 0) {
    errors->value = value;
    errors->limit = limit;
  }
}

// A warp per token. Shared memory: the token's E probabilities, then the top k's probabilities and
// ids in rank order.
__global__ void __launch_bounds__(32)
    moe_route_kernel(const float* logits, const float* shared_logits, int64_t experts, int64_t top_k, bool normalize,
                     int32_t* expert_ids, float* weights) {
  extern __shared__ float route_words[];
  float* probabilities = route_words;
  float* ranked_probabilities = probabilities + experts;
  int32_t* ranked = reinterpret_cast<int32_t*>(ranked_probabilities + top_k);
  follow_previous_grid();
  const int64_t token = blockIdx.x;
  const int lane = static_cast<int>(threadIdx.x);
  const float* row = logits + token * experts;
  // The largest logit (a maximum: the same in any order).
  float largest = -INFINITY;
  for (int64_t e = lane; e < experts; e += 32) largest = fmaxf(largest, row[e]);
  largest = warp_max(largest);
  for (int64_t e = lane; e < experts; e += 32) probabilities[e] = routing::shifted_exp(row[e], largest);
  __syncwarp();
  float total = 0.0f;
  if (lane == 0) total = routing::sequential_sum(probabilities, experts);
  total = __shfl_sync(kFullMask, total, 0);
  for (int64_t e = lane; e < experts; e += 32) probabilities[e] = routing::divide(probabilities[e], total);
  __syncwarp();
  // The top k one rank at a time: the best candidate of each lane, then of the warp. ranks_before
  // is a total order on the (probability, id) pairs, so the warp's best is route_token's rank.
  // A chosen expert's probability becomes −∞, below every candidate's (probabilities are ≥ 0).
  for (int64_t rank = 0; rank < top_k; ++rank) {
    float best_probability = -INFINITY;
    int32_t best = static_cast<int32_t>(experts);
    for (int64_t e = lane; e < experts; e += 32)
      if (routing::ranks_before(probabilities[e], static_cast<int32_t>(e), best_probability, best)) {
        best_probability = probabilities[e];
        best = static_cast<int32_t>(e);
      }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_probability = __shfl_xor_sync(kFullMask, best_probability, offset);
      const int32_t other = __shfl_xor_sync(kFullMask, best, offset);
      if (routing::ranks_before(other_probability, other, best_probability, best)) {
        best_probability = other_probability;
        best = other;
      }
    }
    if (lane == 0) {
      ranked[rank] = best;
      ranked_probabilities[rank] = best_probability;
    }
    if (best < experts && lane == best % 32) probabilities[best] = -INFINITY;
    __syncwarp();
  }
  if (lane != 0) return;
  const int64_t terms = top_k + (shared_logits ? 1 : 0);
  float* token_weights = weights + token * terms;
  routing::finish_route(ranked, ranked_probabilities, top_k, normalize, expert_ids + token * top_k, token_weights);
  if (shared_logits) token_weights[top_k] = routing::sigmoid(shared_logits[token]);
}

// One block: counts the pairs of each expert, gives the experts with pairs their slots and ranges
// in ascending expert order (scans of integers over the block: exact in any order), then places
// each pair in its expert's range.
constexpr int kGroupThreads = 256;
constexpr int kGroupWarps = kGroupThreads / 32;

// Inclusive scans of two counts over the block's threads, in thread order: within each warp by
// shuffles, then over the warps' totals. `totals` is kGroupWarps pairs of shared memory.
__device__ void block_inclusive_scan(int32_t& a, int32_t& b, int2* totals) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int32_t a_before = __shfl_up_sync(kFullMask, a, offset), b_before = __shfl_up_sync(kFullMask, b, offset);
    if (lane >= offset) {
      a += a_before;
      b += b_before;
    }
  }
  if (lane == 31) totals[warp] = make_int2(a, b);
  __syncthreads();
  for (int before = 0; before < warp; ++before) {
    a += totals[before].x;
    b += totals[before].y;
  }
}

__global__ void __launch_bounds__(kGroupThreads)
    group_experts_kernel(const int32_t* expert_ids, int64_t pairs, int64_t experts, int32_t* groups,
                         uint32_t* experts_read, DeviceErrorRecord* errors) {
  __shared__ int2 warp_totals[kGroupWarps];
  follow_previous_grid();
  const ExpertGroupsLayout layout{expert_slots(experts, pairs), pairs};
  int32_t* counters = groups + layout.counter(0);
  const int thread = static_cast<int>(threadIdx.x);
  for (int64_t e = thread; e < experts; e += kGroupThreads) counters[e] = 0;
  __syncthreads();
  for (int64_t pair = thread; pair < pairs; pair += kGroupThreads) {
    const int32_t e = expert_ids[pair];
    if (e < 0 || e >= experts) {
      record_error(errors, kExpertIdOutOfRange, e, static_cast<int32_t>(experts));
      continue;
    }
    atomicAdd(&counters[e], 1);
  }
  __syncthreads();
  // Thread i takes the experts [i·span, (i + 1)·span).
  const int64_t span = (experts + kGroupThreads - 1) / kGroupThreads;
  const int64_t first = thread * span, last = first + span < experts ? first + span : experts;
  int32_t used = 0, counted = 0;
  for (int64_t e = first; e < last; ++e) {
    used += counters[e] > 0;
    counted += counters[e];
  }
  int32_t used_through = used, pairs_through = counted;
  block_inclusive_scan(used_through, pairs_through, warp_totals);
  int32_t slot = used_through - used, next = pairs_through - counted;
  for (int64_t e = first; e < last; ++e) {
    const int32_t count = counters[e];
    if (count == 0) continue;
    groups[layout.expert(slot)] = static_cast<int32_t>(e);
    groups[layout.begin(slot)] = next;
    groups[layout.end(slot)] = next + count;
    counters[e] = next;  // from here on, where the expert's next pair goes
    next += count;
    ++slot;
  }
  if (thread == kGroupThreads - 1) {
    groups[layout.used()] = used_through;
    if (experts_read) *experts_read += static_cast<uint32_t>(used_through);
  }
  __syncthreads();
  for (int64_t pair = thread; pair < pairs; pair += kGroupThreads) {
    const int32_t e = expert_ids[pair];
    if (e < 0 || e >= experts) continue;
    groups[layout.pair(atomicAdd(&counters[e], 1))] = static_cast<int32_t>(pair);
  }
}

// out[t, :] = Σ_s weights[t, s] · term_s, s in order, one fma chain per element.
__global__ void moe_combine_kernel(const float* routed, const float* shared, const float* weights, int64_t top_k,
                                   int64_t terms, int64_t width, float* out) {
  follow_previous_grid();
  const int64_t token = blockIdx.x;
  for (int64_t column = blockIdx.y * blockDim.x + threadIdx.x; column < width; column += gridDim.y * blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < terms; ++s) {
      const float term = s < top_k ? routed[(token * top_k + s) * width + column] : shared[token * width + column];
      acc = fmaf(weights[token * terms + s], term, acc);
    }
    out[token * width + column] = acc;
  }
}

}  // namespace

cudaError_t launch_moe_route(const float* logits, const float* shared_logits, int64_t tokens, int64_t experts,
                             int64_t top_k, bool normalize, int32_t* expert_ids, float* weights, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (experts > kMoeRouteMaxExperts || top_k < 1 || top_k > experts) return cudaErrorInvalidValue;
  const size_t shared = static_cast<size_t>(experts + 2 * top_k) * sizeof(float);
  return launch_after_previous(&moe_route_kernel, dim3(static_cast<unsigned>(tokens)), dim3(32), shared, stream, logits,
                               shared_logits, experts, top_k, normalize, expert_ids, weights);
}

cudaError_t launch_group_experts(const int32_t* expert_ids, int64_t pairs, int64_t experts, int32_t* groups,
                                 uint32_t* experts_read, DeviceErrorRecord* errors, cudaStream_t stream) {
  if (pairs > INT32_MAX || experts > INT32_MAX) return cudaErrorInvalidValue;
  return launch_after_previous(&group_experts_kernel, dim3(1), dim3(kGroupThreads), 0, stream, expert_ids, pairs,
                               experts, groups, experts_read, errors);
}

cudaError_t launch_moe_combine(const float* routed, const float* shared, const float* weights, int64_t tokens,
                               int64_t top_k, int64_t terms, int64_t width, float* out, cudaStream_t stream) {
  if (tokens == 0 || width == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t column_blocks = (width + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(column_blocks < 64 ? column_blocks : 64));
  return launch_after_previous(&moe_combine_kernel, grid, dim3(kThreads), 0, stream, routed, shared, weights, top_k,
                               terms, width, out);
}

}  // namespace kiln::cuda
