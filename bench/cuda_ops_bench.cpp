// kiln_cuda_bench: the CUDA backend's performance-critical ops against the device's ceilings.
//
//   decode matmul (bf16 and f32 weights, m = 1/8/16, and the q/k/v and gate/up groups): weight
//     bytes per second over the measured device-to-device copy bandwidth (the decode roofline),
//     timed inside a captured CUDA graph as decode steps run them. Each shape cycles through
//     enough weight copies to exceed the 60 MB L2, so the figure is HBM bandwidth, not cache.
//   prefill matmul (bf16, m = 512/4096): TFLOP/s.
//   quantized matmul (4-bit and 8-bit group 64, FP8 blocks, against bf16; Llama-3.1-8B shapes):
//     decode bytes per second over the copy bandwidth, and the 512-row prefill's time; and the
//     fused decode kernel in each of its launch shapes (quantized-shapes).
//   attention: decode (1 token per sequence, split-KV) in KV bytes per second; prefill TFLOP/s.
//   cuBLAS (loaded at run time when libcublas.so.13 is there): whether a row of x·wᵀ keeps its
//     bits as the row count changes — the invariance contract kiln's own GEMMs keep — and its
//     TFLOP/s at the prefill shapes, the measured tensor-core peak the prefill target refers to.
//   delta rule (Qwen3.5-9B's GDN heads): a prefill (chunked form) and a decode step; µs per call.
//
// Other times are host wall clock over many back-to-back launches between two synchronize() calls
// (launches are queued asynchronously, so the device never waits on the host for these sizes).
// Prints one table; figures go to docs/perf.md with the date, device and commit.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.h"
#include "backend/cuda/kernels.h"
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

// Seconds per call of `body` inside a captured CUDA graph (how decode steps run them): `calls`
// calls are recorded once, then the graph is replayed; the median of five timed replays.
template <typename Body>
double seconds_per_captured_call(Backend& backend, int calls, Body&& body) {
  GraphOps* graphs = backend.graph_ops();
  if (!graphs) fail("kiln_cuda_bench: the backend cannot capture graphs");
  std::unique_ptr<CapturedWork> work = graphs->capture([&] {
    for (int i = 0; i < calls; ++i) body(i);
  });
  return seconds_per_call(backend, 1, [&](int) { work->replay(); }) / calls;
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
      {"up 14336x4096", 4, 14336, 4096},     {"up 14336x4096", 5, 14336, 4096},  {"up 14336x4096", 8, 14336, 4096},
      {"up 14336x4096", 16, 14336, 4096},    {"q/o 4096x4096", 5, 4096, 4096},   {"down 4096x14336", 5, 4096, 14336},
      {"lm 128256x4096", 5, 128256, 4096},   {"small 2048x2048", 1, 2048, 2048}};
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
    const double seconds =
        seconds_per_captured_call(*cuda, 100, [&](int i) { cuda->matmul(x, weights[i % copies], nullptr, out); });
    const double gbps = weight_bytes / seconds / 1e9;
    std::printf("decode matmul %-5s %-16s m=%-3lld %9.1f us %8.1f GB/s %6.1f %% of copy (in a graph)\n",
                std::string(dtype_name(act)).c_str(), shape.what, static_cast<long long>(shape.m), seconds * 1e6, gbps,
                100 * gbps / copy_gbps);
  }
  if (act != DType::BF16) return;
  // Groups: the products a layer takes from one input (Llama-3-8B q/k/v and gate/up).
  struct Group {
    const char* what;
    std::vector<int64_t> widths;
  };
  for (const Group& group : {Group{"q/k/v group", {4096, 1024, 1024}}, Group{"gate/up group", {14336, 14336}}}) {
    const int64_t k = 4096;
    size_t group_bytes = 0;
    for (int64_t n : group.widths) group_bytes += static_cast<size_t>(n * k) * dtype_size(act);
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / group_bytes + 1));
    std::vector<std::vector<Weight>> weights(copies);
    std::vector<Tensor> outs;
    for (int i = 0; i < copies; ++i)
      for (int64_t n : group.widths) weights[i].push_back(cuda->upload(random_host({n, k}, act, random, 0.02f)));
    for (int64_t n : group.widths) outs.push_back(cuda->alloc({1, n}, act));
    Tensor x = cuda->upload(random_host({1, k}, act, random, 1.0f));
    const double seconds = seconds_per_captured_call(*cuda, 100, [&](int i) {
      std::vector<MatmulTarget> targets;
      for (size_t t = 0; t < outs.size(); ++t) targets.push_back({&weights[i % copies][t], nullptr, &outs[t]});
      cuda->matmul_group(x, targets);
    });
    const double gbps = group_bytes / seconds / 1e9;
    std::printf("decode matmul BF16  %-16s m=1   %9.1f us %8.1f GB/s %6.1f %% of copy (in a graph)\n", group.what,
                seconds * 1e6, gbps, 100 * gbps / copy_gbps);
  }
}

void bench_prefill_matmul() {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(2);
  // m = 64 (batch-64 decode) streams its weights: its figure is also given as weight bytes per second.
  for (const MatmulShape& shape : std::vector<MatmulShape>{{"4096x4096", 64, 4096, 4096},
                                                           {"14336x4096", 64, 14336, 4096},
                                                           {"4096x14336", 64, 4096, 14336},
                                                           {"4096x4096", 512, 4096, 4096},
                                                           {"4096x4096", 4096, 4096, 4096},
                                                           {"14336x4096", 4096, 14336, 4096},
                                                           {"4096x14336", 4096, 4096, 14336}}) {
    Tensor w = cuda->upload(random_host({shape.n, shape.k}, DType::BF16, random, 0.02f));
    Tensor x = cuda->upload(random_host({shape.m, shape.k}, DType::BF16, random, 1.0f));
    Tensor out = cuda->alloc({shape.m, shape.n}, DType::BF16);
    const double seconds = seconds_per_call(*cuda, 20, [&](int) { cuda->matmul(x, w, nullptr, out); });
    const double tflops = 2.0 * shape.m * shape.n * shape.k / seconds / 1e12;
    const double weight_gbps = 2.0 * shape.n * shape.k / seconds / 1e9;
    std::printf("prefill matmul BF16 %-12s m=%-5lld %9.1f us %8.1f TFLOP/s %8.1f GB/s of weights\n", shape.what,
                static_cast<long long>(shape.m), seconds * 1e6, tflops, weight_gbps);
  }
}

// cuBLAS's bf16 GEMM (f32 accumulate, CUBLAS_GEMM_DEFAULT), as a user calling it gets it. The
// library is opened at run time so that the bench runs where it is missing.
void bench_cublas() {
  void* library = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    std::printf("cublas: not loaded (%s): section skipped\n", dlerror());
    return;
  }
  using Create = cublasStatus_t (*)(cublasHandle_t*);
  using Destroy = cublasStatus_t (*)(cublasHandle_t);
  using SetStream = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  auto create = reinterpret_cast<Create>(dlsym(library, "cublasCreate_v2"));
  auto destroy = reinterpret_cast<Destroy>(dlsym(library, "cublasDestroy_v2"));
  auto set_stream = reinterpret_cast<SetStream>(dlsym(library, "cublasSetStream_v2"));
  auto gemm = reinterpret_cast<GemmEx>(dlsym(library, "cublasGemmEx"));
  if (!create || !destroy || !set_stream || !gemm) fail("cublas: a symbol is missing from libcublas.so.13");
  cublasHandle_t handle = nullptr;
  if (create(&handle) != CUBLAS_STATUS_SUCCESS) fail("cublasCreate failed");
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) fail("cudaStreamCreate failed");
  set_stream(handle, stream);
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(7);
  const float one = 1.0f, zero = 0.0f;
  // out [m, n] (f32, row-major) = x [m, k] · w [n, k]ᵀ, i.e. column-major outᵀ = w · xᵀ.
  auto multiply = [&](const Tensor& x, const Tensor& w, Tensor& out, int64_t m) {
    const int n = static_cast<int>(w.dim(0)), k = static_cast<int>(w.dim(1));
    if (gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, static_cast<int>(m), k, &one, w.raw(), CUDA_R_16BF, k, x.raw(),
             CUDA_R_16BF, k, &zero, out.raw(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
        CUBLAS_STATUS_SUCCESS)
      fail("cublasGemmEx failed at m={}", m);
  };
  // Row 0 of x·wᵀ for growing m, against m = 1: the elements whose bits differ.
  {
    const int64_t n = 4096, k = 4096, max_m = 4096;
    Tensor w = cuda->upload(random_host({n, k}, DType::BF16, random, 0.02f));
    Tensor x = cuda->upload(random_host({max_m, k}, DType::BF16, random, 1.0f));
    Tensor out = cuda->alloc({max_m, n}, DType::F32);
    Tensor reference;
    std::printf("cublas row 0 of x·wᵀ (4096×4096) against m=1, differing elements of 4096:");
    for (int64_t m : {1, 2, 8, 16, 17, 64, 128, 512, 4096}) {
      multiply(x, w, out, m);
      if (cudaStreamSynchronize(stream) != cudaSuccess) fail("cublas: the GEMM failed");
      Tensor row = cuda->download(out).slice_rows(0, 1);
      if (m == 1) reference = row;
      int differing = 0;
      for (int64_t i = 0; i < n; ++i)
        differing += std::memcmp(row.data<float>() + i, reference.data<float>() + i, sizeof(float)) != 0;
      std::printf(" m=%lld: %d", static_cast<long long>(m), differing);
    }
    std::printf("\n");
  }
  for (const MatmulShape& shape : std::vector<MatmulShape>{{"4096x4096", 4096, 4096, 4096},
                                                           {"14336x4096", 4096, 14336, 4096},
                                                           {"4096x14336", 4096, 4096, 14336}}) {
    Tensor w = cuda->upload(random_host({shape.n, shape.k}, DType::BF16, random, 0.02f));
    Tensor x = cuda->upload(random_host({shape.m, shape.k}, DType::BF16, random, 1.0f));
    Tensor out = cuda->alloc({shape.m, shape.n}, DType::F32);
    for (int i = 0; i < 3; ++i) multiply(x, w, out, shape.m);
    cudaStreamSynchronize(stream);
    constexpr int kCalls = 20;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) multiply(x, w, out, shape.m);
    if (cudaStreamSynchronize(stream) != cudaSuccess) fail("cublas: the GEMM failed");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kCalls;
    std::printf("cublas matmul BF16 %-12s m=%-5lld %9.1f us %8.1f TFLOP/s\n", shape.what,
                static_cast<long long>(shape.m), seconds * 1e6, 2.0 * shape.m * shape.n * shape.k / seconds / 1e12);
  }
  destroy(handle);
  cudaStreamDestroy(stream);
}

// One layer's paged KV cache of `slots` sequences of `capacity` positions, each slot in its own
// blocks in order (the layout Model::make_cache starts with), zeroed.
struct BenchKvCache {
  Tensor keys, values, block_table;

  BenchKvCache(Backend& backend, int64_t slots, int64_t capacity, int64_t kv_heads, int64_t head_dim) {
    const int64_t width = kv_table_width(capacity);
    keys = backend.alloc({slots * width, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype());
    values = backend.alloc({slots * width, kKvBlockTokens, kv_heads, head_dim}, backend.activation_dtype());
    backend.zero(keys);
    backend.zero(values);
    Tensor table = Tensor::empty({slots, width}, DType::I32);
    for (int64_t entry = 0; entry < slots * width; ++entry) table.data<int32_t>()[entry] = static_cast<int32_t>(entry);
    block_table = backend.upload(table);
  }
  KvCacheView view() { return {keys, values, block_table}; }
};

void bench_attention(DType act, double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, act);
  std::mt19937 random(3);
  const int64_t heads = 32, kv_heads = 8, head_dim = 128;
  // F32 attention is one warp per (token, head), sequential over keys: two small points suffice.
  const std::vector<int64_t> contexts = act == DType::BF16 ? std::vector<int64_t>{1024, 4096, 16384} : std::vector<int64_t>{1024, 4096};
  const std::vector<int64_t> batches = act == DType::BF16 ? std::vector<int64_t>{1, 8} : std::vector<int64_t>{1};
  for (int64_t context : contexts) {
    for (int64_t batch : batches) {
      BenchKvCache cache(*cuda, batch, context, kv_heads, head_dim);
      std::vector<SequenceSpan> spans;
      for (int32_t slot = 0; slot < batch; ++slot)
        spans.push_back({slot, slot, 1, static_cast<int32_t>(context - 1)});
      const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(batch, 0));
      Tensor q = cuda->upload(random_host({batch, heads, head_dim}, act, random, 1.0f));
      Tensor out = cuda->alloc({batch, heads, head_dim}, act);
      const double seconds = seconds_per_call(*cuda, act == DType::BF16 ? 100 : 10, [&](int) {
        cuda->attention(q, cache.view(), layout, 0.088f, out);
      });
      const double bytes = 2.0 * batch * context * kv_heads * head_dim * dtype_size(act);
      const double gbps = bytes / seconds / 1e9;
      std::printf("decode attention %-5s ctx=%-6lld batch=%-2lld %9.1f us %8.1f GB/s %6.1f %% of copy\n",
                  std::string(dtype_name(act)).c_str(), static_cast<long long>(context),
                  static_cast<long long>(batch), seconds * 1e6, gbps, 100 * gbps / copy_gbps);
    }
  }
  if (act != DType::BF16) return;
  for (int64_t tokens : {1024, 4096, 8192}) {
    BenchKvCache cache(*cuda, 1, tokens, kv_heads, head_dim);
    Tensor k = cuda->upload(random_host({tokens, kv_heads, head_dim}, act, random, 1.0f));
    Tensor v = cuda->upload(random_host({tokens, kv_heads, head_dim}, act, random, 1.0f));
    const BatchLayout layout = cuda->make_layout({{0, 0, static_cast<int32_t>(tokens), 0}}, std::vector<int32_t>(tokens, 0));
    cuda->kv_write(k, v, layout, cache.view());
    Tensor q = cuda->upload(random_host({tokens, heads, head_dim}, act, random, 1.0f));
    Tensor out = cuda->alloc({tokens, heads, head_dim}, act);
    const double seconds = seconds_per_call(*cuda, 10, [&](int) {
      cuda->attention(q, cache.view(), layout, 0.088f, out);
    });
    // Causal: about half of the T² score and P·V products (2 · 2 · T²/2 · heads · head_dim FLOPs).
    const double tflops = 2.0 * tokens * tokens * heads * head_dim / seconds / 1e12;
    std::printf("prefill attention BF16 tokens=%-5lld %9.1f us %8.1f TFLOP/s\n", static_cast<long long>(tokens),
                seconds * 1e6, tflops);
  }
}

// Seconds per launch of `launch(i)` (a kernel launch on `stream`, i = 0, 1, …), 60 of them captured
// in one graph and the graph replayed 20 times: launch shapes timed as decode steps run them.
template <typename Launch>
double seconds_per_graph_launch(cudaStream_t stream, Launch&& launch) {
  constexpr int kCalls = 60, kReplays = 20;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < kCalls; ++i) launch(i);
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
    fail("capturing a launch shape failed");
  cudaGraphLaunch(exec, stream);
  cudaStreamSynchronize(stream);
  const auto start = std::chrono::steady_clock::now();
  for (int replay = 0; replay < kReplays; ++replay) cudaGraphLaunch(exec, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) fail("a launch shape failed");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / (kCalls * kReplays);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return seconds;
}

// Every decode launch shape (kernels.h) on the products of a Llama-3-8B and a Llama-3.2-1B layer at
// m = 1, each timed in a captured graph: the data behind launch_matmul_bf16's choice of shape.
void bench_decode_shapes(double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(5);
  struct Products {
    const char* what;
    int64_t k;
    std::vector<int64_t> widths;
  };
  const std::vector<Products> all = {
      {"8B q/k/v", 4096, {4096, 1024, 1024}}, {"8B o", 4096, {4096}},     {"8B gate/up", 4096, {14336, 14336}},
      {"8B down", 14336, {4096}},             {"1B q/k/v", 2048, {2048, 512, 512}}, {"1B o", 2048, {2048}},
      {"1B gate/up", 2048, {8192, 8192}},     {"1B down", 8192, {2048}}};
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) fail("cudaStreamCreate failed");
  for (const Products& products : all) {
    size_t bytes = 0;
    for (int64_t n : products.widths) bytes += static_cast<size_t>(n * products.k) * 2;
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / bytes + 1));
    std::vector<Tensor> keep;
    Tensor x = cuda->upload(random_host({1, products.k}, DType::BF16, random, 1.0f));
    std::vector<std::vector<cuda::MatmulArgs>> calls(copies);
    for (int i = 0; i < copies; ++i)
      for (int64_t n : products.widths) {
        keep.push_back(cuda->upload(random_host({n, products.k}, DType::BF16, random, 0.02f)));
        keep.push_back(cuda->alloc({1, n}, DType::BF16));
        cuda::MatmulArgs args;
        args.x = x.raw();
        args.w = keep[keep.size() - 2].raw();
        args.out = keep.back().raw();
        args.m = 1, args.n = n, args.k = products.k;
        args.x_dtype = args.w_dtype = args.out_dtype = DType::BF16;
        calls[i].push_back(args);
      }
    cuda->synchronize();
    std::printf("decode shapes %-11s", products.what);
    for (int shape = 0; shape < cuda::decode_launch_shape_count(); ++shape) {
      const double seconds = seconds_per_graph_launch(stream, [&](int i) {
        cuda::launch_matmul_bf16_decode(calls[i % copies].data(), static_cast<int>(products.widths.size()), shape,
                                        stream);
      });
      const cuda::DecodeLaunchShape launch = cuda::decode_launch_shape(shape);
      std::printf("  %dx%dx%d %5.1fus %4.1f%%", launch.columns, launch.warps, launch.stages, seconds * 1e6,
                  100 * bytes / seconds / 1e9 / copy_gbps);
    }
    std::printf("\n");
  }
  cudaStreamDestroy(stream);
}

// The small ops of a Llama-3-8B decode step at batch 1 (and a context of 512 for attention), each
// timed in a captured graph: what a layer spends between its matmuls.
void bench_decode_ops() {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(6);
  const int64_t hidden = 4096, ffn = 14336, heads = 32, kv_heads = 8, head_dim = 128, context = 512;
  Tensor residual = cuda->upload(random_host({1, hidden}, DType::F32, random, 1.0f));
  Tensor delta = cuda->upload(random_host({1, hidden}, DType::F32, random, 1.0f));
  Tensor gain = cuda->upload(random_host({hidden}, DType::BF16, random, 1.0f));
  Tensor normed = cuda->alloc({1, hidden}, DType::BF16);
  Tensor gate = cuda->upload(random_host({1, ffn}, DType::BF16, random, 1.0f));
  Tensor up = cuda->upload(random_host({1, ffn}, DType::BF16, random, 1.0f));
  Tensor q = cuda->upload(random_host({1, heads, head_dim}, DType::BF16, random, 1.0f));
  Tensor k = cuda->upload(random_host({1, kv_heads, head_dim}, DType::BF16, random, 1.0f));
  Tensor v = cuda->upload(random_host({1, kv_heads, head_dim}, DType::BF16, random, 1.0f));
  BenchKvCache cache(*cuda, 1, context, kv_heads, head_dim);
  Tensor inv_freq = cuda->upload(random_host({head_dim / 2}, DType::F32, random, 0.5f));
  const BatchLayout layout = cuda->make_layout({{0, 0, 1, static_cast<int32_t>(context - 1)}}, {0});
  Tensor attended = cuda->alloc({1, heads, head_dim}, DType::BF16);
  auto report = [](const char* what, double seconds) { std::printf("decode op %-28s %7.2f us (in a graph)\n", what, seconds * 1e6); };
  report("add_rms_norm 4096 (f32 stream)", seconds_per_captured_call(*cuda, 100, [&](int) {
           cuda->add_rms_norm(residual, delta, gain, 1e-5f, NormStyle::Plain, normed);
         }));
  report("swiglu 14336", seconds_per_captured_call(*cuda, 100, [&](int) { cuda->swiglu(gate, up, gate); }));
  report("rope_kv_write 32/8 heads x 128", seconds_per_captured_call(*cuda, 100, [&](int) {
           cuda->rope_kv_write(q, k, v, layout, inv_freq, static_cast<int>(head_dim), nullptr, cache.view());
         }));
  Tensor head_gain = cuda->upload(random_host({head_dim}, DType::BF16, random, 1.0f));
  const HeadNorms head_norms{head_gain, head_gain, 1e-6f, NormStyle::Plain};
  report("q/k norms, rope_kv_write (3 ops)", seconds_per_captured_call(*cuda, 100, [&](int) {
           cuda->rms_norm(q, head_gain, 1e-6f, NormStyle::Plain, q);
           cuda->rms_norm(k, head_gain, 1e-6f, NormStyle::Plain, k);
           cuda->rope_kv_write(q, k, v, layout, inv_freq, static_cast<int>(head_dim), nullptr, cache.view());
         }));
  report("rope_kv_write with head norms", seconds_per_captured_call(*cuda, 100, [&](int) {
           cuda->rope_kv_write(q, k, v, layout, inv_freq, static_cast<int>(head_dim), &head_norms, cache.view());
         }));
  report("attention ctx 512", seconds_per_captured_call(*cuda, 100, [&](int) {
           cuda->attention(q, cache.view(), layout, 0.088f, attended);
         }));
}

// The gated delta rule at Qwen3.5-9B's GDN heads (16 key heads, 32 value heads, 128 × 128 state):
// one sequence's prefill from position 0 (whole aligned 64-token chunks in the chunked form), then
// a decode step of batch 1 and 8 in a graph (the recurrent kernel).
void bench_delta_rule() {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  HybridOps& hybrid = *cuda->hybrid_ops();
  std::mt19937 random(6);
  constexpr int64_t kKeyHeads = 16, kValueHeads = 32, kDim = 128;
  // One call's tensors: `tokens` rows over `sequences` state slots.
  auto run = [&](int64_t tokens, int64_t sequences, const std::vector<SequenceSpan>& spans, auto&& time) {
    Tensor q = cuda->upload(random_host({tokens, kKeyHeads, kDim}, DType::F32, random, 0.088f));
    Tensor k = cuda->upload(random_host({tokens, kKeyHeads, kDim}, DType::F32, random, 0.088f));
    Tensor v = cuda->upload(random_host({tokens, kValueHeads, kDim}, DType::F32, random, 1.0f));
    Tensor g = cuda->upload(random_host({tokens, kValueHeads}, DType::F32, random, 0.1f));
    Tensor beta = cuda->upload(random_host({tokens, kValueHeads}, DType::F32, random, 0.5f));
    Tensor state = cuda->alloc({sequences, kValueHeads, kDim, kDim}, DType::F32);
    Tensor out = cuda->alloc({tokens, kValueHeads, kDim}, DType::BF16);
    const BatchLayout layout = cuda->make_layout(spans, std::vector<int32_t>(static_cast<size_t>(tokens), 0));
    return time([&](int) { hybrid.gated_delta_rule(q, k, v, g, beta, layout, state, out); });
  };
  for (int32_t tokens : {512, 8192}) {
    const double seconds = run(tokens, 1, {{0, 0, tokens, 0}}, [&](auto&& body) {
      return seconds_per_call(*cuda, 5, body);
    });
    std::printf("delta rule prefill %5d tokens: %9.1f us\n", tokens, seconds * 1e6);
  }
  for (int32_t batch : {1, 8}) {
    std::vector<SequenceSpan> spans;
    for (int32_t i = 0; i < batch; ++i) spans.push_back({i, i, 1, 100});
    const double seconds = run(batch, batch, spans, [&](auto&& body) {
      return seconds_per_captured_call(*cuda, 100, body);
    });
    std::printf("delta rule decode batch %d: %.2f us (in a graph)\n", batch, seconds * 1e6);
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

// A random host weight [n, k] in `format` ("bf16", "4-bit g64", "8-bit g64", "fp8"): random codes
// (all a bandwidth figure needs), bf16 scales and biases, FP8 with F32 scale_inv in 128x128 blocks.
Weight random_weight(const std::string& format, int64_t n, int64_t k, std::mt19937& random) {
  if (format == "bf16") return Weight(random_host({n, k}, DType::BF16, random, 0.02f));
  if (format == "fp8") {
    Tensor values = Tensor::empty({n, k}, DType::F8E4M3);
    for (int64_t i = 0; i < values.numel(); ++i) values.data<uint8_t>()[i] = static_cast<uint8_t>(random() % 0x7f);
    return Weight::fp8_block(values, random_host({(n + 127) / 128, (k + 127) / 128}, DType::F32, random, 1e-3f), 128, 128);
  }
  const int bits = format == "4-bit g64" ? 4 : 8;
  Tensor codes = Tensor::empty({n, k * bits / 32}, DType::U32);
  for (int64_t i = 0; i < codes.numel(); ++i) codes.data<uint32_t>()[i] = static_cast<uint32_t>(random());
  return Weight::affine(codes, random_host({n, k / 64}, DType::BF16, random, 1e-3f),
                        random_host({n, k / 64}, DType::BF16, random, 0.02f), bits, 64);
}

// Quantized matmuls on the Llama-3.1-8B shapes against bf16: the decode product (m = 1, in a
// captured graph) in bytes of every part of the weight per second over the copy bandwidth, and
// the 512-row prefill product (the quantized ones decode into scratch first) against bf16's time.
void bench_quantized_matmul(double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(4);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{4096, 4096}, {14336, 4096}, {4096, 14336}, {128256, 4096}};
  for (const auto& [n, k] : shapes) {
    double bf16_prefill_seconds = 0;
    for (const std::string format : {"bf16", "4-bit g64", "8-bit g64", "fp8"}) {
      const Weight host = random_weight(format, n, k, random);
      const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / host.nbytes() + 1));
      std::vector<Weight> weights;
      for (int i = 0; i < copies; ++i) weights.push_back(cuda->upload_weight(host));
      for (int64_t m : {int64_t{1}, int64_t{512}}) {
        Tensor x = cuda->upload(random_host({m, k}, DType::BF16, random, 1.0f));
        Tensor out = cuda->alloc({m, n}, DType::BF16);
        auto call = [&](int i) { cuda->matmul(x, weights[i % copies], nullptr, out); };
        if (m == 1) {
          const double seconds = seconds_per_captured_call(*cuda, 100, call);
          const double gbps = static_cast<double>(host.nbytes()) / seconds / 1e9;
          std::printf("quantized decode  m=1   %6lld x %5lld %-10s %9.1f us %7.0f GB/s  %5.1f %% of copy\n",
                      static_cast<long long>(n), static_cast<long long>(k), format.c_str(), seconds * 1e6, gbps,
                      100.0 * gbps / copy_gbps);
        } else {
          const double seconds = seconds_per_call(*cuda, 5, call);
          if (format == "bf16") bf16_prefill_seconds = seconds;
          std::printf("quantized prefill m=512 %6lld x %5lld %-10s %9.1f us %7.1f TFLOP/s  bf16's time / this %.2f\n",
                      static_cast<long long>(n), static_cast<long long>(k), format.c_str(), seconds * 1e6,
                      2.0 * m * n * k / seconds / 1e12, bf16_prefill_seconds / seconds);
        }
      }
    }
  }
}

// The fused quantized decode product (m = 1) in each launch shape, on the Llama-3.1-8B products,
// each timed in a captured graph: bytes of every part of the weight per second over the copy
// bandwidth (the shape `default` names is the one launch_matmul_quantized_decode picks).
void bench_quantized_decode_shapes(double copy_gbps) {
  std::unique_ptr<Backend> cuda = make_cuda_backend(0, DType::BF16);
  std::mt19937 random(6);
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess) fail("cudaGetDeviceProperties failed");
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) fail("cudaStreamCreate failed");
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1024, 4096}, {4096, 4096}, {14336, 4096}, {4096, 14336},
                                                           {128256, 4096}};
  for (const std::string format : {"4-bit g64", "8-bit g64", "fp8"}) {
    for (const auto& [n, k] : shapes) {
      const Weight host = random_weight(format, n, k, random);
      const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / host.nbytes() + 1));
      std::vector<Weight> weights;
      for (int i = 0; i < copies; ++i) weights.push_back(cuda->upload_weight(host));
      Tensor x = cuda->upload(random_host({1, k}, DType::BF16, random, 1.0f));
      Tensor out = cuda->alloc({1, n}, DType::BF16);
      cuda->synchronize();
      cuda::MatmulArgs args;
      args.x = x.raw();
      args.out = out.raw();
      args.m = 1, args.n = n, args.k = k;
      args.x_dtype = args.out_dtype = DType::BF16;
      args.multiprocessors = properties.multiProcessorCount;
      std::printf("quantized decode shapes %-10s %6lld x %5lld", format.c_str(), static_cast<long long>(n),
                  static_cast<long long>(k));
      for (int shape = -1; shape < cuda::quantized_decode_launch_shape_count(); ++shape) {
        const double seconds = seconds_per_graph_launch(stream, [&](int i) {
          cuda::launch_matmul_quantized_decode(args, quantized_weight_args(weights[i % copies]), stream, shape);
        });
        const double percent = 100.0 * static_cast<double>(host.nbytes()) / seconds / 1e9 / copy_gbps;
        if (shape < 0) {
          std::printf("  default %6.1fus %5.1f%%", seconds * 1e6, percent);
        } else {
          const cuda::QuantizedDecodeLaunchShape launch = cuda::quantized_decode_launch_shape(shape);
          std::printf("  %dx%d %6.1fus %5.1f%%", launch.rows, launch.warps, seconds * 1e6, percent);
        }
      }
      std::printf("\n");
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kiln

// Sections to run: any of launch, decode, decode-shapes, quantized, quantized-shapes, decode-ops,
// prefill, cublas, attention, delta-rule (default: all).
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
    if (wanted("decode-shapes")) bench_decode_shapes(copy_gbps);
    if (wanted("quantized")) bench_quantized_matmul(copy_gbps);
    if (wanted("quantized-shapes")) bench_quantized_decode_shapes(copy_gbps);
    if (wanted("decode-ops")) bench_decode_ops();
    if (wanted("prefill")) bench_prefill_matmul();
    if (wanted("cublas")) bench_cublas();
    if (wanted("attention")) {
      bench_attention(DType::BF16, copy_gbps);
      bench_attention(DType::F32, copy_gbps);
    }
    if (wanted("delta-rule")) bench_delta_rule();
  } catch (const Error& error) {
    std::fprintf(stderr, "kiln_cuda_bench: %s\n", error.what());
    return 1;
  }
  return 0;
}
