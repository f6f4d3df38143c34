#include "backend/cpu/memory_bandwidth.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kMinBufferBytes = int64_t{256} << 20;
constexpr int64_t kMinTrafficBytes = int64_t{1} << 30;
constexpr int kTimedRuns = 3;
// Threads copy disjoint chunks whose edges fall on 2 MiB (a huge page), so none shares a page.
constexpr int64_t kChunkGrain = int64_t{2} << 20;

int64_t last_level_cache_bytes() {
  int64_t largest = 0;
  for (int name : {_SC_LEVEL1_DCACHE_SIZE, _SC_LEVEL2_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL4_CACHE_SIZE})
    largest = std::max<int64_t>(largest, sysconf(name));
  return largest;
}

}  // namespace

double measure_copy_bandwidth_gbps(int threads) {
  ThreadPool pool(threads);
  const int64_t bytes = (std::max(kMinBufferBytes, 2 * last_level_cache_bytes()) + kChunkGrain - 1) /
                        kChunkGrain * kChunkGrain;
  Tensor source = Tensor::empty({bytes / 4}, DType::F32);
  Tensor target = Tensor::empty({bytes / 4}, DType::F32);
  auto* from = static_cast<char*>(source.raw());
  auto* to = static_cast<char*>(target.raw());
  // One contiguous share per thread, as STREAM does: memcpy picks its store strategy by size
  // (glibc switches to non-temporal stores above a fraction of the L3), so the share size is
  // part of what is measured and must not follow the pool's chunking.
  const int64_t share = (bytes / threads + kChunkGrain - 1) / kChunkGrain * kChunkGrain;
  auto copy_pass = [&] {
    pool.parallel_for(bytes, share, [&](int64_t begin, int64_t end) {
      std::memcpy(to + begin, from + begin, static_cast<size_t>(end - begin));
    });
  };
  // Fault every page in (from each thread's own chunk) before timing.
  pool.parallel_for(bytes, share, [&](int64_t begin, int64_t end) {
    std::memset(from + begin, 1, static_cast<size_t>(end - begin));
    std::memset(to + begin, 0, static_cast<size_t>(end - begin));
  });
  const int64_t passes = std::max<int64_t>(1, (kMinTrafficBytes + 2 * bytes - 1) / (2 * bytes));
  double best_seconds = 0;
  for (int run = 0; run < kTimedRuns; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t pass = 0; pass < passes; ++pass) copy_pass();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (run == 0 || seconds < best_seconds) best_seconds = seconds;
  }
  return static_cast<double>(2 * bytes * passes) / best_seconds / 1e9;
}

}  // namespace kiln::cpu
