#include "backend/cpu/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/checks.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::cpu {
namespace {

// A weight in its stored floating dtype, widened exactly to f32.
std::vector<float> widen_weight(const Tensor& weight, const char* op, const char* argument) {
  std::vector<float> values(static_cast<size_t>(weight.numel()));
  switch (weight.dtype()) {
    case DType::F32:
      std::copy_n(weight.data<float>(), values.size(), values.begin());
      break;
    case DType::BF16:
      for (size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_f32(weight.data<uint16_t>()[i]);
      break;
    case DType::F16:
      for (size_t i = 0; i < values.size(); ++i) values[i] = f16_to_f32(weight.data<uint16_t>()[i]);
      break;
    case DType::I32:
    case DType::U32:
    case DType::F8E4M3:
      fail("cpu {}: {} has dtype {}, expected F32, BF16 or F16", op, argument, dtype_name(weight.dtype()));
  }
  return values;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// torch.nn.functional.softplus with beta 1 and threshold 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// --- causal conv ---------------------------------------------------------------------------------

// Channels per conv task: a multiple of every SIMD width, and small enough to balance threads.
constexpr int64_t kConvChannelBlock = 64;

// One (sequence, channel block) task. `taps` is the weight transposed to [tap][channel];
// `history` is scratch for (K-1) × kConvChannelBlock floats.
void conv_span_block(const float* x, int64_t channels, const float* taps, int64_t kernel,
                     const SequenceSpan& span, int64_t c0, int64_t c1, float* state, float* history,
                     float* out) {
  const int64_t width = c1 - c0;
  const int64_t history_rows = kernel - 1;
  // The slot's previous inputs for this block (zeros for a fresh sequence), copied so that the
  // slot can be overwritten in place below.
  for (int64_t r = 0; r < history_rows; ++r) {
    float* row = history + r * width;
    if (span.first_position == 0)
      std::fill(row, row + width, 0.0f);
    else
      std::copy_n(state + r * channels + c0, width, row);
  }
  // Input row i of the sequence relative to the span start; negative rows come from the history.
  auto input_row = [&](int64_t i) -> const float* {
    return i >= 0 ? x + (span.first_token + i) * channels + c0 : history + (history_rows + i) * width;
  };
  for (int64_t t = 0; t < span.tokens; ++t) {
    float* out_row = out + (span.first_token + t) * channels + c0;
    std::fill(out_row, out_row + width, 0.0f);
    for (int64_t j = 0; j < kernel; ++j) {
      const float* row = input_row(t - history_rows + j);
      const float* tap = taps + j * channels + c0;
      for (int64_t c = 0; c < width; ++c) out_row[c] += tap[c] * row[c];
    }
    for (int64_t c = 0; c < width; ++c) out_row[c] = silu(out_row[c]);
  }
  // The new tail: the last K-1 inputs, reaching back into the old history for short spans.
  for (int64_t r = 0; r < history_rows; ++r)
    std::copy_n(input_row(span.tokens - history_rows + r), width, state + r * channels + c0);
}

// --- gated delta rule ----------------------------------------------------------------------------

DeltaRuleDims check_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                               const Tensor& beta, std::span<const SequenceSpan> spans, const Tensor& state,
                               const Tensor& out, const char* op) {
  const DeltaRuleDims dims = check_gated_delta_rule(kCpuOps, op, q, k, v, g, beta, spans, state, out);
  return dims;
}

// One (sequence, value head) task: strided views of its inputs and its [dk, dv] state.
struct HeadStream {
  const float* q;  // token t at q + t * key_stride
  const float* k;
  const float* v;  // token t at v + t * value_stride
  const float* g;  // token t at g + t * gate_stride
  const float* beta;
  float* out;      // token t at out + t * value_stride
  float* state;    // [dk][dv]
  int64_t key_stride;
  int64_t value_stride;
  int64_t gate_stride;
  int64_t key_dim;
  int64_t value_dim;
};

HeadStream head_stream(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       Tensor& state, Tensor& out, const DeltaRuleDims& shape, const SequenceSpan& span,
                       int64_t value_head) {
  const int64_t key_head = value_head / (shape.value_heads / shape.key_heads);
  const int64_t key_stride = shape.key_heads * shape.key_dim;
  const int64_t value_stride = shape.value_heads * shape.value_dim;
  const int64_t first = span.first_token;
  return HeadStream{
      q.data<float>() + first * key_stride + key_head * shape.key_dim,
      k.data<float>() + first * key_stride + key_head * shape.key_dim,
      v.data<float>() + first * value_stride + value_head * shape.value_dim,
      g.data<float>() + first * shape.value_heads + value_head,
      beta.data<float>() + first * shape.value_heads + value_head,
      out.data<float>() + first * value_stride + value_head * shape.value_dim,
      state.data<float>() + (span.slot * shape.value_heads + value_head) * shape.key_dim * shape.value_dim,
      key_stride,
      value_stride,
      shape.value_heads,
      shape.key_dim,
      shape.value_dim,
  };
}

// Tokens [begin, end) of a stream by the recurrence of spec A.6.4. `scratch` holds dv floats.
void recurrent_steps(const HeadStream& s, int64_t begin, int64_t end, float* scratch) {
  const int64_t dk = s.key_dim;
  const int64_t dv = s.value_dim;
  float* delta = scratch;
  for (int64_t t = begin; t < end; ++t) {
    const float* q = s.q + t * s.key_stride;
    const float* k = s.k + t * s.key_stride;
    const float* v = s.v + t * s.value_stride;
    float* o = s.out + t * s.value_stride;
    const float decay = std::exp(s.g[t * s.gate_stride]);
    const float beta = s.beta[t * s.gate_stride];
    // Decay first, then m = Sᵀk accumulated over dk in ascending order (kept in `delta`).
    std::fill(delta, delta + dv, 0.0f);
    for (int64_t p = 0; p < dk; ++p) {
      float* row = s.state + p * dv;
      const float kp = k[p];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] *= decay;
        delta[j] += kp * row[j];
      }
    }
    for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - delta[j]) * beta;
    // Rank-1 update, then the read-out o = Sᵀq of the updated state, over dk in ascending order.
    std::fill(o, o + dv, 0.0f);
    for (int64_t p = 0; p < dk; ++p) {
      float* row = s.state + p * dv;
      const float kp = k[p];
      const float qp = q[p];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] += kp * delta[j];
        o[j] += qp * row[j];
      }
    }
  }
}

// Scratch of one chunked task, sized once per thread block.
struct ChunkScratch {
  std::vector<float> key_transposed;  // [dk][C]
  std::vector<float> decay;           // [C][C]: Γ_ij for j ≤ i
  std::vector<float> decay_from_start;  // [C]: exp(g_0 + … + g_i)
  std::vector<float> key_dots;        // [C][C]: k_i·k_j
  std::vector<float> query_dots;      // [C][C]: q_i·k_j
  std::vector<float> key_state;       // [C][dv]: Sᵀk_i
  std::vector<float> query_state;     // [C][dv]: Sᵀq_i
  std::vector<float> corrected;       // [C][dv]: Δ_i

  ChunkScratch(int64_t chunk, int64_t dk, int64_t dv)
      : key_transposed(static_cast<size_t>(dk * chunk)),
        decay(static_cast<size_t>(chunk * chunk)),
        decay_from_start(static_cast<size_t>(chunk)),
        key_dots(static_cast<size_t>(chunk * chunk)),
        query_dots(static_cast<size_t>(chunk * chunk)),
        key_state(static_cast<size_t>(chunk * dv)),
        query_state(static_cast<size_t>(chunk * dv)),
        corrected(static_cast<size_t>(chunk * dv)) {}
};

// Tokens [begin, begin + C) of a stream by the chunked form (see the header for the formulas).
void chunk_step(const HeadStream& s, int64_t begin, int64_t chunk, ChunkScratch& scratch) {
  const int64_t dk = s.key_dim;
  const int64_t dv = s.value_dim;
  const int64_t n = chunk;
  auto q_row = [&](int64_t i) { return s.q + (begin + i) * s.key_stride; };
  auto k_row = [&](int64_t i) { return s.k + (begin + i) * s.key_stride; };
  auto gate = [&](const float* base, int64_t i) { return base[(begin + i) * s.gate_stride]; };

  float* key_t = scratch.key_transposed.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < dk; ++p) key_t[p * n + i] = k_row(i)[p];
  // Γ_ij = exp(g_{j+1} + … + g_i), each exponent summed from g_i downwards. Summing the pair's own
  // terms instead of subtracting inclusive cumulative sums (γ_i − γ_j, HF/FLA) keeps Γ accurate when
  // the cumulative sums grow large (strong decay), where their difference would cancel.
  float* decay = scratch.decay.data();
  float* decay_from_start = scratch.decay_from_start.data();
  for (int64_t i = 0; i < n; ++i) {
    float exponent = 0.0f;
    decay[i * n + i] = 1.0f;
    for (int64_t j = i - 1; j >= 0; --j) {
      exponent += gate(s.g, j + 1);
      decay[i * n + j] = std::exp(exponent);
    }
    decay_from_start[i] = std::exp(exponent + gate(s.g, 0));
  }

  // k_i·k_j and q_i·k_j for the causal pairs j ≤ i, each a dot product over dk in ascending order.
  float* key_dots = scratch.key_dots.data();
  float* query_dots = scratch.query_dots.data();
  for (int64_t i = 0; i < n; ++i) {
    float* kk = key_dots + i * n;
    float* qk = query_dots + i * n;
    std::fill(kk, kk + i + 1, 0.0f);
    std::fill(qk, qk + i + 1, 0.0f);
    const float* k = k_row(i);
    const float* q = q_row(i);
    for (int64_t p = 0; p < dk; ++p) {
      const float* column = key_t + p * n;
      for (int64_t j = 0; j <= i; ++j) {
        kk[j] += k[p] * column[j];
        qk[j] += q[p] * column[j];
      }
    }
  }
  // Sᵀk_i and Sᵀq_i against the chunk-start state, over dk in ascending order.
  float* key_state = scratch.key_state.data();
  float* query_state = scratch.query_state.data();
  for (int64_t i = 0; i < n; ++i) {
    float* ks = key_state + i * dv;
    float* qs = query_state + i * dv;
    std::fill(ks, ks + dv, 0.0f);
    std::fill(qs, qs + dv, 0.0f);
    const float* k = k_row(i);
    const float* q = q_row(i);
    for (int64_t p = 0; p < dk; ++p) {
      const float* row = s.state + p * dv;
      for (int64_t j = 0; j < dv; ++j) {
        ks[j] += k[p] * row[j];
        qs[j] += q[p] * row[j];
      }
    }
  }
  // Forward substitution for the corrected values Δ, then the outputs.
  float* corrected = scratch.corrected.data();
  for (int64_t i = 0; i < n; ++i) {
    const float beta = gate(s.beta, i);
    const float* v = s.v + (begin + i) * s.value_stride;
    const float* ks = key_state + i * dv;
    float* delta = corrected + i * dv;
    for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - decay_from_start[i] * ks[j]);
    for (int64_t m = 0; m < i; ++m) {
      const float coefficient = beta * key_dots[i * n + m] * decay[i * n + m];
      const float* earlier = corrected + m * dv;
      for (int64_t j = 0; j < dv; ++j) delta[j] -= coefficient * earlier[j];
    }
    float* o = s.out + (begin + i) * s.value_stride;
    const float* qs = query_state + i * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] = decay_from_start[i] * qs[j];
    for (int64_t m = 0; m <= i; ++m) {
      const float coefficient = query_dots[i * n + m] * decay[i * n + m];
      const float* term = corrected + m * dv;
      for (int64_t j = 0; j < dv; ++j) o[j] += coefficient * term[j];
    }
  }
  // The state at the chunk end.
  const float decay_whole = decay_from_start[n - 1];
  const float* decay_to_end = decay + (n - 1) * n;
  for (int64_t p = 0; p < dk; ++p) {
    float* row = s.state + p * dv;
    for (int64_t j = 0; j < dv; ++j) row[j] *= decay_whole;
    const float* column = key_t + p * n;
    for (int64_t m = 0; m < n; ++m) {
      const float coefficient = column[m] * decay_to_end[m];
      const float* term = corrected + m * dv;
      for (int64_t j = 0; j < dv; ++j) row[j] += coefficient * term[j];
    }
  }
}

void zero_state_of_fresh_sequence(const HeadStream& s, const SequenceSpan& span) {
  if (span.first_position == 0) std::fill(s.state, s.state + s.key_dim * s.value_dim, 0.0f);
}

}  // namespace

void causal_conv1d_silu(const Tensor& x, const Tensor& weight, std::span<const SequenceSpan> spans,
                        Tensor& conv_state, Tensor& out) {
  constexpr const char* op = "causal_conv1d_silu";
  const ConvDims dims = check_causal_conv1d_silu(kCpuOps, x, weight, spans, conv_state, out);
  const int64_t channels = dims.channels;
  const int64_t kernel = dims.kernel;
  const std::vector<float> weight_f32 = widen_weight(weight, op, "weight");
  std::vector<float> taps(weight_f32.size());
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = weight_f32[c * kernel + j];

  const int64_t blocks = (channels + kConvChannelBlock - 1) / kConvChannelBlock;
  const int64_t tasks = static_cast<int64_t>(spans.size()) * blocks;
  ThreadPool::global().parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> history(static_cast<size_t>((kernel - 1) * kConvChannelBlock));
    for (int64_t task = begin; task < end; ++task) {
      const SequenceSpan& span = spans[static_cast<size_t>(task / blocks)];
      const int64_t c0 = task % blocks * kConvChannelBlock;
      const int64_t c1 = std::min(channels, c0 + kConvChannelBlock);
      float* state = conv_state.data<float>() + span.slot * (kernel - 1) * channels;
      conv_span_block(x.data<float>(), channels, taps.data(), kernel, span, c0, c1, state, history.data(),
                      out.data<float>());
    }
  });
}

void gated_delta_prepare_qkv(const Tensor& qkv, int64_t key_heads, int64_t key_dim, int64_t value_heads,
                             int64_t value_dim, Tensor& q, Tensor& k, Tensor& v) {
  constexpr const char* op = "gated_delta_prepare_qkv";
  const PrepareQkvDims dims = check_gated_delta_prepare_qkv(kCpuOps, qkv, q, k, v);
  if (dims.key_heads != key_heads || dims.key_dim != key_dim || dims.value_heads != value_heads ||
      dims.value_dim != value_dim)
    fail("cpu {}: q {} and v {} are not the key heads {}x{} and value heads {}x{} asked for", op,
         shape_string(q.shape()), shape_string(v.shape()), key_heads, key_dim, value_heads, value_dim);
  const int64_t key_width = key_heads * key_dim;
  const int64_t value_width = value_heads * value_dim;
  const int64_t tokens = dims.tokens;
  // HF-Q35 multiplies by the python float 1/sqrt(dk), which torch applies as an f32 scalar.
  const float query_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(key_dim)));

  // k̂ = k / ‖k‖ (scale 1, an exact product) and q̃ = (q / ‖q‖) · dk^-½, per head.
  auto normalize = [&](const float* in, float scale, float* out_row) {
    float sum = 0.0f;
    for (int64_t i = 0; i < key_dim; ++i) sum += in[i] * in[i];
    const float inverse_norm = 1.0f / std::sqrt(sum + kGatedDeltaL2NormEps);
    for (int64_t i = 0; i < key_dim; ++i) out_row[i] = in[i] * inverse_norm * scale;
  };
  ThreadPool::global().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = qkv.data<float>() + t * qkv.dim(1);
      for (int64_t h = 0; h < key_heads; ++h) {
        normalize(row + h * key_dim, query_scale, q.data<float>() + (t * key_heads + h) * key_dim);
        normalize(row + key_width + h * key_dim, 1.0f, k.data<float>() + (t * key_heads + h) * key_dim);
      }
      std::copy_n(row + 2 * key_width, value_width, v.data<float>() + t * value_width);
    }
  });
}

void gated_delta_gates(const Tensor& b, const Tensor& a, const Tensor& a_log, const Tensor& dt_bias,
                       Tensor& beta, Tensor& g) {
  constexpr const char* op = "gated_delta_gates";
  const int64_t heads = check_gated_delta_gates(kCpuOps, b, a, a_log, dt_bias, beta, g).heads;
  const std::vector<float> a_log_f32 = widen_weight(a_log, op, "A_log");
  const std::vector<float> dt_bias_f32 = widen_weight(dt_bias, op, "dt_bias");
  std::vector<float> negative_rate(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) negative_rate[h] = -std::exp(a_log_f32[h]);

  const int64_t count = b.numel();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t h = i % heads;
    beta.data<float>()[i] = 1.0f / (1.0f + std::exp(-b.data<float>()[i]));
    g.data<float>()[i] = negative_rate[h] * softplus(a.data<float>()[i] + dt_bias_f32[h]);
  }
}

void gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, std::span<const SequenceSpan> spans, Tensor& state,
                                Tensor& out) {
  const DeltaRuleDims shape =
      check_delta_rule(q, k, v, g, beta, spans, state, out, "gated_delta_rule_recurrent");
  const int64_t tasks = static_cast<int64_t>(spans.size()) * shape.value_heads;
  ThreadPool::global().parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(shape.value_dim));
    for (int64_t task = begin; task < end; ++task) {
      const SequenceSpan& span = spans[static_cast<size_t>(task / shape.value_heads)];
      const HeadStream stream = head_stream(q, k, v, g, beta, state, out, shape, span, task % shape.value_heads);
      zero_state_of_fresh_sequence(stream, span);
      recurrent_steps(stream, 0, span.tokens, scratch.data());
    }
  });
}

void gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, std::span<const SequenceSpan> spans, Tensor& state,
                              Tensor& out, int64_t chunk) {
  const DeltaRuleDims shape = check_delta_rule(q, k, v, g, beta, spans, state, out, "gated_delta_rule_chunked");
  if (chunk < 1) fail("cpu gated_delta_rule_chunked: chunk must be positive, got {}", chunk);
  const int64_t tasks = static_cast<int64_t>(spans.size()) * shape.value_heads;
  ThreadPool::global().parallel_for(tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> recurrent_scratch(static_cast<size_t>(shape.value_dim));
    ChunkScratch chunk_scratch(chunk, shape.key_dim, shape.value_dim);
    for (int64_t task = begin; task < end; ++task) {
      const SequenceSpan& span = spans[static_cast<size_t>(task / shape.value_heads)];
      const HeadStream stream = head_stream(q, k, v, g, beta, state, out, shape, span, task % shape.value_heads);
      zero_state_of_fresh_sequence(stream, span);
      // Recurrent up to the first absolute chunk boundary, whole aligned chunks, recurrent tail.
      const int64_t head_end = gated_delta_head_tokens(span, chunk);
      recurrent_steps(stream, 0, head_end, recurrent_scratch.data());
      int64_t t = head_end;
      for (; t + chunk <= span.tokens; t += chunk) chunk_step(stream, t, chunk, chunk_scratch);
      recurrent_steps(stream, t, span.tokens, recurrent_scratch.data());
    }
  });
}

void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, Tensor& out) {
  constexpr const char* op = "rms_norm_gated";
  const int64_t width = check_rms_norm_gated(kCpuOps, x, z, weight, out).width;
  const std::vector<float> gain = widen_weight(weight, op, "weight");
  const int64_t rows = x.numel() / width;
  ThreadPool::global().parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = x.data<float>() + r * width;
      const float* gate = z.data<float>() + r * width;
      float* y = out.data<float>() + r * width;
      float sum = 0.0f;
      for (int64_t i = 0; i < width; ++i) sum += in[i] * in[i];
      const float inverse_rms = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; ++i) y[i] = in[i] * inverse_rms * gain[i] * silu(gate[i]);
    }
  });
}

}  // namespace kiln::cpu
