#include "backend/backend.h"

#include <numeric>

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

void Backend::expert_matmul_on_host(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                                    Tensor* experts_read) {
  const std::string backend = name();
  const ExpertMatmulDims dims =
      check_expert_matmul(OpContext{backend, activation_dtype(), device()}, x, experts, targets, experts_read);
  const int64_t pairs = dims.tokens * dims.top_k;
  const int64_t count = *std::min_element(dims.experts, dims.experts + targets.size());
  const Tensor routes = download(experts);
  const int32_t* ids = routes.data<int32_t>();
  // Expert e's pairs are rows first[e] … first[e + 1] − 1 of the sorted order, ascending by pair.
  std::vector<int64_t> first(static_cast<size_t>(count) + 1, 0);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    if (ids[pair] < 0 || ids[pair] >= count)
      fail("{} expert_matmul: experts[{}, {}] is {}, outside the weights' {} experts", backend, pair / dims.top_k,
           pair % dims.top_k, ids[pair], count);
    ++first[static_cast<size_t>(ids[pair]) + 1];
  }
  std::partial_sum(first.begin(), first.end(), first.begin());
  Tensor x_rows = Tensor::empty({pairs}, DType::I32), sorted_rows = Tensor::empty({pairs}, DType::I32);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t row = next[static_cast<size_t>(ids[pair])]++;
    x_rows.data<int32_t>()[row] = static_cast<int32_t>(dims.x_rows == pairs ? pair : pair / dims.top_k);
    sorted_rows.data<int32_t>()[pair] = static_cast<int32_t>(row);
  }
  Tensor gathered = alloc({pairs, dims.k}, x.dtype());
  gather_rows(x, upload(x_rows), gathered);
  std::vector<Tensor> sorted;
  for (const MatmulTarget& target : targets) sorted.push_back(alloc({pairs, target.out->dim(1)}, target.out->dtype()));
  int64_t experts_with_pairs = 0;
  for (int64_t e = 0; e < count; ++e) {
    const int64_t begin = first[static_cast<size_t>(e)], rows = first[static_cast<size_t>(e) + 1] - begin;
    if (rows == 0) continue;
    ++experts_with_pairs;
    Weight matrices[kMaxMatmulGroup];
    Tensor outs[kMaxMatmulGroup];
    MatmulTarget products[kMaxMatmulGroup];
    for (size_t t = 0; t < targets.size(); ++t) {
      matrices[t] = targets[t].w->rows(e * dims.n[t], dims.n[t]);
      outs[t] = sorted[t].slice_rows(begin, rows);
      products[t] = {&matrices[t], nullptr, &outs[t]};
    }
    matmul_group(gathered.slice_rows(begin, rows), {products, targets.size()});
  }
  const Tensor pair_rows = upload(sorted_rows);
  for (size_t t = 0; t < targets.size(); ++t) gather_rows(sorted[t], pair_rows, *targets[t].out);
  if (experts_read) {
    Tensor total = download(*experts_read);
    total.data<uint32_t>()[0] += static_cast<uint32_t>(experts_with_pairs);
    copy(upload(total), *experts_read);
  }
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
