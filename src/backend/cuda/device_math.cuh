// Device-side helpers shared by the kernels: element conversion, dtype dispatch, mma.sync and
// cp.async wrappers (internal to backend/cuda).
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"

namespace kiln::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(bf16 value) { return __bfloat162float(value); }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

// The value a T holds after storing `value` (round to nearest even; identity for float). The
// graph's rounding points follow transformers' (architectures.md D.1) and vanish in f32.
template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_float(from_float<T>(value));
}

// Calls body(T{}) with T the C++ type of an activation dtype (F32 or BF16); false otherwise.
template <typename Body>
inline bool dispatch_activation(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::F32: body(float{}); return true;
    case DType::BF16: body(bf16{}); return true;
    default: return false;
  }
}
// Same for any floating storage dtype (weights): F32, BF16 or F16.
template <typename Body>
inline bool dispatch_float(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::F32: body(float{}); return true;
    case DType::BF16: body(bf16{}); return true;
    case DType::F16: body(__half{}); return true;
    default: return false;
  }
}

// Raises a kernel's dynamic shared-memory limit, once per device: the attribute call costs a
// driver round trip that every launch would otherwise pay. `opted_in` is the caller's per-kernel
// bitmask of devices already done.
template <typename Kernel>
cudaError_t allow_dynamic_shared(Kernel kernel, int bytes, std::atomic<uint64_t>& opted_in) {
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (opted_in.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_relaxed);
  return status;
}

inline unsigned blocks_for(int64_t items, int threads) {
  return static_cast<unsigned>((items + threads - 1) / threads);
}

// --- warp reductions with a fixed butterfly (the same order for every call) ---
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
__device__ __forceinline__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// --- tensor cores: D = A·B + C with A 16×16 (row), B 16×8 (col), bf16 in, f32 accumulate ---
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two bf16 (low = first) in one 32-bit register, as mma operands hold them.
__device__ __forceinline__ uint32_t pack_bf16x2(float first, float second) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(first, second);
  return *reinterpret_cast<uint32_t*>(&pair);
}

// --- cp.async: global → shared copies; zero-filled when `valid` is false ---
// (the destination as a shared-memory address, or as a pointer into shared memory)
__device__ __forceinline__ void cp_async_16(uint32_t shared_destination, const void* global_source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_destination), "l"(global_source),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* shared_destination, const void* global_source, bool valid) {
  cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(shared_destination)), global_source, valid);
}
// The 4-byte form (cp.async.ca: 16 bytes is the only size .cg takes), for data that is not in
// 16-byte runs.
__device__ __forceinline__ void cp_async_4(void* shared_destination, const void* global_source, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared_destination))),
               "l"(global_source), "r"(valid ? 4 : 0));
}
// The 8-byte form, for runs of four bf16.
__device__ __forceinline__ void cp_async_8(void* shared_destination, const void* global_source, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared_destination))),
               "l"(global_source), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// --- programmatic dependent launch (sm_90): a kernel started by launch_after_previous may begin
// while the kernel before it on the stream finishes; it must call wait_for_previous_grid() before
// it reads anything that kernel wrote or writes anything it reads (which also orders it after
// every earlier kernel: the previous one finished only after its own wait). A kernel that calls
// allow_dependent_launch() lets such a successor start early; both are no-ops otherwise.
// Every kernel of a decode step is launched this way, so a step's ~10 kernels per layer pay their
// launch latency while the kernel before them still runs, not after it (inside CUDA graphs too). ---
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }
// The usual opening of such a kernel: wait for the previous grid, then let the next one start.
__device__ __forceinline__ void follow_previous_grid() {
  wait_for_previous_grid();
  allow_dependent_launch();
}

template <typename... Parameters, typename... Arguments>
cudaError_t launch_after_previous(void (*kernel)(Parameters...), dim3 grid, dim3 block, size_t shared_bytes,
                                  cudaStream_t stream, Arguments&&... arguments) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute after_previous[1] = {};
  after_previous[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  after_previous[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = after_previous;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Arguments>(arguments)...);
}

// The pool row of a position of a slot in the paged KV cache (kernels.h's KvBlockTable): one table
// load. Rows that share a block (a key tile) take it from one call. The table is a step input that
// no kernel writes (ModelCache::assign_blocks copies it in stream order between steps), so a kernel
// may read it before waiting for the previous grid.
__device__ __forceinline__ int64_t kv_pool_row(const KvBlockTable& table, int64_t slot, int64_t position) {
  return static_cast<int64_t>(table.entries[slot * table.width + position / kKvBlockRows]) * kKvBlockRows +
         position % kKvBlockRows;
}

// ldmatrix .x4: four 8×8 b16 matrices from row-major shared memory; lanes 8j..8j+7 give the
// addresses of matrix j's rows, and register j of lane (g, q) receives its row g, columns 2q, 2q+1
// — an mma A fragment (matrices: rows 0–7 / 8–15 × columns 0–7 / 8–15), or two B fragments of
// a K-major operand.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&fragments)[4], const void* row_address) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragments[0]), "=r"(fragments[1]), "=r"(fragments[2]), "=r"(fragments[3])
               : "r"(address));
}
// The same, transposed: the B fragments (16 k-rows × 8 n-columns) of two adjacent column groups
// from row-major [k][n]; lanes 0..15 address rows 0..15 of the first group, 16..31 of the second.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&fragments)[4], const void* row_address) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragments[0]), "=r"(fragments[1]), "=r"(fragments[2]), "=r"(fragments[3])
               : "r"(address));
}

// --- wgmma (sm_90a): operands in shared memory in the 128-byte-swizzled K-major layout. Row r's
// 64 k of a 64-k block fill one 128-byte line, its 16-byte unit u stored at position u ^ (r % 8);
// an operand's lines follow each other, and each 8-line swizzle atom is 1,024-byte aligned. ---
constexpr int kSwizzleLineBytes = 128;
__device__ __forceinline__ uint32_t swizzled_unit(int row, int unit) {
  return static_cast<uint32_t>(row * kSwizzleLineBytes + ((unit ^ (row % 8)) * 16));
}
// A shared-memory matrix descriptor: start address, leading offset 16 bytes (unused by swizzled
// K-major operands), 1,024 bytes between 8-line swizzle atoms, 128-byte swizzle. A k16 step
// further along the lines is +2 (32 bytes).
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t shared_address) {
  return static_cast<uint64_t>((shared_address & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) |
         (uint64_t{(8 * kSwizzleLineBytes) >> 4} << 32) | (uint64_t{1} << 62);
}
// Pins accumulators in place around an asynchronous wgmma (the compiler must neither read them
// early nor move other writes across).
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// --- mbarriers (shared-memory barriers counting arrivals and copied bytes) and the bulk tensor
// copy engine (TMA), which writes shared memory in the async proxy that wgmma reads: a barrier's
// phase completes when its arrivals and expected bytes are all in; waiting names the parity of the
// phase waited for (a fresh barrier's previous phase, parity 1, counts as complete). ---
__device__ __forceinline__ void mbarrier_init(uint32_t barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}
// Makes the initialised barriers visible to the copy engine (before the block barrier that
// publishes them to the other threads).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// One arrival that also announces `bytes` the copy engine will deliver to this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "waiting:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra waiting;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
// The box at (inner, outer) of a 2-d tensor map (a __grid_constant__ kernel parameter) into
// shared memory, its bytes counted on `barrier`.
__device__ __forceinline__ void tma_load_2d(uint32_t destination, const void* tensor_map, int inner, int outer,
                                            uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(destination),
      "l"(tensor_map), "r"(inner), "r"(outer), "r"(barrier)
      : "memory");
}
// Brings a tensor map's descriptor into the cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}
// A warpgroup's registers per thread (sm_90a; the kernel needs __launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void set_max_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void set_max_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace kiln::cuda
