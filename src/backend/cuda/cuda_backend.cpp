// CudaBackend (cuda_backend_impl.h): the device, memory, batch layouts, graph capture, host
// transfers, the argument checks every op shares, and the factory.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace kiln {

void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  fail("CUDA {} failed: {}", what, cudaGetErrorString(status));
}

namespace {

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

}  // namespace

CudaBackend::CudaBackend(int device, DType activations) : device_(device), activations_(activations) {
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

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
  cudaFreeHost(host_errors_);
  cudaFreeHost(staging_);
  for (cudaEvent_t event : download_events_) cudaEventDestroy(event);
}

double CudaBackend::measure_copy_bandwidth_gbps() {
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

void CudaBackend::synchronize() {
  refuse_while_recording("synchronize");
  activate();
  synchronize_and_check("cudaStreamSynchronize");
}

Tensor CudaBackend::alloc(const Shape& shape, DType dtype) {
  activate();
  for (int64_t extent : shape)
    if (extent < 0) fail("CUDA alloc: shape {} has a negative extent", shape_string(shape));
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  std::shared_ptr<void> block = allocator_->allocate(bytes);
  void* data = block.get();
  return Tensor::borrow(data, shape, dtype, std::move(block), Device::CUDA);
}

// Free device memory counts the blocks the allocator caches: alloc hands them out again.
DeviceMemory CudaBackend::memory() {
  activate();
  size_t free = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return {free + allocator_->cached_bytes(), total};
}

uint64_t CudaBackend::attention_scratch_bytes(int64_t tokens, int64_t heads, int64_t head_dim,
                                              int64_t max_position) const {
  // What attention() allocates: the split partials of a call of few tokens.
  cuda::AttentionArgs args;
  args.dtype = activations_;
  args.tokens = tokens;
  args.heads = heads;
  args.head_dim = head_dim;
  args.max_position = max_position;
  return static_cast<uint64_t>(cuda::attention_partials_floats(args)) * sizeof(float);
}

Tensor CudaBackend::upload(const Tensor& host) {
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

Tensor CudaBackend::download(const Tensor& tensor) {
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

void CudaBackend::zero(Tensor& tensor) {
  require_device(tensor, "zero", "tensor");
  activate();
  if (tensor.nbytes()) check_cuda(cudaMemsetAsync(tensor.raw(), 0, tensor.nbytes(), stream_), "cudaMemsetAsync");
}

Weight CudaBackend::upload_weight(const Weight& host) {
  refuse_while_recording("upload_weight");
  Weight device = Backend::upload_weight(host);
  if (!device.quantized() || device.code_order() != CodeOrder::Stored ||
      !cuda::fragment_order_applies(quantized_weight_args(device)))
    return device;
  // upload hands back a tensor already on the device as it is: its codes are arranged in a copy,
  // never in the caller's tensor.
  if (host.values().device() == Device::CUDA) {
    Tensor values = alloc(host.values().shape(), host.values().dtype());
    copy(host.values(), values);
    device = device.with_parts(values, device.scales(), device.biases());
  }
  activate();
  launched(cuda::launch_arrange_fragments(quantized_weight_args(device), stream_), "upload_weight (fragment order)");
  return device.in_code_order(CodeOrder::Fragment);
}

void CudaBackend::copy(const Tensor& from, Tensor& to) {
  const int64_t bytes = check_copy(contract(), from, to);
  require_device(from, "copy", "from");
  require_device(to, "copy", "to");
  activate();
  if (bytes > 0)
    check_cuda(cudaMemcpyAsync(to.raw(), from.raw(), static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (copy)");
}

BatchLayout CudaBackend::make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) {
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

std::unique_ptr<CapturedWork> CudaBackend::capture(const std::function<void()>& work) {
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

void CudaBackend::upload_into(const Tensor& host, Tensor& device) {
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

std::unique_ptr<PendingDownload> CudaBackend::download_later(const Tensor& device, Tensor& host) {
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

Tensor CudaBackend::alloc_pinned(const Shape& shape, DType dtype) {
  for (int64_t extent : shape)
    if (extent < 0) fail("CUDA alloc_pinned: shape {} has a negative extent", shape_string(shape));
  activate();
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
  void* data = nullptr;
  check_cuda(cudaMallocHost(&data, bytes), "cudaMallocHost");
  std::shared_ptr<const void> owner(data, [](const void* block) { cudaFreeHost(const_cast<void*>(block)); });
  return Tensor::borrow(data, shape, dtype, std::move(owner), Device::CPU);
}

// cudaSetDevice only when another device is current: the call is then a no-op inside captures.
void CudaBackend::activate() const {
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
}

// Host copies and synchronisation cannot be part of a recorded graph.
void CudaBackend::refuse_while_recording(const char* op) const {
  if (recording_) fail("CUDA {}: not allowed inside captured work (graph recording)", op);
}

void CudaBackend::launched(cudaError_t status, const char* op) const {
  if (status == cudaSuccess) return;
  cudaGetLastError();
  fail("CUDA {} kernel launch failed: {}", op, cudaGetErrorString(status));
}

// Waits for the stream and fails with the first error a kernel recorded. The record comes back
// in the same wait (an asynchronous copy queued behind the work), not in a second round trip.
void CudaBackend::synchronize_and_check(const char* what) {
  check_cuda(cudaMemcpyAsync(host_errors_, errors_, sizeof *host_errors_, cudaMemcpyDeviceToHost, stream_),
             "cudaMemcpyAsync (error record)");
  check_cuda(cudaStreamSynchronize(stream_), what);
  fail_on_device_error(*host_errors_);
}

// Fails with a recorded kernel error (after clearing the device's record for later work).
void CudaBackend::fail_on_device_error(const cuda::DeviceErrorRecord record) {
  if (record.code == cuda::kNoDeviceError) return;
  check_cuda(cudaMemsetAsync(errors_, 0, sizeof record, stream_), "cudaMemsetAsync (error record)");
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (error record)");
  if (record.code == cuda::kEmbeddingIdOutOfRange)
    fail("CUDA embedding: token id {} is outside the embedding table's {} rows", record.value, record.limit);
  if (record.code == cuda::kGatherRowOutOfRange)
    fail("CUDA gather_rows: row index {} is outside x's {} rows", record.value, record.limit);
  if (record.code == cuda::kExpertIdOutOfRange)
    fail("CUDA expert_matmul: expert id {} is outside the weights' {} experts", record.value, record.limit);
  if (record.code == cuda::kFeedRowOutOfRange)
    fail("CUDA feed_tokens: feed index {} is past the previous step's {} tokens", record.value, record.limit);
  if (record.code == cuda::kSamplingRowNotSorted)
    fail("CUDA sample_tokens: row {} has a temperature but the call was made without sorting", record.value);
  fail("CUDA kernel reported error code {}", record.code);
}

void CudaBackend::require_device(const Tensor& tensor, const char* op, const char* name) {
  if (!tensor.defined()) fail("CUDA {}: {} is undefined", op, name);
  if (tensor.device() != Device::CUDA)
    fail("CUDA {}: {} {} is not on the CUDA device (upload it first)", op, name, shape_string(tensor.shape()));
}

uint64_t cuda_allocator_held_bytes(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (!cuda) fail("cuda_allocator_held_bytes: the {} backend is not a CUDA backend", backend.name());
  return cuda->held_bytes();
}

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
