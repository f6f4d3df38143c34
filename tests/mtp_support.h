// What the MTP tests share (tests/mtp_test.cpp on the CPU, tests/cuda/mtp_test.cpp on the GPU, the
// CLI's in tests/speculative_surfaces_test.cpp): a fixture checkpoint copied with random
// multi-token-prediction weights beside its own, the model loaded with its head, a proposer that
// records what the head proposed (and may verify other proposals instead), and the check that
// every recorded proposal is what a fresh head proposes from the plain run's hidden states.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "engine/generation.h"
#include "engine/mtp_proposer.h"
#include "engine/sampler.h"
#include "engine/step_plan.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/family.h"
#include "model/loader.h"
#include "model/synth.h"
#include "model_test_support.h"

namespace kiln::testing {

// A standard-normal-like value of `index` in the stream `seed` (SplitMix64's mix, a Box–Muller pair).
inline float mtp_test_normal(uint64_t seed, uint64_t index) {
  const auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  const uint64_t bits = mix(seed ^ mix(index));
  const double u1 = (static_cast<double>(bits >> 40) + 1.0) / 16777217.0;
  const double u2 = static_cast<double>(bits & 0xffffff) / 16777216.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Copies the checkpoint in `fixture` into `out` with the MTP tensors kiln synth --mtp lays out for
// its config added, in the checkpoint's dtype: matrices N(0, 0.06²), norm gains N(0, 0.2²) (random,
// so that a reference checks that they are applied as 1 + γ). Extra entries of `config_fields` are
// written into its config.json; `rename` maps a tensor name to the name it is stored under.
inline void write_with_mtp(const std::filesystem::path& fixture, const std::filesystem::path& out, uint64_t seed = 1,
                           const nlohmann::json& config_fields = nlohmann::json::object(),
                           const std::function<std::string(const std::string&)>& rename = {}) {
  std::filesystem::create_directories(out);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fixture / "config.json"));
  config.update(config_fields);
  std::ofstream(out / "config.json") << config.dump(2);
  const Checkpoint checkpoint = Checkpoint::open(fixture);
  std::vector<SafetensorsEntry> entries;
  DType dtype = DType::F32;
  for (const auto& [name, info] : checkpoint.tensors()) {
    const Tensor view = checkpoint.view(name);
    SafetensorsEntry entry{name, info.dtype, info.shape};
    entry.bytes.assign(static_cast<const uint8_t*>(view.raw()), static_cast<const uint8_t*>(view.raw()) + view.nbytes());
    entries.push_back(std::move(entry));
    if (name.ends_with("embed_tokens.weight")) dtype = info.dtype;
  }
  uint64_t stream = seed;
  for (const SynthTensor& tensor : synth_mtp_tensor_layout(load_model_config(fixture))) {
    const bool gain = tensor.shape.size() == 1;
    const float scale = gain ? 0.2f : 0.06f;
    SafetensorsEntry entry{rename ? rename(tensor.name) : tensor.name, dtype, tensor.shape};
    const auto count = static_cast<uint64_t>(shape_numel(tensor.shape));
    entry.bytes.resize(count * dtype_size(dtype));
    ++stream;
    for (uint64_t i = 0; i < count; ++i) {
      const float value = scale * mtp_test_normal(stream, i);
      if (dtype == DType::BF16) {
        const uint16_t half = f32_to_bf16(value);
        std::memcpy(entry.bytes.data() + 2 * i, &half, 2);
      } else {
        std::memcpy(entry.bytes.data() + 4 * i, &value, 4);
      }
    }
    entries.push_back(std::move(entry));
  }
  write_sharded_safetensors(out, entries, uint64_t{1} << 40);
}

// The checkpoint in `dir` loaded with its MTP head on `backend`.
inline TestModel open_with_mtp_head(const std::filesystem::path& dir, std::unique_ptr<Backend> backend) {
  TestModel loaded;
  loaded.backend = std::move(backend);
  LoadOptions options;
  options.mtp = true;
  loaded.model = load_model(dir, *loaded.backend, options);
  return loaded;
}

// An MTP proposer whose proposals are recorded with the tokens they followed. With `verified`, the
// target verifies those instead: the plain run's continuation with every `period`-th of each
// step's proposals off by one (tests/speculative_support.h's AdversarialProposer), so the head's
// cache is caught up after every depth of acceptance.
class RecordingMtpProposer final : public Proposer {
 public:
  struct Record {
    std::vector<int32_t> tokens;
    std::vector<int32_t> proposal;
  };

  RecordingMtpProposer(Model& target, int32_t slots, int64_t context, std::vector<int32_t> prompt = {},
                       std::vector<int32_t> continuation = {}, size_t period = 0)
      : inner_(target, slots, context),
        vocab_(static_cast<int32_t>(target.config().vocab_size)),
        prompt_(std::move(prompt)),
        continuation_(std::move(continuation)),
        period_(period) {}
  std::string name() const override { return "mtp"; }
  bool reads_hidden_states() const override { return true; }
  std::unique_ptr<SequenceProposer> start(std::span<const int32_t> prompt) override { return inner_.start(prompt); }
  void propose_together(std::span<ProposalAsk> asks) override {
    inner_.propose_together(asks);
    for (ProposalAsk& ask : asks) {
      if (ask.count == 0) continue;
      records.push_back({std::vector<int32_t>(ask.tokens.begin(), ask.tokens.end()), ask.proposal});
      if (period_ == 0) continue;
      const size_t generated = ask.tokens.size() - prompt_.size();
      const size_t right = generated % period_;
      ask.proposal.clear();
      for (size_t i = 0; i < static_cast<size_t>(ask.count) && generated + i < continuation_.size(); ++i) {
        const int32_t truth = continuation_[generated + i];
        ask.proposal.push_back(i < right ? truth : (truth + 1) % vocab_);
      }
    }
  }

  std::vector<Record> records;

 private:
  MtpProposer inner_;
  int32_t vocab_;
  std::vector<int32_t> prompt_, continuation_;
  size_t period_;
};

// The target's final hidden states at every position of `tokens` (on the device, [tokens, hidden]),
// as a plain run computes them: the first `prompt_length` prefilled in 64-token chunks, then one
// token at a time.
inline Tensor plain_hidden_states(Model& model, const std::vector<int32_t>& tokens, int64_t prompt_length) {
  Backend& backend = model.backend();
  const auto length = static_cast<int64_t>(tokens.size());
  auto cache = model.make_cache(1, length);
  Tensor all = backend.alloc({length, model.config().hidden_size}, backend.activation_dtype());
  for (int64_t start = 0; start < length;) {
    const int64_t end = start < prompt_length ? prefill_chunk_end(prompt_length, start, 64) : start + 1;
    Tensor hidden;
    run_step(model, *cache,
             {{0, static_cast<int32_t>(start), std::vector<int32_t>(tokens.begin() + start, tokens.begin() + end),
               false, 1, true}},
             &hidden);
    Tensor rows = all.slice_rows(start, end - start);
    backend.copy(hidden, rows);
    start = end;
  }
  return all;
}

// What a fresh head proposes after `tokens` (their hidden states `hidden`, from
// plain_hidden_states): one head step over every pair (x_{p+1}, h_p), p < n − 1, then the chain.
inline std::vector<int32_t> fresh_head_proposal(Model& model, const std::vector<int32_t>& tokens, const Tensor& hidden,
                                                size_t count) {
  if (count == 0) return {};
  const auto vocab = static_cast<size_t>(model.config().vocab_size);
  const auto n = static_cast<int64_t>(tokens.size());
  auto cache = model.draft_head()->make_cache(1, n + static_cast<int64_t>(count));
  DraftHeadStep step = run_draft_head_step(model, *cache, {{0, 0, std::vector<int32_t>(tokens.begin() + 1, tokens.end())}},
                                           hidden.slice_rows(0, n - 1));
  std::vector<int32_t> proposal;
  for (;;) {
    proposal.push_back(argmax(std::span<const float>(step.logits.data<float>(), vocab)));
    if (proposal.size() == count) return proposal;
    const auto position = static_cast<int32_t>(n - 2 + static_cast<int64_t>(proposal.size()));
    step = run_draft_head_step(model, *cache, {{0, position, {proposal.back()}}}, step.hidden);
  }
}

// Every recorded proposal is what a fresh head proposes after the same tokens: the head's cache
// was caught up exactly (rows past the accepted tokens written over, the prompt's taken in chunk by
// chunk), bit for bit by the invariance contract. `run` is the plain run's tokens after `prompt`.
inline void expect_fresh_head_proposals(Model& model, const std::vector<int32_t>& prompt,
                                        const std::vector<int32_t>& run,
                                        const std::vector<RecordingMtpProposer::Record>& records,
                                        const std::string& what) {
  std::vector<int32_t> tokens = prompt;
  tokens.insert(tokens.end(), run.begin(), run.end());
  const Tensor hidden = plain_hidden_states(model, tokens, static_cast<int64_t>(prompt.size()));
  ASSERT_FALSE(records.empty()) << what;
  for (size_t i = 0; i < records.size(); ++i) {
    const RecordingMtpProposer::Record& record = records[i];
    ASSERT_TRUE(std::equal(record.tokens.begin(), record.tokens.end(), tokens.begin())) << what << ", call " << i;
    EXPECT_EQ(record.proposal, fresh_head_proposal(model, record.tokens, hidden, record.proposal.size()))
        << what << ", call " << i << " after " << record.tokens.size() << " tokens";
  }
}

}  // namespace kiln::testing
