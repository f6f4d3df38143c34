// A test backend that hands every call to a CPU backend: a test derives from it and overrides only
// the calls it watches or changes (decode_graph_test's replaying "graphs", memory_plan_test's
// counted allocations).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace kiln::testing {

class ForwardingCpuBackend : public Backend, public HybridOps {
 public:
  std::string name() const override { return cpu_->name(); }
  Device device() const override { return cpu_->device(); }
  DType activation_dtype() const override { return cpu_->activation_dtype(); }
  double measure_copy_bandwidth_gbps() override { return cpu_->measure_copy_bandwidth_gbps(); }
  void synchronize() override { cpu_->synchronize(); }
  Tensor alloc(const Shape& shape, DType dtype) override { return cpu_->alloc(shape, dtype); }
  DeviceMemory memory() override { return cpu_->memory(); }
  uint64_t allocation_bytes(uint64_t bytes) const override { return cpu_->allocation_bytes(bytes); }
  bool caches_freed_blocks() const override { return cpu_->caches_freed_blocks(); }
  Tensor upload(const Tensor& host) override { return cpu_->upload(host); }
  Tensor download(const Tensor& tensor) override { return cpu_->download(tensor); }
  void zero(Tensor& tensor) override { cpu_->zero(tensor); }
  void copy(const Tensor& from, Tensor& to) override { cpu_->copy(from, to); }
  BatchLayout make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) override {
    return cpu_->make_layout(spans, token_ids);
  }

  void embedding(const Weight& table, const Tensor& ids, Tensor& out) override { cpu_->embedding(table, ids, out); }
  void matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) override {
    cpu_->matmul(x, w, bias, out);
  }
  void matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) override { cpu_->matmul_group(x, targets); }
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) override {
    cpu_->rms_norm(x, weight, eps, style, out);
  }
  void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps, NormStyle style,
                    Tensor& out) override {
    cpu_->add_rms_norm(residual, delta, weight, eps, style, out);
  }
  void add(Tensor& a, const Tensor& b) override { cpu_->add(a, b); }
  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override { cpu_->gather_rows(x, rows, out); }
  void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                 Tensor& weights) override {
    cpu_->moe_route(logits, shared_logits, normalize, experts, weights);
  }
  void expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                     Tensor* experts_read) override {
    cpu_->expert_matmul(x, experts, targets, experts_read);
  }
  void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) override {
    cpu_->moe_combine(routed, shared, weights, out);
  }
  void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) override {
    cpu_->rope(x, positions, inv_freq, rotary_dim);
  }
  void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override { cpu_->swiglu(gate, up, out); }
  void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) override {
    cpu_->kv_write(k, v, layout, cache);
  }
  void rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                     int rotary_dim, const HeadNorms* head_norms, const KvCacheView& cache) override {
    cpu_->rope_kv_write(q, k, v, layout, inv_freq, rotary_dim, head_norms, cache);
  }
  void attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                 Tensor& out) override {
    cpu_->attention(q, cache, layout, scale, out);
  }

  HybridOps* hybrid_ops() override { return this; }
  void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) override {
    hybrid_.split_query_gate(query_and_gate, query, gate);
  }
  void sigmoid_gate(Tensor& x, const Tensor& gate) override { hybrid_.sigmoid_gate(x, gate); }
  void causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout, Tensor& conv_state,
                          Tensor& out) override {
    hybrid_.causal_conv1d_silu(x, weight, layout, conv_state, out);
  }
  void gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) override {
    hybrid_.gated_delta_prepare_qkv(qkv, q, k, v);
  }
  void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias, Tensor& beta,
                         Tensor& g) override {
    hybrid_.gated_delta_gates(b, a, a_log, dt_bias, beta, g);
  }
  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const BatchLayout& layout, Tensor& state, Tensor& out) override {
    hybrid_.gated_delta_rule(q, k, v, g, beta, layout, state, out);
  }
  void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) override {
    hybrid_.rms_norm_gated(x, z, weight, eps, out);
  }

 protected:
  Backend& cpu() { return *cpu_; }

 private:
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  HybridOps& hybrid_ = *cpu_->hybrid_ops();
};

}  // namespace kiln::testing
