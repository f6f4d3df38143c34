// A caching allocator of device memory (internal to backend/cuda).
//
// The graph allocates the same scratch shapes on every forward; cudaMalloc/cudaFree each time
// would synchronise the device and cost tens of microseconds. Freed blocks go to a free list keyed
// by their rounded size and are handed out again for requests of that size. All of the backend's
// work runs on one stream, so a block returned while kernels that use it are still queued is only
// reused by work queued after them.
//
// Captured graphs (CUDA graphs) keep raw pointers to their scratch for as long as they exist, so
// their blocks must never go back to the shared free list. While the allocator is in a graph mode
// it serves requests from a separate graph pool, whose blocks return only to that pool: every
// captured graph of the backend shares it, which is safe because the backend replays them on its
// one stream, one after another, and nothing outside captured work ever receives those blocks.
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
  // Bytes taken from the device and not given back: blocks in use and cached ones, both pools.
  size_t held_bytes() const;
  // The block size a request of `bytes` takes.
  static size_t rounded_size(size_t bytes);

  enum class Mode {
    Shared,     // the shared free list (ordinary work)
    GraphGrow,  // the graph pool, adding blocks when it has none of the size (a capture's real run)
    GraphFixed, // the graph pool only: a request it cannot serve is an error (while recording)
  };
  void set_mode(Mode mode);

 private:
  void release(void* block, size_t size, bool graph_pool);
  void* take_shared(size_t size);

  int device_;
  mutable std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;
  size_t cached_bytes_ = 0;
  size_t held_bytes_ = 0;
  Mode mode_ = Mode::Shared;
  std::multimap<size_t, void*> graph_free_blocks_;
};

}  // namespace kiln::cuda
