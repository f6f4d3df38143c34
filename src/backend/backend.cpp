#include "backend/backend.h"

#include "backend/op_contract.h"
#include "core/error.h"

namespace kiln {

Weight Backend::upload_weight(const Weight& host) {
  if (!host.quantized()) return Weight(upload(host.values()));
  auto part = [&](const Tensor& tensor) { return tensor.defined() && tensor.numel() > 0 ? upload(tensor) : tensor; };
  return host.with_parts(upload(host.values()), upload(host.scales()), part(host.biases()));
}

void Backend::matmul_group(const Tensor& x, std::span<const MatmulTarget> targets) {
  const std::string backend = name();
  check_matmul_group(OpContext{backend, activation_dtype(), device()}, x, targets);
  for (const MatmulTarget& target : targets) matmul(x, *target.w, target.bias, *target.out);
}

void Backend::rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                            int rotary_dim, const HeadNorms* head_norms, const KvCacheView& cache) {
  const std::string backend = name();
  check_rope_kv_write(OpContext{backend, activation_dtype(), device()}, q, k, v, layout, inv_freq, rotary_dim, head_norms,
                      cache);
  if (head_norms) {
    rms_norm(q, head_norms->q_weight, head_norms->eps, head_norms->style, q);
    rms_norm(k, head_norms->k_weight, head_norms->eps, head_norms->style, k);
  }
  rope(q, layout.positions, inv_freq, rotary_dim);
  rope(k, layout.positions, inv_freq, rotary_dim);
  kv_write(k, v, layout, cache);
}

void check_recurrent_spans(std::span<const SequenceSpan> spans, int64_t total_tokens, int64_t slots,
                           const std::string& op) {
  std::vector<bool> slot_taken(static_cast<size_t>(slots), false);
  for (const SequenceSpan& span : spans) {
    if (span.tokens < 0 || span.first_token < 0 || span.first_position < 0 ||
        int64_t{span.first_token} + span.tokens > total_tokens)
      fail("{}: span (slot {}, first_token {}, tokens {}, first_position {}) lies outside the {} tokens "
           "of the batch", op, span.slot, span.first_token, span.tokens, span.first_position, total_tokens);
    if (span.slot < 0 || span.slot >= slots)
      fail("{}: span slot {} is outside the {} slots of the state", op, span.slot, slots);
    if (slot_taken[static_cast<size_t>(span.slot)]) fail("{}: two spans of one batch use slot {}", op, span.slot);
    slot_taken[static_cast<size_t>(span.slot)] = true;
  }
}

}  // namespace kiln
