// A backend that stands in for another one (the target) in a dry run: it computes nothing and
// measures what the target would allocate. `kiln fit` and the server's admission run a model's
// real construction, cache and worst-case step on it (engine/memory_plan.h), so the plan follows
// the code that allocates instead of a hand-kept copy of it.
//
// Every op checks its arguments through the op contract (backend/op_contract.h), so a wrong shape
// fails here as it would on the target, and then does no arithmetic: the cost of an op does not
// grow with its tensors. Tensors carry a shape and a dtype on the target's device but no storage
// (Tensor::unbacked: any access through them faults), so a plan of any size is made in a few
// megabytes of host memory, and a plan for CUDA needs no GPU work.
//
// What is measured is what the target's allocator would hold from its device, each block rounded
// as the target rounds it (Backend::allocation_bytes) and kept or given back as the target keeps
// it (Backend::caches_freed_blocks): a caching allocator keeps a freed block for later requests of
// its size, and captured work (GraphOps::capture) takes its scratch from a pool of its own whose
// blocks never go back. The target's ops' own scratch (matmul, attention, sampling) is allocated
// where the target allocates it, with the sizes the target reports for each call. Uploads are
// allocations too: on the CPU, where upload hands the host tensor over, that is the memory the
// tensor occupies (a weight's mapped or converted bytes). Downloads and pinned host buffers are
// host memory the engine holds, not the target's: they are not counted.
//
// Not thread-safe, like the backends it stands in for.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/op_contract.h"
#include "core/tensor.h"

namespace kiln {

// What the target would hold, in bytes, each block rounded as it rounds it.
struct MeasuredMemory {
  uint64_t held = 0;       // taken from the device and not given back: blocks in use and cached ones
  uint64_t peak_held = 0;  // the most held since the backend was made or restart_peak was called
  uint64_t in_use = 0;     // the blocks of tensors that still exist
};

class MeasuringBackend final : public Backend, public HybridOps, public GraphOps {
 public:
  // Measures for `target`, which must outlive this backend; only its size and rounding rules are
  // asked (no op of the target runs), and memory() is the target's.
  explicit MeasuringBackend(Backend& target);
  ~MeasuringBackend() override;
  MeasuringBackend(const MeasuringBackend&) = delete;
  MeasuringBackend& operator=(const MeasuringBackend&) = delete;

  MeasuredMemory measured() const;
  // Starts a new peak from what is held now (to measure the peak of one phase of a dry run).
  void restart_peak();

  std::string name() const override { return name_; }
  Device device() const override { return device_; }
  DType activation_dtype() const override { return activations_; }
  // Fails: there is nothing to measure a bandwidth on.
  double measure_copy_bandwidth_gbps() override;
  void synchronize() override {}

  Tensor alloc(const Shape& shape, DType dtype) override;
  DeviceMemory memory() override { return target_.memory(); }
  uint64_t allocation_bytes(uint64_t bytes) const override { return target_.allocation_bytes(bytes); }
  bool caches_freed_blocks() const override { return target_.caches_freed_blocks(); }
  uint64_t matmul_scratch_bytes(const Tensor& x, std::span<const MatmulTarget> targets) const override {
    return target_.matmul_scratch_bytes(x, targets);
  }
  uint64_t attention_scratch_bytes(int64_t tokens, int64_t heads, int64_t head_dim,
                                   int64_t max_position) const override {
    return target_.attention_scratch_bytes(tokens, heads, head_dim, max_position);
  }
  uint64_t reserved_bytes() const override { return target_.reserved_bytes(); }
  // A measured copy on the target's device (a tensor already on a device other than the host is
  // returned as it is, as the CUDA backend does).
  Tensor upload(const Tensor& host) override;
  // An unbacked host tensor of the same shape and dtype.
  Tensor download(const Tensor& tensor) override;
  bool computes_values() const override { return false; }
  void zero(Tensor& tensor) override;
  void copy(const Tensor& from, Tensor& to) override;
  // The spans are checked as every backend checks them (positive tokens, covering the token ids
  // in order); the device tensors are views of one measured I32 block of 3·T + 4·S words, the
  // bytes the CPU and CUDA layouts take.
  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override;

  void embedding(const Weight& table, const Tensor& ids, Tensor& out) override;
  void matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) override;
  void matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) override;
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) override;
  void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                    Tensor& out) override;
  void add(Tensor& a, const Tensor& b) override;
  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override;
  void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                 Tensor& weights) override;
  // The target's own scratch for the call (expert_matmul_scratch_bytes), in one block.
  void expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                     Tensor* experts_read) override;
  uint64_t expert_matmul_scratch_bytes(const Tensor& x, const Tensor& experts,
                                       std::span<const MatmulTarget> targets) const override {
    return target_.expert_matmul_scratch_bytes(x, experts, targets);
  }
  void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) override;
  void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) override;
  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) override;
  void rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                     int rotary_dim, const HeadNorms* head_norms, const KvCacheView& cache) override;
  void attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                 Tensor& out) override;

  // Present exactly where the target's are.
  HybridOps* hybrid_ops() override;
  GraphOps* graph_ops() override;

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

  // Runs `work` once, with its allocations served from the captured work's pool; the returned
  // work's replay does nothing. Attention inside it allocates for the whole cache, as the
  // interface says captured work does.
  std::unique_ptr<CapturedWork> capture(const std::function<void()>& work) override;
  void upload_into(const Tensor& host, Tensor& device) override;
  void sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                     Tensor& logprobs) override;
  std::vector<uint64_t> sampling_scratch_bytes(int64_t rows, int64_t vocab, bool sorting) const override;
  void feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) override;
  std::unique_ptr<PendingDownload> download_later(const Tensor& device, Tensor& host) override;
  // Real, zeroed host memory: the engine writes a step's inputs into these buffers (they hold a
  // few words per decode row).
  Tensor alloc_pinned(const Shape& shape, DType dtype) override;

 private:
  class Allocator;

  // A measured tensor whose block is held for as long as the tensor or a view of it exists.
  Tensor measured_tensor(const Shape& shape, DType dtype);
  // Holds a scratch block of `bytes` (none for 0) until the returned handle goes.
  std::shared_ptr<const void> scratch(uint64_t bytes);
  // The target as the op contract sees it: its name, activations and device.
  OpContext contract() const { return {name_, activations_, device_}; }

  Backend& target_;
  std::string name_;
  Device device_;
  DType activations_;
  std::shared_ptr<Allocator> allocator_;  // shared with the blocks it hands out
  bool capturing_ = false;
};

}  // namespace kiln
