#include "backend/measuring_backend.h"

#include <algorithm>
#include <map>
#include <utility>

#include "backend/op_contract.h"
#include "core/error.h"

namespace kiln {

// The target's allocator as far as its footprint goes: blocks of the target's rounded sizes,
// a freed block kept for its size (a caching target) or given back, and the captured work's pool,
// whose blocks are kept (device_allocator.h is the CUDA allocator this follows).
class MeasuringBackend::Allocator : public std::enable_shared_from_this<Allocator> {
 public:
  explicit Allocator(bool caches_freed_blocks) : caches_freed_blocks_(caches_freed_blocks) {}

  // A block of `size` (already rounded) held until the returned handle goes.
  std::shared_ptr<const void> take(uint64_t size, bool capturing) {
    bool from_capture_pool = false;
    if (capturing) from_capture_pool = take_free(capture_pool_, size);
    if (!from_capture_pool && !take_free(shared_pool_, size)) {
      held_ += size;
      peak_held_ = std::max(peak_held_, held_);
    }
    in_use_ += size;
    // Blocks taken while capturing go back to the capture pool, whatever pool they came from.
    auto self = shared_from_this();
    return std::shared_ptr<const void>(nullptr, [self, size, capturing](const void*) { self->give_back(size, capturing); });
  }

  MeasuredMemory measured() const { return {held_, peak_held_, in_use_}; }
  void restart_peak() { peak_held_ = held_; }

 private:
  static bool take_free(std::map<uint64_t, int64_t>& pool, uint64_t size) {
    const auto found = pool.find(size);
    if (found == pool.end()) return false;
    if (--found->second == 0) pool.erase(found);
    return true;
  }

  void give_back(uint64_t size, bool to_capture_pool) {
    in_use_ -= size;
    if (to_capture_pool) ++capture_pool_[size];
    else if (caches_freed_blocks_) ++shared_pool_[size];
    else held_ -= size;
  }

  bool caches_freed_blocks_;
  uint64_t held_ = 0, peak_held_ = 0, in_use_ = 0;
  std::map<uint64_t, int64_t> shared_pool_;   // free blocks by size (a caching target's)
  std::map<uint64_t, int64_t> capture_pool_;  // free blocks of captured work by size
};

namespace {

class NothingCaptured final : public CapturedWork {
 public:
  void replay() override {}
};

class NothingPending final : public PendingDownload {
 public:
  void wait() override {}
};

}  // namespace

MeasuringBackend::MeasuringBackend(Backend& target)
    : target_(target),
      name_(target.name()),
      device_(target.device()),
      activations_(target.activation_dtype()),
      allocator_(std::make_shared<Allocator>(target.caches_freed_blocks())) {}

MeasuringBackend::~MeasuringBackend() = default;

MeasuredMemory MeasuringBackend::measured() const { return allocator_->measured(); }

void MeasuringBackend::restart_peak() { allocator_->restart_peak(); }

double MeasuringBackend::measure_copy_bandwidth_gbps() {
  fail("the measuring backend for {} computes nothing: it has no copy bandwidth to measure", name_);
}

Tensor MeasuringBackend::measured_tensor(const Shape& shape, DType dtype) {
  for (int64_t extent : shape)
    if (extent < 0) fail("{} alloc: shape {} has a negative extent", name_, shape_string(shape));
  const uint64_t bytes = static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype);
  return Tensor::unbacked(shape, dtype, device_, allocator_->take(target_.allocation_bytes(bytes), capturing_));
}

std::shared_ptr<const void> MeasuringBackend::scratch(uint64_t bytes) {
  if (bytes == 0) return nullptr;
  return allocator_->take(target_.allocation_bytes(bytes), capturing_);
}

Tensor MeasuringBackend::alloc(const Shape& shape, DType dtype) { return measured_tensor(shape, dtype); }

Tensor MeasuringBackend::upload(const Tensor& host) {
  if (!host.defined()) fail("{} upload: the host tensor is undefined", name_);
  if (host.device() != Device::CPU) return host;
  return measured_tensor(host.shape(), host.dtype());
}

Tensor MeasuringBackend::download(const Tensor& tensor) {
  if (!tensor.defined()) fail("{} download: the tensor is undefined", name_);
  return Tensor::unbacked(tensor.shape(), tensor.dtype());
}

void MeasuringBackend::zero(Tensor& tensor) {
  if (!tensor.defined()) fail("{} zero: the tensor is undefined", name_);
}

void MeasuringBackend::copy(const Tensor& from, Tensor& to) { check_copy(contract(), from, to); }

BatchLayout MeasuringBackend::make_layout(const std::vector<SequenceSpan>& spans,
                                          const std::vector<int32_t>& token_ids) {
  int64_t total = 0;
  for (size_t index = 0; index < spans.size(); ++index) {
    const SequenceSpan& span = spans[index];
    if (span.tokens <= 0 || span.slot < 0 || span.first_position < 0)
      fail("{} make_layout: span {} (slot {}, tokens {}, first_position {}) needs a slot and a first position >= 0 "
           "and at least one token", name_, index, span.slot, span.tokens, span.first_position);
    if (span.first_token != total)
      fail("{} make_layout: span {} starts at token {}, but the spans before it end at token {}", name_, index,
           span.first_token, total);
    total += span.tokens;
  }
  if (static_cast<int64_t>(token_ids.size()) != total)
    fail("{} make_layout: {} token ids for spans covering {} tokens", name_, token_ids.size(), total);
  const auto span_count = static_cast<int64_t>(spans.size());
  const Tensor packed = measured_tensor({3 * total + 4 * span_count}, DType::I32);
  const auto owner = std::make_shared<const Tensor>(packed);
  BatchLayout layout;
  layout.spans = spans;
  layout.total_tokens = total;
  layout.token_ids = Tensor::unbacked({total}, DType::I32, device_, owner);
  layout.positions = Tensor::unbacked({total}, DType::I32, device_, owner);
  layout.slots = Tensor::unbacked({total}, DType::I32, device_, owner);
  layout.spans_device = Tensor::unbacked({span_count, 4}, DType::I32, device_, owner);
  return layout;
}

void MeasuringBackend::embedding(const Weight& table, const Tensor& ids, Tensor& out) {
  check_embedding(contract(), table, ids, out);
}

void MeasuringBackend::matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) {
  check_matmul(contract(), x, w, bias, out);
  const MatmulTarget product{&w, bias, &out};
  const auto held = scratch(target_.matmul_scratch_bytes(x, {&product, 1}));
}

void MeasuringBackend::matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) {
  check_matmul_group(contract(), x, targets);
  const auto held = scratch(target_.matmul_scratch_bytes(x, targets));
}

void MeasuringBackend::rms_norm(const Tensor& x, const Tensor& weight, float, NormStyle, Tensor& out) {
  check_rms_norm(contract(), x, weight, out);
}

void MeasuringBackend::add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float, NormStyle,
                                    Tensor& out) {
  check_add_rms_norm(contract(), residual, delta, weight, out);
}

void MeasuringBackend::add(Tensor& a, const Tensor& b) { check_add(contract(), a, b); }

void MeasuringBackend::moe_route(const Tensor& logits, const Tensor* shared_logits, bool, Tensor& experts,
                                 Tensor& weights) {
  check_moe_route(contract(), logits, shared_logits, experts, weights);
}

void MeasuringBackend::expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                                     Tensor* experts_read) {
  check_expert_matmul(contract(), x, experts, targets, experts_read);
  const auto held = scratch(target_.expert_matmul_scratch_bytes(x, experts, targets));
}

void MeasuringBackend::moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) {
  check_moe_combine(contract(), routed, shared, weights, out);
}

void MeasuringBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  check_gather_rows(contract(), x, rows, out);
}

void MeasuringBackend::rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  check_rope(contract(), "rope", "x", x, positions, inv_freq, rotary_dim);
}

void MeasuringBackend::swiglu(const Tensor& gate, const Tensor& up, Tensor& out) {
  check_swiglu(contract(), gate, up, out);
}

void MeasuringBackend::kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) {
  check_kv_write(contract(), k, v, layout, cache);
}

void MeasuringBackend::rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout,
                                     const Tensor& inv_freq, int rotary_dim, const HeadNorms* head_norms,
                                     const KvCacheView& cache) {
  check_rope_kv_write(contract(), q, k, v, layout, inv_freq, rotary_dim, head_norms, cache);
}

void MeasuringBackend::attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float,
                                 Tensor& out) {
  const AttentionDims dims = check_attention(contract(), q, cache, layout, out);
  // Captured work replays at later positions, so it is sized for the whole cache (GraphOps::capture).
  int64_t max_position = 0;
  if (capturing_) {
    max_position = dims.cache.capacity - 1;
  } else {
    for (const SequenceSpan& span : layout.spans)
      max_position = std::max<int64_t>(max_position, int64_t{span.first_position} + span.tokens - 1);
  }
  const auto held =
      scratch(target_.attention_scratch_bytes(dims.tokens, dims.heads, dims.cache.head_dim, max_position));
}

HybridOps* MeasuringBackend::hybrid_ops() { return target_.hybrid_ops() ? this : nullptr; }

GraphOps* MeasuringBackend::graph_ops() { return target_.graph_ops() ? this : nullptr; }

void MeasuringBackend::split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) {
  check_split_query_gate(contract(), query_and_gate, query, gate);
}

void MeasuringBackend::sigmoid_gate(Tensor& x, const Tensor& gate) {
  check_sigmoid_gate(contract(), x, gate);
}

void MeasuringBackend::causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout,
                                          Tensor& conv_state, Tensor& out) {
  check_causal_conv1d_silu(contract(), x, weight, layout.spans, conv_state, out);
}

void MeasuringBackend::gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  check_gated_delta_prepare_qkv(contract(), qkv, q, k, v);
}

void MeasuringBackend::gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log,
                                         const Tensor& dt_bias, Tensor& beta, Tensor& g) {
  check_gated_delta_gates(contract(), b, a, a_log, dt_bias, beta, g);
}

void MeasuringBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const BatchLayout& layout, Tensor& state, Tensor& out) {
  check_gated_delta_rule(contract(), "gated_delta_rule", q, k, v, g, beta, layout.spans, state, out);
}

void MeasuringBackend::rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float, Tensor& out) {
  check_rms_norm_gated(contract(), x, z, weight, out);
}

std::unique_ptr<CapturedWork> MeasuringBackend::capture(const std::function<void()>& work) {
  if (capturing_) fail("{} graph capture: capture() was called from inside captured work", name_);
  capturing_ = true;
  struct Restore {
    bool& capturing;
    ~Restore() { capturing = false; }
  } restore{capturing_};
  work();
  return std::make_unique<NothingCaptured>();
}

void MeasuringBackend::upload_into(const Tensor& host, Tensor& device) {
  if (!host.defined() || host.device() != Device::CPU) fail("{} upload_into: the source must be a host tensor", name_);
  if (!device.defined()) fail("{} upload_into: the device tensor is undefined", name_);
  if (host.dtype() != device.dtype() || host.numel() != device.numel())
    fail("{} upload_into: host {} {} does not match device {} {}", name_, dtype_name(host.dtype()),
         shape_string(host.shape()), dtype_name(device.dtype()), shape_string(device.shape()));
}

void MeasuringBackend::sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                                     Tensor& logprobs) {
  const SamplingDims dims = check_sample_tokens(contract(), logits, settings, tokens, logprobs);
  std::vector<std::shared_ptr<const void>> held;
  for (uint64_t bytes : sampling_scratch_bytes(dims.rows, dims.vocab, sorting)) held.push_back(scratch(bytes));
}

std::vector<uint64_t> MeasuringBackend::sampling_scratch_bytes(int64_t rows, int64_t vocab, bool sorting) const {
  return target_.graph_ops() ? target_.graph_ops()->sampling_scratch_bytes(rows, vocab, sorting)
                             : std::vector<uint64_t>{};
}

void MeasuringBackend::feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) {
  check_feed_tokens(contract(), previous, feed, token_ids);
}

std::unique_ptr<PendingDownload> MeasuringBackend::download_later(const Tensor& device, Tensor& host) {
  if (!device.defined()) fail("{} download_later: the device tensor is undefined", name_);
  if (host.device() != Device::CPU || host.dtype() != device.dtype() || host.numel() != device.numel())
    fail("{} download_later: host {} {} does not match device {} {}", name_, dtype_name(host.dtype()),
         shape_string(host.shape()), dtype_name(device.dtype()), shape_string(device.shape()));
  return std::make_unique<NothingPending>();
}

Tensor MeasuringBackend::alloc_pinned(const Shape& shape, DType dtype) { return Tensor::zeros(shape, dtype); }

}  // namespace kiln
