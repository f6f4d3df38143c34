// The CPU backend: f32 activations, weights read in their stored dtype (F32, BF16, F16), SIMD
// kernels chosen once per backend from the detected instruction set.
//
// Not safe for concurrent calls: ops share the process-wide thread pool and per-backend scratch.
#pragma once

#include <istream>
#include <memory>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"
#include "backend/cpu/ops.h"

namespace kiln::cpu {

// MemAvailable and MemTotal (in bytes) from the text of /proc/meminfo; fails when either is missing.
DeviceMemory parse_meminfo(std::istream& meminfo);

class CpuBackend final : public Backend, public HybridOps {
 public:
  // Fails (kiln::Error) when this CPU cannot run `isa`.
  explicit CpuBackend(CpuIsa isa);

  CpuIsa isa() const { return isa_; }

  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::CPU; }
  DType activation_dtype() const override { return DType::F32; }
  // Copy bandwidth with the global pool's thread count (memory_bandwidth.h).
  double measure_copy_bandwidth_gbps() override;
  // Every op has finished when it returns.
  void synchronize() override {}

  Tensor alloc(const Shape& shape, DType dtype) override;
  // MemAvailable and MemTotal of /proc/meminfo (the kernel's estimate of what can be allocated
  // without swapping).
  DeviceMemory memory() override;
  Tensor upload(const Tensor& host) override;
  Tensor download(const Tensor& tensor) override;
  void zero(Tensor& tensor) override;
  void copy(const Tensor& from, Tensor& to) override;
  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override;

  void embedding(const Weight& table, const Tensor& ids, Tensor& out) override;
  void matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) override;
  void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                    Tensor& out) override;
  void add(Tensor& a, const Tensor& b) override;
  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override;
  void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                 Tensor& weights) override;
  // The routes are in host memory: the pairs are sorted by expert and each expert's rows take one
  // matmul (Backend::expert_matmul_on_host).
  void expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                     Tensor* experts_read) override;
  void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) override;
  void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) override;
  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) override;
  void attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                 Tensor& out) override;

  HybridOps* hybrid_ops() override { return this; }
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
  CpuIsa isa_;
  const MatmulKernels& matmul_kernels_;
  const AttentionKernels& attention_kernels_;
  MatmulScratch matmul_scratch_;
};

// A CPU backend on a chosen instruction set (tests and benchmarks compare them); fails when the
// CPU lacks it. make_cpu_backend() (backend.h) uses best_cpu_isa().
std::unique_ptr<Backend> make_cpu_backend(CpuIsa isa);

}  // namespace kiln::cpu
