#include "backend/op_contract.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln {
namespace {

std::string_view placement(Device device) { return device == Device::CPU ? "host memory" : "CUDA device memory"; }

void require_defined(const OpContext& context, std::string_view op, const Tensor& tensor, std::string_view name) {
  if (!tensor.defined()) fail("{} {}: {} is an undefined tensor", context.backend, op, name);
  if (tensor.device() != context.device)
    fail("{} {}: {} is in {}, but this backend's kernels read {} (upload or download it first)", context.backend, op,
         name, placement(tensor.device()), placement(context.device));
}

void require_dtype(const OpContext& context, std::string_view op, const Tensor& tensor, DType dtype,
                   std::string_view name) {
  require_defined(context, op, tensor, name);
  if (tensor.dtype() != dtype)
    fail("{} {}: {} has dtype {}, expected {}", context.backend, op, name, dtype_name(tensor.dtype()),
         dtype_name(dtype));
}

void require_weight(const OpContext& context, std::string_view op, const Tensor& tensor, std::string_view name) {
  require_defined(context, op, tensor, name);
  if (tensor.dtype() != DType::F32 && tensor.dtype() != DType::BF16 && tensor.dtype() != DType::F16)
    fail("{} {}: {} has dtype {}, expected F32, BF16 or F16", context.backend, op, name, dtype_name(tensor.dtype()));
}

// A matmul's or embedding's weight: a dense weight as require_weight says; a quantized one's
// parts (their dtypes and shapes were checked when the Weight was made) on the backend's device.
void require_matrix(const OpContext& context, std::string_view op, const Weight& weight, std::string_view name) {
  if (!weight.quantized()) return require_weight(context, op, weight.values(), name);
  require_defined(context, op, weight.values(), name);
  if (weight.code_order() == CodeOrder::Fragment && context.device != Device::CUDA)
    fail("{} {}: {} holds its codes in the CUDA backend's fragment order, which only the CUDA kernels read",
         context.backend, op, name);
  require_defined(context, op, weight.scales(), fmt::format("{} scales", name));
  if (weight.format() == WeightFormat::Affine) require_defined(context, op, weight.biases(), fmt::format("{} biases", name));
}

void require_activation(const OpContext& context, std::string_view op, const Tensor& tensor, std::string_view name) {
  require_defined(context, op, tensor, name);
  if (tensor.dtype() != context.activations)
    fail("{} {}: {} has dtype {}, expected the activation dtype {}", context.backend, op, name,
         dtype_name(tensor.dtype()), dtype_name(context.activations));
}

// The residual stream is f32 whatever the activations (model/model.h); ops that read or write it
// also take the activation dtype.
void require_stream(const OpContext& context, std::string_view op, const Tensor& tensor, std::string_view name) {
  require_defined(context, op, tensor, name);
  if (tensor.dtype() != DType::F32 && tensor.dtype() != context.activations)
    fail("{} {}: {} has dtype {}, expected F32 or the activation dtype {}", context.backend, op, name,
         dtype_name(tensor.dtype()), dtype_name(context.activations));
}

void require_shape(const OpContext& context, std::string_view op, const Tensor& tensor, const Shape& shape,
                   std::string_view name) {
  if (tensor.shape() != shape)
    fail("{} {}: {} has shape {}, expected {}", context.backend, op, name, shape_string(tensor.shape()),
         shape_string(shape));
}

void require_same_numel(const OpContext& context, std::string_view op, const Tensor& a, std::string_view a_name,
                        const Tensor& b, std::string_view b_name) {
  if (a.numel() != b.numel())
    fail("{} {}: {} {} and {} {} differ in element count", context.backend, op, a_name, shape_string(a.shape()), b_name,
         shape_string(b.shape()));
}

void require_layout_tokens(const OpContext& context, std::string_view op, const BatchLayout& layout, int64_t tokens) {
  if (layout.total_tokens != tokens)
    fail("{} {}: the inputs have {} tokens, but the layout has {}", context.backend, op, tokens, layout.total_tokens);
}

// Both norms: a weight [D > 0] over the last axis of x.
int64_t check_norm_weight(const OpContext& context, std::string_view op, const Tensor& x, const Tensor& weight) {
  require_weight(context, op, weight, "weight");
  if (weight.ndim() != 1 || weight.numel() == 0)
    fail("{} {}: weight has shape {}, expected [D] with D > 0", context.backend, op, shape_string(weight.shape()));
  const int64_t width = weight.numel();
  // The CPU required x's last axis to be D, CUDA only a whole number of rows of D.
  if (x.ndim() < 1 || x.dim(-1) != width)
    fail("{} {}: x has shape {}, expected its last axis to be D = {}", context.backend, op, shape_string(x.shape()),
         width);
  return width;
}

// Two activations of as many elements (element-wise ops): returns that count.
int64_t check_same_numel_activations(const OpContext& context, std::string_view op, const Tensor& a,
                                     std::string_view a_name, const Tensor& b, std::string_view b_name) {
  require_activation(context, op, a, a_name);
  require_activation(context, op, b, b_name);
  require_same_numel(context, op, a, a_name, b, b_name);
  return a.numel();
}

// rms_norm and add_rms_norm: their stream input `x` (called `x_name`), its weight, and an out of as
// many elements that may be x itself only in x's dtype. Returns the row width D.
int64_t check_norm_input_and_out(const OpContext& context, std::string_view op, const Tensor& x,
                                 std::string_view x_name, const Tensor& weight, const Tensor& out) {
  require_stream(context, op, x, x_name);
  const int64_t width = check_norm_weight(context, op, x, weight);
  require_activation(context, op, out, "out");
  require_same_numel(context, op, x, x_name, out, "out");
  if (out.raw() == x.raw() && out.dtype() != x.dtype())
    fail("{} {}: out {} is {} {} in another dtype (in place only in one dtype)", context.backend, op,
         dtype_name(out.dtype()), x_name, dtype_name(x.dtype()));
  return width;
}

}  // namespace

EmbeddingDims check_embedding(const OpContext& context, const Weight& table, const Tensor& ids, const Tensor& out) {
  constexpr std::string_view op = "embedding";
  require_matrix(context, op, table, "table");
  if (table.shape().size() != 2)
    fail("{} {}: table has shape {}, expected [vocab, hidden]", context.backend, op, shape_string(table.shape()));
  require_dtype(context, op, ids, DType::I32, "ids");
  // The CPU required ids [T] and out [T, hidden]; CUDA only out's element count.
  if (ids.ndim() != 1) fail("{} {}: ids has shape {}, expected [T]", context.backend, op, shape_string(ids.shape()));
  // The CPU wrote F32 only (its activation dtype); CUDA also wrote its activations.
  require_stream(context, op, out, "out");
  const EmbeddingDims dims{table.dim(0), table.dim(1), ids.dim(0)};
  require_shape(context, op, out, {dims.tokens, dims.hidden}, "out");
  return dims;
}

MatmulDims check_matmul(const OpContext& context, const Tensor& x, const Weight& w, const Tensor* bias,
                        const Tensor& out) {
  constexpr std::string_view op = "matmul";
  require_matrix(context, op, w, "weight");
  if (w.shape().size() != 2 || w.dim(1) == 0)
    fail("{} {}: weight has shape {}, expected [N, K] with K > 0", context.backend, op, shape_string(w.shape()));
  const int64_t n = w.dim(0), k = w.dim(1);
  require_activation(context, op, x, "x");
  // The CPU required x [..., K] and out [..., N]; CUDA only whole rows of K and M · N elements.
  if (x.ndim() < 1 || x.dim(-1) != k)
    fail("{} {}: x has shape {}, expected its last axis to be K = {} of weight {}", context.backend, op,
         shape_string(x.shape()), k, shape_string(w.shape()));
  const int64_t rows = x.numel() / k;
  // The CPU wrote F32 only (its activation dtype); CUDA F32 or its activations.
  require_stream(context, op, out, "out");
  if (out.ndim() < 1 || out.dim(-1) != n || out.numel() != rows * n)
    fail("{} {}: out has shape {}, expected {} rows of N = {}", context.backend, op, shape_string(out.shape()), rows,
         n);
  if (bias) {
    require_weight(context, op, *bias, "bias");
    // The CPU required bias [N]; CUDA N elements.
    require_shape(context, op, *bias, {n}, "bias");
  }
  return {rows, n, k};
}

void check_matmul_group(const OpContext& context, const Tensor& x, std::span<const MatmulTarget> targets) {
  if (targets.empty() || targets.size() > kMaxMatmulGroup)
    fail("{} matmul_group: {} products, it takes 1 to {}", context.backend, targets.size(), kMaxMatmulGroup);
  for (const MatmulTarget& target : targets) {
    if (!target.w || !target.out) fail("{} matmul_group: a product has no weight or no output", context.backend);
    check_matmul(context, x, *target.w, target.bias, *target.out);
  }
}

NormDims check_rms_norm(const OpContext& context, const Tensor& x, const Tensor& weight, const Tensor& out) {
  const int64_t width = check_norm_input_and_out(context, "rms_norm", x, "x", weight, out);
  return {x.numel() / width, width};
}

NormDims check_add_rms_norm(const OpContext& context, const Tensor& residual, const Tensor& delta, const Tensor& weight,
                            const Tensor& out) {
  constexpr std::string_view op = "add_rms_norm";
  const int64_t width = check_norm_input_and_out(context, op, residual, "residual", weight, out);
  require_dtype(context, op, delta, residual.dtype(), "delta");
  require_same_numel(context, op, residual, "residual", delta, "delta");
  return {residual.numel() / width, width};
}

int64_t check_add(const OpContext& context, const Tensor& a, const Tensor& b) {
  return check_same_numel_activations(context, "add", a, "a", b, "b");
}

int64_t check_swiglu(const OpContext& context, const Tensor& gate, const Tensor& up, const Tensor& out) {
  constexpr std::string_view op = "swiglu";
  require_activation(context, op, gate, "gate");
  require_activation(context, op, up, "up");
  require_activation(context, op, out, "out");
  require_same_numel(context, op, gate, "gate", up, "up");
  require_same_numel(context, op, gate, "gate", out, "out");
  return gate.numel();
}

int64_t check_copy(const OpContext& context, const Tensor& from, const Tensor& to) {
  constexpr std::string_view op = "copy";
  require_defined(context, op, from, "from");
  require_defined(context, op, to, "to");
  require_dtype(context, op, to, from.dtype(), "to");
  require_same_numel(context, op, from, "from", to, "to");
  if (from.numel() > 0 && from.raw() != nullptr && from.raw() == to.raw())
    fail("{} {}: from and to are the same tensor", context.backend, op);
  return static_cast<int64_t>(from.nbytes());
}

GatherDims check_gather_rows(const OpContext& context, const Tensor& x, const Tensor& rows, const Tensor& out) {
  constexpr std::string_view op = "gather_rows";
  // The CPU took F32 only (its activation dtype); CUDA copied rows of any dtype. The f32 stream
  // too: expert_matmul_on_host gathers f32 expert outputs back into pair order.
  require_stream(context, op, x, "x");
  if (x.ndim() < 1) fail("{} {}: x is a scalar, expected rows along axis 0", context.backend, op);
  const int64_t available = x.dim(0);
  const int64_t row_elements = available ? x.numel() / available : 0;
  require_dtype(context, op, rows, DType::I32, "rows");
  if (rows.ndim() != 1) fail("{} {}: rows has shape {}, expected [R]", context.backend, op, shape_string(rows.shape()));
  require_dtype(context, op, out, x.dtype(), "out");
  // The CPU required out [R, ...]; CUDA only R rows' elements.
  if (out.ndim() < 1 || out.dim(0) != rows.dim(0) || out.numel() != rows.dim(0) * row_elements)
    fail("{} {}: out has shape {}, expected {} rows of {} elements", context.backend, op, shape_string(out.shape()),
         rows.dim(0), row_elements);
  return {rows.dim(0), available, row_elements};
}

RouteDims check_moe_route(const OpContext& context, const Tensor& logits, const Tensor* shared_logits,
                          const Tensor& experts, const Tensor& weights) {
  constexpr std::string_view op = "moe_route";
  require_dtype(context, op, logits, DType::F32, "logits");
  if (logits.ndim() != 2 || logits.dim(1) == 0)
    fail("{} {}: logits has shape {}, expected [T, E] with E > 0", context.backend, op, shape_string(logits.shape()));
  const int64_t tokens = logits.dim(0), count = logits.dim(1);
  require_dtype(context, op, experts, DType::I32, "experts");
  if (experts.ndim() != 2 || experts.dim(0) != tokens || experts.dim(1) < 1 || experts.dim(1) > count)
    fail("{} {}: experts has shape {}, expected [{}, k] with 0 < k <= {} experts", context.backend, op,
         shape_string(experts.shape()), tokens, count);
  const int64_t top_k = experts.dim(1);
  if (shared_logits) {
    require_dtype(context, op, *shared_logits, DType::F32, "shared_logits");
    require_shape(context, op, *shared_logits, {tokens, 1}, "shared_logits");
  }
  const int64_t terms = top_k + (shared_logits ? 1 : 0);
  require_dtype(context, op, weights, DType::F32, "weights");
  require_shape(context, op, weights, {tokens, terms}, "weights");
  return {tokens, count, top_k, terms};
}

ExpertMatmulDims check_expert_matmul(const OpContext& context, const Tensor& x, const Tensor& experts,
                                     std::span<const MatmulTarget> targets, const Tensor* experts_read) {
  constexpr std::string_view op = "expert_matmul";
  if (targets.empty() || targets.size() > kMaxMatmulGroup)
    fail("{} {}: {} products, it takes 1 to {}", context.backend, op, targets.size(), kMaxMatmulGroup);
  require_dtype(context, op, experts, DType::I32, "experts");
  if (experts.ndim() != 2 || experts.dim(1) < 1)
    fail("{} {}: experts has shape {}, expected [T, k] with k > 0", context.backend, op,
         shape_string(experts.shape()));
  ExpertMatmulDims dims{};
  dims.tokens = experts.dim(0);
  dims.top_k = experts.dim(1);
  const int64_t pairs = dims.tokens * dims.top_k;
  require_activation(context, op, x, "x");
  if (x.ndim() != 2 || (x.dim(0) != dims.tokens && x.dim(0) != pairs))
    fail("{} {}: x has shape {}, expected [{} or {}, K] (a row per token or per token and expert)", context.backend,
         op, shape_string(x.shape()), dims.tokens, pairs);
  dims.x_rows = x.dim(0);
  dims.k = x.dim(1);
  for (size_t t = 0; t < targets.size(); ++t) {
    const MatmulTarget& target = targets[t];
    if (!target.w || !target.out) fail("{} {}: a product has no weight or no output", context.backend, op);
    if (target.bias) fail("{} {}: a product has a bias (experts take none)", context.backend, op);
    const Weight& w = *target.w;
    require_matrix(context, op, w, "weight");
    require_stream(context, op, *target.out, "out");
    const Tensor& out = *target.out;
    if (out.ndim() != 2 || out.dim(0) != pairs || out.dim(1) == 0)
      fail("{} {}: out has shape {}, expected [{}, N] with N > 0 (a row per token and expert)", context.backend, op,
           shape_string(out.shape()), pairs);
    const int64_t n = out.dim(1);
    if (w.shape().size() != 2 || w.dim(1) != dims.k || w.dim(0) % n != 0 || w.dim(0) == 0)
      fail("{} {}: weight has shape {}, expected experts' [N, K] = [{}, {}] matrices stacked into [E·{}, {}]",
           context.backend, op, shape_string(w.shape()), n, dims.k, n, dims.k);
    dims.experts[t] = w.dim(0) / n;
    dims.n[t] = n;
  }
  if (experts_read) {
    require_dtype(context, op, *experts_read, DType::U32, "experts_read");
    require_shape(context, op, *experts_read, {1}, "experts_read");
  }
  return dims;
}

CombineDims check_moe_combine(const OpContext& context, const Tensor& routed, const Tensor* shared,
                              const Tensor& weights, const Tensor& out) {
  constexpr std::string_view op = "moe_combine";
  require_dtype(context, op, weights, DType::F32, "weights");
  if (weights.ndim() != 2)
    fail("{} {}: weights has shape {}, expected [T, S]", context.backend, op, shape_string(weights.shape()));
  const int64_t tokens = weights.dim(0), terms = weights.dim(1);
  const int64_t top_k = shared ? terms - 1 : terms;
  if (top_k < 1)
    fail("{} {}: weights has shape {}, expected a column per routed expert{} (at least one)", context.backend, op,
         shape_string(weights.shape()), shared ? " and one for the shared expert" : "");
  require_dtype(context, op, routed, DType::F32, "routed");
  if (routed.ndim() != 2 || routed.dim(0) != tokens * top_k)
    fail("{} {}: routed has shape {}, expected [{}, H] (a row per token and routed expert)", context.backend, op,
         shape_string(routed.shape()), tokens * top_k);
  const int64_t width = routed.dim(1);
  if (shared) {
    require_dtype(context, op, *shared, DType::F32, "shared");
    require_shape(context, op, *shared, {tokens, width}, "shared");
  }
  require_dtype(context, op, out, DType::F32, "out");
  require_shape(context, op, out, {tokens, width}, "out");
  return {tokens, top_k, terms, width};
}

RopeDims check_rope(const OpContext& context, std::string_view op, std::string_view name, const Tensor& x,
                    const Tensor& positions, const Tensor& inv_freq, int rotary_dim) {
  require_activation(context, op, x, name);
  if (x.ndim() != 3)
    fail("{} {}: {} has shape {}, expected [T, heads, head_dim]", context.backend, op, name, shape_string(x.shape()));
  const RopeDims dims{x.dim(0), x.dim(1), x.dim(2)};
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > dims.head_dim)
    fail("{} {}: rotary_dim {} must be even and in (0, head_dim = {}]", context.backend, op, rotary_dim, dims.head_dim);
  require_dtype(context, op, positions, DType::I32, "positions");
  // The CPU required positions [T] and inv_freq [rotary_dim / 2]; CUDA only their element counts.
  require_shape(context, op, positions, {dims.tokens}, "positions");
  require_dtype(context, op, inv_freq, DType::F32, "inv_freq");
  if (inv_freq.shape() != Shape{rotary_dim / 2})
    fail("{} {}: inv_freq has {} entries, rotary_dim {} needs {}", context.backend, op, inv_freq.numel(), rotary_dim,
         rotary_dim / 2);
  return dims;
}

CacheDims check_caches(const OpContext& context, std::string_view op, const KvCacheView& cache) {
  require_activation(context, op, cache.keys, "k_cache");
  require_activation(context, op, cache.values, "v_cache");
  if (cache.keys.ndim() != 4 || cache.keys.dim(1) != kKvBlockTokens)
    fail("{} {}: k_cache has shape {}, expected [blocks, {}, kv_heads, head_dim]", context.backend, op,
         shape_string(cache.keys.shape()), kKvBlockTokens);
  require_shape(context, op, cache.values, cache.keys.shape(), "v_cache");
  require_dtype(context, op, cache.block_table, DType::I32, "block_table");
  if (cache.block_table.ndim() != 2)
    fail("{} {}: block_table has shape {}, expected [slots, table_width]", context.backend, op,
         shape_string(cache.block_table.shape()));
  CacheDims dims;
  dims.blocks = cache.keys.dim(0);
  dims.kv_heads = cache.keys.dim(2);
  dims.head_dim = cache.keys.dim(3);
  dims.slots = cache.block_table.dim(0);
  dims.table_width = cache.block_table.dim(1);
  dims.capacity = dims.table_width * kKvBlockTokens;
  return dims;
}

void check_cache_layout(const OpContext& context, std::string_view op, const BatchLayout& layout, int64_t tokens,
                        const CacheDims& cache) {
  require_layout_tokens(context, op, layout, tokens);
  // CUDA checked each span against the cache, the CPU each token's slot and position (which it
  // still does, as its kernels read them); both name the position that does not fit.
  for (size_t index = 0; index < layout.spans.size(); ++index) {
    const SequenceSpan& span = layout.spans[index];
    if (span.slot < 0 || span.slot >= cache.slots)
      fail("{} {}: span {} is in slot {}, but the block table has {} slots", context.backend, op, index, span.slot,
           cache.slots);
    if (span.first_position < 0)
      fail("{} {}: span {} starts at position {}", context.backend, op, index, span.first_position);
    const int64_t last_position = int64_t{span.first_position} + span.tokens - 1;
    if (last_position >= cache.capacity)
      fail("{} {}: span {} reaches position {}, but the block table holds {} positions per slot ({} blocks of {})",
           context.backend, op, index, last_position, cache.capacity, cache.table_width, kKvBlockTokens);
  }
}

void check_block_ids(const OpContext& context, std::string_view op, const Tensor& block_table, int64_t slot,
                     int64_t first_position, int64_t last_position, const CacheDims& cache) {
  const int32_t* entries = block_table.data<const int32_t>() + slot * cache.table_width;
  for (int64_t entry = first_position / kKvBlockTokens; entry <= last_position / kKvBlockTokens; ++entry)
    if (entries[entry] < 0 || entries[entry] >= cache.blocks)
      fail("{} {}: slot {} position {} is in block {} (block_table entry {}), but the pool has {} blocks",
           context.backend, op, slot, std::max(first_position, entry * kKvBlockTokens), entries[entry], entry,
           cache.blocks);
}

CacheDims check_kv_write(const OpContext& context, const Tensor& k, const Tensor& v, const BatchLayout& layout,
                         const KvCacheView& cache_view) {
  constexpr std::string_view op = "kv_write";
  const CacheDims cache = check_caches(context, op, cache_view);
  require_activation(context, op, k, "k");
  require_activation(context, op, v, "v");
  const int64_t tokens = layout.total_tokens;
  require_shape(context, op, k, {tokens, cache.kv_heads, cache.head_dim}, "k");
  require_shape(context, op, v, {tokens, cache.kv_heads, cache.head_dim}, "v");
  check_cache_layout(context, op, layout, tokens, cache);
  return cache;
}

RopeKvWriteDims check_rope_kv_write(const OpContext& context, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchLayout& layout, const Tensor& inv_freq, int rotary_dim,
                                    const HeadNorms* head_norms, const KvCacheView& cache_view) {
  constexpr std::string_view op = "rope_kv_write";
  const RopeDims query = check_rope(context, op, "q", q, layout.positions, inv_freq, rotary_dim);
  check_rope(context, op, "k", k, layout.positions, inv_freq, rotary_dim);
  const CacheDims cache = check_caches(context, op, cache_view);
  require_activation(context, op, v, "v");
  require_shape(context, op, k, {layout.total_tokens, cache.kv_heads, cache.head_dim}, "k");
  require_shape(context, op, v, k.shape(), "v");
  require_shape(context, op, q, {layout.total_tokens, query.heads, cache.head_dim}, "q");
  check_cache_layout(context, op, layout, layout.total_tokens, cache);
  if (head_norms) {
    require_weight(context, op, head_norms->q_weight, "q norm weight");
    require_shape(context, op, head_norms->q_weight, {cache.head_dim}, "q norm weight");
    require_weight(context, op, head_norms->k_weight, "k norm weight");
    require_shape(context, op, head_norms->k_weight, {cache.head_dim}, "k norm weight");
  }
  return {layout.total_tokens, query.heads, cache};
}

AttentionDims check_attention(const OpContext& context, const Tensor& q, const KvCacheView& cache_view,
                              const BatchLayout& layout, const Tensor& out) {
  constexpr std::string_view op = "attention";
  const CacheDims cache = check_caches(context, op, cache_view);
  require_activation(context, op, q, "q");
  if (q.ndim() != 3 || q.dim(2) != cache.head_dim)
    fail("{} {}: q has shape {}, expected [T, heads, head_dim = {}]", context.backend, op, shape_string(q.shape()),
         cache.head_dim);
  const int64_t heads = q.dim(1);
  if (heads == 0 || cache.kv_heads == 0 || heads % cache.kv_heads != 0)
    fail("{} {}: {} query heads are not a multiple of {} kv heads", context.backend, op, heads, cache.kv_heads);
  require_activation(context, op, out, "out");
  require_shape(context, op, out, q.shape(), "out");
  check_cache_layout(context, op, layout, q.dim(0), cache);
  return {q.dim(0), heads, cache};
}

void check_split_query_gate(const OpContext& context, const Tensor& query_and_gate, const Tensor& query,
                            const Tensor& gate) {
  constexpr std::string_view op = "split_query_gate";
  require_activation(context, op, query_and_gate, "query_and_gate");
  require_activation(context, op, query, "query");
  require_activation(context, op, gate, "gate");
  // CUDA required gate of query's shape; the CPU only its element count.
  if (query.ndim() != 3 || gate.shape() != query.shape() || query_and_gate.numel() != 2 * query.numel())
    fail("{} {}: query must be [T, heads, head_dim] like gate and query_and_gate twice its size, got {}, {} and {}",
         context.backend, op, shape_string(query.shape()), shape_string(gate.shape()),
         shape_string(query_and_gate.shape()));
}

int64_t check_sigmoid_gate(const OpContext& context, const Tensor& x, const Tensor& gate) {
  return check_same_numel_activations(context, "sigmoid_gate", x, "x", gate, "gate");
}

ConvDims check_causal_conv1d_silu(const OpContext& context, const Tensor& x, const Tensor& weight,
                                  std::span<const SequenceSpan> spans, const Tensor& conv_state, const Tensor& out) {
  constexpr std::string_view op = "causal_conv1d_silu";
  require_activation(context, op, x, "x");
  require_activation(context, op, out, "out");
  require_dtype(context, op, conv_state, DType::F32, "conv_state");
  if (x.ndim() != 2) fail("{} {}: x must be [T, channels], got {}", context.backend, op, shape_string(x.shape()));
  const int64_t channels = x.dim(1);
  require_weight(context, op, weight, "weight");
  if (weight.ndim() != 2 || weight.dim(0) != channels || weight.dim(1) < 1)
    fail("{} {}: weight has shape {}, expected [{}, kernel]", context.backend, op, shape_string(weight.shape()),
         channels);
  const int64_t kernel = weight.dim(1);
  if (conv_state.ndim() != 3 || conv_state.dim(1) != kernel - 1 || conv_state.dim(2) != channels)
    fail("{} {}: conv_state must be [slots, {}, {}], got {}", context.backend, op, kernel - 1, channels,
         shape_string(conv_state.shape()));
  require_shape(context, op, out, x.shape(), "out");
  // The CPU refused an out that is x; CUDA did not check, though its kernel also re-reads inputs.
  if (out.raw() == x.raw() && x.numel() > 0)
    fail("{} {}: out must not alias x (earlier inputs are re-read)", context.backend, op);
  check_recurrent_spans(spans, x.dim(0), conv_state.dim(0), fmt::format("{} {}", context.backend, op));
  return {x.dim(0), channels, kernel, conv_state.dim(0)};
}

PrepareQkvDims check_gated_delta_prepare_qkv(const OpContext& context, const Tensor& qkv, const Tensor& q,
                                             const Tensor& k, const Tensor& v) {
  constexpr std::string_view op = "gated_delta_prepare_qkv";
  require_activation(context, op, qkv, "qkv");
  require_dtype(context, op, q, DType::F32, "q");
  require_dtype(context, op, k, DType::F32, "k");
  require_dtype(context, op, v, DType::F32, "v");
  if (q.ndim() != 3 || v.ndim() != 3)
    fail("{} {}: q must be [T, key_heads, key_dim] and v [T, value_heads, value_dim], got {} and {}", context.backend,
         op, shape_string(q.shape()), shape_string(v.shape()));
  const PrepareQkvDims dims{q.dim(0), q.dim(1), q.dim(2), v.dim(1), v.dim(2)};
  if (dims.key_heads <= 0 || dims.key_dim <= 0 || dims.value_heads <= 0 || dims.value_dim <= 0)
    fail("{} {}: head counts and dims must be positive (key {}x{}, value {}x{})", context.backend, op, dims.key_heads,
         dims.key_dim, dims.value_heads, dims.value_dim);
  require_shape(context, op, k, q.shape(), "k");
  require_shape(context, op, v, {dims.tokens, dims.value_heads, dims.value_dim}, "v");
  require_shape(context, op, qkv, {dims.tokens, 2 * dims.key_heads * dims.key_dim + dims.value_heads * dims.value_dim},
                "qkv");
  return dims;
}

GatesDims check_gated_delta_gates(const OpContext& context, const Tensor& b, const Tensor& a, const Tensor& a_log,
                                  const Tensor& dt_bias, const Tensor& beta, const Tensor& g) {
  constexpr std::string_view op = "gated_delta_gates";
  require_activation(context, op, b, "b");
  require_activation(context, op, a, "a");
  require_dtype(context, op, beta, DType::F32, "beta");
  require_dtype(context, op, g, DType::F32, "g");
  if (b.ndim() != 2) fail("{} {}: b must be [T, value_heads], got {}", context.backend, op, shape_string(b.shape()));
  const GatesDims dims{b.dim(0), b.dim(1)};
  require_shape(context, op, a, b.shape(), "a");
  require_weight(context, op, a_log, "A_log");
  require_shape(context, op, a_log, {dims.heads}, "A_log");
  require_weight(context, op, dt_bias, "dt_bias");
  require_shape(context, op, dt_bias, {dims.heads}, "dt_bias");
  require_shape(context, op, beta, b.shape(), "beta");
  require_shape(context, op, g, b.shape(), "g");
  return dims;
}

DeltaRuleDims check_gated_delta_rule(const OpContext& context, std::string_view op, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& g, const Tensor& beta,
                                     std::span<const SequenceSpan> spans, const Tensor& state, const Tensor& out) {
  require_dtype(context, op, q, DType::F32, "q");
  require_dtype(context, op, k, DType::F32, "k");
  require_dtype(context, op, v, DType::F32, "v");
  require_dtype(context, op, g, DType::F32, "g");
  require_dtype(context, op, beta, DType::F32, "beta");
  require_dtype(context, op, state, DType::F32, "state");
  require_activation(context, op, out, "out");
  if (q.ndim() != 3)
    fail("{} {}: q must be [T, key_heads, key_dim], got {}", context.backend, op, shape_string(q.shape()));
  if (v.ndim() != 3)
    fail("{} {}: v must be [T, value_heads, value_dim], got {}", context.backend, op, shape_string(v.shape()));
  if (state.ndim() != 4)
    fail("{} {}: state must be [slots, value_heads, key_dim, value_dim], got {}", context.backend, op,
         shape_string(state.shape()));
  const DeltaRuleDims dims{q.dim(0), q.dim(1), v.dim(1), q.dim(2), v.dim(2), state.dim(0)};
  if (dims.key_heads == 0 || dims.value_heads % dims.key_heads != 0)
    fail("{} {}: {} value heads are not a multiple of {} key heads", context.backend, op, dims.value_heads,
         dims.key_heads);
  require_shape(context, op, k, q.shape(), "k");
  require_shape(context, op, v, {dims.tokens, dims.value_heads, dims.value_dim}, "v");
  require_shape(context, op, g, {dims.tokens, dims.value_heads}, "g");
  require_shape(context, op, beta, {dims.tokens, dims.value_heads}, "beta");
  require_shape(context, op, state, {dims.slots, dims.value_heads, dims.key_dim, dims.value_dim}, "state");
  require_shape(context, op, out, v.shape(), "out");
  check_recurrent_spans(spans, dims.tokens, dims.slots, fmt::format("{} {}", context.backend, op));
  return dims;
}

NormDims check_rms_norm_gated(const OpContext& context, const Tensor& x, const Tensor& z, const Tensor& weight,
                              const Tensor& out) {
  constexpr std::string_view op = "rms_norm_gated";
  require_activation(context, op, x, "x");
  require_activation(context, op, z, "z");
  require_activation(context, op, out, "out");
  const int64_t width = check_norm_weight(context, op, x, weight);
  // The CPU required z and out of x's shape; CUDA only its element count.
  require_shape(context, op, z, x.shape(), "z");
  require_shape(context, op, out, x.shape(), "out");
  return {x.numel() / width, width};
}

SamplingDims check_sample_tokens(const OpContext& context, const Tensor& logits, const Tensor& settings,
                                 const Tensor& tokens, const Tensor& logprobs) {
  constexpr std::string_view op = "sample_tokens";
  require_dtype(context, op, logits, DType::F32, "logits");
  require_dtype(context, op, settings, DType::I32, "settings");
  require_dtype(context, op, tokens, DType::I32, "tokens");
  require_dtype(context, op, logprobs, DType::F32, "logprobs");
  if (logits.ndim() != 2 || logits.dim(1) == 0)
    fail("{} {}: logits must be [rows, vocab], got {}", context.backend, op, shape_string(logits.shape()));
  const SamplingDims dims{logits.dim(0), logits.dim(1)};
  if (settings.numel() != dims.rows * kSamplingSettingsWords || tokens.numel() != dims.rows ||
      logprobs.numel() != dims.rows)
    fail("{} {}: settings {}, tokens {} and logprobs {} do not fit {} rows", context.backend, op,
         shape_string(settings.shape()), shape_string(tokens.shape()), shape_string(logprobs.shape()), dims.rows);
  return dims;
}

void check_feed_tokens(const OpContext& context, const Tensor& previous, const Tensor& feed, const Tensor& token_ids) {
  constexpr std::string_view op = "feed_tokens";
  require_dtype(context, op, previous, DType::I32, "previous");
  require_dtype(context, op, feed, DType::I32, "feed");
  require_dtype(context, op, token_ids, DType::I32, "token_ids");
  if (feed.numel() != token_ids.numel())
    fail("{} {}: feed {} and token_ids {} must have one entry per row", context.backend, op, shape_string(feed.shape()),
         shape_string(token_ids.shape()));
}

}  // namespace kiln
