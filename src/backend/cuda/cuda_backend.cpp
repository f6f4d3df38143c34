// CudaBackend: memory, batch layouts, and the host side of every op — shape and dtype checks
// that fail with a kiln::Error naming the op and tensor, then one kernel launch on the backend's
// stream (kernels.h). This file is plain C++ (fmt cannot be compiled by nvcc); the kernels live
// in the .cu files, one per op group.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cuda/device_allocator.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"

namespace kiln {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  fail("CUDA {} failed: {}", what, cudaGetErrorString(status));
}

bool is_activation(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16; }
bool is_float(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

static_assert(kSamplingSettingsWords == cuda::kSamplingWords, "backend.h and kernels.h describe one settings row");

// An instantiated CUDA graph, replayed on the backend's stream. It holds the allocator, whose
// graph pool owns the scratch the graph's kernels address (device_allocator.h).
class CudaGraph final : public CapturedWork {
 public:
  CudaGraph(cudaGraphExec_t graph, cudaStream_t stream, int device, std::shared_ptr<cuda::DeviceAllocator> allocator)
      : graph_(graph), stream_(stream), device_(device), allocator_(std::move(allocator)) {}
  ~CudaGraph() override {
    cudaSetDevice(device_);
    cudaGraphExecDestroy(graph_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  void replay() override {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaGraphLaunch(graph_, stream_), "cudaGraphLaunch");
  }

 private:
  cudaGraphExec_t graph_;
  cudaStream_t stream_;
  int device_;
  std::shared_ptr<cuda::DeviceAllocator> allocator_;
};

class CudaBackend final : public Backend, public GraphOps, public HybridOps {
 public:
  CudaBackend(int device, DType activations) : device_(device), activations_(activations) {
    if (!is_activation(activations))
      fail("CUDA backend: activation dtype {} is not supported (F32 or BF16)", dtype_name(activations));
    const int count = cuda_device_count();
    if (device < 0 || device >= count)
      fail("CUDA device {} does not exist ({} CUDA device{} visible)", device, count, count == 1 ? "" : "s");
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp properties{};
    check_cuda(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
    if (properties.major != 9 || properties.minor != 0)
      fail("CUDA device {} ({}) has compute capability {}.{}; kiln's kernels are built for sm_90a (Hopper, 9.0)",
           device, properties.name, properties.major, properties.minor);
    device_name_ = properties.name;
    multiprocessors_ = properties.multiProcessorCount;
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    allocator_ = std::make_shared<cuda::DeviceAllocator>(device);
    errors_owner_ = allocator_->allocate(sizeof(cuda::DeviceErrorRecord));
    errors_ = static_cast<cuda::DeviceErrorRecord*>(errors_owner_.get());
    check_cuda(cudaMemsetAsync(errors_, 0, sizeof(cuda::DeviceErrorRecord), stream_), "cudaMemsetAsync");
    // One record for synchronize_and_check, then one per pending download.
    check_cuda(cudaMallocHost(reinterpret_cast<void**>(&host_errors_),
                              (1 + kMaxPendingDownloads) * sizeof(cuda::DeviceErrorRecord)),
               "cudaMallocHost (error records)");
    for (cudaEvent_t& event : download_events_)
      check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate (download_later)");
    check_cuda(cudaMallocHost(&staging_, kStagingBytes), "cudaMallocHost (download staging)");
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaFreeHost(host_errors_);
    cudaFreeHost(staging_);
    for (cudaEvent_t event : download_events_) cudaEventDestroy(event);
  }

  GraphOps* graph_ops() override { return this; }
  HybridOps* hybrid_ops() override { return this; }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::CUDA; }
  DType activation_dtype() const override { return activations_; }

  double measure_copy_bandwidth_gbps() override {
    activate();
    // 1 GiB each way: far past the 60 MB L2, so the copy measures HBM.
    constexpr size_t kBytes = size_t{1} << 30;
    constexpr int kWarmup = 3, kTimed = 20;
    void* source = nullptr;
    void* destination = nullptr;
    check_cuda(cudaMalloc(&source, kBytes), "cudaMalloc (bandwidth probe)");
    if (cudaError_t status = cudaMalloc(&destination, kBytes); status != cudaSuccess) {
      cudaFree(source);
      check_cuda(status, "cudaMalloc (bandwidth probe)");
    }
    cudaEvent_t start = nullptr, stop = nullptr;
    std::vector<float> milliseconds;
    cudaError_t status = cudaEventCreate(&start);
    if (status == cudaSuccess) status = cudaEventCreate(&stop);
    if (status == cudaSuccess) status = cudaMemsetAsync(source, 0x5a, kBytes, stream_);
    for (int run = 0; run < kWarmup + kTimed && status == cudaSuccess; ++run) {
      status = cudaEventRecord(start, stream_);
      if (status == cudaSuccess) status = cudaMemcpyAsync(destination, source, kBytes, cudaMemcpyDeviceToDevice, stream_);
      if (status == cudaSuccess) status = cudaEventRecord(stop, stream_);
      if (status == cudaSuccess) status = cudaEventSynchronize(stop);
      float elapsed = 0;
      if (status == cudaSuccess) status = cudaEventElapsedTime(&elapsed, start, stop);
      if (status == cudaSuccess && run >= kWarmup) milliseconds.push_back(elapsed);
    }
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    cudaFree(source);
    cudaFree(destination);
    check_cuda(status, "device-to-device copy (bandwidth probe)");
    std::sort(milliseconds.begin(), milliseconds.end());
    const double median_seconds = milliseconds[milliseconds.size() / 2] / 1e3;
    return 2.0 * static_cast<double>(kBytes) / median_seconds / 1e9;
  }

  void synchronize() override {
    refuse_while_recording("synchronize");
    activate();
    synchronize_and_check("cudaStreamSynchronize");
  }

  // --- memory ---
  Tensor alloc(const Shape& shape, DType dtype) override {
    activate();
    for (int64_t extent : shape)
      if (extent < 0) fail("CUDA alloc: shape {} has a negative extent", shape_string(shape));
    const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
    std::shared_ptr<void> block = allocator_->allocate(bytes);
    void* data = block.get();
    return Tensor::borrow(data, shape, dtype, std::move(block), Device::CUDA);
  }

  // Free device memory counts the blocks the allocator caches: alloc hands them out again.
  DeviceMemory memory() override {
    activate();
    size_t free = 0, total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return {free + allocator_->cached_bytes(), total};
  }

  uint64_t allocation_bytes(uint64_t bytes) const override { return cuda::DeviceAllocator::rounded_size(bytes); }

  // For what no plan lists tensor by tensor: the lazily loaded kernel modules, the graphs'
  // executables and the split-K partials of the prefill GEMM. Not measured piece by piece; in
  // tests/cuda/memory_plan_test.cpp (eight sequences of a 4-layer llama-3.2-1b served on an H100)
  // the measured use, 1,307 MiB, stayed under the plan without it (1,452 MiB).
  uint64_t reserved_bytes() const override { return uint64_t{512} << 20; }

  uint64_t attention_scratch_bytes(int64_t tokens, int64_t heads, int64_t head_dim, int64_t capacity) const override {
    // The split partials exist for calls of few tokens only, and grow with the tokens of the call.
    cuda::AttentionArgs args;
    args.dtype = activations_;
    args.heads = heads;
    args.head_dim = head_dim;
    args.max_position = capacity - 1;
    args.tokens = std::min(tokens, cuda::kAttentionDecodeMaxTokens);
    const int64_t floats = args.tokens > 0 ? cuda::attention_partials_floats(args) : 0;
    return floats ? allocation_bytes(static_cast<uint64_t>(floats) * sizeof(float)) : 0;
  }

  Tensor upload(const Tensor& host) override {
    if (host.device() == Device::CUDA) return host;
    if (!host.defined()) fail("CUDA upload: the host tensor is undefined");
    refuse_while_recording("upload");
    Tensor device = alloc(host.shape(), host.dtype());
    // From pageable memory the copy is staged before cudaMemcpyAsync returns, so `host` may go
    // away immediately (CUDA runtime API, "API synchronization behavior").
    if (host.nbytes())
      check_cuda(cudaMemcpyAsync(device.raw(), host.raw(), host.nbytes(), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (upload)");
    return device;
  }

  Tensor download(const Tensor& tensor) override {
    require_device(tensor, "download", "tensor");
    refuse_while_recording("download");
    activate();
    Tensor host = Tensor::empty(tensor.shape(), tensor.dtype());
    // Small downloads (a decode step's token ids) go through pinned staging: the copy is then a
    // plain asynchronous DMA that the one synchronisation below waits for.
    const bool staged = tensor.nbytes() <= kStagingBytes;
    if (tensor.nbytes())
      check_cuda(cudaMemcpyAsync(staged ? staging_ : host.raw(), tensor.raw(), tensor.nbytes(), cudaMemcpyDeviceToHost,
                                 stream_),
                 "cudaMemcpyAsync (download)");
    synchronize_and_check("cudaStreamSynchronize (download)");
    if (staged && tensor.nbytes()) std::memcpy(host.raw(), staging_, tensor.nbytes());
    return host;
  }

  void zero(Tensor& tensor) override {
    require_device(tensor, "zero", "tensor");
    activate();
    if (tensor.nbytes()) check_cuda(cudaMemsetAsync(tensor.raw(), 0, tensor.nbytes(), stream_), "cudaMemsetAsync");
  }

  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override {
    int64_t total = 0;
    for (size_t index = 0; index < spans.size(); ++index) {
      const SequenceSpan& span = spans[index];
      if (span.tokens <= 0) fail("batch layout: span {} has {} tokens (must be positive)", index, span.tokens);
      if (span.first_token != total)
        fail("batch layout: span {} starts at token {} but the previous spans end at {} (spans must be contiguous "
             "and in order)", index, span.first_token, total);
      if (span.first_position < 0) fail("batch layout: span {} has negative first_position {}", index, span.first_position);
      if (span.slot < 0) fail("batch layout: span {} has negative slot {}", index, span.slot);
      total += span.tokens;
    }
    if (static_cast<int64_t>(token_ids.size()) != total)
      fail("batch layout: {} token ids for spans covering {} tokens", token_ids.size(), total);

    // One upload: [token ids | positions | slots | spans × 4].
    const int64_t span_count = static_cast<int64_t>(spans.size());
    Tensor packed = Tensor::empty({3 * total + 4 * span_count}, DType::I32);
    int32_t* data = packed.data<int32_t>();
    std::copy(token_ids.begin(), token_ids.end(), data);
    for (const SequenceSpan& span : spans)
      for (int32_t i = 0; i < span.tokens; ++i) {
        data[total + span.first_token + i] = span.first_position + i;
        data[2 * total + span.first_token + i] = span.slot;
      }
    for (int64_t index = 0; index < span_count; ++index) {
      const SequenceSpan& span = spans[index];
      int32_t* row = data + 3 * total + 4 * index;
      row[0] = span.slot;
      row[1] = span.first_token;
      row[2] = span.tokens;
      row[3] = span.first_position;
    }
    Tensor device = upload(packed);
    // The four views share the one block: each keeps the uploaded tensor alive.
    const auto owner = std::make_shared<const Tensor>(device);
    auto view = [&](int64_t offset, Shape shape) {
      return Tensor::borrow(device.data<int32_t>() + offset, std::move(shape), DType::I32, owner, Device::CUDA);
    };
    BatchLayout layout;
    layout.spans = spans;
    layout.total_tokens = total;
    layout.token_ids = view(0, {total});
    layout.positions = view(total, {total});
    layout.slots = view(2 * total, {total});
    layout.spans_device = view(3 * total, {span_count, 4});
    return layout;
  }

  // --- captured decode steps ---
  std::unique_ptr<CapturedWork> capture(const std::function<void()>& work) override {
    if (graph_mode_) fail("CUDA graph capture: capture() was called from inside captured work");
    activate();
    struct Restore {
      CudaBackend& backend;
      ~Restore() {
        backend.graph_mode_ = false;
        backend.recording_ = false;
        backend.allocator_->set_mode(cuda::DeviceAllocator::Mode::Shared);
      }
    } restore{*this};
    graph_mode_ = true;
    // The real run: it fills the graph pool and makes every lazy one-time setting (kernel
    // shared-memory opt-ins) before recording, where such calls would be captured or refused.
    allocator_->set_mode(cuda::DeviceAllocator::Mode::GraphGrow);
    work();
    allocator_->set_mode(cuda::DeviceAllocator::Mode::GraphFixed);
    check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    recording_ = true;
    cudaGraph_t graph = nullptr;
    try {
      work();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaGetLastError();
      throw;
    }
    recording_ = false;
    check_cuda(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
    cudaGraphExec_t executable = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&executable, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(status, "cudaGraphInstantiate");
    return std::make_unique<CudaGraph>(executable, stream_, device_, allocator_);
  }

  void upload_into(const Tensor& host, Tensor& device) override {
    if (!host.defined() || host.device() != Device::CPU) fail("CUDA upload_into: the source must be a host tensor");
    require_device(device, "upload_into", "device");
    refuse_while_recording("upload_into");
    if (host.dtype() != device.dtype() || host.numel() != device.numel())
      fail("CUDA upload_into: host {} {} does not match device {} {}", dtype_name(host.dtype()),
           shape_string(host.shape()), dtype_name(device.dtype()), shape_string(device.shape()));
    activate();
    if (host.nbytes())
      check_cuda(cudaMemcpyAsync(device.raw(), host.raw(), host.nbytes(), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (upload_into)");
  }

  uint64_t sampling_scratch_bytes(int64_t rows, int64_t vocab) const override {
    const auto words = [](size_t bytes) { return (bytes + 3) / 4 * 4; };  // the I32 tensors sample_tokens takes
    return allocation_bytes(words(cuda::sampling_sort_scratch_bytes(rows, vocab))) +
           allocation_bytes(words(cuda::sampling_chunk_scratch_bytes(rows, vocab)));
  }

  void sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                     Tensor& logprobs) override {
    require_device(logits, "sample_tokens", "logits");
    require_device(settings, "sample_tokens", "settings");
    require_device(tokens, "sample_tokens", "tokens");
    require_device(logprobs, "sample_tokens", "logprobs");
    require_dtype(logits, DType::F32, "sample_tokens", "logits");
    require_dtype(settings, DType::I32, "sample_tokens", "settings");
    require_dtype(tokens, DType::I32, "sample_tokens", "tokens");
    require_dtype(logprobs, DType::F32, "sample_tokens", "logprobs");
    if (logits.ndim() != 2 || logits.dim(1) == 0)
      fail("CUDA sample_tokens: logits must be [rows, vocab], got {}", shape_string(logits.shape()));
    const int64_t rows = logits.dim(0), vocab = logits.dim(1);
    if (settings.numel() != rows * kSamplingSettingsWords || tokens.numel() != rows || logprobs.numel() != rows)
      fail("CUDA sample_tokens: settings {}, tokens {} and logprobs {} do not fit {} rows", shape_string(settings.shape()),
           shape_string(tokens.shape()), shape_string(logprobs.shape()), rows);
    if (rows * vocab > std::numeric_limits<int>::max())
      fail("CUDA sample_tokens: {} rows of {} logits exceed the sort's {} items", rows, vocab,
           std::numeric_limits<int>::max());
    cuda::SamplingArgs args;
    args.logits = logits.data<float>();
    args.settings = settings.data<int32_t>();
    args.rows = rows;
    args.vocab = vocab;
    args.tokens = tokens.data<int32_t>();
    args.logprobs = logprobs.data<float>();
    args.errors = errors_;
    Tensor sort_scratch;
    if (sorting) {
      const auto bytes = static_cast<int64_t>(cuda::sampling_sort_scratch_bytes(rows, vocab));
      sort_scratch = alloc({(bytes + 3) / 4}, DType::I32);
      args.sort_scratch = sort_scratch.raw();
    }
    const auto chunk_bytes = static_cast<int64_t>(cuda::sampling_chunk_scratch_bytes(rows, vocab));
    const Tensor chunk_scratch = alloc({(chunk_bytes + 3) / 4}, DType::I32);
    args.chunk_scratch = chunk_scratch.raw();
    activate();
    launched(cuda::launch_sample_tokens(args, stream_), "sample_tokens");
  }

  void feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) override {
    constexpr const char* op = "feed_tokens";
    require_device(previous, op, "previous");
    require_device(feed, op, "feed");
    require_device(token_ids, op, "token_ids");
    require_dtype(previous, DType::I32, op, "previous");
    require_dtype(feed, DType::I32, op, "feed");
    require_dtype(token_ids, DType::I32, op, "token_ids");
    if (feed.numel() != token_ids.numel())
      fail("CUDA feed_tokens: feed {} and token_ids {} must have one entry per row", shape_string(feed.shape()),
           shape_string(token_ids.shape()));
    activate();
    launched(cuda::launch_feed_tokens(previous.data<int32_t>(), previous.numel(), feed.data<int32_t>(), feed.numel(),
                                      token_ids.data<int32_t>(), errors_, stream_),
             op);
  }

  std::unique_ptr<PendingDownload> download_later(const Tensor& device, Tensor& host) override {
    require_device(device, "download_later", "device");
    refuse_while_recording("download_later");
    if (host.device() != Device::CPU || host.dtype() != device.dtype() || host.numel() != device.numel())
      fail("CUDA download_later: host {} {} does not match device {} {}", dtype_name(host.dtype()),
           shape_string(host.shape()), dtype_name(device.dtype()), shape_string(device.shape()));
    const auto free_slot = std::find(download_slot_busy_.begin(), download_slot_busy_.end(), false);
    if (free_slot == download_slot_busy_.end())
      fail("CUDA download_later: {} downloads are already pending (wait for one first)", kMaxPendingDownloads);
    const auto slot = static_cast<int>(free_slot - download_slot_busy_.begin());
    activate();
    if (device.nbytes())
      check_cuda(cudaMemcpyAsync(host.raw(), device.raw(), device.nbytes(), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (download_later)");
    check_cuda(cudaMemcpyAsync(host_errors_ + 1 + slot, errors_, sizeof(cuda::DeviceErrorRecord),
                               cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (error record)");
    check_cuda(cudaEventRecord(download_events_[slot], stream_), "cudaEventRecord (download_later)");
    download_slot_busy_[slot] = true;
    return std::make_unique<CudaPendingDownload>(*this, slot);
  }

  Tensor alloc_pinned(const Shape& shape, DType dtype) override {
    for (int64_t extent : shape)
      if (extent < 0) fail("CUDA alloc_pinned: shape {} has a negative extent", shape_string(shape));
    activate();
    const size_t bytes = std::max<size_t>(1, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
    void* data = nullptr;
    check_cuda(cudaMallocHost(&data, bytes), "cudaMallocHost");
    std::shared_ptr<const void> owner(data, [](const void* block) { cudaFreeHost(const_cast<void*>(block)); });
    return Tensor::borrow(data, shape, dtype, std::move(owner), Device::CPU);
  }

  // --- ops ---
  void embedding(const Tensor& table, const Tensor& ids, Tensor& out) override {
    require_device(table, "embedding", "table");
    require_device(ids, "embedding", "ids");
    require_device(out, "embedding", "out");
    if (table.ndim() != 2 || !is_float(table.dtype()))
      fail("CUDA embedding: table must be a 2-d float tensor, got {} {}", dtype_name(table.dtype()),
           shape_string(table.shape()));
    require_dtype(ids, DType::I32, "embedding", "ids");
    require_stream(out, "embedding", "out");
    const int64_t width = table.dim(1);
    if (out.numel() != ids.numel() * width)
      fail("CUDA embedding: out {} does not hold {} rows of width {}", shape_string(out.shape()), ids.numel(), width);
    activate();
    launched(cuda::launch_embedding(table.raw(), table.dtype(), table.dim(0), width, ids.data<int32_t>(), ids.numel(),
                                    out.raw(), out.dtype(), errors_, stream_),
             "embedding");
  }

  void matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) override {
    cuda::MatmulArgs args = matmul_args(x, w, bias, out);
    activate();
    if (activations_ == DType::F32) {
      launched(cuda::launch_matmul_f32(args, stream_), "matmul (f32)");
      return;
    }
    const Tensor partials = split_scratch(&args, 1);
    launched(cuda::launch_matmul_bf16(args, stream_), "matmul (bf16)");
  }

  void matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) override {
    static_assert(cuda::kMatmulGroupMax == kMaxMatmulGroup);
    if (targets.empty() || targets.size() > kMaxMatmulGroup)
      fail("{} matmul_group: {} products, it takes 1 to {}", name(), targets.size(), kMaxMatmulGroup);
    cuda::MatmulArgs products[kMaxMatmulGroup];
    for (size_t t = 0; t < targets.size(); ++t)
      products[t] = matmul_args(x, *targets[t].w, targets[t].bias, *targets[t].out);
    activate();
    if (activations_ == DType::F32) {
      for (size_t t = 0; t < targets.size(); ++t) launched(cuda::launch_matmul_f32(products[t], stream_), "matmul (f32)");
      return;
    }
    const Tensor partials = split_scratch(products, static_cast<int>(targets.size()));
    launched(cuda::launch_matmul_bf16_group(products, static_cast<int>(targets.size()), stream_),
             "matmul_group (bf16)");
  }

  // The scratch a split prefill GEMM adds its segments from (kernels.h), lent to the products;
  // the caller keeps it until the launches are queued (the allocator orders its reuse on the stream).
  Tensor split_scratch(cuda::MatmulArgs* products, int count) {
    const int64_t floats = cuda::matmul_bf16_partials_floats(products, count);
    if (floats == 0) return Tensor();
    Tensor partials = alloc({floats}, DType::F32);
    for (int t = 0; t < count; ++t) products[t].partials = partials.data<float>();
    return partials;
  }

  void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) override {
    cuda::NormArgs args = norm_args(x, weight, eps, style, out, "rms_norm");
    args.x = x.raw();
    activate();
    launched(cuda::launch_rms_norm(args, stream_), "rms_norm");
  }

  void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                    Tensor& out) override {
    cuda::NormArgs args = norm_args(residual, weight, eps, style, out, "add_rms_norm");
    require_device(delta, "add_rms_norm", "delta");
    if (delta.dtype() != residual.dtype() || delta.numel() != residual.numel())
      fail("CUDA add_rms_norm: delta {} {} does not match residual {} {}", dtype_name(delta.dtype()),
           shape_string(delta.shape()), dtype_name(residual.dtype()), shape_string(residual.shape()));
    args.residual = residual.raw();
    args.delta = delta.raw();
    activate();
    launched(cuda::launch_add_rms_norm(args, stream_), "add_rms_norm");
  }

  void add(Tensor& a, const Tensor& b) override {
    require_device(a, "add", "a");
    require_device(b, "add", "b");
    require_activation(a, "add", "a");
    if (a.dtype() != b.dtype() || a.numel() != b.numel())
      fail("CUDA add: b {} {} does not match a {} {}", dtype_name(b.dtype()), shape_string(b.shape()),
           dtype_name(a.dtype()), shape_string(a.shape()));
    activate();
    launched(cuda::launch_add(a.raw(), b.raw(), a.numel(), a.dtype(), stream_), "add");
  }

  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override {
    require_device(x, "gather_rows", "x");
    require_device(rows, "gather_rows", "rows");
    require_device(out, "gather_rows", "out");
    require_dtype(rows, DType::I32, "gather_rows", "rows");
    if (x.ndim() < 1 || out.dtype() != x.dtype())
      fail("CUDA gather_rows: x {} {} and out {} {} must share a dtype", dtype_name(x.dtype()),
           shape_string(x.shape()), dtype_name(out.dtype()), shape_string(out.shape()));
    const int64_t x_rows = x.dim(0);
    const int64_t row_elements = x_rows ? x.numel() / x_rows : 0;
    if (out.numel() != rows.numel() * row_elements)
      fail("CUDA gather_rows: out {} does not hold {} rows of x {}", shape_string(out.shape()), rows.numel(),
           shape_string(x.shape()));
    activate();
    launched(cuda::launch_gather_rows(x.raw(), x_rows, row_elements * static_cast<int64_t>(dtype_size(x.dtype())),
                                      rows.data<int32_t>(), rows.numel(), out.raw(), errors_, stream_),
             "gather_rows");
  }

  void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) override {
    check_rope(x, positions, inv_freq, rotary_dim, "rope", "x");
    activate();
    launched(cuda::launch_rope(x.raw(), x.dtype(), x.dim(0), x.dim(1), x.dim(2), rotary_dim,
                               positions.data<int32_t>(), inv_freq.data<float>(), stream_),
             "rope");
  }

  void rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                     int rotary_dim, const HeadNorms* head_norms, Tensor& k_cache, Tensor& v_cache) override {
    constexpr const char* op = "rope_kv_write";
    check_rope(q, layout.positions, inv_freq, rotary_dim, op, "q");
    check_rope(k, layout.positions, inv_freq, rotary_dim, op, "k");
    require_device(v, op, "v");
    const CacheShape cache = cache_shape(k_cache, v_cache, op);
    if (k.dim(1) != cache.kv_heads || k.dim(2) != cache.head_dim || v.shape() != k.shape() ||
        k.dtype() != cache.dtype || v.dtype() != cache.dtype || q.dtype() != cache.dtype || q.dim(0) != k.dim(0) ||
        q.dim(2) != k.dim(2))
      fail("CUDA {}: q {} {}, k {} {} and v {} {} must be [tokens, heads, {}] in the cache dtype {} ({} kv heads)",
           op, dtype_name(q.dtype()), shape_string(q.shape()), dtype_name(k.dtype()), shape_string(k.shape()),
           dtype_name(v.dtype()), shape_string(v.shape()), cache.head_dim, dtype_name(cache.dtype), cache.kv_heads);
    check_layout(layout, k.dim(0), cache, op);
    cuda::RopeKvWriteArgs args;
    args.q = q.raw();
    args.k = k.raw();
    args.v = v.raw();
    args.k_cache = k_cache.raw();
    args.v_cache = v_cache.raw();
    args.positions = layout.positions.data<int32_t>();
    args.slots = layout.slots.data<int32_t>();
    args.inv_freq = inv_freq.data<float>();
    args.tokens = k.dim(0);
    args.q_heads = q.dim(1);
    args.kv_heads = cache.kv_heads;
    args.head_dim = cache.head_dim;
    args.rotary_dim = rotary_dim;
    args.capacity = cache.capacity;
    args.dtype = cache.dtype;
    if (head_norms) {
      const Tensor& q_weight = head_norms->q_weight;
      const Tensor& k_weight = head_norms->k_weight;
      require_device(q_weight, op, "q norm weight");
      require_device(k_weight, op, "k norm weight");
      if (q_weight.ndim() != 1 || k_weight.ndim() != 1 || q_weight.dim(0) != cache.head_dim ||
          k_weight.dim(0) != cache.head_dim || !is_float(q_weight.dtype()) || k_weight.dtype() != q_weight.dtype())
        fail("CUDA {}: the q and k norm weights {} {} and {} {} must be [{}] in one float dtype", op,
             dtype_name(q_weight.dtype()), shape_string(q_weight.shape()), dtype_name(k_weight.dtype()),
             shape_string(k_weight.shape()), cache.head_dim);
      if (cache.head_dim > cuda::kNormWarpRowMaxWidth)
        fail("CUDA {}: per-head norms take heads of at most {} dims, not {}", op, cuda::kNormWarpRowMaxWidth,
             cache.head_dim);
      args.q_norm = q_weight.raw();
      args.k_norm = k_weight.raw();
      args.norm_dtype = q_weight.dtype();
      args.norm_eps = head_norms->eps;
      args.norm_zero_centred = head_norms->style == NormStyle::ZeroCentred;
    }
    activate();
    launched(cuda::launch_rope_kv_write(args, stream_), op);
  }

  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    require_device(gate, "swiglu", "gate");
    require_device(up, "swiglu", "up");
    require_device(out, "swiglu", "out");
    require_activation(gate, "swiglu", "gate");
    if (up.dtype() != gate.dtype() || out.dtype() != gate.dtype() || up.numel() != gate.numel() ||
        out.numel() != gate.numel())
      fail("CUDA swiglu: gate {} {}, up {} {} and out {} {} must match", dtype_name(gate.dtype()),
           shape_string(gate.shape()), dtype_name(up.dtype()), shape_string(up.shape()), dtype_name(out.dtype()),
           shape_string(out.shape()));
    activate();
    launched(cuda::launch_swiglu(gate.raw(), up.raw(), out.raw(), gate.numel(), gate.dtype(), stream_), "swiglu");
  }

  void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, Tensor& k_cache,
                Tensor& v_cache) override {
    require_device(k, "kv_write", "k");
    require_device(v, "kv_write", "v");
    require_device(k_cache, "kv_write", "k_cache");
    require_device(v_cache, "kv_write", "v_cache");
    require_activation(k, "kv_write", "k");
    const CacheShape cache = cache_shape(k_cache, v_cache, "kv_write");
    if (k.ndim() != 3 || k.dim(1) != cache.kv_heads || k.dim(2) != cache.head_dim || v.shape() != k.shape() ||
        k.dtype() != cache.dtype || v.dtype() != cache.dtype)
      fail("CUDA kv_write: k {} {} and v {} {} must be [tokens, {}, {}] in the cache dtype {}", dtype_name(k.dtype()),
           shape_string(k.shape()), dtype_name(v.dtype()), shape_string(v.shape()), cache.kv_heads, cache.head_dim,
           dtype_name(cache.dtype));
    check_layout(layout, k.dim(0), cache, "kv_write");
    activate();
    launched(cuda::launch_kv_write(k.raw(), v.raw(), k.dim(0), cache.kv_heads * cache.head_dim *
                                                                   static_cast<int64_t>(dtype_size(cache.dtype)),
                                   layout.slots.data<int32_t>(), layout.positions.data<int32_t>(), cache.capacity,
                                   k_cache.raw(), v_cache.raw(), stream_),
             "kv_write");
  }

  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const BatchLayout& layout,
                 float scale, Tensor& out) override {
    require_device(q, "attention", "q");
    require_device(k_cache, "attention", "k_cache");
    require_device(v_cache, "attention", "v_cache");
    require_device(out, "attention", "out");
    require_activation(q, "attention", "q");
    const CacheShape cache = cache_shape(k_cache, v_cache, "attention");
    if (q.ndim() != 3 || q.dim(2) != cache.head_dim || q.dtype() != cache.dtype)
      fail("CUDA attention: q {} {} must be [tokens, heads, {}] in the cache dtype {}", dtype_name(q.dtype()),
           shape_string(q.shape()), cache.head_dim, dtype_name(cache.dtype));
    const int64_t heads = q.dim(1);
    if (heads == 0 || cache.kv_heads == 0 || heads % cache.kv_heads != 0)
      fail("CUDA attention: {} query heads are not a multiple of {} kv heads", heads, cache.kv_heads);
    if (out.shape() != q.shape() || out.dtype() != q.dtype())
      fail("CUDA attention: out {} {} must match q {} {}", dtype_name(out.dtype()), shape_string(out.shape()),
           dtype_name(q.dtype()), shape_string(q.shape()));
    check_layout(layout, q.dim(0), cache, "attention");
    if (q.dtype() == DType::BF16 && !cuda::attention_bf16_supports_head_dim(cache.head_dim))
      fail("CUDA attention: the BF16 path supports head_dim 16, 32, 64, 128 or 256, got {}", cache.head_dim);

    cuda::AttentionArgs args;
    args.q = q.raw();
    args.k_cache = k_cache.raw();
    args.v_cache = v_cache.raw();
    args.out = out.raw();
    args.spans = layout.spans_device.data<int32_t>();
    args.slots = layout.slots.data<int32_t>();
    args.positions = layout.positions.data<int32_t>();
    args.tokens = q.dim(0);
    args.heads = heads;
    args.kv_heads = cache.kv_heads;
    args.head_dim = cache.head_dim;
    args.capacity = cache.capacity;
    args.span_count = static_cast<int64_t>(layout.spans.size());
    for (const SequenceSpan& span : layout.spans) {
      args.max_span_tokens = std::max<int64_t>(args.max_span_tokens, span.tokens);
      args.max_position = std::max<int64_t>(args.max_position, span.first_position + span.tokens - 1);
    }
    // Captured work replays at later positions: size the key splits for the whole cache (the
    // kernels skip splits past each row's own position, read from the layout's device tensors).
    if (graph_mode_) args.max_position = cache.capacity - 1;
    args.scale = scale;
    args.dtype = q.dtype();
    Tensor partials;
    if (const int64_t floats = cuda::attention_partials_floats(args); floats > 0) {
      partials = alloc({floats}, DType::F32);
      args.partials = partials.data<float>();
    }
    activate();
    launched(cuda::launch_attention(args, stream_), "attention");
  }

  // --- HybridOps (gated_delta.cu) ---

  void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) override {
    constexpr const char* op = "split_query_gate";
    require_device(query_and_gate, op, "query_and_gate");
    require_device(query, op, "query");
    require_device(gate, op, "gate");
    require_activation(query_and_gate, op, "query_and_gate");
    require_activation(query, op, "query");
    require_activation(gate, op, "gate");
    if (query.ndim() != 3 || gate.shape() != query.shape() || query_and_gate.numel() != 2 * query.numel())
      fail("CUDA {}: query must be [T, heads, head_dim] like gate and query_and_gate twice its size, got {}, {} and {}",
           op, shape_string(query.shape()), shape_string(gate.shape()), shape_string(query_and_gate.shape()));
    activate();
    launched(cuda::launch_split_query_gate(query_and_gate.raw(), query.raw(), gate.raw(), query.numel() / query.dim(2),
                                           query.dim(2), activations_, stream_),
             op);
  }

  void sigmoid_gate(Tensor& x, const Tensor& gate) override {
    constexpr const char* op = "sigmoid_gate";
    require_device(x, op, "x");
    require_device(gate, op, "gate");
    require_activation(x, op, "x");
    require_activation(gate, op, "gate");
    if (gate.numel() != x.numel())
      fail("CUDA {}: x {} and gate {} differ in size", op, shape_string(x.shape()), shape_string(gate.shape()));
    activate();
    launched(cuda::launch_sigmoid_gate(x.raw(), gate.raw(), x.numel(), activations_, stream_), op);
  }

  void causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout, Tensor& conv_state,
                          Tensor& out) override {
    constexpr const char* op = "causal_conv1d_silu";
    require_device(x, op, "x");
    require_device(weight, op, "weight");
    require_device(conv_state, op, "conv_state");
    require_device(out, op, "out");
    require_activation(x, op, "x");
    require_activation(out, op, "out");
    require_dtype(conv_state, DType::F32, op, "conv_state");
    if (x.ndim() != 2 || out.shape() != x.shape())
      fail("CUDA {}: x must be [T, C] and out the same, got {} and {}", op, shape_string(x.shape()),
           shape_string(out.shape()));
    const int64_t channels = x.dim(1);
    if (weight.shape() != Shape{channels, cuda::kGatedDeltaConvKernel} || !is_float(weight.dtype()))
      fail("CUDA {}: weight must be a float [{}, {}] tensor (the kernel size this backend is built for), got {} {}",
           op, channels, cuda::kGatedDeltaConvKernel, dtype_name(weight.dtype()), shape_string(weight.shape()));
    if (conv_state.ndim() != 3 || conv_state.dim(1) != cuda::kGatedDeltaConvKernel - 1 || conv_state.dim(2) != channels)
      fail("CUDA {}: conv_state must be [slots, {}, {}], got {}", op, cuda::kGatedDeltaConvKernel - 1, channels,
           shape_string(conv_state.shape()));
    check_state_layout(layout, x.dim(0), conv_state.dim(0), op);
    cuda::ConvArgs args;
    args.x = x.raw();
    args.weight = weight.raw();
    args.spans = layout.spans_device.data<int32_t>();
    args.conv_state = conv_state.data<float>();
    args.out = out.raw();
    args.span_count = static_cast<int64_t>(layout.spans.size());
    args.channels = channels;
    args.kernel = cuda::kGatedDeltaConvKernel;
    args.dtype = activations_;
    args.weight_dtype = weight.dtype();
    activate();
    launched(cuda::launch_causal_conv1d_silu(args, stream_), op);
  }

  void gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) override {
    constexpr const char* op = "gated_delta_prepare_qkv";
    require_device(qkv, op, "qkv");
    require_device(q, op, "q");
    require_device(k, op, "k");
    require_device(v, op, "v");
    require_activation(qkv, op, "qkv");
    for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}})
      require_dtype(*tensor, DType::F32, op, name);
    if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || qkv.ndim() != 2 || v.dim(0) != q.dim(0) ||
        qkv.dim(0) != q.dim(0) || qkv.dim(1) != 2 * q.dim(1) * q.dim(2) + v.dim(1) * v.dim(2))
      fail("CUDA {}: qkv {} does not split into q {}, k {} and v {}", op, shape_string(qkv.shape()),
           shape_string(q.shape()), shape_string(k.shape()), shape_string(v.shape()));
    // HF-Q35 multiplies by the python float 1/sqrt(dk), which torch applies as an f32 scalar.
    const float query_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.dim(2))));
    activate();
    launched(cuda::launch_gated_delta_prepare_qkv(qkv.raw(), activations_, q.dim(0), q.dim(1), q.dim(2),
                                                  v.dim(1) * v.dim(2), query_scale, kGatedDeltaL2NormEps,
                                                  q.data<float>(), k.data<float>(), v.data<float>(), stream_),
             op);
  }

  void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias, Tensor& beta,
                         Tensor& g) override {
    constexpr const char* op = "gated_delta_gates";
    for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&b, "b"}, {&a, "a"}, {&a_log, "A_log"},
                                       {&dt_bias, "dt_bias"}, {&beta, "beta"}, {&g, "g"}})
      require_device(*tensor, op, name);
    require_activation(b, op, "b");
    require_activation(a, op, "a");
    require_dtype(beta, DType::F32, op, "beta");
    require_dtype(g, DType::F32, op, "g");
    if (b.ndim() != 2 || a.shape() != b.shape() || beta.shape() != b.shape() || g.shape() != b.shape())
      fail("CUDA {}: b, a, beta and g must be equal [T, value_heads] tensors, got {}, {}, {} and {}", op,
           shape_string(b.shape()), shape_string(a.shape()), shape_string(beta.shape()), shape_string(g.shape()));
    const int64_t heads = b.dim(1);
    if (a_log.shape() != Shape{heads} || dt_bias.shape() != Shape{heads} || a_log.dtype() != dt_bias.dtype() ||
        !is_float(a_log.dtype()))
      fail("CUDA {}: A_log and dt_bias must be float [{}] tensors of one dtype, got {} {} and {} {}", op, heads,
           dtype_name(a_log.dtype()), shape_string(a_log.shape()), dtype_name(dt_bias.dtype()),
           shape_string(dt_bias.shape()));
    activate();
    launched(cuda::launch_gated_delta_gates(b.raw(), a.raw(), activations_, a_log.raw(), dt_bias.raw(), a_log.dtype(),
                                            b.numel(), heads, beta.data<float>(), g.data<float>(), stream_),
             op);
  }

  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const BatchLayout& layout, Tensor& state, Tensor& out) override {
    constexpr const char* op = "gated_delta_rule";
    for (const auto& [tensor, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"},
                                       {&g, "g"}, {&beta, "beta"}, {&state, "state"}}) {
      require_device(*tensor, op, name);
      require_dtype(*tensor, DType::F32, op, name);
    }
    require_device(out, op, "out");
    require_activation(out, op, "out");
    if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || v.dim(0) != q.dim(0) || out.shape() != v.shape())
      fail("CUDA {}: q {}, k {}, v {} and out {} do not fit together", op, shape_string(q.shape()),
           shape_string(k.shape()), shape_string(v.shape()), shape_string(out.shape()));
    const int64_t tokens = q.dim(0), key_heads = q.dim(1), key_dim = q.dim(2);
    const int64_t value_heads = v.dim(1), value_dim = v.dim(2);
    if (value_heads % key_heads != 0)
      fail("CUDA {}: {} value heads are not a multiple of {} key heads", op, value_heads, key_heads);
    if (g.shape() != Shape{tokens, value_heads} || beta.shape() != g.shape())
      fail("CUDA {}: g {} and beta {} must be [{}, {}]", op, shape_string(g.shape()), shape_string(beta.shape()),
           tokens, value_heads);
    if (state.ndim() != 4 || state.dim(1) != value_heads || state.dim(2) != key_dim || state.dim(3) != value_dim)
      fail("CUDA {}: state must be [slots, {}, {}, {}], got {}", op, value_heads, key_dim, value_dim,
           shape_string(state.shape()));
    if ((key_dim != 32 && key_dim != 64 && key_dim != 128) || value_dim > cuda::kGatedDeltaMaxValueDim)
      fail("CUDA {}: key_dim {} / value_dim {} are not built (key_dim 32, 64 or 128; value_dim ≤ {})", op, key_dim,
           value_dim, cuda::kGatedDeltaMaxValueDim);
    check_state_layout(layout, tokens, state.dim(0), op);
    cuda::DeltaRuleArgs args;
    args.q = q.data<float>();
    args.k = k.data<float>();
    args.v = v.data<float>();
    args.g = g.data<float>();
    args.beta = beta.data<float>();
    args.spans = layout.spans_device.data<int32_t>();
    args.states = state.data<float>();
    args.out = out.raw();
    args.span_count = static_cast<int64_t>(layout.spans.size());
    args.key_heads = key_heads;
    args.value_heads = value_heads;
    args.key_dim = key_dim;
    args.value_dim = value_dim;
    args.dtype = activations_;
    static_assert(cuda::kGatedDeltaChunkTokens == kGatedDeltaChunk);
    args.whole_chunks = std::any_of(layout.spans.begin(), layout.spans.end(), [](const SequenceSpan& span) {
      return span.tokens - gated_delta_head_tokens(span) >= kGatedDeltaChunk;
    });
    activate();
    launched(cuda::launch_gated_delta_rule(args, stream_), op);
  }

  void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) override {
    constexpr const char* op = "rms_norm_gated";
    require_device(x, op, "x");
    require_device(z, op, "z");
    require_device(weight, op, "weight");
    require_device(out, op, "out");
    require_activation(x, op, "x");
    require_activation(z, op, "z");
    require_activation(out, op, "out");
    if (weight.ndim() != 1 || weight.numel() == 0 || !is_float(weight.dtype()))
      fail("CUDA {}: weight must be a non-empty float vector, got {} {}", op, dtype_name(weight.dtype()),
           shape_string(weight.shape()));
    const int64_t width = weight.numel();
    if (x.numel() % width != 0 || z.numel() != x.numel() || out.numel() != x.numel())
      fail("CUDA {}: x {}, z {} and out {} must be equal whole rows of width {}", op, shape_string(x.shape()),
           shape_string(z.shape()), shape_string(out.shape()), width);
    activate();
    launched(cuda::launch_rms_norm_gated(x.raw(), z.raw(), activations_, weight.raw(), weight.dtype(),
                                         x.numel() / width, width, eps, out.raw(), stream_),
             op);
  }

 private:
  struct CacheShape {
    int64_t slots, capacity, kv_heads, head_dim;
    DType dtype;
  };

  // cudaSetDevice only when another device is current: the call is then a no-op inside captures.
  void activate() const {
    int current = -1;
    check_cuda(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  }

  // Host copies and synchronisation cannot be part of a recorded graph.
  void refuse_while_recording(const char* op) const {
    if (recording_) fail("CUDA {}: not allowed inside captured work (graph recording)", op);
  }

  void launched(cudaError_t status, const char* op) const {
    if (status == cudaSuccess) return;
    cudaGetLastError();
    fail("CUDA {} kernel launch failed: {}", op, cudaGetErrorString(status));
  }

  // Waits for the stream and fails with the first error a kernel recorded. The record comes back
  // in the same wait (an asynchronous copy queued behind the work), not in a second round trip.
  void synchronize_and_check(const char* what) {
    check_cuda(cudaMemcpyAsync(host_errors_, errors_, sizeof *host_errors_, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (error record)");
    check_cuda(cudaStreamSynchronize(stream_), what);
    fail_on_device_error(*host_errors_);
  }

  class CudaPendingDownload final : public PendingDownload {
   public:
    CudaPendingDownload(CudaBackend& backend, int slot) : backend_(backend), slot_(slot) {}
    ~CudaPendingDownload() override {
      if (!waited_) cudaEventSynchronize(backend_.download_events_[slot_]);
      backend_.download_slot_busy_[slot_] = false;
    }
    CudaPendingDownload(const CudaPendingDownload&) = delete;
    CudaPendingDownload& operator=(const CudaPendingDownload&) = delete;
    void wait() override {
      if (waited_) return;
      check_cuda(cudaEventSynchronize(backend_.download_events_[slot_]), "cudaEventSynchronize (download_later)");
      waited_ = true;
      backend_.fail_on_device_error(backend_.host_errors_[1 + slot_]);
    }

   private:
    CudaBackend& backend_;
    int slot_;
    bool waited_ = false;
  };

  // Fails with a recorded kernel error (after clearing the device's record for later work).
  void fail_on_device_error(const cuda::DeviceErrorRecord record) {
    if (record.code == cuda::kNoDeviceError) return;
    check_cuda(cudaMemsetAsync(errors_, 0, sizeof record, stream_), "cudaMemsetAsync (error record)");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (error record)");
    if (record.code == cuda::kEmbeddingIdOutOfRange)
      fail("CUDA embedding: token id {} is outside the embedding table's {} rows", record.value, record.limit);
    if (record.code == cuda::kGatherRowOutOfRange)
      fail("CUDA gather_rows: row index {} is outside x's {} rows", record.value, record.limit);
    if (record.code == cuda::kFeedRowOutOfRange)
      fail("CUDA feed_tokens: feed index {} is past the previous step's {} tokens", record.value, record.limit);
    if (record.code == cuda::kSamplingRowNotSorted)
      fail("CUDA sample_tokens: row {} has a temperature but the call was made without sorting", record.value);
    fail("CUDA kernel reported error code {}", record.code);
  }

  static void require_device(const Tensor& tensor, const char* op, const char* name) {
    if (!tensor.defined()) fail("CUDA {}: {} is undefined", op, name);
    if (tensor.device() != Device::CUDA)
      fail("CUDA {}: {} {} is not on the CUDA device (upload it first)", op, name, shape_string(tensor.shape()));
  }
  static void require_dtype(const Tensor& tensor, DType dtype, const char* op, const char* name) {
    if (tensor.dtype() != dtype)
      fail("CUDA {}: {} must be {}, got {} {}", op, name, dtype_name(dtype), dtype_name(tensor.dtype()),
           shape_string(tensor.shape()));
  }
  void require_activation(const Tensor& tensor, const char* op, const char* name) const {
    if (tensor.dtype() != activations_)
      fail("CUDA {}: {} is {} {} but this backend's activations are {}", op, name, dtype_name(tensor.dtype()),
           shape_string(tensor.shape()), dtype_name(activations_));
  }
  // The residual stream (embedding output, norm input, matmul output) may be f32 or activations.
  void require_stream(const Tensor& tensor, const char* op, const char* name) const {
    if (tensor.dtype() != activations_ && tensor.dtype() != DType::F32)
      fail("CUDA {}: {} is {} {} but must be f32 or this backend's activations ({})", op, name,
           dtype_name(tensor.dtype()), shape_string(tensor.shape()), dtype_name(activations_));
  }

  // x [tokens, heads, head_dim] in the activation dtype, one I32 position per token, f32 inv_freq
  // of rotary_dim / 2 entries, rotary_dim even and within head_dim.
  void check_rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim, const char* op,
                  const char* name) const {
    require_device(x, op, name);
    require_device(positions, op, "positions");
    require_device(inv_freq, op, "inv_freq");
    require_activation(x, op, name);
    require_dtype(positions, DType::I32, op, "positions");
    require_dtype(inv_freq, DType::F32, op, "inv_freq");
    if (x.ndim() != 3) fail("CUDA {}: {} must be [tokens, heads, head_dim], got {}", op, name, shape_string(x.shape()));
    const int64_t head_dim = x.dim(2);
    if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
      fail("CUDA {}: rotary_dim {} must be even and within head_dim {}", op, rotary_dim, head_dim);
    if (positions.numel() != x.dim(0)) fail("CUDA {}: {} positions for {} tokens", op, positions.numel(), x.dim(0));
    if (inv_freq.numel() != rotary_dim / 2)
      fail("CUDA {}: inv_freq has {} entries, rotary_dim {} needs {}", op, inv_freq.numel(), rotary_dim,
           rotary_dim / 2);
  }

  // Validates one product and describes it for the kernels (both matmul paths).
  cuda::MatmulArgs matmul_args(const Tensor& x, const Tensor& w, const Tensor* bias, const Tensor& out) const {
    require_device(x, "matmul", "x");
    require_device(w, "matmul", "w");
    require_device(out, "matmul", "out");
    if (w.ndim() != 2 || !is_float(w.dtype()))
      fail("CUDA matmul: w must be a 2-d float tensor, got {} {}", dtype_name(w.dtype()), shape_string(w.shape()));
    require_activation(x, "matmul", "x");
    const int64_t n = w.dim(0), k = w.dim(1);
    if (k == 0 || x.numel() % k != 0)
      fail("CUDA matmul: x {} is not a whole number of rows of w's width {}", shape_string(x.shape()), k);
    const int64_t m = x.numel() / k;
    if (out.numel() != m * n)
      fail("CUDA matmul: out {} does not hold [{}, {}] (x {}, w {})", shape_string(out.shape()), m, n,
           shape_string(x.shape()), shape_string(w.shape()));
    if (out.dtype() != DType::F32 && out.dtype() != activations_)
      fail("CUDA matmul: out dtype {} is neither F32 nor the activation dtype {}", dtype_name(out.dtype()),
           dtype_name(activations_));
    if (bias) {
      require_device(*bias, "matmul", "bias");
      if (!is_float(bias->dtype()) || bias->numel() != n)
        fail("CUDA matmul: bias {} {} is not {} floats", dtype_name(bias->dtype()), shape_string(bias->shape()), n);
    }
    cuda::MatmulArgs args;
    args.x = x.raw();
    args.w = w.raw();
    args.bias = bias ? bias->raw() : nullptr;
    args.out = out.raw();
    args.m = m;
    args.n = n;
    args.k = k;
    args.x_dtype = x.dtype();
    args.w_dtype = w.dtype();
    args.bias_dtype = bias ? bias->dtype() : DType::F32;
    args.out_dtype = out.dtype();
    args.multiprocessors = multiprocessors_;
    if (activations_ == DType::F32) return args;
    if (w.dtype() != DType::BF16)
      fail("CUDA matmul: BF16 activations need BF16 weights, got {} w {} (construct the backend with F32 "
           "activations for {} checkpoints)", dtype_name(w.dtype()), shape_string(w.shape()), dtype_name(w.dtype()));
    if (k % 8 != 0)
      fail("CUDA matmul: the BF16 tensor-core path needs K to be a multiple of 8 (16-byte rows), got w {}",
           shape_string(w.shape()));
    if (k > cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments)
      fail("CUDA matmul: the BF16 path takes K up to {}, got w {}", cuda::kMatmulSegmentK * cuda::kMatmulMaxSegments,
           shape_string(w.shape()));
    if (reinterpret_cast<uintptr_t>(x.raw()) % 16 || reinterpret_cast<uintptr_t>(w.raw()) % 16)
      fail("CUDA matmul: x and w must be 16-byte aligned for the BF16 path (x {}, w {})", shape_string(x.shape()),
           shape_string(w.shape()));
    return args;
  }

  cuda::NormArgs norm_args(const Tensor& x, const Tensor& weight, float eps, NormStyle style, const Tensor& out,
                           const char* op) const {
    require_device(x, op, "x");
    require_device(weight, op, "weight");
    require_device(out, op, "out");
    require_stream(x, op, "x");
    require_activation(out, op, "out");
    if (weight.ndim() != 1 || !is_float(weight.dtype()))
      fail("CUDA {}: weight must be a 1-d float tensor, got {} {}", op, dtype_name(weight.dtype()),
           shape_string(weight.shape()));
    const int64_t width = weight.dim(0);
    if (width == 0 || x.numel() % width != 0)
      fail("CUDA {}: x {} is not a whole number of rows of width {}", op, shape_string(x.shape()), width);
    if (out.numel() != x.numel() || (out.raw() == x.raw() && out.dtype() != x.dtype()))
      fail("CUDA {}: out {} {} must hold x {} {} (in place only in one dtype)", op, dtype_name(out.dtype()),
           shape_string(out.shape()), dtype_name(x.dtype()), shape_string(x.shape()));
    cuda::NormArgs args;
    args.weight = weight.raw();
    args.out = out.raw();
    args.rows = x.numel() / width;
    args.width = width;
    args.eps = eps;
    args.zero_centred = style == NormStyle::ZeroCentred;
    args.act_dtype = out.dtype();
    args.stream_dtype = x.dtype();
    args.weight_dtype = weight.dtype();
    return args;
  }

  static CacheShape cache_shape(const Tensor& k_cache, const Tensor& v_cache, const char* op) {
    if (k_cache.ndim() != 4 || v_cache.shape() != k_cache.shape() || v_cache.dtype() != k_cache.dtype())
      fail("CUDA {}: caches must be two equal [slots, capacity, kv_heads, head_dim] tensors, got {} {} and {} {}", op,
           dtype_name(k_cache.dtype()), shape_string(k_cache.shape()), dtype_name(v_cache.dtype()),
           shape_string(v_cache.shape()));
    return {k_cache.dim(0), k_cache.dim(1), k_cache.dim(2), k_cache.dim(3), k_cache.dtype()};
  }

  static void check_layout(const BatchLayout& layout, int64_t tokens, const CacheShape& cache, const char* op) {
    if (layout.total_tokens != tokens)
      fail("CUDA {}: the layout has {} tokens but the inputs have {}", op, layout.total_tokens, tokens);
    if (layout.slots.device() != Device::CUDA || layout.positions.device() != Device::CUDA ||
        layout.spans_device.device() != Device::CUDA)
      fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
    for (size_t index = 0; index < layout.spans.size(); ++index) {
      const SequenceSpan& span = layout.spans[index];
      if (span.slot < 0 || span.slot >= cache.slots)
        fail("CUDA {}: span {} uses slot {} but the cache has {} slots", op, index, span.slot, cache.slots);
      if (span.first_position < 0 || span.first_position + span.tokens > cache.capacity)
        fail("CUDA {}: span {} covers positions [{}, {}) but the cache holds {} per slot", op, index,
             span.first_position, span.first_position + span.tokens, cache.capacity);
    }
  }

  // A recurrent-state op's layout: made by this backend, spans inside the batch with one distinct
  // slot each, inside the state.
  static void check_state_layout(const BatchLayout& layout, int64_t tokens, int64_t slots, const char* op) {
    if (layout.total_tokens != tokens)
      fail("CUDA {}: the layout has {} tokens but the inputs have {}", op, layout.total_tokens, tokens);
    if (layout.spans_device.device() != Device::CUDA)
      fail("CUDA {}: the batch layout was not made by this backend (make_layout)", op);
    check_recurrent_spans(layout.spans, tokens, slots, std::string("CUDA ") + op);
  }

  int device_;
  DType activations_;
  std::string device_name_;
  int multiprocessors_ = 0;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<cuda::DeviceAllocator> allocator_;
  std::shared_ptr<void> errors_owner_;
  cuda::DeviceErrorRecord* errors_ = nullptr;
  cuda::DeviceErrorRecord* host_errors_ = nullptr;  // pinned: 1 + kMaxPendingDownloads records
  std::array<cudaEvent_t, kMaxPendingDownloads> download_events_{};
  std::array<bool, kMaxPendingDownloads> download_slot_busy_{};
  static constexpr size_t kStagingBytes = 64 << 10;
  void* staging_ = nullptr;                          // pinned, kStagingBytes
  bool graph_mode_ = false;  // inside capture(): its real run or its recording
  bool recording_ = false;   // inside capture()'s recording
};

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

DType cuda_activation_dtype_for(DType weights) { return weights == DType::BF16 ? DType::BF16 : DType::F32; }

std::unique_ptr<Backend> make_cuda_backend(int device, DType activations) {
  return std::make_unique<CudaBackend>(device, activations);
}

}  // namespace kiln
