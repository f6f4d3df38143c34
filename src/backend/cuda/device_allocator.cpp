#include "backend/cuda/device_allocator.h"

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace kiln::cuda {

DeviceAllocator::~DeviceAllocator() {
  // Errors are ignored here: at process exit the runtime may already be shutting down, and the
  // memory goes with the context either way.
  cudaSetDevice(device_);
  for (auto& [size, block] : free_blocks_) cudaFree(block);
}

size_t DeviceAllocator::rounded_size(size_t bytes) {
  // Small blocks round to a power of two (at least 512 bytes), large ones to 2 MiB, so that
  // requests of nearby sizes share blocks while waste stays under half (small) or 2 MiB (large).
  constexpr size_t kSmallLimit = size_t{1} << 20;
  constexpr size_t kLargeGranule = size_t{2} << 20;
  if (bytes <= 512) return 512;
  if (bytes <= kSmallLimit) {
    size_t size = 512;
    while (size < bytes) size *= 2;
    return size;
  }
  return (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

std::shared_ptr<void> DeviceAllocator::allocate(size_t bytes) {
  const size_t size = rounded_size(bytes);
  void* block = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (auto found = free_blocks_.find(size); found != free_blocks_.end()) {
      block = found->second;
      free_blocks_.erase(found);
      cached_bytes_ -= size;
    }
  }
  if (!block) {
    if (cudaSetDevice(device_) != cudaSuccess) fail("CUDA device {} cannot be selected", device_);
    cudaError_t status = cudaMalloc(&block, size);
    if (status == cudaErrorMemoryAllocation && cached_bytes() > 0) {
      // Give the cached blocks back to the driver and try once more before failing.
      cudaGetLastError();
      std::lock_guard lock(mutex_);
      for (auto& [cached_size, cached] : free_blocks_) cudaFree(cached);
      free_blocks_.clear();
      cached_bytes_ = 0;
      status = cudaMalloc(&block, size);
    }
    if (status != cudaSuccess) {
      cudaGetLastError();
      fail("CUDA out of memory: cudaMalloc of {} bytes on device {} failed ({})", size, device_,
           cudaGetErrorString(status));
    }
  }
  std::shared_ptr<DeviceAllocator> self = shared_from_this();
  return std::shared_ptr<void>(block, [self, size](void* returned) { self->release(returned, size); });
}

void DeviceAllocator::release(void* block, size_t size) {
  std::lock_guard lock(mutex_);
  free_blocks_.emplace(size, block);
  cached_bytes_ += size;
}

size_t DeviceAllocator::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

}  // namespace kiln::cuda
