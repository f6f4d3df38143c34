// A caching allocator of device memory (internal to backend/cuda).
//
// The graph allocates the same scratch shapes on every forward; cudaMalloc/cudaFree each time
// would synchronise the device and cost tens of microseconds. Freed blocks go to a free list keyed
// by their rounded size and are handed out again for requests of that size. All of the backend's
// work runs on one stream, so a block returned while kernels that use it are still queued is only
// reused by work queued after them.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

namespace kiln::cuda {

class DeviceAllocator : public std::enable_shared_from_this<DeviceAllocator> {
 public:
  explicit DeviceAllocator(int device) : device_(device) {}
  ~DeviceAllocator();  // releases the cached blocks
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // Device memory for `bytes`; the returned owner gives the block back when the last reference
  // goes (and keeps this allocator alive until then).
  std::shared_ptr<void> allocate(size_t bytes);

  size_t cached_bytes() const;

 private:
  static size_t rounded_size(size_t bytes);
  void release(void* block, size_t size);

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;
  size_t cached_bytes_ = 0;
};

}  // namespace kiln::cuda
