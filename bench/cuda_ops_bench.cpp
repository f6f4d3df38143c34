// kiln_cuda_bench: the CUDA backend's performance-critical ops against the device's ceilings.
//
//   decode matmul (bf16 and f32 weights, m = 1/8/16): weight bytes per second over the measured
//     device-to-device copy bandwidth (the decode roofline). Each shape cycles through enough
//     weight copies to exceed the 60 MB L2, so the figure is HBM bandwidth, not cache.
//   prefill matmul (bf16, m = 512/4096): TFLOP/s.
//   attention: decode (1 token per sequence, split-KV) in KV bytes per second; prefill TFLOP/s.
//
// Times are host wall clock over many back-to-back launches between two synchronize() calls
// (launches are queued asynchronously, so the device never waits on the host for these sizes).
// Prints one table; figures go to docs/perf.md with the date, device and commit.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace kiln {
namespace {

// Values uniform in [-scale, scale) from a xorshift stream: timing needs non-zero data (zeros
// run faster on tensor cores), not a good distribution, and gigabytes of it must be quick to make.
Tensor random_host(const Shape& shape, DType dtype, std::mt19937& random, float scale) {
  Tensor tensor = Tensor::empty(shape, dtype);
  uint64_t state = random() | 1;
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float value = scale * (static_cast<float>(state >> 40) / 8388608.0f - 1.0f);
    if (dtype == DType::BF16)
      tensor.data<uint16_t>()[i] = f32_to_bf16(value);
    else
      tensor.data<float>()[i] = value;
  }
  return tensor;
}

// Seconds per call of `body`, the median of `repeats` timed batches of `calls` calls.
template <typename Body>
double seconds_per_call(Backend& backend, int calls, Body&& body) {
  constexpr int kRepeats = 5;
  for (int i = 0; i < 3; ++i) body(i);
  backend.synchronize();
  std::vector<double> samples;
  for (int repeat = 0; repeat < kRepeats; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) body(i);
    backend.synchronize();
    samples.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

struct MatmulShape {
  const char* what;
  int64_t m, n, k;
};

void bench_decode_matmul(DType act, double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(1);
  const std::vector<MatmulShape> all_shapes = {
      {"q/o 4096x4096", 1, 4096, 4096},      {"kv 1024x4096", 1, 1024, 4096},  {"up 14336x4096", 1, 14336, 4096},
      {"down 4096x14336", 1, 4096, 14336},   {"lm 128256x4096", 1, 128256, 4096},
      {"up 14336x4096", 8, 14336, 4096},     {"up 14336x4096", 16, 14336, 4096}, {"small 2048x2048", 1, 2048, 2048}};
  // F32 is the exactness path; three shapes show its bandwidth.
  const std::vector<MatmulShape> shapes =
      act == DType::BF16 ? all_shapes : std::vector<MatmulShape>(all_shapes.begin(), all_shapes.begin() + 3);
  for (const MatmulShape& shape : shapes) {
    const size_t weight_bytes = static_cast<size_t>(shape.n * shape.k) * dtype_size(act);
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / weight_bytes + 1));
    std::vector<Tensor> weights;
    for (int i = 0; i < copies; ++i)
      weights.push_back(cuda->upload(random_host({shape.n, shape.k}, act, random, 0.02f)));
    Tensor x = cuda->upload(random_host({shape.m, shape.k}, act, random, 1.0f));
    Tensor out = cuda->alloc({shape.m, shape.n}, act);
    const double seconds = seconds_per_call(*cuda, 200, [&](int i) { cuda->matmul(x, weights[i % copies], nullptr, out); });
    const double gbps = weight_bytes / seconds / 1e9;
    std::printf("decode matmul %-5s %-16s m=%-3lld %9.1f us %8.1f GB/s %6.1f %% of copy\n", std::string(dtype_name(act)).c_str(),
                shape.what, static_cast<long long>(shape.m), seconds * 1e6, gbps, 100 * gbps / copy_gbps);
  }
}

void bench_prefill_matmul() {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(2);
  for (const MatmulShape& shape : std::vector<MatmulShape>{{"4096x4096", 512, 4096, 4096},
                                                           {"4096x4096", 4096, 4096, 4096},
                                                           {"14336x4096", 4096, 14336, 4096},
                                                           {"4096x14336", 4096, 4096, 14336}}) {
    Tensor w = cuda->upload(random_host({shape.n, shape.k}, DType::BF16, random, 0.02f));
    Tensor x = cuda->upload(random_host({shape.m, shape.k}, DType::BF16, random, 1.0f));
    Tensor out = cuda->alloc({shape.m, shape.n}, DType::BF16);
    const double seconds = seconds_per_call(*cuda, 20, [&](int) { cuda->matmul(x, w, nullptr, out); });
    const double tflops = 2.0 * shape.m * shape.n * shape.k / seconds / 1e12;
    std::printf("prefill matmul BF16 %-12s m=%-5lld %9.1f us %8.1f TFLOP/s\n", shape.what,
                static_cast<long long>(shape.m), seconds * 1e6, tflops);
  }
}

void bench_attention(DType act, double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(3);
  const int64_t heads = 32, kv_heads = 8, head_dim = 128;
  // F32 attention is one warp per (token, head), sequential over keys: two small points suffice.
  const std::vector<int64_t> contexts = act == DType::BF16 ? std::vector<int64_t>{1024, 4096, 16384} : std::vector<int64_t>{1024, 4096};
  const std::vector<int64_t> batches = act == DType::BF16 ? std::vector<int64_t>{1, 8} : std::vector<int64_t>{1};
  for (int64_t context : contexts) {
    for (int64_t batch : batches) {
      Tensor k_cache = cuda->alloc({batch, context, kv_heads, head_dim}, act);
      Tensor v_cache = cuda->alloc({batch, context, kv_heads, head_dim}, act);
      cuda->zero(k_cache);
      cuda->zero(v_cache);
      std::vector<SequenceSpan> spans;
      for (int32_t slot = 0; slot < batch; ++slot)
        spans.push_back({slot, slot, 1, static_cast<int32_t>(context - 1)});
      const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(batch, 0));
      Tensor q = cuda->upload(random_host({batch, heads, head_dim}, act, random, 1.0f));
      Tensor out = cuda->alloc({batch, heads, head_dim}, act);
      const double seconds = seconds_per_call(*cuda, act == DType::BF16 ? 100 : 10, [&](int) {
        cuda->attention(q, k_cache, v_cache, layout, 0.088f, out);
      });
      const double bytes = 2.0 * batch * context * kv_heads * head_dim * dtype_size(act);
      const double gbps = bytes / seconds / 1e9;
      std::printf("decode attention %-5s ctx=%-6lld batch=%-2lld %9.1f us %8.1f GB/s %6.1f %% of copy\n",
                  std::string(dtype_name(act)).c_str(), static_cast<long long>(context),
                  static_cast<long long>(batch), seconds * 1e6, gbps, 100 * gbps / copy_gbps);
    }
  }
  if (act != DType::BF16) return;
  for (int64_t tokens : {1024, 4096}) {
    Tensor k_cache = cuda->alloc({1, tokens, kv_heads, head_dim}, act);
    Tensor v_cache = cuda->alloc({1, tokens, kv_heads, head_dim}, act);
    Tensor k = cuda->upload(random_host({tokens, kv_heads, head_dim}, act, random, 1.0f));
    Tensor v = cuda->upload(random_host({tokens, kv_heads, head_dim}, act, random, 1.0f));
    const BatchLayout layout = cuda->make_layout({{0, 0, static_cast<int32_t>(tokens), 0}}, std::vector<int32_t>(tokens, 0));
    cuda->kv_write(k, v, layout, k_cache, v_cache);
    Tensor q = cuda->upload(random_host({tokens, heads, head_dim}, act, random, 1.0f));
    Tensor out = cuda->alloc({tokens, heads, head_dim}, act);
    const double seconds = seconds_per_call(*cuda, 10, [&](int) {
      cuda->attention(q, k_cache, v_cache, layout, 0.088f, out);
    });
    // Causal: about half of the T² score and P·V products (2 · 2 · T²/2 · heads · head_dim FLOPs).
    const double tflops = 2.0 * tokens * tokens * heads * head_dim / seconds / 1e12;
    std::printf("prefill attention BF16 tokens=%-5lld %9.1f us %8.1f TFLOP/s\n", static_cast<long long>(tokens),
                seconds * 1e6, tflops);
  }
}

// Host-side cost per op: ops too small for the device to matter, back to back. Decode steps of
// small models are bounded by this unless the launches are captured (CUDA graphs).
void bench_launch() {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(4);
  Tensor a = cuda->upload(random_host({1}, DType::BF16, random, 1.0f));
  Tensor b = cuda->upload(random_host({1}, DType::BF16, random, 1.0f));
  const double add = seconds_per_call(*cuda, 2000, [&](int) { cuda->add(a, b); });
  Tensor w = cuda->upload(random_host({16, 64}, DType::BF16, random, 1.0f));
  Tensor x = cuda->upload(random_host({1, 64}, DType::BF16, random, 1.0f));
  Tensor out = cuda->alloc({1, 16}, DType::BF16);
  const double matmul = seconds_per_call(*cuda, 2000, [&](int) { cuda->matmul(x, w, nullptr, out); });
  std::printf("per-op floor: add of 1 element %.2f us, matmul 1x16x64 %.2f us\n", add * 1e6, matmul * 1e6);
}

}  // namespace
}  // namespace kiln

// Sections to run: any of launch, decode, prefill, attention (default: all).
int main(int argc, char** argv) {
  using namespace kiln;
  try {
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "kiln_cuda_bench: no CUDA device visible\n");
      return 1;
    }
    auto wanted = [&](const char* section) {
      if (argc < 2) return true;
      for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == section) return true;
      return false;
    };
    const double copy_gbps = make_cuda_backend(0, DType::BF16)->measure_copy_bandwidth_gbps();
    std::printf("device-to-device copy %.1f GB/s (read + write)\n", copy_gbps);
    if (wanted("launch")) bench_launch();
    if (wanted("decode")) {
      bench_decode_matmul(DType::BF16, copy_gbps);
      bench_decode_matmul(DType::F32, copy_gbps);
    }
    if (wanted("prefill")) bench_prefill_matmul();
    if (wanted("attention")) {
      bench_attention(DType::BF16, copy_gbps);
      bench_attention(DType::F32, copy_gbps);
    }
  } catch (const Error& error) {
    std::fprintf(stderr, "kiln_cuda_bench: %s\n", error.what());
    return 1;
  }
  return 0;
}
