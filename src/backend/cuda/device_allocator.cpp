#include "backend/cuda/device_allocator.h"

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace kiln::cuda {

DeviceAllocator::~DeviceAllocator() {
  // Errors are ignored here: at process exit the runtime may already be shutting down, and the
  // memory goes with the context either way.
  cudaSetDevice(device_);
  for (auto& [size, block] : free_blocks_) cudaFree(block);
  for (auto& [size, block] : graph_free_blocks_) cudaFree(block);
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

void* DeviceAllocator::take_shared(size_t size) {
  void* block = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (auto found = free_blocks_.find(size); found != free_blocks_.end()) {
      block = found->second;
      free_blocks_.erase(found);
      cached_bytes_ -= size;
    }
  }
  if (block) return block;
  if (cudaSetDevice(device_) != cudaSuccess) fail("CUDA device {} cannot be selected", device_);
  cudaError_t status = cudaMalloc(&block, size);
  if (status == cudaErrorMemoryAllocation && cached_bytes() > 0) {
    // Give the cached blocks back to the driver and try once more before failing.
    cudaGetLastError();
    std::lock_guard lock(mutex_);
    for (auto& [cached_size, cached] : free_blocks_) cudaFree(cached);
    free_blocks_.clear();
    held_bytes_ -= cached_bytes_;
    cached_bytes_ = 0;
    status = cudaMalloc(&block, size);
  }
  if (status != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA out of memory: cudaMalloc of {} bytes on device {} failed ({})", size, device_,
         cudaGetErrorString(status));
  }
  std::lock_guard lock(mutex_);
  held_bytes_ += size;
  return block;
}

std::shared_ptr<void> DeviceAllocator::allocate(size_t bytes) {
  const size_t size = rounded_size(bytes);
  Mode mode;
  void* block = nullptr;
  {
    std::lock_guard lock(mutex_);
    mode = mode_;
    if (mode != Mode::Shared) {
      if (auto found = graph_free_blocks_.find(size); found != graph_free_blocks_.end()) {
        block = found->second;
        graph_free_blocks_.erase(found);
      } else if (mode == Mode::GraphFixed) {
        fail("CUDA graph capture: recording needs a {}-byte block that the capture's real run did not use "
             "(the captured work allocated differently the second time)", size);
      }
    }
  }
  const bool graph_pool = mode != Mode::Shared;
  if (!block) block = take_shared(size);
  std::shared_ptr<DeviceAllocator> self = shared_from_this();
  return std::shared_ptr<void>(block,
                               [self, size, graph_pool](void* returned) { self->release(returned, size, graph_pool); });
}

void DeviceAllocator::release(void* block, size_t size, bool graph_pool) {
  std::lock_guard lock(mutex_);
  if (graph_pool) {
    graph_free_blocks_.emplace(size, block);
    return;
  }
  free_blocks_.emplace(size, block);
  cached_bytes_ += size;
}

void DeviceAllocator::set_mode(Mode mode) {
  std::lock_guard lock(mutex_);
  mode_ = mode;
}

size_t DeviceAllocator::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

size_t DeviceAllocator::held_bytes() const {
  std::lock_guard lock(mutex_);
  return held_bytes_;
}

}  // namespace kiln::cuda
