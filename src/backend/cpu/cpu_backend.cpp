#include "backend/cpu/cpu_backend.h"

#include <cstring>
#include <fstream>
#include <string>

#include "backend/cpu/checks.h"
#include "backend/cpu/gated_delta.h"
#include "backend/cpu/memory_bandwidth.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

CpuIsa checked(CpuIsa isa) {
  if (!cpu_supports(isa)) fail("cpu backend: this CPU does not support the {} instruction set", isa_name(isa));
  return isa;
}

const MatmulKernels& matmul_kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return matmul_kernels_avx512();
    case CpuIsa::Avx2: return matmul_kernels_avx2();
    case CpuIsa::Scalar: break;
  }
  return matmul_kernels_scalar();
}

const AttentionKernels& attention_kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return attention_kernels_avx512();
    case CpuIsa::Avx2: return attention_kernels_avx2();
    case CpuIsa::Scalar: break;
  }
  return attention_kernels_scalar();
}

}  // namespace

CpuBackend::CpuBackend(CpuIsa isa)
    : isa_(checked(isa)), matmul_kernels_(matmul_kernels_for(isa)), attention_kernels_(attention_kernels_for(isa)) {}

double CpuBackend::measure_copy_bandwidth_gbps() {
  return cpu::measure_copy_bandwidth_gbps(ThreadPool::global().size());
}

Tensor CpuBackend::alloc(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype); }

DeviceMemory parse_meminfo(std::istream& meminfo) {
  DeviceMemory memory;
  std::string key, unit;
  uint64_t kib = 0;
  bool found_available = false, found_total = false;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") memory.available = kib * 1024, found_available = true;
    if (key == "MemTotal:") memory.total = kib * 1024, found_total = true;
  }
  if (!found_available || !found_total) fail("cpu backend: /proc/meminfo has no MemAvailable or MemTotal line");
  return memory;
}

DeviceMemory CpuBackend::memory() {
  std::ifstream meminfo("/proc/meminfo");
  if (!meminfo) fail("cpu backend: cannot read /proc/meminfo for the memory available");
  return parse_meminfo(meminfo);
}

Tensor CpuBackend::upload(const Tensor& host) {
  require_cpu(host, "upload", "tensor");
  return host;
}

Tensor CpuBackend::download(const Tensor& tensor) {
  require_cpu(tensor, "download", "tensor");
  Tensor copy = Tensor::empty(tensor.shape(), tensor.dtype());
  std::memcpy(copy.raw(), tensor.raw(), tensor.nbytes());
  return copy;
}

void CpuBackend::zero(Tensor& tensor) {
  require_cpu(tensor, "zero", "tensor");
  std::memset(tensor.raw(), 0, tensor.nbytes());
}

void CpuBackend::copy(const Tensor& from, Tensor& to) {
  const int64_t bytes = check_copy(kCpuOps, from, to);
  require_cpu(from, "copy", "from");
  require_cpu(to, "copy", "to");
  if (bytes > 0) std::memcpy(to.raw(), from.raw(), static_cast<size_t>(bytes));
}

BatchLayout CpuBackend::make_layout(const std::vector<SequenceSpan>& spans, const std::vector<int32_t>& token_ids) {
  return cpu::make_layout(spans, token_ids);
}

void CpuBackend::embedding(const Weight& table, const Tensor& ids, Tensor& out) { cpu::embedding(table, ids, out); }

void CpuBackend::matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) {
  cpu::matmul(matmul_kernels_, x, w, bias, out, matmul_scratch_);
}

void CpuBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) {
  cpu::rms_norm(x, weight, eps, style, out);
}

void CpuBackend::add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                              NormStyle style, Tensor& out) {
  cpu::add_rms_norm(residual, delta, weight, eps, style, out);
}

void CpuBackend::add(Tensor& a, const Tensor& b) { cpu::add(a, b); }

void CpuBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) { cpu::gather_rows(x, rows, out); }
void CpuBackend::moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                           Tensor& weights) {
  cpu::moe_route(logits, shared_logits, normalize, experts, weights);
}

void CpuBackend::expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                               Tensor* experts_read) {
  expert_matmul_on_host(x, experts, targets, experts_read);
}

void CpuBackend::moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) {
  cpu::moe_combine(routed, shared, weights, out);
}

void CpuBackend::rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  cpu::rope(x, positions, inv_freq, rotary_dim);
}

void CpuBackend::swiglu(const Tensor& gate, const Tensor& up, Tensor& out) { cpu::swiglu(gate, up, out); }

void CpuBackend::kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) {
  cpu::kv_write(k, v, layout, cache);
}

void CpuBackend::attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                           Tensor& out) {
  cpu::attention(attention_kernels_, q, cache, layout, scale, out);
}

void CpuBackend::split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  cpu::split_query_gate(query_and_gate, query, gate);
}

void CpuBackend::sigmoid_gate(Tensor& x, const Tensor& gate) { cpu::sigmoid_gate(x, gate); }

void CpuBackend::causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout,
                                    Tensor& conv_state, Tensor& out) {
  cpu::causal_conv1d_silu(x, weight, layout.spans, conv_state, out);
}

void CpuBackend::gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  cpu::gated_delta_prepare_qkv(qkv, q.dim(1), q.dim(2), v.dim(1), v.dim(2), q, k, v);
}

void CpuBackend::gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                   Tensor& beta, Tensor& g) {
  cpu::gated_delta_gates(b, a, a_log, dt_bias, beta, g);
}

void CpuBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, const BatchLayout& layout, Tensor& state, Tensor& out) {
  cpu::gated_delta_rule_chunked(q, k, v, g, beta, layout.spans, state, out);
}

void CpuBackend::rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) {
  cpu::rms_norm_gated(x, z, weight, eps, out);
}

std::unique_ptr<Backend> make_cpu_backend(CpuIsa isa) { return std::make_unique<CpuBackend>(isa); }

}  // namespace kiln::cpu

namespace kiln {

std::unique_ptr<Backend> make_cpu_backend() { return cpu::make_cpu_backend(cpu::best_cpu_isa()); }

}  // namespace kiln
