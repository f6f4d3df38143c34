// The Gated DeltaNet CPU ops against a float64 reference written straight from spec A.6
// (shared/specs/architectures.md), and the invariance properties they promise, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/gated_delta.h"
#include "core/error.h"
#include "core/thread_pool.h"

using namespace kiln;
using namespace kiln::cpu;

namespace {

std::vector<float> random_values(size_t count, uint32_t seed, float scale = 1.0f) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = scale * uniform(generator);
  return values;
}

Tensor tensor_of(const std::vector<float>& values, Shape shape) {
  Tensor tensor = Tensor::empty(std::move(shape), DType::F32);
  EXPECT_EQ(static_cast<size_t>(tensor.numel()), values.size());
  std::copy(values.begin(), values.end(), tensor.data<float>());
  return tensor;
}

Tensor bf16_tensor_of(const std::vector<float>& values, Shape shape) {
  Tensor tensor = Tensor::empty(std::move(shape), DType::BF16);
  for (size_t i = 0; i < values.size(); ++i) tensor.data<uint16_t>()[i] = f32_to_bf16(values[i]);
  return tensor;
}

std::vector<float> values_of(const Tensor& tensor) {
  return std::vector<float>(tensor.data<float>(), tensor.data<float>() + tensor.numel());
}

bool bit_identical(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// max |ours - reference| / max |reference|, the normalised error of fixtures/README.md.
double relative_error(const std::vector<float>& ours, const std::vector<double>& reference) {
  double worst = 0.0;
  double scale = 0.0;
  for (size_t i = 0; i < reference.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(ours[i]) - reference[i]));
    scale = std::max(scale, std::abs(reference[i]));
  }
  return worst / scale;
}

double relative_error(const std::vector<float>& ours, const std::vector<float>& reference) {
  return relative_error(ours, std::vector<double>(reference.begin(), reference.end()));
}

// --- float64 reference, from the spec's formulas ---------------------------------------------------

double silu64(double x) { return x / (1.0 + std::exp(-x)); }

// Spec A.6.2 for one sequence: history [K-1][C] (oldest first), x [n][C], weight [C][K].
void reference_conv(const std::vector<double>& history, const std::vector<float>& x, const std::vector<float>& weight,
                    int64_t n, int64_t channels, int64_t kernel, std::vector<double>& out,
                    std::vector<double>& tail) {
  auto u = [&](int64_t i, int64_t c) {  // input at sequence offset i (negative: history)
    return i >= 0 ? static_cast<double>(x[i * channels + c]) : history[(kernel - 1 + i) * channels + c];
  };
  out.assign(n * channels, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < channels; ++c) {
      double s = 0.0;
      for (int64_t j = 0; j < kernel; ++j) s += static_cast<double>(weight[c * kernel + j]) * u(t - (kernel - 1) + j, c);
      out[t * channels + c] = silu64(s);
    }
  tail.assign((kernel - 1) * channels, 0.0);
  for (int64_t r = 0; r < kernel - 1; ++r)
    for (int64_t c = 0; c < channels; ++c) tail[r * channels + c] = u(n - (kernel - 1) + r, c);
}

// Spec A.6.4 for one value head: state [dk][dv], q/k [n][dk], v [n][dv], g/beta [n].
std::vector<double> reference_recurrence(std::vector<double>& state, const std::vector<double>& q,
                                         const std::vector<double>& k, const std::vector<double>& v,
                                         const std::vector<double>& g, const std::vector<double>& beta, int64_t n,
                                         int64_t dk, int64_t dv) {
  std::vector<double> out(n * dv);
  for (int64_t t = 0; t < n; ++t) {
    const double alpha = std::exp(g[t]);
    for (double& s : state) s *= alpha;
    std::vector<double> delta(dv);
    for (int64_t j = 0; j < dv; ++j) {
      double m = 0.0;
      for (int64_t p = 0; p < dk; ++p) m += state[p * dv + j] * k[t * dk + p];
      delta[j] = beta[t] * (v[t * dv + j] - m);
    }
    for (int64_t p = 0; p < dk; ++p)
      for (int64_t j = 0; j < dv; ++j) state[p * dv + j] += k[t * dk + p] * delta[j];
    for (int64_t j = 0; j < dv; ++j) {
      double o = 0.0;
      for (int64_t p = 0; p < dk; ++p) o += state[p * dv + j] * q[t * dk + p];
      out[t * dv + j] = o;
    }
  }
  return out;
}

// --- a random GDN problem ----------------------------------------------------------------------

struct DeltaProblem {
  int64_t tokens, key_heads, value_heads, key_dim, value_dim, slots;
  Tensor q, k, v, g, beta, state;
};

// q̃, k̂ from the prepare op over random conv outputs, gates from the gate op over random
// projections with A_log and dt_bias drawn as the fixture generator draws them
// (shared/oracle/gen_fixtures.py), and a random non-zero initial state in every slot.
DeltaProblem make_problem(int64_t tokens, int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
                          int64_t slots, uint32_t seed) {
  DeltaProblem problem{tokens, key_heads, value_heads, key_dim, value_dim, slots, {}, {}, {}, {}, {}, {}};
  const int64_t width = 2 * key_heads * key_dim + value_heads * value_dim;
  const Tensor qkv = tensor_of(random_values(tokens * width, seed), {tokens, width});
  problem.q = Tensor::empty({tokens, key_heads, key_dim}, DType::F32);
  problem.k = Tensor::empty({tokens, key_heads, key_dim}, DType::F32);
  problem.v = Tensor::empty({tokens, value_heads, value_dim}, DType::F32);
  gated_delta_prepare_qkv(qkv, key_heads, key_dim, value_heads, value_dim, problem.q, problem.k, problem.v);

  std::mt19937 generator(seed + 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> a_log(value_heads), dt_bias(value_heads);
  for (float& value : a_log) value = std::log(unit(generator) * 15.0f + 1.0f);
  for (float& value : dt_bias) value = unit(generator) * 0.5f + 0.5f;
  const Tensor b = tensor_of(random_values(tokens * value_heads, seed + 2, 3.0f), {tokens, value_heads});
  const Tensor a = tensor_of(random_values(tokens * value_heads, seed + 3, 3.0f), {tokens, value_heads});
  problem.beta = Tensor::empty({tokens, value_heads}, DType::F32);
  problem.g = Tensor::empty({tokens, value_heads}, DType::F32);
  gated_delta_gates(b, a, tensor_of(a_log, {value_heads}), tensor_of(dt_bias, {value_heads}), problem.beta,
                    problem.g);
  problem.state = tensor_of(random_values(slots * value_heads * key_dim * value_dim, seed + 4, 0.5f),
                            {slots, value_heads, key_dim, value_dim});
  return problem;
}

Tensor clone(const Tensor& tensor) {
  Tensor copy = Tensor::empty(tensor.shape(), tensor.dtype());
  std::memcpy(copy.raw(), tensor.raw(), tensor.nbytes());
  return copy;
}

enum class Form { Recurrent, Chunked };

// Runs one form over `spans` on copies of the problem's state; returns {out, final state}.
std::pair<Tensor, Tensor> run_rule(Form form, const DeltaProblem& problem, const std::vector<SequenceSpan>& spans,
                                   Tensor state) {
  Tensor out = Tensor::zeros({problem.tokens, problem.value_heads, problem.value_dim}, DType::F32);
  if (form == Form::Recurrent)
    gated_delta_rule_recurrent(problem.q, problem.k, problem.v, problem.g, problem.beta, spans, state, out);
  else
    gated_delta_rule_chunked(problem.q, problem.k, problem.v, problem.g, problem.beta, spans, state, out);
  return {out, state};
}

// Rows [first, first + count) of a [T, ...] tensor as a new tensor.
Tensor rows_of(const Tensor& tensor, int64_t first, int64_t count) { return clone(tensor.slice_rows(first, count)); }

// The problem restricted to tokens [first, first + count).
DeltaProblem sub_problem(const DeltaProblem& problem, int64_t first, int64_t count) {
  DeltaProblem part = problem;
  part.tokens = count;
  part.q = rows_of(problem.q, first, count);
  part.k = rows_of(problem.k, first, count);
  part.v = rows_of(problem.v, first, count);
  part.g = rows_of(problem.g, first, count);
  part.beta = rows_of(problem.beta, first, count);
  return part;
}

// The float64 reference output and final state of one slot's sequence over all the problem's tokens.
std::pair<std::vector<double>, std::vector<double>> reference_rule(const DeltaProblem& problem, int32_t slot,
                                                                   bool fresh) {
  const int64_t T = problem.tokens, dk = problem.key_dim, dv = problem.value_dim;
  const int64_t ratio = problem.value_heads / problem.key_heads;
  std::vector<double> out(T * problem.value_heads * dv);
  std::vector<double> states;
  for (int64_t h = 0; h < problem.value_heads; ++h) {
    const int64_t kh = h / ratio;
    std::vector<double> q(T * dk), k(T * dk), v(T * dv), g(T), beta(T);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t p = 0; p < dk; ++p) {
        q[t * dk + p] = problem.q.data<float>()[(t * problem.key_heads + kh) * dk + p];
        k[t * dk + p] = problem.k.data<float>()[(t * problem.key_heads + kh) * dk + p];
      }
      for (int64_t j = 0; j < dv; ++j) v[t * dv + j] = problem.v.data<float>()[(t * problem.value_heads + h) * dv + j];
      g[t] = problem.g.data<float>()[t * problem.value_heads + h];
      beta[t] = problem.beta.data<float>()[t * problem.value_heads + h];
    }
    const float* initial = problem.state.data<float>() + (slot * problem.value_heads + h) * dk * dv;
    std::vector<double> state(dk * dv, 0.0);
    if (!fresh) std::copy(initial, initial + dk * dv, state.begin());
    const std::vector<double> o = reference_recurrence(state, q, k, v, g, beta, T, dk, dv);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < dv; ++j) out[(t * problem.value_heads + h) * dv + j] = o[t * dv + j];
    states.insert(states.end(), state.begin(), state.end());
  }
  return {out, states};
}

std::vector<float> slot_state(const Tensor& state, int32_t slot) {
  const int64_t size = state.numel() / state.dim(0);
  return std::vector<float>(state.data<float>() + slot * size, state.data<float>() + (slot + 1) * size);
}

bool slot_states_identical(const Tensor& a, const Tensor& b, int32_t slot_a, int32_t slot_b) {
  return slot_state(a, slot_a) == slot_state(b, slot_b);
}

}  // namespace

// --- causal conv ---------------------------------------------------------------------------------

TEST(GatedDeltaConv, MatchesFloat64ReferenceFromStateAndFromScratch) {
  const int64_t channels = 200, kernel = 4, slots = 3;  // 200: a partial last channel block
  for (DType weight_dtype : {DType::F32, DType::BF16}) {
    const std::vector<float> weight_values = random_values(channels * kernel, 11, 0.7f);
    std::vector<float> weight_used = weight_values;  // the values the op sees, after storage rounding
    if (weight_dtype == DType::BF16)
      for (float& value : weight_used) value = round_to_bf16(value);
    const Tensor weight = weight_dtype == DType::F32 ? tensor_of(weight_values, {channels, kernel})
                                                     : bf16_tensor_of(weight_values, {channels, kernel});
    // A fresh 9-token sequence in slot 2, a 2-token append (shorter than K-1) in slot 0 and a
    // 30-token continuation in slot 1, in one batch.
    const std::vector<SequenceSpan> spans = {{2, 0, 9, 0}, {0, 9, 2, 17}, {1, 11, 30, 40}};
    const int64_t tokens = 41;
    const std::vector<float> x_values = random_values(tokens * channels, 12, 2.0f);
    const Tensor x = tensor_of(x_values, {tokens, channels});
    Tensor state = tensor_of(random_values(slots * (kernel - 1) * channels, 13), {slots, kernel - 1, channels});
    const Tensor initial_state = clone(state);
    Tensor out = Tensor::empty({tokens, channels}, DType::F32);
    causal_conv1d_silu(x, weight, spans, state, out);

    for (const SequenceSpan& span : spans) {
      std::vector<double> history((kernel - 1) * channels, 0.0);
      if (span.first_position != 0) {
        const std::vector<float> stored = slot_state(initial_state, span.slot);
        history.assign(stored.begin(), stored.end());
      }
      const std::vector<float> span_x(x_values.begin() + span.first_token * channels,
                                      x_values.begin() + (span.first_token + span.tokens) * channels);
      std::vector<double> expected_out, expected_tail;
      reference_conv(history, span_x, weight_used, span.tokens, channels, kernel, expected_out, expected_tail);
      const std::vector<float> got(out.data<float>() + span.first_token * channels,
                                   out.data<float>() + (span.first_token + span.tokens) * channels);
      EXPECT_LT(relative_error(got, expected_out), 1e-6) << "slot " << span.slot;
      // The tail holds inputs, copied exactly.
      const std::vector<float> tail = slot_state(state, span.slot);
      EXPECT_EQ(std::vector<double>(tail.begin(), tail.end()), expected_tail) << "slot " << span.slot;
    }
  }
}

TEST(GatedDeltaConv, SplitAtRandomPointsIsBitIdentical) {
  const int64_t channels = 96, kernel = 4, tokens = 57;
  const Tensor weight = tensor_of(random_values(channels * kernel, 21), {channels, kernel});
  const Tensor x = tensor_of(random_values(tokens * channels, 22, 2.0f), {tokens, channels});
  const Tensor initial_state = tensor_of(random_values((kernel - 1) * channels, 23), {1, kernel - 1, channels});
  for (int32_t first_position : {0, 5}) {
    Tensor whole_state = clone(initial_state);
    Tensor whole_out = Tensor::empty({tokens, channels}, DType::F32);
    causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{0, 0, int32_t(tokens), first_position}}, whole_state,
                       whole_out);

    std::mt19937 generator(24 + first_position);
    for (int trial = 0; trial < 20; ++trial) {
      // Random pieces, many shorter than K-1 so that the tail reaches back into older state.
      Tensor state = clone(initial_state);
      Tensor out = Tensor::empty({tokens, channels}, DType::F32);
      int64_t done = 0;
      while (done < tokens) {
        const int64_t piece = std::min<int64_t>(tokens - done, std::uniform_int_distribution<int64_t>(1, 9)(generator));
        const Tensor piece_x = rows_of(x, done, piece);
        Tensor piece_out = Tensor::empty({piece, channels}, DType::F32);
        causal_conv1d_silu(piece_x, weight,
                           std::vector<SequenceSpan>{{0, 0, int32_t(piece), int32_t(first_position + done)}}, state,
                           piece_out);
        std::memcpy(out.data<float>() + done * channels, piece_out.raw(), piece_out.nbytes());
        done += piece;
      }
      ASSERT_TRUE(bit_identical(out, whole_out)) << "trial " << trial;
      ASSERT_TRUE(bit_identical(state, whole_state)) << "trial " << trial;
    }
  }
}

TEST(GatedDeltaConv, FreshSequenceIgnoresWhatTheSlotHolds) {
  const int64_t channels = 8, kernel = 4;
  const Tensor weight = tensor_of(random_values(channels * kernel, 31), {channels, kernel});
  const Tensor x = tensor_of(random_values(5 * channels, 32), {5, channels});
  Tensor stale = tensor_of(random_values((kernel - 1) * channels, 33), {1, kernel - 1, channels});
  Tensor zeroed = Tensor::zeros({1, kernel - 1, channels}, DType::F32);
  Tensor out_stale = Tensor::empty({5, channels}, DType::F32);
  Tensor out_zeroed = Tensor::empty({5, channels}, DType::F32);
  const std::vector<SequenceSpan> spans = {{0, 0, 5, 0}};
  causal_conv1d_silu(x, weight, spans, stale, out_stale);
  causal_conv1d_silu(x, weight, spans, zeroed, out_zeroed);
  EXPECT_TRUE(bit_identical(out_stale, out_zeroed));
  EXPECT_TRUE(bit_identical(stale, zeroed));
}

TEST(GatedDeltaConv, RejectsBadShapesAndSpans) {
  const Tensor x = Tensor::zeros({4, 8}, DType::F32);
  const Tensor weight = Tensor::zeros({8, 4}, DType::F32);
  Tensor state = Tensor::zeros({2, 3, 8}, DType::F32);
  Tensor out = Tensor::zeros({4, 8}, DType::F32);
  Tensor wrong_state = Tensor::zeros({2, 4, 8}, DType::F32);
  EXPECT_THROW(causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{0, 0, 4, 0}}, wrong_state, out), Error);
  EXPECT_THROW(causal_conv1d_silu(x, Tensor::zeros({8, 1, 4}, DType::F32), std::vector<SequenceSpan>{{0, 0, 4, 0}},
                                  state, out),
               Error);
  EXPECT_THROW(causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{0, 2, 3, 0}}, state, out), Error);
  EXPECT_THROW(causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{2, 0, 4, 0}}, state, out), Error);
  EXPECT_THROW(causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{1, 0, 2, 0}, {1, 2, 2, 0}}, state, out),
               Error);
  try {
    Tensor aliased = x;
    causal_conv1d_silu(x, weight, std::vector<SequenceSpan>{{0, 0, 4, 0}}, state, aliased);
    FAIL() << "aliasing out and x was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("causal_conv1d_silu"), std::string::npos) << error.what();
  }
}

// --- q/k normalisation and gates -----------------------------------------------------------------

// The span checks every recurrent-state op shares (check_recurrent_spans, backend.h), through the
// CPU conv: each failure names the op and the offending span.
TEST(GatedDeltaConv, SpanErrorsNameTheOpAndTheSpan) {
  const Tensor x = Tensor::zeros({4, 8}, DType::F32);
  const Tensor weight = Tensor::zeros({8, 4}, DType::F32);
  Tensor state = Tensor::zeros({2, 3, 8}, DType::F32);
  Tensor out = Tensor::zeros({4, 8}, DType::F32);
  auto message_of = [&](const std::vector<SequenceSpan>& spans) -> std::string {
    try {
      causal_conv1d_silu(x, weight, spans, state, out);
    } catch (const Error& error) {
      return error.what();
    }
    return "no error";
  };
  EXPECT_EQ(message_of({{0, 2, 3, 0}}),
            "cpu causal_conv1d_silu: span (slot 0, first_token 2, tokens 3, first_position 0) lies outside the 4 "
            "tokens of the batch");
  EXPECT_EQ(message_of({{2, 0, 4, 0}}), "cpu causal_conv1d_silu: span slot 2 is outside the 2 slots of the state");
  EXPECT_EQ(message_of({{1, 0, 2, 0}, {1, 2, 2, 0}}), "cpu causal_conv1d_silu: two spans of one batch use slot 1");
}

TEST(GatedDeltaPrepare, NormalisesAndScalesPerHead) {
  const int64_t tokens = 5, key_heads = 2, key_dim = 12, value_heads = 4, value_dim = 6;
  const int64_t width = 2 * key_heads * key_dim + value_heads * value_dim;
  const std::vector<float> values = random_values(tokens * width, 41, 3.0f);
  Tensor q = Tensor::empty({tokens, key_heads, key_dim}, DType::F32);
  Tensor k = Tensor::empty({tokens, key_heads, key_dim}, DType::F32);
  Tensor v = Tensor::empty({tokens, value_heads, value_dim}, DType::F32);
  gated_delta_prepare_qkv(tensor_of(values, {tokens, width}), key_heads, key_dim, value_heads, value_dim, q, k, v);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < key_heads; ++h)
      for (int which = 0; which < 2; ++which) {
        const float* in = values.data() + t * width + which * key_heads * key_dim + h * key_dim;
        double sum = 0.0;
        for (int64_t i = 0; i < key_dim; ++i) sum += double(in[i]) * in[i];
        const double scale = (which == 0 ? 1.0 / std::sqrt(double(key_dim)) : 1.0) / std::sqrt(sum + 1e-6);
        const float* got = (which == 0 ? q : k).data<float>() + (t * key_heads + h) * key_dim;
        for (int64_t i = 0; i < key_dim; ++i) EXPECT_NEAR(got[i], in[i] * scale, 1e-6) << t << " " << h << " " << i;
      }
    for (int64_t i = 0; i < value_heads * value_dim; ++i)
      EXPECT_EQ(v.data<float>()[t * value_heads * value_dim + i], values[t * width + 2 * key_heads * key_dim + i]);
  }
}

TEST(GatedDeltaGates, MatchFloat64ReferenceWithTorchSoftplusThreshold) {
  const int64_t tokens = 6, heads = 3;
  std::vector<float> b = random_values(tokens * heads, 51, 6.0f);
  std::vector<float> a = random_values(tokens * heads, 52, 6.0f);
  a[0] = 25.0f;    // a + dt_bias > 20: softplus returns its input exactly (torch threshold)
  a[1] = -40.0f;   // log1p(exp(x)) stays accurate far below zero
  const std::vector<float> a_log = {0.5f, 1.2f, 2.7f};
  const std::vector<float> dt_bias = {0.75f, 0.5f, 0.9f};
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor a_log_tensor = dtype == DType::F32 ? tensor_of(a_log, {heads}) : bf16_tensor_of(a_log, {heads});
    const Tensor dt_bias_tensor = dtype == DType::F32 ? tensor_of(dt_bias, {heads}) : bf16_tensor_of(dt_bias, {heads});
    Tensor beta = Tensor::empty({tokens, heads}, DType::F32);
    Tensor g = Tensor::empty({tokens, heads}, DType::F32);
    gated_delta_gates(tensor_of(b, {tokens, heads}), tensor_of(a, {tokens, heads}), a_log_tensor, dt_bias_tensor, beta,
                      g);
    for (int64_t i = 0; i < tokens * heads; ++i) {
      const int64_t h = i % heads;
      const double stored_a_log = dtype == DType::F32 ? a_log[h] : round_to_bf16(a_log[h]);
      const double stored_dt_bias = dtype == DType::F32 ? dt_bias[h] : round_to_bf16(dt_bias[h]);
      const double x = double(a[i]) + stored_dt_bias;
      const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
      const double expected_g = -std::exp(stored_a_log) * softplus;
      EXPECT_NEAR(beta.data<float>()[i], 1.0 / (1.0 + std::exp(-double(b[i]))), 1e-7) << i;
      EXPECT_NEAR(g.data<float>()[i], expected_g, 2e-6 * std::max(1.0, std::abs(expected_g))) << i;
    }
    // Above the threshold the f32 result is exactly -exp(A_log) · (a + dt_bias).
    EXPECT_EQ(g.data<float>()[0],
              -std::exp(float(dtype == DType::F32 ? a_log[0] : round_to_bf16(a_log[0]))) *
                  (a[0] + float(dtype == DType::F32 ? dt_bias[0] : round_to_bf16(dt_bias[0]))));
  }
}

// --- the delta rule --------------------------------------------------------------------------------

class GatedDeltaRuleRatio : public ::testing::TestWithParam<int64_t> {};

// Both forms against the float64 recurrence from a non-zero state, and against each other.
TEST_P(GatedDeltaRuleRatio, RecurrentAndChunkedMatchFloat64Reference) {
  const int64_t ratio = GetParam();
  const int64_t key_heads = 2, value_heads = key_heads * ratio, key_dim = 24, value_dim = 16;
  for (int64_t tokens : {1, 63, 64, 65, 150, 300}) {
    // Slot 1 continues at an aligned position, slot 0 mid-chunk; both from a non-zero state.
    for (int32_t first_position : {128, 100}) {
      SCOPED_TRACE(testing::Message() << "T " << tokens << ", first position " << first_position);
      const DeltaProblem problem = make_problem(tokens, key_heads, value_heads, key_dim, value_dim, 2,
                                                static_cast<uint32_t>(60 + tokens + ratio));
      const int32_t slot = first_position == 128 ? 1 : 0;
      const std::vector<SequenceSpan> spans = {{slot, 0, int32_t(tokens), first_position}};
      const auto [expected_out, expected_state] = reference_rule(problem, slot, false);
      const auto [recurrent_out, recurrent_state] = run_rule(Form::Recurrent, problem, spans, clone(problem.state));
      const auto [chunked_out, chunked_state] = run_rule(Form::Chunked, problem, spans, clone(problem.state));
      // Both forms stay within a few f32 roundings of the exact result (measured: < 4e-7).
      EXPECT_LT(relative_error(values_of(recurrent_out), expected_out), 1e-6);
      EXPECT_LT(relative_error(values_of(chunked_out), expected_out), 1e-6);
      EXPECT_LT(relative_error(values_of(chunked_out), values_of(recurrent_out)), 1e-5);
      EXPECT_LT(relative_error(slot_state(recurrent_state, slot), expected_state), 1e-6);
      EXPECT_LT(relative_error(slot_state(chunked_state, slot), expected_state), 1e-6);
      EXPECT_LT(relative_error(slot_state(chunked_state, slot), slot_state(recurrent_state, slot)), 1e-5);
      // The other slot is untouched.
      EXPECT_EQ(slot_state(chunked_state, 1 - slot), slot_state(problem.state, 1 - slot));
      // The chunked form really ran wherever a whole aligned chunk fits (it rounds differently).
      const bool has_whole_chunk = (first_position + 63) / 64 * 64 + 64 <= first_position + tokens;
      EXPECT_EQ(!bit_identical(chunked_out, recurrent_out), has_whole_chunk);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(GatedDeltaRule, GatedDeltaRuleRatio, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "HvOverHk" + std::to_string(info.param); });

TEST(GatedDeltaRule, FreshSequenceStartsFromZeroState) {
  const DeltaProblem problem = make_problem(70, 2, 4, 16, 8, 1, 71);
  const std::vector<SequenceSpan> spans = {{0, 0, 70, 0}};
  const auto [expected_out, expected_state] = reference_rule(problem, 0, true);
  for (Form form : {Form::Recurrent, Form::Chunked}) {
    const auto [out, state] = run_rule(form, problem, spans, clone(problem.state));  // stale, non-zero slot
    EXPECT_LT(relative_error(values_of(out), expected_out), 1e-5);
    EXPECT_LT(relative_error(slot_state(state, 0), expected_state), 1e-5);
    const auto [out_zero, state_zero] = run_rule(form, problem, spans, Tensor::zeros(problem.state.shape(), DType::F32));
    EXPECT_TRUE(bit_identical(out, out_zero));
    EXPECT_TRUE(bit_identical(state, state_zero));
  }
}

// (a) A prefill split at multiples of 64 equals the one-shot prefill, bit for bit.
TEST(GatedDeltaRule, PrefillSplitAtMultiplesOf64IsBitIdentical) {
  const DeltaProblem problem = make_problem(300, 2, 4, 24, 16, 1, 81);
  for (int32_t start : {0, 64}) {  // from scratch, and continuing an aligned warm state
    const auto [whole_out, whole_state] = run_rule(Form::Chunked, problem, {{0, 0, 300, start}}, clone(problem.state));
    for (const std::vector<int64_t>& cuts :
         std::vector<std::vector<int64_t>>{{64}, {128}, {64, 128, 192, 256}, {192, 256}, {256}}) {
      Tensor state = clone(problem.state);
      Tensor out = Tensor::empty(whole_out.shape(), DType::F32);
      int64_t done = 0;
      std::vector<int64_t> ends = cuts;
      ends.push_back(300);
      for (int64_t end : ends) {
        const DeltaProblem piece = sub_problem(problem, done, end - done);
        auto [piece_out, piece_state] =
            run_rule(Form::Chunked, piece, {{0, 0, int32_t(end - done), int32_t(start + done)}}, state);
        std::memcpy(out.data<float>() + done * 4 * 16, piece_out.raw(), piece_out.nbytes());
        state = piece_state;
        done = end;
      }
      EXPECT_TRUE(bit_identical(out, whole_out)) << "start " << start << ", " << cuts.size() << " cuts";
      EXPECT_TRUE(bit_identical(state, whole_state)) << "start " << start << ", " << cuts.size() << " cuts";
    }
  }
}

// (b) k ≤ 16 tokens appended in one call equal the same tokens decoded one at a time, bit for bit,
// wherever the append falls (including across a chunk boundary).
TEST(GatedDeltaRule, SmallAppendEqualsOneTokenDecodes) {
  const int64_t prefix = 120;
  const DeltaProblem problem = make_problem(prefix + 16, 2, 4, 24, 16, 1, 91);
  for (int64_t split : {int64_t{50}, int64_t{60}, prefix}) {
    const Tensor warm_state =
        run_rule(Form::Chunked, sub_problem(problem, 0, split), {{0, 0, int32_t(split), 0}}, clone(problem.state))
            .second;
    for (int64_t count : {1, 2, 5, 16}) {
      for (Form form : {Form::Recurrent, Form::Chunked}) {
        const DeltaProblem append = sub_problem(problem, split, count);
        const auto [append_out, append_state] =
            run_rule(form, append, {{0, 0, int32_t(count), int32_t(split)}}, clone(warm_state));
        Tensor state = clone(warm_state);
        for (int64_t i = 0; i < count; ++i) {
          const DeltaProblem step = sub_problem(problem, split + i, 1);
          auto [step_out, step_state] = run_rule(form, step, {{0, 0, 1, int32_t(split + i)}}, state);
          state = step_state;
          EXPECT_EQ(std::memcmp(step_out.raw(), append_out.data<float>() + i * 4 * 16, step_out.nbytes()), 0)
              << "split " << split << ", append " << count << ", token " << i;
        }
        EXPECT_TRUE(bit_identical(state, append_state)) << "split " << split << ", append " << count;
      }
    }
  }
}

// (c) A sequence alone equals the same sequence inside a batch of three, bit for bit, whatever
// the thread count.
TEST(GatedDeltaRule, SequenceAloneEqualsInsideBatchOfThree) {
  // Three sequences flattened: a 150-token prefill continuing at 64, a fresh 70-token prefill,
  // and a 1-token decode at position 77.
  const std::vector<SequenceSpan> batch = {{2, 0, 150, 64}, {0, 150, 70, 0}, {1, 220, 1, 77}};
  const DeltaProblem problem = make_problem(221, 2, 4, 24, 16, 3, 101);
  for (Form form : {Form::Recurrent, Form::Chunked}) {
    const auto [batch_out, batch_state] = run_rule(form, problem, batch, clone(problem.state));
    for (int threads : {1, 3}) {
      ThreadPool::set_global_threads(threads);
      for (const SequenceSpan& span : batch) {
        const DeltaProblem alone = sub_problem(problem, span.first_token, span.tokens);
        const SequenceSpan alone_span{0, 0, span.tokens, span.first_position};
        Tensor state = Tensor::empty({1, 4, 24, 16}, DType::F32);
        const std::vector<float> initial = slot_state(problem.state, span.slot);
        std::copy(initial.begin(), initial.end(), state.data<float>());
        const auto [alone_out, alone_state] = run_rule(form, alone, {alone_span}, state);
        EXPECT_EQ(std::memcmp(alone_out.raw(), batch_out.data<float>() + span.first_token * 4 * 16,
                              alone_out.nbytes()),
                  0)
            << "slot " << span.slot << ", " << threads << " threads";
        EXPECT_TRUE(slot_states_identical(alone_state, batch_state, 0, span.slot)) << "slot " << span.slot;
      }
    }
  }
  ThreadPool::set_global_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

// The chunked call's first tokens up to the next multiple of 64 are recurrent steps, bit for bit.
TEST(GatedDeltaRule, MidChunkStartRunsRecurrentStepsToTheBoundary) {
  const DeltaProblem problem = make_problem(200, 2, 4, 24, 16, 1, 111);
  const std::vector<SequenceSpan> spans = {{0, 0, 200, 100}};
  const auto [chunked_out, chunked_state] = run_rule(Form::Chunked, problem, spans, clone(problem.state));
  const auto [recurrent_out, recurrent_state] =
      run_rule(Form::Recurrent, sub_problem(problem, 0, 28), {{0, 0, 28, 100}}, clone(problem.state));
  EXPECT_EQ(std::memcmp(chunked_out.raw(), recurrent_out.raw(), recurrent_out.nbytes()), 0);
  // ... and the rest is the chunk [128, 192) and recurrent steps over [192, 300).
  const auto [rest_out, rest_state] =
      run_rule(Form::Chunked, sub_problem(problem, 28, 172), {{0, 0, 172, 128}}, recurrent_state);
  EXPECT_EQ(std::memcmp(chunked_out.data<float>() + 28 * 4 * 16, rest_out.raw(), rest_out.nbytes()), 0);
  EXPECT_TRUE(bit_identical(chunked_state, rest_state));
}

TEST(GatedDeltaRule, RejectsMismatchedShapes) {
  const DeltaProblem problem = make_problem(4, 2, 4, 8, 8, 2, 121);
  Tensor state = clone(problem.state);
  Tensor out = Tensor::empty({4, 4, 8}, DType::F32);
  const std::vector<SequenceSpan> spans = {{0, 0, 4, 3}};
  Tensor wrong_out = Tensor::empty({4, 4, 7}, DType::F32);
  EXPECT_THROW(gated_delta_rule_chunked(problem.q, problem.k, problem.v, problem.g, problem.beta, spans, state,
                                        wrong_out),
               Error);
  Tensor wrong_state = Tensor::empty({2, 4, 8, 7}, DType::F32);
  EXPECT_THROW(gated_delta_rule_recurrent(problem.q, problem.k, problem.v, problem.g, problem.beta, spans,
                                          wrong_state, out),
               Error);
  // Three value heads cannot share two key heads.
  const Tensor v3 = Tensor::zeros({4, 3, 8}, DType::F32);
  const Tensor gates3 = Tensor::zeros({4, 3}, DType::F32);
  Tensor state3 = Tensor::zeros({2, 3, 8, 8}, DType::F32);
  Tensor out3 = Tensor::empty({4, 3, 8}, DType::F32);
  EXPECT_THROW(gated_delta_rule_recurrent(problem.q, problem.k, v3, gates3, gates3, spans, state3, out3), Error);
  EXPECT_THROW(gated_delta_rule_chunked(problem.q, problem.k, problem.v, problem.g, problem.beta,
                                        std::vector<SequenceSpan>{{0, 0, 2, 0}, {0, 2, 2, 0}}, state, out),
               Error);
}

// --- gated norm --------------------------------------------------------------------------------

TEST(GatedDeltaNorm, MatchesFloat64Reference) {
  const int64_t tokens = 7, heads = 3, width = 40;
  const std::vector<float> x = random_values(tokens * heads * width, 131, 4.0f);
  const std::vector<float> z = random_values(tokens * heads * width, 132, 6.0f);
  const std::vector<float> w = random_values(width, 133, 1.5f);
  const float eps = 1e-6f;
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor weight = dtype == DType::F32 ? tensor_of(w, {width}) : bf16_tensor_of(w, {width});
    Tensor out = Tensor::empty({tokens, heads, width}, DType::F32);
    rms_norm_gated(tensor_of(x, {tokens, heads, width}), tensor_of(z, {tokens, heads, width}), weight, eps, out);
    std::vector<double> expected(x.size());
    for (int64_t r = 0; r < tokens * heads; ++r) {
      double sum = 0.0;
      for (int64_t i = 0; i < width; ++i) sum += double(x[r * width + i]) * x[r * width + i];
      const double inverse_rms = 1.0 / std::sqrt(sum / width + eps);
      for (int64_t i = 0; i < width; ++i) {
        const double gain = dtype == DType::F32 ? w[i] : round_to_bf16(w[i]);
        expected[r * width + i] = x[r * width + i] * inverse_rms * gain * silu64(z[r * width + i]);
      }
    }
    EXPECT_LT(relative_error(values_of(out), expected), 1e-6);
  }
  Tensor out = Tensor::empty({tokens, heads, width}, DType::F32);
  EXPECT_THROW(rms_norm_gated(tensor_of(x, {tokens, heads, width}), tensor_of(z, {tokens, heads * width}),
                              tensor_of(w, {width}), eps, out),
               Error);
}
