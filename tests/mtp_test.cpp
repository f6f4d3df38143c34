// Speculation with Qwen3.5's multi-token-prediction head (engine/mtp_proposer.h), on the dense and
// the MoE fixture with random MTP weights written beside their own: the head's weights kept only
// when asked, its logits against a float64 evaluation of the same weights, a run's tokens and
// logprobs those of the plain run (alone and among plain requests), every proposal the one a fresh
// head makes from the plain run's hidden states, and what a load without a head, or with a
// malformed one, is refused with.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/generation_core.h"
#include "engine/mtp_proposer.h"
#include "engine/scheduler.h"
#include "model/qwen3_5_checkpoint.h"
#include "mtp_support.h"
#include "speculative_support.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

std::filesystem::path fixture(const std::string& name) { return fixtures_dir() / name; }

// A prompt of `length` tokens: the fixture's own, repeated.
std::vector<int32_t> long_prompt(const std::string& name, size_t length) {
  const std::vector<int32_t> own = fixture_prompt(fixture(name));
  std::vector<int32_t> prompt;
  while (prompt.size() < length) prompt.insert(prompt.end(), own.begin(), own.end());
  prompt.resize(length);
  return prompt;
}

// --- a float64 evaluation of the head, straight from the checkpoint's tensors ---------------------

class ReferenceHead {
 public:
  explicit ReferenceHead(const std::filesystem::path& dir)
      : checkpoint_(Checkpoint::open(dir)), json_(nlohmann::json::parse(std::ifstream(dir / "config.json"))) {
    hidden_ = json_["hidden_size"];
    heads_ = json_["num_attention_heads"];
    kv_heads_ = json_["num_key_value_heads"];
    head_dim_ = json_["head_dim"];
    eps_ = json_["rms_norm_eps"];
    vocab_ = json_["vocab_size"];
    theta_ = json_["rope_parameters"]["rope_theta"];
    rotary_ = static_cast<int64_t>(static_cast<double>(head_dim_) * json_["partial_rotary_factor"].get<double>());
    embed_ = values("model.embed_tokens.weight");
    lm_head_ = json_["tie_word_embeddings"].get<bool>() ? embed_ : values("lm_head.weight");
  }

  struct Output {
    std::vector<std::vector<double>> logits, hidden;  // per pair
  };

  // The head over the pairs (tokens[p], hidden[p]) at positions 0, 1, … (spec A.8).
  Output run(const std::vector<int32_t>& tokens, const std::vector<std::vector<double>>& hidden) {
    const int64_t H = hidden_, D = head_dim_;
    const std::string layer = "mtp.layers.0.";
    std::vector<std::vector<double>> stream, keys, vals, queries, gates;
    for (size_t t = 0; t < tokens.size(); ++t) {
      std::vector<double> embedded(embed_.begin() + tokens[t] * H, embed_.begin() + (tokens[t] + 1) * H);
      std::vector<double> joined = norm(embedded, "mtp.pre_fc_norm_embedding.weight");
      const std::vector<double> g = norm(hidden[t], "mtp.pre_fc_norm_hidden.weight");
      joined.insert(joined.end(), g.begin(), g.end());
      stream.push_back(product("mtp.fc.weight", joined));
      const std::vector<double> a = norm(stream.back(), layer + "input_layernorm.weight");
      const std::vector<double> q_and_gate = product(layer + "self_attn.q_proj.weight", a);
      std::vector<double> q, gate;
      for (int64_t h = 0; h < heads_; ++h) {
        std::vector<double> head(q_and_gate.begin() + h * 2 * D, q_and_gate.begin() + h * 2 * D + D);
        head = rotate(norm(head, layer + "self_attn.q_norm.weight"), static_cast<double>(t));
        q.insert(q.end(), head.begin(), head.end());
        gate.insert(gate.end(), q_and_gate.begin() + h * 2 * D + D, q_and_gate.begin() + (h + 1) * 2 * D);
      }
      const std::vector<double> k = product(layer + "self_attn.k_proj.weight", a);
      std::vector<double> rotated_k;
      for (int64_t h = 0; h < kv_heads_; ++h) {
        std::vector<double> head(k.begin() + h * D, k.begin() + (h + 1) * D);
        head = rotate(norm(head, layer + "self_attn.k_norm.weight"), static_cast<double>(t));
        rotated_k.insert(rotated_k.end(), head.begin(), head.end());
      }
      keys.push_back(rotated_k);
      vals.push_back(product(layer + "self_attn.v_proj.weight", a));
      queries.push_back(q);
      gates.push_back(gate);
    }
    Output output;
    for (size_t t = 0; t < tokens.size(); ++t) {
      std::vector<double> attended(static_cast<size_t>(heads_ * D), 0.0);
      for (int64_t h = 0; h < heads_; ++h) {
        const int64_t kv = h / (heads_ / kv_heads_);
        std::vector<double> scores;
        for (size_t j = 0; j <= t; ++j) {
          double score = 0;
          for (int64_t d = 0; d < D; ++d) score += queries[t][h * D + d] * keys[j][kv * D + d];
          scores.push_back(score / std::sqrt(static_cast<double>(D)));
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double& score : scores) sum += (score = std::exp(score - top));
        for (size_t j = 0; j <= t; ++j)
          for (int64_t d = 0; d < D; ++d) attended[h * D + d] += scores[j] / sum * vals[j][kv * D + d];
        for (int64_t d = 0; d < D; ++d) attended[h * D + d] *= sigmoid(gates[t][h * D + d]);
      }
      std::vector<double> u = stream[t];
      add(u, product(layer + "self_attn.o_proj.weight", attended));
      add(u, mlp(norm(u, layer + "post_attention_layernorm.weight"), layer + "mlp."));
      output.hidden.push_back(norm(u, "mtp.norm.weight"));
      output.logits.push_back(matrix_product(lm_head_, vocab_, output.hidden.back()));
    }
    return output;
  }

 private:
  std::vector<double> values(const std::string& name) const {
    const Tensor view = checkpoint_.view(name);
    std::vector<double> out(static_cast<size_t>(view.numel()));
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = view.dtype() == DType::BF16 ? bf16_to_f32(view.data<uint16_t>()[i]) : view.data<float>()[i];
    return out;
  }
  const std::vector<double>& weight(const std::string& name) {
    auto found = cache_.find(name);
    if (found == cache_.end()) found = cache_.emplace(name, values(name)).first;
    return found->second;
  }
  static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
  static double silu(double x) { return x * sigmoid(x); }
  static void add(std::vector<double>& a, const std::vector<double>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  }
  // Zero-centred RMSNorm: x / rms(x) · (1 + γ).
  std::vector<double> norm(const std::vector<double>& x, const std::string& gain) {
    const std::vector<double>& gamma = weight(gain);
    double squares = 0;
    for (double v : x) squares += v * v;
    const double scale = 1.0 / std::sqrt(squares / static_cast<double>(x.size()) + eps_);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * scale * (1.0 + gamma[i]);
    return out;
  }
  // Rotate-half RoPE on the first `rotary_` dims at `position`.
  std::vector<double> rotate(std::vector<double> x, double position) const {
    const int64_t half = rotary_ / 2;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = position * std::pow(theta_, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_));
      const double a = x[i], b = x[i + half];
      x[i] = a * std::cos(angle) - b * std::sin(angle);
      x[i + half] = b * std::cos(angle) + a * std::sin(angle);
    }
    return x;
  }
  // rows [N, x.size()] · x, of a matrix stored at `offset` in `w`.
  static std::vector<double> matrix_product(const std::vector<double>& w, int64_t rows, const std::vector<double>& x,
                                            size_t offset = 0) {
    std::vector<double> out(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (size_t k = 0; k < x.size(); ++k) out[r] += w[offset + r * x.size() + k] * x[k];
    return out;
  }
  std::vector<double> product(const std::string& name, const std::vector<double>& x) {
    const std::vector<double>& w = weight(name);
    return matrix_product(w, static_cast<int64_t>(w.size() / x.size()), x);
  }
  // SwiGLU of the matrices at these offsets ([width, H], [width, H], [H, width]).
  std::vector<double> swiglu(const std::vector<double>& gate_w, size_t gate_at, const std::vector<double>& up_w,
                             size_t up_at, const std::vector<double>& down_w, size_t down_at, int64_t width,
                             const std::vector<double>& x) {
    const std::vector<double> gate = matrix_product(gate_w, width, x, gate_at);
    const std::vector<double> up = matrix_product(up_w, width, x, up_at);
    std::vector<double> inner(static_cast<size_t>(width));
    for (int64_t i = 0; i < width; ++i) inner[i] = silu(gate[i]) * up[i];
    return matrix_product(down_w, hidden_, inner, down_at);
  }
  // The dense MLP, or the MoE of model/moe.h (softmax, top-k renormalised, shared expert gated).
  std::vector<double> mlp(const std::vector<double>& x, const std::string& prefix) {
    if (!json_.contains("num_experts")) {
      const std::vector<double>& gate = weight(prefix + "gate_proj.weight");
      return swiglu(gate, 0, weight(prefix + "up_proj.weight"), 0, weight(prefix + "down_proj.weight"), 0,
                    static_cast<int64_t>(gate.size()) / hidden_, x);
    }
    const int64_t experts = json_["num_experts"], top_k = json_["num_experts_per_tok"];
    const int64_t width = json_["moe_intermediate_size"], shared = json_["shared_expert_intermediate_size"];
    std::vector<double> p = product(prefix + "gate.weight", x);
    const double top = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& v : p) sum += (v = std::exp(v - top));
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    order.resize(static_cast<size_t>(top_k));
    double chosen = 0;
    for (int64_t e : order) chosen += p[e];
    const std::vector<double>& gate_up = weight(prefix + "experts.gate_up_proj");
    const std::vector<double>& down = weight(prefix + "experts.down_proj");
    std::vector<double> out(static_cast<size_t>(hidden_), 0.0);
    for (int64_t e : order) {
      const auto at = static_cast<size_t>(e * 2 * width * hidden_);
      const std::vector<double> y = swiglu(gate_up, at, gate_up, at + static_cast<size_t>(width * hidden_), down,
                                           static_cast<size_t>(e * hidden_ * width), width, x);
      for (int64_t i = 0; i < hidden_; ++i) out[i] += p[e] / chosen * y[i];
    }
    const std::vector<double> y =
        swiglu(weight(prefix + "shared_expert.gate_proj.weight"), 0, weight(prefix + "shared_expert.up_proj.weight"), 0,
               weight(prefix + "shared_expert.down_proj.weight"), 0, shared, x);
    const double gate = sigmoid(product(prefix + "shared_expert_gate.weight", x)[0]);
    for (int64_t i = 0; i < hidden_; ++i) out[i] += gate * y[i];
    return out;
  }

  Checkpoint checkpoint_;
  nlohmann::json json_;
  int64_t hidden_, heads_, kv_heads_, head_dim_, vocab_, rotary_;
  double eps_, theta_;
  std::vector<double> embed_, lm_head_;
  std::map<std::string, std::vector<double>> cache_;
};

std::vector<std::vector<double>> host_rows(Backend& backend, const Tensor& device) {
  const Tensor host = backend.download(device);
  std::vector<std::vector<double>> rows(static_cast<size_t>(host.dim(0)));
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t c = 0; c < host.dim(1); ++c) rows[r].push_back(host.data<float>()[r * host.dim(1) + c]);
  return rows;
}

// max |ours − reference| / max |reference| over a row.
double relative_error(const std::vector<double>& ours, const std::vector<double>& reference) {
  double error = 0, scale = 0;
  for (size_t i = 0; i < reference.size(); ++i) {
    error = std::max(error, std::abs(ours[i] - reference[i]));
    scale = std::max(scale, std::abs(reference[i]));
  }
  return error / scale;
}

class MtpHeadOf : public ::testing::TestWithParam<std::string> {};

// The head's logits and output hidden states over a prompt's pairs, then a chained step from its
// own output: within f32 rounding of the float64 evaluation of the same weights.
TEST_P(MtpHeadOf, MatchesAFloat64Evaluation) {
  TempDir dir;
  write_with_mtp(fixture(GetParam()) / "f32", dir.path());
  TestModel opened = open_with_mtp_head(dir.path(), make_cpu_backend());
  Model& model = *opened.model;
  Backend& backend = model.backend();
  ASSERT_NE(model.draft_head(), nullptr);
  const std::vector<int32_t> prompt = long_prompt(GetParam(), 24);
  const Tensor hidden = plain_hidden_states(model, prompt, static_cast<int64_t>(prompt.size()));
  const auto pairs = static_cast<int32_t>(prompt.size()) - 1;
  auto cache = model.draft_head()->make_cache(1, 64);
  const auto run_head = [&](int32_t first, std::vector<int32_t> tokens, const Tensor& inputs, Tensor& logits,
                            Tensor& out) {
    const auto count = static_cast<int64_t>(tokens.size());
    const BatchLayout layout = backend.make_layout({{0, 0, static_cast<int32_t>(count), first}}, tokens);
    Tensor rows = Tensor::empty({count}, DType::I32);
    std::iota(rows.data<int32_t>(), rows.data<int32_t>() + count, 0);
    logits = backend.alloc({count, model.config().vocab_size}, DType::F32);
    out = backend.alloc({count, model.config().hidden_size}, backend.activation_dtype());
    model.draft_head()->forward(layout, inputs, backend.upload(rows), *cache, logits, out);
  };
  Tensor logits, out;
  run_head(0, std::vector<int32_t>(prompt.begin() + 1, prompt.end()), hidden.slice_rows(0, pairs), logits, out);

  ReferenceHead reference(dir.path());
  std::vector<std::vector<double>> inputs = host_rows(backend, hidden);
  inputs.resize(static_cast<size_t>(pairs));
  std::vector<int32_t> tokens(prompt.begin() + 1, prompt.end());
  const ReferenceHead::Output expected = reference.run(tokens, inputs);
  const std::vector<std::vector<double>> ours = host_rows(backend, logits), ours_hidden = host_rows(backend, out);
  for (int32_t p = 0; p < pairs; ++p) {
    EXPECT_LT(relative_error(ours[p], expected.logits[p]), 1e-4) << "logits at position " << p;
    EXPECT_LT(relative_error(ours_hidden[p], expected.hidden[p]), 1e-4) << "hidden state at position " << p;
  }

  // Chained: the last pair's proposal with its output hidden state, one position on.
  const int32_t proposal = argmax(std::span<const float>(
      backend.download(logits).data<float>() + (pairs - 1) * model.config().vocab_size,
      static_cast<size_t>(model.config().vocab_size)));
  Tensor chained_logits, chained_out;
  run_head(pairs, {proposal}, out.slice_rows(pairs - 1, 1), chained_logits, chained_out);
  tokens.push_back(proposal);
  inputs.push_back(expected.hidden.back());
  const ReferenceHead::Output chained = reference.run(tokens, inputs);
  EXPECT_LT(relative_error(host_rows(backend, chained_logits)[0], chained.logits.back()), 1e-4) << "chained logits";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpHeadOf, ::testing::Values("qwen3_5-text-tiny", "qwen3_5-moe-tiny"),
                         [](const auto& info) { return info.param == "qwen3_5-text-tiny" ? "dense" : "moe"; });

class MtpSpeculationOf : public ::testing::TestWithParam<std::string> {};

// 256 tokens, greedy and seeded, with a prompt of two prefill chunks: the plain run's tokens and
// logprob bits; and every proposal the head made is what a fresh head makes from the plain run's
// hidden states — with its own proposals verified, and with the plain run's continuation verified
// instead, wrong at every depth in turn, so the head is caught up after every length of acceptance.
TEST_P(MtpSpeculationOf, GivesThePlainRunAndProposesAsAFreshHead) {
  TempDir dir;
  write_with_mtp(fixture(GetParam()) / "f32", dir.path());
  TestModel opened = open_with_mtp_head(dir.path(), make_cpu_backend());
  Model& model = *opened.model;
  const std::vector<int32_t> prompt = long_prompt(GetParam(), 100);
  const int64_t context = static_cast<int64_t>(prompt.size()) + kGeneratedTokens + 1;
  for (const float temperature : {0.0f, 0.8f}) {
    const std::string at = GetParam() + " at temperature " + std::to_string(temperature);
    const GeneratedRun plain = run_generate(model, prompt, plain_options(temperature));
    ASSERT_EQ(plain.tokens.size(), static_cast<size_t>(kGeneratedTokens)) << at;

    const GeneratedRun mtp =
        run_generate(model, prompt, with_speculation(plain_options(temperature),
                                                     std::make_shared<MtpProposer>(model, 1, context), 4));
    expect_same_run(mtp, plain, at + ", mtp");
    EXPECT_GT(mtp.counts.verify_steps, 0) << at;

    for (const size_t period : {0u, 3u}) {
      auto recording = std::make_shared<RecordingMtpProposer>(model, 1, context, prompt, plain.tokens, period);
      const GeneratedRun checked =
          run_generate(model, prompt, with_speculation(plain_options(temperature), recording, 4));
      expect_same_run(checked, plain, at + ", recorded, period " + std::to_string(period));
      if (period > 0) {
        EXPECT_GT(checked.counts.accepted, 0) << at;
        EXPECT_LT(checked.counts.accepted, checked.counts.proposed) << at;
      }
      expect_fresh_head_proposals(model, prompt, plain.tokens, recording->records,
                                  at + ", period " + std::to_string(period));
    }
  }
}

// MTP requests (greedy and sampled, one with penalties and logprobs) share the scheduler's batch
// with a plain and an n-gram one: each gets its plain solo run, and the MTP requests propose
// together what each proposes alone (the counts are the sum of their solo runs').
TEST_P(MtpSpeculationOf, SharesABatchWithPlainRequests) {
  TempDir dir;
  write_with_mtp(fixture(GetParam()) / "f32", dir.path());
  TestModel opened = open_with_mtp_head(dir.path(), make_cpu_backend());
  Model& model = *opened.model;
  const std::vector<int32_t> prompt = long_prompt(GetParam(), 40), longer = long_prompt(GetParam(), 150);
  std::vector<GenerationRequest> requests(5);
  requests[0].prompt = prompt;  // plain, greedy
  requests[0].sampling.temperature = 0;
  requests[1].prompt = longer;  // mtp, greedy, prefilled in chunks beside the others' decodes
  requests[1].sampling.temperature = 0;
  requests[2].prompt = prompt;  // mtp, sampled
  requests[2].sampling.temperature = 0.8f;
  requests[2].sampling.seed = 7;
  requests[3].prompt = longer;  // n-gram, sampled
  requests[3].sampling.temperature = 0.8f;
  requests[3].sampling.seed = 3;
  requests[3].speculation = {std::make_shared<NgramProposer>(), 3};
  requests[4].prompt = prompt;  // mtp, penalised, with logprobs
  requests[4].sampling.temperature = 0.8f;
  requests[4].sampling.seed = 5;
  requests[4].sampling.repetition_penalty = 1.1f;
  requests[4].top_logprobs = 2;
  for (size_t i = 0; i < requests.size(); ++i) requests[i].max_tokens = 120 + 10 * static_cast<int64_t>(i);
  constexpr int64_t kContext = 512;

  std::vector<GeneratedRun> solo;
  SpeculationCounts solo_counts;
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationOptions options;
    options.max_tokens = requests[i].max_tokens;
    options.sampling = requests[i].sampling;
    options.prefill_chunk = 64;
    solo.push_back(run_generate(model, requests[i].prompt, options));
    if (i == 1 || i == 2 || i == 4) {
      const GeneratedRun alone = run_generate(
          model, requests[i].prompt, with_speculation(options, std::make_shared<MtpProposer>(model, 1, kContext), 4));
      expect_same_run(alone, solo.back(), "request " + std::to_string(i) + " alone");
      solo_counts.verify_steps += alone.counts.verify_steps;
      solo_counts.proposed += alone.counts.proposed;
      solo_counts.accepted += alone.counts.accepted;
    }
  }
  auto mtp = std::make_shared<MtpProposer>(model, 3, kContext);
  for (const size_t i : {1u, 2u, 4u}) requests[i].speculation = {mtp, 4};

  SchedulerOptions options;
  options.max_batch = 3;
  options.context_tokens = kContext;
  options.prefill_chunk = 64;
  Scheduler scheduler(model, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& request : requests) streams.push_back(scheduler.submit(request));
  for (size_t i = 0; i < streams.size(); ++i) {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    for (;;) {
      std::optional<TokenEvent> event = streams[i]->next(std::chrono::seconds(60));
      ASSERT_TRUE(event.has_value()) << "request " << i;
      if (event->token >= 0) {
        tokens.push_back(event->token);
        logprobs.push_back(event->logprob);
      }
      if (event->finished) break;
    }
    EXPECT_EQ(tokens, solo[i].tokens) << "request " << i;
    for (size_t t = 0; t < tokens.size() && t < solo[i].logprobs.size(); ++t)
      EXPECT_EQ(std::memcmp(&logprobs[t], &solo[i].logprobs[t], sizeof(float)), 0) << "request " << i << " token " << t;
  }
  scheduler.shutdown(true);
  // The n-gram request's verify steps are counted too: only the MTP requests' are compared.
  const GeneratedRun ngram = run_generate(model, requests[3].prompt, [&] {
    GenerationOptions alone;
    alone.max_tokens = requests[3].max_tokens;
    alone.sampling = requests[3].sampling;
    alone.prefill_chunk = 64;
    return with_speculation(alone, std::make_shared<NgramProposer>(), 3);
  }());
  const SpeculationCounts counts = scheduler.stats().speculation;
  EXPECT_EQ(counts.verify_steps, solo_counts.verify_steps + ngram.counts.verify_steps);
  EXPECT_EQ(counts.proposed, solo_counts.proposed + ngram.counts.proposed);
  EXPECT_EQ(counts.accepted, solo_counts.accepted + ngram.counts.accepted);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpSpeculationOf, ::testing::Values("qwen3_5-text-tiny", "qwen3_5-moe-tiny"),
                         [](const auto& info) { return info.param == "qwen3_5-text-tiny" ? "dense" : "moe"; });

// --- loading --------------------------------------------------------------------------------------

// Without LoadOptions::mtp the MTP tensors are dropped (the model holds nothing of them); with it
// they are planned under mtp.* (wrapped names renamed) and the model has its head.
TEST(MtpLoad, KeepsTheHeadOnlyWhenAsked) {
  for (const char* name : {"qwen3_5-text-tiny", "qwen3_5-moe-tiny"}) {
    SCOPED_TRACE(name);
    TempDir dir;
    // The multimodal export's nesting: model.mtp.* for the test.
    write_with_mtp(fixture(name) / "f32", dir.path(), 2, nlohmann::json::object(),
                   [](const std::string& tensor) { return "model." + tensor; });
    const ModelPlan plain = plan_model(dir.path(), Device::CPU, true);
    const size_t dropped = std::count_if(plain.load_plan.dropped.begin(), plain.load_plan.dropped.end(),
                                         [](const DroppedTensor& t) { return t.source.starts_with("model.mtp."); });
    EXPECT_EQ(dropped, synth_mtp_tensor_layout(plain.config).size());
    for (const PlannedTensor& tensor : plain.load_plan.tensors) EXPECT_FALSE(tensor.canonical.starts_with("mtp."));
    auto backend = make_cpu_backend();
    EXPECT_EQ(build_model(plain, *backend)->draft_head(), nullptr);
    EXPECT_EQ(planned_weight_bytes(plain), planned_weight_bytes(plan_model(fixture(name) / "f32", Device::CPU, true)));

    LoadOptions options;
    options.mtp = true;
    const ModelPlan kept = plan_model(dir.path(), Device::CPU, true, options);
    EXPECT_TRUE(kept.load_plan.dropped.empty());
    EXPECT_TRUE(std::any_of(kept.load_plan.tensors.begin(), kept.load_plan.tensors.end(),
                            [](const PlannedTensor& t) { return t.canonical == "mtp.fc.weight" && t.source == "model.mtp.fc.weight"; }));
    EXPECT_GT(planned_weight_bytes(kept), planned_weight_bytes(plain));
    EXPECT_NE(build_model(kept, *backend)->draft_head(), nullptr);
  }
}

// The tensors of a checkpoint of the dense fixture's config with the head, as plan_qwen3_5_checkpoint
// sees them (no bytes), named in `file`.
std::map<std::string, TensorInfo> tensors_with_mtp(const ModelConfig& config, const std::filesystem::path& file) {
  std::map<std::string, TensorInfo> tensors;
  for (const SynthTensor& tensor : synth_tensor_layout(config))
    tensors[tensor.name] = TensorInfo{tensor.name, DType::F32, tensor.shape, file, 0, 0};
  for (const SynthTensor& tensor : synth_mtp_tensor_layout(config))
    tensors[tensor.name] = TensorInfo{tensor.name, DType::F32, tensor.shape, file, 0, 0};
  return tensors;
}

TEST(MtpLoad, RefusesWhatItCannotRun) {
  const std::filesystem::path dense = fixture("qwen3_5-text-tiny") / "f32";
  LoadOptions options;
  options.mtp = true;
  // No MTP weights; a family with no MTP head.
  expect_error_mentions([&] { plan_model(dense, Device::CPU, true, options); }, {dense.string(), "no MTP weights"});
  expect_error_mentions([&] { plan_model(fixture("llama3-tiny") / "f32", Device::CPU, true, options); },
                        {"model_type llama has no multi-token-prediction head"});

  const ModelConfig config = load_model_config(dense);
  const std::filesystem::path file = "/ckpt/model.safetensors";
  const auto plan = [&](const std::map<std::string, TensorInfo>& tensors, const ModelConfig& with) {
    plan_qwen3_5_checkpoint(tensors, with, true);
  };
  EXPECT_NO_THROW(plan(tensors_with_mtp(config, file), config));
  // A misshapen tensor, a missing one, one the head does not have, one named twice.
  auto tensors = tensors_with_mtp(config, file);
  tensors["mtp.fc.weight"].shape = {128, 128};
  expect_error_mentions([&] { plan(tensors, config); }, {file.string(), "mtp.fc.weight", "[128, 128]", "[128, 256]"});
  tensors = tensors_with_mtp(config, file);
  tensors.erase("mtp.layers.0.self_attn.k_norm.weight");
  expect_error_mentions([&] { plan(tensors, config); }, {"mtp.layers.0.self_attn.k_norm.weight", "multi-token-prediction"});
  tensors = tensors_with_mtp(config, file);
  tensors["mtp.layers.0.linear_attn.A_log"] = TensorInfo{"mtp.layers.0.linear_attn.A_log", DType::F32, {4}, file, 0, 0};
  expect_error_mentions([&] { plan(tensors, config); }, {file.string(), "mtp.layers.0.linear_attn.A_log", "not part of"});
  tensors = tensors_with_mtp(config, file);
  tensors["model.mtp.norm.weight"] = tensors["mtp.norm.weight"];
  expect_error_mentions([&] { plan(tensors, config); }, {"mtp.norm.weight", "model.mtp.norm.weight", "both name"});
  // A config declaring other than one MTP layer.
  ModelConfig two = config;
  two.mtp_layers = 2;
  expect_error_mentions([&] { plan(tensors_with_mtp(config, file), two); },
                        {"declares 2 multi-token-prediction layers", "exactly one"});
}

TEST(MtpLoad, ReadsTheLayerCountFromEitherField) {
  nlohmann::json json = nlohmann::json::parse(std::ifstream(fixture("qwen3_5-text-tiny") / "f32" / "config.json"));
  EXPECT_EQ(parse_model_config(json, "config.json").mtp_layers, 1);
  json["mtp_num_hidden_layers"] = 3;
  EXPECT_EQ(parse_model_config(json, "config.json").mtp_layers, 3);
  json["num_nextn_predict_layers"] = 2;
  expect_error_mentions([&] { parse_model_config(json, "config.json"); },
                        {"num_nextn_predict_layers", "is 2, but mtp_num_hidden_layers is 3"});
  json.erase("mtp_num_hidden_layers");
  json["num_nextn_predict_layers"] = -1;
  expect_error_mentions([&] { parse_model_config(json, "config.json"); }, {"num_nextn_predict_layers", "is -1"});
}

// Without a head loaded, the proposer refuses to start.
TEST(MtpLoad, TheProposerNeedsTheHead) {
  TestModel opened = open_cpu_model(fixture("qwen3_5-text-tiny") / "f32");
  expect_error_mentions([&] { MtpProposer(*opened.model, 1, 64); }, {"without its multi-token-prediction head"});
}

}  // namespace
