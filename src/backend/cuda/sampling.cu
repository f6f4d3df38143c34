// Token choice on the device (GraphOps::sample_tokens), following engine/sampler.cpp step by step
// so that the same logits and the same uniform draw give the same token as the host Sampler.
//
// Every row is first summarised in fixed chunks of its logits, by a grid of blocks: each chunk's
// argmax (the host's tie rule: the lowest id among equal logits) and its f64 Σ exp(logit − chunk
// max). Greedy rows take the best of the chunks' argmaxes.
// Sampling rows: every row's candidates are sorted once by one device radix sort over all rows,
// keyed (row, logit descending): a stable sort of ids in ascending order, so equal logits keep
// the lower id first — the host's partial_sort comparator. Then one block per row walks the sorted
// candidates with the host's filters in the host's order (top_k, top_p, min_p) and picks with the
// host's draw, all in f64 like the host. The host sums sequentially; here each of the block's
// threads sums a contiguous chunk and the chunk sums are combined in a fixed order, so a token can
// differ from the host's only when the draw falls within f64 rounding (~1e-16 of the mass) of a
// boundary between two candidates. The arithmetic depends only on the row itself: a row samples
// the same token in any batch.
//
// The reported logprob is the log-softmax of the chosen logit over the whole row, rounded to f32:
// f64 as on the host, the row's Σ exp(logit − max) formed from the chunks' sums, each scaled by
// exp(chunk max − row max).
#include <cmath>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 1024;

struct RowSettings {
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  double uniform;
};

__device__ RowSettings read_settings(const int32_t* settings, int64_t row) {
  const int32_t* words = settings + row * kSamplingWords;
  RowSettings parsed;
  parsed.temperature = __int_as_float(words[0]);
  parsed.top_k = words[1];
  parsed.top_p = __int_as_float(words[2]);
  parsed.min_p = __int_as_float(words[3]);
  parsed.uniform = __hiloint2double(words[5], words[4]);
  return parsed;
}

// A fixed-order tree reduction over the block (shared scratch of kThreads entries): at each
// stride, thread i combines its entry with that of thread i + stride.
template <typename T, typename Combine>
__device__ T block_reduce(T value, T* scratch, Combine combine) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) scratch[threadIdx.x] = combine(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    __syncthreads();
  }
  const T total = scratch[0];
  __syncthreads();
  return total;
}

__device__ double block_sum(double value, double* scratch) {
  return block_reduce(value, scratch, [](double a, double b) { return a + b; });
}

__device__ int64_t block_min(int64_t value, int64_t* scratch) {
  return block_reduce(value, scratch, [](int64_t a, int64_t b) { return b < a ? b : a; });
}

// The sum of the values of the threads before this one (thread 0 adds them in thread order).
__device__ double block_exclusive_prefix(double value, double* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    double running = 0.0;
    for (int i = 0; i < kThreads; ++i) {
      const double own = scratch[i];
      scratch[i] = running;
      running += own;
    }
  }
  __syncthreads();
  const double prefix = scratch[threadIdx.x];
  __syncthreads();
  return prefix;
}

// A row's logits are first summarised in chunks of kChunkLogits by a grid of blocks (one pass over
// the row, spread over the device), and the sampling block combines the chunks' summaries: one
// block reading a 128k-entry vocabulary and taking an f64 exp of every logit cost tens of
// microseconds per step. The chunk count depends on the vocabulary alone.
constexpr int kChunkThreads = 256;
constexpr int64_t kChunkLogits = 2048;

struct ChunkSummary {
  double exp_sum;  // Σ exp(logit − maximum) over the chunk, f64, in the block's fixed order
  float maximum;   // the chunk's largest logit
  int32_t argmax;  // its lowest index among equals, within the row
};

__host__ __device__ int64_t chunks_of(int64_t vocab) { return (vocab + kChunkLogits - 1) / kChunkLogits; }

// (value, index) orders candidates by the host's rule: the larger logit, then the lower id;
// index < 0 marks no candidate.
struct Candidate {
  float value;
  int32_t index;
};
__device__ __forceinline__ Candidate better(Candidate own, Candidate other) {
  if (other.index < 0) return own;
  if (own.index < 0 || other.value > own.value || (other.value == own.value && other.index < own.index)) return other;
  return own;
}
__device__ __forceinline__ Candidate warp_best(Candidate candidate) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const Candidate other{__shfl_xor_sync(0xffffffffu, candidate.value, offset),
                          __shfl_xor_sync(0xffffffffu, candidate.index, offset)};
    candidate = better(candidate, other);
  }
  return candidate;
}
__device__ __forceinline__ double warp_sum(double value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Block (chunk, row): the chunk's argmax, then Σ exp(logit − chunk max), each thread taking the
// chunk's logits at its stride; warps reduce by a fixed butterfly, warp results in warp order.
__global__ void __launch_bounds__(kChunkThreads)
    summarise_chunks_kernel(const float* logits, int64_t vocab, ChunkSummary* summaries) {
  follow_previous_grid();
  __shared__ Candidate warp_candidates[kChunkThreads / 32];
  __shared__ double warp_sums[kChunkThreads / 32];
  const int64_t row = blockIdx.y, chunk = blockIdx.x;
  const float* row_logits = logits + row * vocab;
  const int64_t begin = chunk * kChunkLogits;
  const int64_t end = begin + kChunkLogits < vocab ? begin + kChunkLogits : vocab;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Candidate best{-INFINITY, -1};
  for (int64_t i = begin + threadIdx.x; i < end; i += kChunkThreads)
    best = better(best, Candidate{row_logits[i], static_cast<int32_t>(i)});
  best = warp_best(best);
  if (lane == 0) warp_candidates[warp] = best;
  __syncthreads();
  best = warp_candidates[0];
  for (int w = 1; w < kChunkThreads / 32; ++w) best = better(best, warp_candidates[w]);
  // A chunk of −∞ only (a masked stretch of the vocabulary) adds nothing to the row's sum.
  const double maximum = best.value;
  double local = 0.0;
  if (maximum != -INFINITY)
    for (int64_t i = begin + threadIdx.x; i < end; i += kChunkThreads)
      local += exp(static_cast<double>(row_logits[i]) - maximum);
  local = warp_sum(local);
  if (lane == 0) warp_sums[warp] = local;
  __syncthreads();
  if (threadIdx.x != 0) return;
  double sum = 0.0;
  for (int w = 0; w < kChunkThreads / 32; ++w) sum += warp_sums[w];
  summaries[row * gridDim.x + chunk] = ChunkSummary{sum, best.value, best.index};
}

struct RowSummary {
  int64_t argmax;
  double maximum;
  double exp_sum;  // Σ exp(logit − maximum) over the row
};

// Warp 0 combines a row's chunk summaries (lane c takes chunks c, c + 32, …; fixed butterflies)
// and shares the result with the block.
__device__ RowSummary combine_chunks(const ChunkSummary* chunks, int64_t count, RowSummary* shared) {
  if (threadIdx.x < 32) {
    Candidate best{-INFINITY, -1};
    for (int64_t c = threadIdx.x; c < count; c += 32) best = better(best, Candidate{chunks[c].maximum, chunks[c].argmax});
    best = warp_best(best);
    const double maximum = best.value;
    double local = 0.0;
    for (int64_t c = threadIdx.x; c < count; c += 32)
      local += chunks[c].exp_sum * exp(static_cast<double>(chunks[c].maximum) - maximum);
    local = warp_sum(local);
    if (threadIdx.x == 0) *shared = RowSummary{best.index, maximum, local};
  }
  __syncthreads();
  return *shared;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, const ChunkSummary* chunks, const int32_t* settings, int64_t vocab,
                  const int32_t* sorted_ids, int32_t* tokens, float* logprobs, DeviceErrorRecord* errors) {
  follow_previous_grid();
  __shared__ double sums[kThreads];
  __shared__ int64_t indices[kThreads];
  __shared__ RowSummary row_summary;
  const int64_t row = blockIdx.x;
  const float* row_logits = logits + row * vocab;
  const RowSettings row_settings = read_settings(settings, row);
  const int64_t chunk_count = chunks_of(vocab);
  const RowSummary summary = combine_chunks(chunks + row * chunk_count, chunk_count, &row_summary);
  int64_t token = summary.argmax;
  if (row_settings.temperature != 0.0f && !sorted_ids) {
    if (threadIdx.x == 0 && atomicCAS(&errors->code, 0, kSamplingRowNotSorted) == 0) {
      errors->value = static_cast<int32_t>(row);
      errors->limit = 0;
    }
  } else if (row_settings.temperature != 0.0f) {
    const int32_t* order = sorted_ids + row * vocab;
    const int64_t candidates =
        row_settings.top_k > 0 && row_settings.top_k < vocab ? static_cast<int64_t>(row_settings.top_k) : vocab;
    const double maximum = row_logits[order[0]];
    const double temperature = row_settings.temperature;
    auto probability = [&](int64_t i) { return exp((static_cast<double>(row_logits[order[i]]) - maximum) / temperature); };
    // Each thread owns one contiguous chunk of the sorted candidates.
    const int64_t chunk = (candidates + kThreads - 1) / kThreads;
    const int64_t begin = threadIdx.x * chunk;
    const int64_t end_all = begin + chunk < candidates ? begin + chunk : candidates;

    double local = 0.0;
    for (int64_t i = begin; i < end_all; ++i) local += probability(i);
    const double total = block_sum(local, sums);

    int64_t kept = candidates;
    if (row_settings.top_p < 1.0f) {  // the smallest prefix whose mass reaches top_p
      double chunk_mass = 0.0;
      for (int64_t i = begin; i < end_all; ++i) chunk_mass += probability(i) / total;
      double mass = block_exclusive_prefix(chunk_mass, sums);
      int64_t reached = candidates;
      for (int64_t i = begin; i < end_all; ++i) {
        mass += probability(i) / total;
        if (mass >= static_cast<double>(row_settings.top_p)) {
          reached = i;
          break;
        }
      }
      const int64_t first = block_min(reached, indices);
      if (first < candidates) kept = first + 1;
    }
    if (row_settings.min_p > 0.0f) {  // keep the leading run at or above min_p × the top probability
      const double threshold = static_cast<double>(row_settings.min_p) * probability(0);
      int64_t below = kept;
      for (int64_t i = begin > 1 ? begin : 1; i < end_all && i < kept; ++i)
        if (probability(i) < threshold) {
          below = i;
          break;
        }
      kept = block_min(below, indices);
    }
    const int64_t end_kept = end_all < kept ? end_all : kept;
    double kept_local = 0.0;
    for (int64_t i = begin; i < end_kept; ++i) kept_local += probability(i);
    const double kept_total = block_sum(kept_local, sums);
    const double target = row_settings.uniform * kept_total;
    double cumulative = block_exclusive_prefix(kept_local, sums);
    int64_t chosen = kept - 1;
    for (int64_t i = begin; i < end_kept; ++i) {
      cumulative += probability(i);
      if (target < cumulative) {
        chosen = i;
        break;
      }
    }
    chosen = block_min(chosen, indices);
    token = order[chosen];
  }
  if (threadIdx.x == 0) {
    tokens[row] = static_cast<int32_t>(token);
    logprobs[row] = static_cast<float>(static_cast<double>(row_logits[token]) - summary.maximum - log(summary.exp_sum));
  }
}

// Sort keys: the row in the high word, then the logit mapped to an unsigned order that descends
// as the logit ascends (−0 is folded onto +0, which the host's comparison treats as equal).
__global__ void sort_keys_kernel(const float* logits, int64_t rows, int64_t vocab, unsigned long long* keys,
                                 int32_t* ids) {
  follow_previous_grid();
  const int64_t count = rows * vocab;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < count;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float logit = logits[index];
    const uint32_t bits = __float_as_uint(logit == 0.0f ? 0.0f : logit);
    const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    keys[index] = (static_cast<unsigned long long>(index / vocab) << 32) | static_cast<uint32_t>(~ascending);
    ids[index] = static_cast<int32_t>(index % vocab);
  }
}

int row_key_bits(int64_t rows) {
  int bits = 0;
  while ((int64_t{1} << bits) < rows) ++bits;
  return bits;
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

size_t cub_scratch_bytes(int64_t rows, int64_t vocab) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const unsigned long long*>(nullptr),
                                  static_cast<unsigned long long*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(rows * vocab), 0,
                                  32 + row_key_bits(rows));
  return bytes;
}

}  // namespace

size_t sampling_sort_scratch_bytes(int64_t rows, int64_t vocab) {
  const size_t items = static_cast<size_t>(rows * vocab);
  return 2 * align_up(items * sizeof(unsigned long long)) + 2 * align_up(items * sizeof(int32_t)) +
         align_up(cub_scratch_bytes(rows, vocab));
}

size_t sampling_chunk_scratch_bytes(int64_t rows, int64_t vocab) {
  return static_cast<size_t>(rows * chunks_of(vocab)) * sizeof(ChunkSummary);
}

cudaError_t launch_sample_tokens(const SamplingArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  const int32_t* sorted_ids = nullptr;
  if (args.sort_scratch) {
    const size_t items = static_cast<size_t>(args.rows * args.vocab);
    char* cursor = static_cast<char*>(args.sort_scratch);
    auto carve = [&](size_t bytes) {
      char* start = cursor;
      cursor += align_up(bytes);
      return start;
    };
    auto* keys_in = reinterpret_cast<unsigned long long*>(carve(items * sizeof(unsigned long long)));
    auto* keys_out = reinterpret_cast<unsigned long long*>(carve(items * sizeof(unsigned long long)));
    auto* ids_in = reinterpret_cast<int32_t*>(carve(items * sizeof(int32_t)));
    auto* ids_out = reinterpret_cast<int32_t*>(carve(items * sizeof(int32_t)));
    size_t cub_bytes = cub_scratch_bytes(args.rows, args.vocab);
    void* cub_scratch = carve(cub_bytes);
    const int64_t blocks = (static_cast<int64_t>(items) + 255) / 256;
    launch_after_previous(&sort_keys_kernel, static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream,
                          args.logits, args.rows, args.vocab, keys_in, ids_in);
    if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
    if (cudaError_t status = cub::DeviceRadixSort::SortPairs(cub_scratch, cub_bytes, keys_in, keys_out, ids_in,
                                                             ids_out, static_cast<int>(items), 0,
                                                             32 + row_key_bits(args.rows), stream);
        status != cudaSuccess)
      return status;
    sorted_ids = ids_out;
  }
  auto* chunks = static_cast<ChunkSummary*>(args.chunk_scratch);
  launch_after_previous(&summarise_chunks_kernel,
                        dim3(static_cast<unsigned>(chunks_of(args.vocab)), static_cast<unsigned>(args.rows)),
                        kChunkThreads, 0, stream, args.logits, args.vocab, chunks);
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  launch_after_previous(&sample_kernel, static_cast<unsigned>(args.rows), kThreads, 0, stream, args.logits, chunks,
                        args.settings, args.vocab, sorted_ids, args.tokens, args.logprobs, args.errors);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
