// The CUDA backend's class, declared once for the files that define it: cuda_backend.cpp (the
// device, memory, batch layouts, graph capture, host transfers and the device-placement check every
// op shares), cuda_dense_ops.cpp (the ops every family uses), cuda_moe_ops.cpp (a mixture of
// experts'), cuda_hybrid_ops.cpp (Gated DeltaNet's) and cuda_sampling.cpp. Each op first checks the op contract (backend/op_contract.h: the shapes and
// dtypes every backend requires), then what is CUDA's own (device placement, layouts made here, the
// limits of its kernels), each failure a kiln::Error naming the op and tensor, then launches its
// kernel on the backend's stream (kernels.h). Plain C++: fmt cannot be compiled by nvcc, so the
// kernels live in the .cu files, one per op group. Only those files include this header; everyone
// else makes the backend with make_cuda_backend.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_allocator.h"
#include "backend/cuda/kernels.h"
#include "backend/op_contract.h"

namespace kiln {

// Fails with the CUDA error's text unless `status` is cudaSuccess (clearing a non-sticky error first).
void check_cuda(cudaError_t status, const char* what);

// A quantized weight on the device (core/weight.h's layout) as the quantized kernels take it.
cuda::QuantizedWeightArgs quantized_weight_args(const Weight& w);

class CudaBackend final : public Backend, public GraphOps, public HybridOps {
 public:
  // --- the device, memory, batch layouts and captured steps (cuda_backend.cpp) ---
  CudaBackend(int device, DType activations);

  ~CudaBackend() override;

  GraphOps* graph_ops() override { return this; }
  HybridOps* hybrid_ops() override { return this; }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::CUDA; }
  DType activation_dtype() const override { return activations_; }

  double measure_copy_bandwidth_gbps() override;

  void synchronize() override;

  Tensor alloc(const Shape& shape, DType dtype) override;

  // Free device memory counts the blocks the allocator caches: alloc hands them out again.
  DeviceMemory memory() override;

  uint64_t allocation_bytes(uint64_t bytes) const override { return cuda::DeviceAllocator::rounded_size(bytes); }

  bool caches_freed_blocks() const override { return true; }

  // For what the allocator does not hand out: the lazily loaded kernel modules and the graphs'
  // executables. Not measured piece by piece; tests/cuda/memory_plan_test.cpp holds a served
  // model's measured use of device memory under the plan with it.
  uint64_t reserved_bytes() const override { return uint64_t{512} << 20; }

  uint64_t matmul_scratch_bytes(const Tensor& x, std::span<const MatmulTarget> targets) const override;

  uint64_t attention_scratch_bytes(int64_t tokens, int64_t heads, int64_t head_dim,
                                   int64_t max_position) const override;

  // Bytes the allocator holds from the device: blocks in use and cached ones.
  uint64_t held_bytes() const { return allocator_->held_bytes(); }

  Tensor upload(const Tensor& host) override;

  // A quantized weight that the fused decode kernel takes gets its codes rearranged into the
  // fragment order on the device (CodeOrder::Fragment; backend/cuda/quantized.cu), in place of the
  // stored order: the same bytes, no second copy.
  Weight upload_weight(const Weight& host) override;

  Tensor download(const Tensor& tensor) override;

  void zero(Tensor& tensor) override;
  void copy(const Tensor& from, Tensor& to) override;

  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override;

  std::unique_ptr<CapturedWork> capture(const std::function<void()>& work) override;

  void upload_into(const Tensor& host, Tensor& device) override;

  // --- sampling (cuda_sampling.cpp) ---
  std::vector<uint64_t> sampling_scratch_bytes(int64_t rows, int64_t vocab, bool sorting) const override;

  void sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                     Tensor& logprobs) override;

  void feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) override;

  // --- host transfers (cuda_backend.cpp) ---
  std::unique_ptr<PendingDownload> download_later(const Tensor& device, Tensor& host) override;

  Tensor alloc_pinned(const Shape& shape, DType dtype) override;

  // --- the ops every family uses (cuda_dense_ops.cpp) ---
  void embedding(const Weight& table, const Tensor& ids, Tensor& out) override;

  void matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) override;

  void matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) override;

  // Where the products' matmul scratch goes (one block, matmul_scratch_bytes): the decoded
  // matrices of the quantized weights the fused decode kernel does not take (each rounded up to
  // 256 bytes), then the floats a split prefill GEMM adds its segments from (kernels.h), over the
  // products that run on plain matrices.
  struct MatmulScratch {
    uint64_t decoded_bytes[kMaxMatmulGroup] = {};  // 0: dense, or decoded inside the fused kernel
    bool fused[kMaxMatmulGroup] = {};
    uint64_t decoded_total = 0;
    int64_t partial_floats = 0;
    uint64_t bytes() const { return decoded_total + static_cast<uint64_t>(partial_floats) * sizeof(float); }
  };
  MatmulScratch matmul_scratch(std::span<const MatmulTarget> targets, const cuda::MatmulArgs* products) const;
  // Runs checked products (matmul_args) of one x: decodes the quantized weights that need it into
  // the scratch, then launches the kernels; the scratch is held until the launches are queued (the
  // allocator orders its reuse on the stream).
  void run_matmuls(std::span<const MatmulTarget> targets, cuda::MatmulArgs* products);

  void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) override;

  void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                    Tensor& out) override;

  void add(Tensor& a, const Tensor& b) override;

  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override;


  void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) override;

  // --- a mixture of experts' ops (cuda_moe_ops.cpp) ---
  void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                 Tensor& weights) override;

  // On the device (the pairs grouped by expert by a kernel, then one launch of the decode kernel
  // over every used expert: cuda::ExpertRouting) inside captured work and for up to
  // kDevicePairsPerExpert pairs per expert; otherwise the pairs are sorted on the host and each
  // expert's rows take one matmul_group, on the prefill GEMM where they are many
  // (Backend::expert_matmul_on_host). Both give every element matmul's bits.
  void expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                     Tensor* experts_read) override;

  // The device path's scratch (expert_scratch), or, for as many pairs as the host path may take,
  // the larger of the two paths' (a dry run does not know whether the call will be captured).
  uint64_t expert_matmul_scratch_bytes(const Tensor& x, const Tensor& experts,
                                       std::span<const MatmulTarget> targets) const override;

  // The device path's scratch (one block): the routing's groups (cuda::expert_groups_ints), then,
  // for each quantized weight, its used experts decoded in the activation dtype (each part rounded
  // up to 256 bytes).
  struct ExpertScratch {
    uint64_t group_bytes = 0;
    uint64_t decoded_bytes[kMaxMatmulGroup] = {};
    uint64_t bytes() const {
      uint64_t total = group_bytes;
      for (uint64_t part : decoded_bytes) total += part;
      return total;
    }
  };
  ExpertScratch expert_scratch(const ExpertMatmulDims& dims, std::span<const MatmulTarget> targets) const;

  void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) override;

  void rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                     int rotary_dim, const HeadNorms* head_norms, const KvCacheView& cache) override;

  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override;

  void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) override;

  void attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                 Tensor& out) override;

  // --- HybridOps: Gated DeltaNet and gated attention (cuda_hybrid_ops.cpp) ---
  void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) override;

  void sigmoid_gate(Tensor& x, const Tensor& gate) override;

  void causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout, Tensor& conv_state,
                          Tensor& out) override;

  void gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) override;

  void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias, Tensor& beta,
                         Tensor& g) override;

  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const BatchLayout& layout, Tensor& state, Tensor& out) override;

  void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) override;

 private:
  static bool is_activation(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16; }

  // This backend as the op contract sees it (errors say "CUDA <op>: ...").
  OpContext contract() const { return {"CUDA", activations_, Device::CUDA}; }

  // cudaSetDevice only when another device is current: the call is then a no-op inside captures.
  void activate() const;

  // Host copies and synchronisation cannot be part of a recorded graph.
  void refuse_while_recording(const char* op) const;

  void launched(cudaError_t status, const char* op) const;

  // Waits for the stream and fails with the first error a kernel recorded. The record comes back
  // in the same wait (an asynchronous copy queued behind the work), not in a second round trip.
  void synchronize_and_check(const char* what);

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
  void fail_on_device_error(const cuda::DeviceErrorRecord record);

  static void require_device(const Tensor& tensor, const char* op, const char* name);

  // Checks one product (the contract, then the BF16 path's own limits) and describes it for the
  // kernels (both matmul paths).
  cuda::MatmulArgs matmul_args(const Tensor& x, const Weight& w, const Tensor* bias, const Tensor& out) const;
  // Describes a checked product of x [m, k] with w (n rows of it at a time: an expert's) into out
  // for the kernels, after checking what the BF16 path takes (matmul_args' last part).
  cuda::MatmulArgs product_args(const char* op, const Tensor& x, const Weight& w, const Tensor* bias, const Tensor& out,
                                int64_t m, int64_t n, int64_t k) const;

  // Describes a norm whose contract check gave `dims`, after checking its tensors' placement.
  cuda::NormArgs norm_args(const NormDims& dims, const Tensor& x, const Tensor& weight, float eps, NormStyle style,
                           const Tensor& out, const char* op) const;

  // The layout's device tensors, which the kernels read, come from this backend's make_layout.
  static void require_device_layout(const BatchLayout& layout, const char* op);

  // A recurrent-state op's layout: made by this backend (the kernels read its device spans) and
  // describing the op's tokens (the contract checks the spans themselves).
  static void require_state_layout(const BatchLayout& layout, int64_t tokens, const char* op);

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

}  // namespace kiln
