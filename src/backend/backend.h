// The op set every backend implements. A model graph (model/*.cpp) is written against this
// interface only; kernels live in backend/cpu and backend/cuda.
//
// Invariance contract (DEVELOPERS.md / README): for every op, each output element is computed
// with a reduction order that depends only on that element's own inputs — never on the number of
// tokens in the call, the batch composition, the chunking of a prefill, or the thread count.
// Each op's shape and dtype rules are stated once, for every backend, in backend/op_contract.h;
// each op's cases are rows of the op table (tests/op_table), run on every backend against the CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/weight.h"

namespace kiln {

// One sequence's tokens inside a flattened batch. Tokens of a sequence are contiguous.
struct SequenceSpan {
  int32_t slot = 0;            // cache row owned by the sequence
  int32_t first_token = 0;     // index of its first token in the flattened batch
  int32_t tokens = 0;          // how many tokens it contributes to this step
  int32_t first_position = 0;  // absolute position of its first token
};

// The per-step batch description. Host copies drive host-side loops; the device tensors
// (I32, on the backend's device) let kernels and captured graphs read the same data.
struct BatchLayout {
  std::vector<SequenceSpan> spans;
  int64_t total_tokens = 0;
  Tensor token_ids;  // [T]
  Tensor positions;  // [T]
  Tensor slots;      // [T]
  Tensor spans_device;  // [S, 4] = {slot, first_token, tokens, first_position}
};

// The KV cache is a pool of blocks of kKvBlockTokens positions, read through per-slot block tables
// (vLLM's paged attention): entry (slot, i) of a table is the pool block that holds positions
// [64·i, 64·i + 64) of the slot's sequence, so position p of slot s is pool row
// block_table[s][p / 64] · 64 + p % 64. 64 is the Gated DeltaNet chunk and the prefill split
// alignment (kGatedDeltaChunk), and the CUDA attention's key tile: a key tile lies inside one block,
// so its kernels read one table entry per tile and nothing in any reduction order changes.
inline constexpr int64_t kKvBlockTokens = 64;

// The block-table entries a slot of `capacity` positions needs.
constexpr int64_t kv_table_width(int64_t capacity) { return (capacity + kKvBlockTokens - 1) / kKvBlockTokens; }

// One attention layer's paged KV cache as the ops take it. keys and values are
// [blocks, kKvBlockTokens, kv_heads, head_dim] in the activation dtype; block_table is I32
// [slots, table_width] on the backend's device, one table for every layer of a model (the same
// block id indexes each layer's pool). A table entry is read only for positions an op writes or
// attends to, so entries past a sequence's length may hold anything.
struct KvCacheView {
  Tensor& keys;
  Tensor& values;
  const Tensor& block_table;
};

// One product of a matmul group: out = x·wᵀ (+ bias), w [N, K] dense or quantized.
struct MatmulTarget {
  const Weight* w = nullptr;
  const Tensor* bias = nullptr;  // or null
  Tensor* out = nullptr;
};
// The most products one matmul_group takes (a GDN layer's qkv, z, b and a projections).
inline constexpr size_t kMaxMatmulGroup = 4;

enum class NormStyle {
  Plain,        // Llama: y = w · x̂
  ZeroCentred,  // Qwen3.5: y = (1 + w) · x̂, with 1 + w in f32
};

// Per-head RMSNorms applied to q and k before RoPE (Qwen3's q_norm / k_norm, Qwen3.5's gated
// attention): gains of [head_dim] each.
struct HeadNorms {
  const Tensor& q_weight;
  const Tensor& k_weight;
  float eps;
  NormStyle style;
};

struct DeviceMemory {
  uint64_t available = 0;  // CPU: MemAvailable of /proc/meminfo; CUDA: cudaMemGetInfo's free
  uint64_t total = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu" | "cuda"
  virtual Device device() const = 0;
  // The dtype activations are kept in between ops on this backend.
  virtual DType activation_dtype() const = 0;

  // Measured device-memory copy bandwidth (bytes read + bytes written per second, in GB/s):
  // the roofline `kiln bench` compares decode against.
  virtual double measure_copy_bandwidth_gbps() = 0;
  // Waits until all queued work on the device is done (timing).
  virtual void synchronize() = 0;

  // --- memory ---
  virtual Tensor alloc(const Shape& shape, DType dtype) = 0;
  // What the device can still give, and its size (`kiln fit`, engine/memory_plan.h).
  virtual DeviceMemory memory() = 0;
  // What the backend's memory use follows from, beyond the tensors it is asked for: the measuring
  // backend (backend/measuring_backend.h) allocates as the backend does, from these, so that a dry
  // run gives the backend's own footprint (`kiln fit`, engine/memory_plan.h).
  //
  // The bytes alloc takes from the device for a tensor of `bytes` (allocators round up).
  virtual uint64_t allocation_bytes(uint64_t bytes) const { return bytes; }
  // Whether a freed tensor's block stays with the backend for later requests of its rounded size
  // (a caching allocator: what it holds then grows to the most blocks of each size live at once)
  // rather than going back to the system.
  virtual bool caches_freed_blocks() const { return false; }
  // The scratch (bytes of one block, 0: none) that one matmul_group call over these products
  // allocates for itself while it runs (CUDA's split prefill GEMM); a matmul call is a group of one.
  virtual uint64_t matmul_scratch_bytes(const Tensor& /*x*/, std::span<const MatmulTarget> /*targets*/) const {
    return 0;
  }
  // The scratch (bytes of one block, 0: none) that an attention call of `tokens` tokens whose
  // latest position is `max_position` allocates for itself while it runs (the CUDA decode
  // attention's split partials).
  virtual uint64_t attention_scratch_bytes(int64_t /*tokens*/, int64_t /*heads*/, int64_t /*head_dim*/,
                                           int64_t /*max_position*/) const {
    return 0;
  }
  // Memory the backend takes that no tensor accounts for (kernel code, captured graphs'
  // executables), which `kiln fit` keeps free.
  virtual uint64_t reserved_bytes() const { return 0; }
  // A copy (or, on the CPU, the same tensor) of a host tensor on this device.
  virtual Tensor upload(const Tensor& host) = 0;
  // Every part of a host weight uploaded (upload's rules for each); a backend may rearrange a
  // quantized weight's codes on the way (core/weight.h's CodeOrder).
  virtual Weight upload_weight(const Weight& host);
  virtual Tensor download(const Tensor& tensor) = 0;  // a host copy
  // False for a backend that only measures what work allocates (backend/measuring_backend.h, the
  // dry run of `kiln fit`): it computes no values, and what it downloads must not be read.
  virtual bool computes_values() const { return true; }
  virtual void zero(Tensor& tensor) = 0;
  // to = from, byte for byte (same dtype and element count; check_copy). Speculative decoding saves
  // a slot's recurrent state with it before a verify step and puts it back when part is rejected.
  virtual void copy(const Tensor& from, Tensor& to) = 0;
  virtual BatchLayout make_layout(const std::vector<SequenceSpan>& spans,
                                  const std::vector<int32_t>& token_ids) = 0;

  // --- dense transformer ops ---
  // out[t, :] = table[ids[t], :], a quantized table's row decoded (core/weight.h) and rounded to
  // out's dtype.
  virtual void embedding(const Weight& table, const Tensor& ids, Tensor& out) = 0;
  // out[t, n] = Σ_k x[t, k] · w[n, k] (+ bias[n]); w is [N, K], dense in its stored dtype or
  // quantized, each element decoded as core/weight.h says and, where the dense path would read a
  // weight in the activation dtype, rounded to it: every output element bit-identical to the
  // dense matmul of the decoded weights.
  virtual void matmul(const Tensor& x, const Weight& w, const Tensor* bias, Tensor& out) = 0;
  // The products of one x with up to kMaxMatmulGroup weights (q/k/v, gate/up): every output
  // element bit-identical to its own matmul call, in one launch on backends where that is faster
  // (the default is one matmul per target).
  virtual void matmul_group(const Tensor& x, std::span<const MatmulTarget> targets);
  // Row-wise RMSNorm over the last axis of x viewed as [R, D].
  virtual void rms_norm(const Tensor& x, const Tensor& weight, float eps, NormStyle style, Tensor& out) = 0;
  // residual += delta; out = rms_norm(residual). One pass (fused on backends that can).
  virtual void add_rms_norm(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                            NormStyle style, Tensor& out) = 0;
  // a += b, elementwise.
  virtual void add(Tensor& a, const Tensor& b) = 0;
  // out[r, :] = x[rows[r], :] (rows is I32 on the device; x F32 or activations).
  virtual void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) = 0;

  // --- mixtures of experts (model/moe.h) ---
  // Routes each token from its f32 router logits [T, E] by backend/moe_routing.h's rule (softmax
  // in f32, the top k, equal probabilities the lower expert id first, renormalised when
  // `normalize`): experts I32 [T, k] ascending by id, weights F32 [T, S] their weights in that
  // order, S = k; with shared_logits (F32 [T, 1], a shared expert's gate logits) S = k + 1 and
  // weights[t, k] = σ(shared_logits[t]). The same bits on every backend (route_token is the CPU's).
  virtual void moe_route(const Tensor& logits, const Tensor* shared_logits, bool normalize, Tensor& experts,
                         Tensor& weights) = 0;
  // The products of each token with the experts it chose, for up to kMaxMatmulGroup targets (gate
  // and up) sharing x and the routing. experts is I32 [T, k] (moe_route's); each target's w stacks
  // E experts' [N, K] matrices (w [E·N, K], dense or quantized, N = its out's width; expert e is
  // w.rows(e·N, N)), with no bias, and out[t·k + j, :] = x[r, :] · W_eᵀ for e = experts[t, j],
  // where r = t when x has T rows and r = t·k + j when it has T·k (the down projection of each
  // pair's own row). out is [T·k, N], F32 or activations. Every element is bit-identical to
  // matmul(x[r], W_e): matmul's per-element order never depends on its rows, so a token's products
  // are the same whatever the other tokens chose. With experts_read (U32 [1]), the number of
  // distinct experts in `experts` (the matrices the call reads of each weight) is added to it,
  // wrapping, on the device: how a step's weight bytes are counted without reading routes back.
  virtual void expert_matmul(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                             Tensor* experts_read) = 0;
  // The scratch (bytes of one block, 0: none) that one expert_matmul call allocates for itself
  // while it runs (at most: CUDA's depends on how many tokens each expert gets).
  virtual uint64_t expert_matmul_scratch_bytes(const Tensor& /*x*/, const Tensor& /*experts*/,
                                               std::span<const MatmulTarget> /*targets*/) const {
    return 0;
  }
  // The weighted sum of a token's expert outputs: out[t, :] = Σ_s weights[t, s] · term_s over
  // s = 0, 1, …, S − 1 in order, as acc = fma(weights[t, s], term_s, acc) from acc = 0, all in f32,
  // where term_s = routed[t·k + s, :] for s < k (routed F32 [T·k, H], expert_matmul's rows) and,
  // with shared (F32 [T, H], S = k + 1), term_k = shared[t, :]. weights F32 [T, S], out F32 [T, H].
  virtual void moe_combine(const Tensor& routed, const Tensor* shared, const Tensor& weights, Tensor& out) = 0;
  // Rotate-half RoPE in place on x [T, heads, head_dim], over the first rotary_dim dims of each
  // head, angle = positions[t] · inv_freq[j] (inv_freq is [rotary_dim / 2] f32 on the device).
  virtual void rope(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int rotary_dim) = 0;
  // out = silu(gate) · up, one fused op at every shape.
  virtual void swiglu(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // Writes k and v [T, kv_heads, head_dim] to the cache at (slot[t], position[t]): pool row
  // block_table[slot][position / kKvBlockTokens] · kKvBlockTokens + position % kKvBlockTokens.
  virtual void kv_write(const Tensor& k, const Tensor& v, const BatchLayout& layout, const KvCacheView& cache) = 0;
  // rope(q); rope(k); kv_write(k, v), with k rotated in place too: the attention inputs of a step
  // in one op (one kernel on CUDA), every element bit-identical to the three ops. With head_norms,
  // rms_norm(q, q_weight) and rms_norm(k, k_weight) over each head come first, in place.
  virtual void rope_kv_write(Tensor& q, Tensor& k, const Tensor& v, const BatchLayout& layout, const Tensor& inv_freq,
                             int rotary_dim, const HeadNorms* head_norms, const KvCacheView& cache);
  // Causal GQA attention of q [T, heads, head_dim] over the cache positions 0..positions[t] of its
  // slot (read through the block table); query head h reads kv head h / (heads / kv_heads). out is
  // [T, heads, head_dim].
  virtual void attention(const Tensor& q, const KvCacheView& cache, const BatchLayout& layout, float scale,
                         Tensor& out) = 0;

  // The Gated DeltaNet / gated-attention ops, or null when this backend has no kernels for them
  // (a hybrid model then has no implementation for this backend: its construction fails).
  virtual class HybridOps* hybrid_ops() { return nullptr; }

  // Capture/replay of decode steps and token choice on the device, or null when this backend
  // runs every step directly and the engine samples on the host (the CPU).
  virtual class GraphOps* graph_ops() { return nullptr; }

 protected:
  // expert_matmul from the plain ops, with the routes read on the host: the (token, expert) pairs
  // sorted by expert, each expert's rows gathered and multiplied by one matmul_group, the results
  // gathered back into pair order. The CPU's expert_matmul, and CUDA's for many pairs outside
  // captured work (its per-expert products then take the prefill GEMM). Checked by the caller.
  void expert_matmul_on_host(const Tensor& x, const Tensor& experts, std::span<const MatmulTarget> targets,
                             Tensor* experts_read);
};

// Device work recorded once (a CUDA graph) and re-issued as a whole, with no host work per op.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Queues the recorded work again on the backend's stream. It reads whatever its input buffers
  // hold when it runs, so callers refill them (GraphOps::upload_into) before each replay.
  virtual void replay() = 0;
};

// The per-row settings sample_tokens reads: kSamplingSettingsWords I32 words per row,
//   [0] temperature (f32 bits; 0 = greedy)  [1] top_k  [2] top_p (f32 bits)  [3] min_p (f32 bits)
//   [4, 5] the row's uniform draw in [0, 1) as f64 bits (low word first), taken from the
//          request's host Sampler so that host and device share one random stream.
constexpr int64_t kSamplingSettingsWords = 6;

// A device-to-host copy queued on the backend's stream (GraphOps::download_later).
class PendingDownload {
 public:
  virtual ~PendingDownload() = default;
  // Waits for the copy (and the work queued before it); fails, as Backend::download does, when a
  // kernel recorded an error.
  virtual void wait() = 0;
};

// The ops a backend needs to run decode steps as captured graphs and sample on the device.
class GraphOps {
 public:
  virtual ~GraphOps() = default;
  // Runs `work` once (for real) and records the device work it queues. Scratch that `work`
  // allocates comes from a pool owned by the backend's captured work: the first (real) run fills
  // the pool, and the recording must find every block there — the allocator never allocates while
  // recording. While `work` runs, lengths that kernels would otherwise take from the host (e.g.
  // attention's number of key splits) are sized for the whole cache, and the kernels read the
  // per-step values from the layout's device tensors; per-element arithmetic is unchanged, so a
  // replay gives the same bits as the same step run directly. Everything `work` reads must live
  // in buffers that outlast the returned object.
  virtual std::unique_ptr<CapturedWork> capture(const std::function<void()>& work) = 0;
  // Copies a host tensor into an existing device tensor of the same dtype and size, in order
  // with the queued work (one asynchronous host-to-device copy).
  virtual void upload_into(const Tensor& host, Tensor& device) = 0;
  // Chooses one token per row of logits [rows, vocab] (f32) with engine/sampler.cpp's rules:
  // temperature 0 takes the argmax (lowest id among equals); otherwise candidates sorted by logit
  // (descending, lower id first among equals), cut to top_k, then to the smallest prefix whose
  // mass reaches top_p, then to those at least min_p × the top probability, and the row's uniform
  // draw picks from the cumulative masses (all in f64, as the host). `settings` is I32
  // [rows, kSamplingSettingsWords]; `tokens` (I32) and `logprobs` (F32, log-softmax of the chosen
  // logit) are [rows]. `sorting` false promises every row is greedy (no sort is queued).
  virtual void sample_tokens(const Tensor& logits, const Tensor& settings, bool sorting, Tensor& tokens,
                             Tensor& logprobs) = 0;
  // The scratch blocks (bytes of each, in the order it allocates them) that one sample_tokens call
  // over `rows` rows of `vocab` logits allocates for itself while it runs.
  virtual std::vector<uint64_t> sampling_scratch_bytes(int64_t /*rows*/, int64_t /*vocab*/, bool /*sorting*/) const {
    return {};
  }
  // token_ids[i] ← previous[feed[i]] for every i with feed[i] ≥ 0; the other rows keep their
  // token (all I32 on the device; the caller keeps feed[i] below previous's size). A decode step
  // takes the token the step before it sampled this way, without the host reading it first.
  virtual void feed_tokens(const Tensor& previous, const Tensor& feed, Tensor& token_ids) = 0;
  // Queues a copy of a device tensor into `host` (from alloc_pinned, the same dtype and size) and
  // returns at once; `host` holds the copy after the returned download's wait(). At most
  // kMaxPendingDownloads may be pending at a time.
  static constexpr int kMaxPendingDownloads = 4;
  virtual std::unique_ptr<PendingDownload> download_later(const Tensor& device, Tensor& host) = 0;
  // A host (CPU) tensor in page-locked memory: upload_into copies from it without staging, so the
  // copy is asynchronous and the caller must not rewrite it until the work queued after has run.
  virtual Tensor alloc_pinned(const Shape& shape, DType dtype) = 0;
};

// For ops over per-sequence recurrent state (the hybrid ops): every span lies inside the batch's
// `total_tokens` and owns a distinct slot below `slots` (each span's work writes its slot's state).
// Fails naming `op` and the offending span.
void check_recurrent_spans(std::span<const SequenceSpan> spans, int64_t total_tokens, int64_t slots,
                           const std::string& op);

// eps of the GDN q/k L2 norm (HF-Q35 `l2norm(x, dim=-1, eps=1e-6)`, spec A.6.3), for every backend.
inline constexpr float kGatedDeltaL2NormEps = 1e-6f;

// Chunk length of the gated delta rule's chunked form, for every backend: HF's torch fallback and
// FLA use 64 (spec A.6.5). Chunks fall on absolute multiples of it, which is what keeps a prefill
// split at those multiples bit-identical to the one-shot prefill.
inline constexpr int64_t kGatedDeltaChunk = 64;

// The tokens at the head of a span that come before its first absolute multiple of `chunk`: every
// backend takes them recurrently, then whole chunks, then a recurrent tail.
inline int64_t gated_delta_head_tokens(const SequenceSpan& span, int64_t chunk = kGatedDeltaChunk) {
  return std::min<int64_t>(span.tokens, (chunk - span.first_position % chunk) % chunk);
}

// The ops only the hybrid Qwen3.5 / Qwen3-Next graph needs (spec A.5, A.6), on the same tensors
// and device as the Backend that provides them.
class HybridOps {
 public:
  virtual ~HybridOps() = default;
  // Gated attention's q_proj output [T, heads, 2·head_dim] holds per head the query, then the
  // gate: split into query and gate [T, heads, head_dim].
  virtual void split_query_gate(const Tensor& query_and_gate, Tensor& query, Tensor& gate) = 0;
  // x ← x · sigmoid(gate), elementwise.
  virtual void sigmoid_gate(Tensor& x, const Tensor& gate) = 0;
  // Depthwise causal conv (kernel K) + SiLU over x [T, C] with weight [C, K], reading and updating
  // each sequence's last K−1 inputs in conv_state [slots, K−1, C] (zeros at position 0); one op.
  virtual void causal_conv1d_silu(const Tensor& x, const Tensor& weight, const BatchLayout& layout,
                                  Tensor& conv_state, Tensor& out) = 0;
  // Splits the conv output [T, 2·Hk·dk + Hv·dv] into q, k [T, Hk, dk] and v [T, Hv, dv],
  // L2-normalising q and k per head and scaling q by dk^−½.
  virtual void gated_delta_prepare_qkv(const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) = 0;
  // beta = sigmoid(b); g = −exp(A_log)·softplus(a + dt_bias); all [T, Hv] f32.
  virtual void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                                 Tensor& beta, Tensor& g) = 0;
  // The gated delta rule over each sequence's recurrent state [slots, Hv, dk, dv] (f32): chunked
  // (64) for whole chunks aligned to absolute multiples of 64, recurrent for every other token —
  // a pure function of positions, so chunked prefill, small appends and batching are invariant.
  virtual void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const BatchLayout& layout, Tensor& state, Tensor& out) = 0;
  // out = rmsnorm(x)·w·silu(z) per row of dv = weight.numel().
  virtual void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) = 0;
};

// The CPU backend (always present).
std::unique_ptr<Backend> make_cpu_backend();

}  // namespace kiln
