// Elementwise and row-copy ops: embedding, gather_rows, add, swiglu, kv_write. None reduces across
// threads, so every element's value is independent of the launch shape.
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

__device__ void record_error(DeviceErrorRecord* errors, int32_t code, int32_t value, int32_t limit) {
  if (atomicCAS(&errors->code, 0, code) == 0) {
    errors->value = value;
    errors->limit = limit;
  }
}

template <typename TableT, typename OutT>
__global__ void embedding_kernel(const TableT* table, int64_t table_rows, int64_t width, const int32_t* ids,
                                 OutT* out, DeviceErrorRecord* errors) {
  follow_previous_grid();
  const int64_t token = blockIdx.x;
  const int32_t id = ids[token];
  OutT* destination = out + token * width;
  if (id < 0 || id >= table_rows) {
    if (threadIdx.x == 0 && blockIdx.y == 0)
      record_error(errors, kEmbeddingIdOutOfRange, id, static_cast<int32_t>(table_rows));
    return;
  }
  const TableT* source = table + static_cast<int64_t>(id) * width;
  for (int64_t column = blockIdx.y * blockDim.x + threadIdx.x; column < width; column += gridDim.y * blockDim.x)
    destination[column] = from_float<OutT>(to_float(source[column]));
}

// Rows are copied as 4-byte words when every row is word-aligned, else as bytes.
template <typename Word>
__global__ void gather_rows_kernel(const Word* x, int64_t x_rows, int64_t row_words, const int32_t* rows, Word* out,
                                   DeviceErrorRecord* errors) {
  follow_previous_grid();
  const int64_t index = blockIdx.x;
  const int32_t row = rows[index];
  if (row < 0 || row >= x_rows) {
    if (threadIdx.x == 0 && blockIdx.y == 0)
      record_error(errors, kGatherRowOutOfRange, row, static_cast<int32_t>(x_rows));
    return;
  }
  for (int64_t word = blockIdx.y * blockDim.x + threadIdx.x; word < row_words; word += gridDim.y * blockDim.x)
    out[index * row_words + word] = x[row * row_words + word];
}

__global__ void feed_tokens_kernel(const int32_t* previous, int64_t previous_count, const int32_t* feed,
                                   int64_t count, int32_t* tokens, DeviceErrorRecord* errors) {
  follow_previous_grid();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t row = feed[i];
    if (row < 0) continue;
    if (row >= previous_count) {
      record_error(errors, kFeedRowOutOfRange, row, static_cast<int32_t>(previous_count));
      continue;
    }
    tokens[i] = previous[row];
  }
}

template <typename T>
__global__ void add_kernel(T* a, const T* b, int64_t count) {
  follow_previous_grid();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    a[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

// kWidth consecutive elements of each operand per thread and step: 16 bytes (one load each) where
// the count and the pointers allow, else one. Every element is the same expression either way.
template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) ElementPack {
  T value[kWidth];
};

template <typename T, int kWidth>
__global__ void swiglu_kernel(const T* gate, const T* up, T* out, int64_t count) {
  follow_previous_grid();
  using Pack = ElementPack<T, kWidth>;
  const int64_t packs = count / kWidth;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Pack g = reinterpret_cast<const Pack*>(gate)[i];
    const Pack u = reinterpret_cast<const Pack*>(up)[i];
    Pack result;
#pragma unroll
    for (int e = 0; e < kWidth; ++e) {
      const float x = to_float(g.value[e]);
      // silu(x) = x · σ(x) = x / (1 + e^-x), in f32 with the accurate expf.
      const float silu = round_to<T>(x / (1.0f + expf(-x)));
      result.value[e] = from_float<T>(silu * to_float(u.value[e]));
    }
    reinterpret_cast<Pack*>(out)[i] = result;
  }
}

template <typename Word>
__global__ void kv_write_kernel(const Word* k, const Word* v, int64_t row_words, const int32_t* slots,
                                const int32_t* positions, KvBlockTable table, Word* k_cache, Word* v_cache) {
  follow_previous_grid();
  const int64_t token = blockIdx.x;
  const int64_t row = kv_pool_row(table, slots[token], positions[token]);
  for (int64_t word = blockIdx.y * blockDim.x + threadIdx.x; word < row_words; word += gridDim.y * blockDim.x) {
    k_cache[row * row_words + word] = k[token * row_words + word];
    v_cache[row * row_words + word] = v[token * row_words + word];
  }
}

// A grid-stride launch for `count` independent elements (capped so huge tensors loop).
unsigned flat_blocks(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}
bool aligned_16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }
unsigned row_blocks(int64_t width) {
  const int64_t blocks = (width + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 64 ? (blocks > 0 ? blocks : 1) : 64);
}

}  // namespace

cudaError_t launch_embedding(const void* table, DType table_dtype, int64_t table_rows, int64_t width,
                             const int32_t* ids, int64_t tokens, void* out, DType out_dtype,
                             DeviceErrorRecord* errors, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  bool dispatched = false;
  dispatch_float(table_dtype, [&](auto table_tag) {
    using TableT = decltype(table_tag);
    dispatched = dispatch_activation(out_dtype, [&](auto out_tag) {
      using OutT = decltype(out_tag);
      launch_after_previous(&embedding_kernel<TableT, OutT>, dim3(static_cast<unsigned>(tokens), row_blocks(width)),
                            kThreads, 0, stream, static_cast<const TableT*>(table), table_rows, width, ids,
                            static_cast<OutT*>(out), errors);
    });
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_feed_tokens(const int32_t* previous, int64_t previous_count, const int32_t* feed, int64_t count,
                               int32_t* tokens, DeviceErrorRecord* errors, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  launch_after_previous(&feed_tokens_kernel, blocks_for(count, kThreads), kThreads, 0, stream, previous,
                        previous_count, feed, count, tokens, errors);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const void* x, int64_t x_rows, int64_t row_bytes, const int32_t* rows,
                               int64_t count, void* out, DeviceErrorRecord* errors, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(count), row_blocks(row_bytes / 4 + 1));
  if (row_bytes % 4 == 0)
    launch_after_previous(&gather_rows_kernel<uint32_t>, grid, kThreads, 0, stream, static_cast<const uint32_t*>(x),
                          x_rows, row_bytes / 4, rows, static_cast<uint32_t*>(out), errors);
  else
    launch_after_previous(&gather_rows_kernel<uint8_t>, grid, kThreads, 0, stream, static_cast<const uint8_t*>(x),
                          x_rows, row_bytes, rows, static_cast<uint8_t*>(out), errors);
  return cudaGetLastError();
}

cudaError_t launch_add(void* a, const void* b, int64_t count, DType dtype, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_after_previous(&add_kernel<T>, flat_blocks(count), kThreads, 0, stream, static_cast<T*>(a),
                          static_cast<const T*>(b), count);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_swiglu(const void* gate, const void* up, void* out, int64_t count, DType dtype,
                          cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const bool dispatched = dispatch_activation(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kWide = 16 / sizeof(T);
    const bool wide = count % kWide == 0 && aligned_16(gate) && aligned_16(up) && aligned_16(out);
    launch_after_previous(wide ? &swiglu_kernel<T, kWide> : &swiglu_kernel<T, 1>,
                          flat_blocks(wide ? count / kWide : count), kThreads, 0, stream, static_cast<const T*>(gate),
                          static_cast<const T*>(up), static_cast<T*>(out), count);
  });
  return dispatched ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_kv_write(const void* k, const void* v, int64_t tokens, int64_t row_bytes,
                            const int32_t* slots, const int32_t* positions, KvBlockTable table, void* k_cache,
                            void* v_cache, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tokens), row_blocks(row_bytes / 4 + 1));
  if (row_bytes % 4 == 0)
    launch_after_previous(&kv_write_kernel<uint32_t>, grid, kThreads, 0, stream, static_cast<const uint32_t*>(k),
                          static_cast<const uint32_t*>(v), row_bytes / 4, slots, positions, table,
                          static_cast<uint32_t*>(k_cache), static_cast<uint32_t*>(v_cache));
  else
    launch_after_previous(&kv_write_kernel<uint8_t>, grid, kThreads, 0, stream, static_cast<const uint8_t*>(k),
                          static_cast<const uint8_t*>(v), row_bytes, slots, positions, table,
                          static_cast<uint8_t*>(k_cache), static_cast<uint8_t*>(v_cache));
  return cudaGetLastError();
}

}  // namespace kiln::cuda
