#include "model_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/generation.h"
#include "model/loader.h"

namespace kiln::testing {

TestModel open_cpu_model(const std::filesystem::path& dir, const std::string& dtype) {
  TestModel loaded;
  loaded.backend = make_cpu_backend();
  LoadOptions options;
  if (dtype == "f32") options.dtype = DType::F32;
  if (dtype == "bf16") options.dtype = DType::BF16;
  loaded.model = load_model(dir, *loaded.backend, options);
  return loaded;
}

void expect_greedy_continuation_of_float64_reference(Model& model, const std::filesystem::path& fixture_dir) {
  const nlohmann::json ref = nlohmann::json::parse(std::ifstream(fixture_dir / "ref.json"));
  std::vector<int32_t> prompt = fixture_prompt(fixture_dir);
  prompt.resize(ref["greedy_prompt_len"].get<size_t>());
  GenerationOptions options;
  options.sampling.temperature = 0;
  options.max_tokens = static_cast<int64_t>(ref["greedy_f64"].size());
  const GenerationResult result = generate(model, prompt, options);
  EXPECT_EQ(result.tokens, ref["greedy_f64"].get<std::vector<int32_t>>());
}

Tensor logits_with_cuts(Model& model, const std::vector<int32_t>& prompt, std::vector<size_t> cuts) {
  auto cache = model.make_cache(1, static_cast<int64_t>(prompt.size()));
  const int64_t vocab = model.config().vocab_size;
  Tensor all = Tensor::empty({static_cast<int64_t>(prompt.size()), vocab}, DType::F32);
  cuts.push_back(prompt.size());
  size_t start = 0;
  for (size_t cut : cuts) {
    if (cut <= start) continue;
    SequenceStep step{0, static_cast<int32_t>(start), std::vector<int32_t>(prompt.begin() + start, prompt.begin() + cut), true};
    Tensor logits = run_step(model, *cache, {step});
    std::memcpy(all.data<float>() + start * vocab, logits.raw(), logits.nbytes());
    start = cut;
  }
  return all;
}

std::vector<double> row_relative_errors(const Tensor& ours, const NpyArray& reference) {
  if (reference.shape.size() != 2 || ours.ndim() != 2 || ours.dim(0) != reference.shape[0] ||
      ours.dim(1) != reference.shape[1])
    fail("logits {} do not match the reference shape {}", shape_string(ours.shape()), shape_string(reference.shape));
  const int64_t rows = reference.shape[0], columns = reference.shape[1];
  std::vector<double> errors(rows);
  for (int64_t row = 0; row < rows; ++row) {
    double max_difference = 0, max_reference = 0;
    for (int64_t column = 0; column < columns; ++column) {
      const double expected = reference.values[row * columns + column];
      const double actual = ours.data<float>()[row * columns + column];
      max_difference = std::max(max_difference, std::abs(actual - expected));
      if (std::isnan(actual)) max_difference = INFINITY;
      max_reference = std::max(max_reference, std::abs(expected));
    }
    errors[row] = max_difference / max_reference;
  }
  return errors;
}

Bf16RowErrors bf16_row_errors(const Tensor& logits, const std::filesystem::path& bf16_dir) {
  const NpyArray truth = read_npy(bf16_dir / "ref_logits_f64.npy");
  const NpyArray torch_bf16 = read_npy(bf16_dir / "ref_logits_torch_bf16.npy");
  Tensor torch_logits = Tensor::empty(torch_bf16.shape, DType::F32);
  std::transform(torch_bf16.values.begin(), torch_bf16.values.end(), torch_logits.data<float>(),
                 [](double v) { return static_cast<float>(v); });
  return {row_relative_errors(logits, truth), row_relative_errors(torch_logits, truth)};
}

AloneAndBatched alone_and_in_a_batch_of_three(Model& model, const std::vector<int32_t>& prompt) {
  const int64_t vocab = model.config().vocab_size;
  const std::vector<int32_t> first(prompt.begin(), prompt.begin() + 100);
  const std::vector<int32_t> other_a(prompt.begin() + 3, prompt.begin() + 40);
  const std::vector<int32_t> other_b(prompt.begin() + 17, prompt.begin() + 150);
  AloneAndBatched result;
  auto alone_cache = model.make_cache(1, 128);
  result.alone_prefill = run_step(model, *alone_cache, {SequenceStep{0, 0, first, true}});
  result.alone_decode = run_step(model, *alone_cache, {SequenceStep{0, 100, {prompt[100]}, true}});
  auto batch_cache = model.make_cache(3, 160);
  const Tensor batch_prefill = run_step(model, *batch_cache,
                                        {SequenceStep{2, 0, other_a, true}, SequenceStep{0, 0, first, true},
                                         SequenceStep{1, 0, other_b, true}});
  const Tensor batch_decode = run_step(model, *batch_cache,
                                       {SequenceStep{1, 133, {prompt[5]}, true}, SequenceStep{2, 37, {prompt[9]}, true},
                                        SequenceStep{0, 100, {prompt[100]}, true}});
  result.batched_prefill =
      batch_prefill.slice_rows(static_cast<int64_t>(other_a.size()), static_cast<int64_t>(first.size()))
          .reshape({100, vocab});
  result.batched_decode = batch_decode.slice_rows(2, 1);
  return result;
}

std::vector<int32_t> fixture_prompt(const std::filesystem::path& fixture_dir) {
  std::ifstream in(fixture_dir / "ref.json");
  if (!in) fail("{}: cannot open ref.json", fixture_dir.string());
  return nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

std::vector<GenerationRequest> mixed_scheduler_requests(const std::vector<int32_t>& prompt, int64_t base_max_tokens) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest request;
    request.prompt.assign(prompt.begin() + i * 7, prompt.begin() + i * 7 + 20 + 30 * i);
    request.max_tokens = base_max_tokens + i;
    request.sampling = {i % 2 ? 0.8f : 0.0f, i == 3 ? 0 : 40, i == 5 ? 0.9f : 1.0f, i == 1 ? 0.05f : 0.0f,
                        static_cast<uint64_t>(100 + i)};
    request.top_logprobs = i == 2 ? 3 : 0;
    requests.push_back(request);
  }
  return requests;
}

std::vector<GenerationRequest> penalised_scheduler_requests(const std::vector<int32_t>& prompt,
                                                            int64_t base_max_tokens) {
  std::vector<GenerationRequest> requests = mixed_scheduler_requests(prompt, base_max_tokens);
  requests[0].sampling.repetition_penalty = 1.3f;
  requests[0].sampling.logit_bias = {{prompt[3], 2.0f}};
  requests[1].sampling.presence_penalty = 1.0f;
  requests[1].sampling.frequency_penalty = 0.5f;
  requests[2].sampling.frequency_penalty = 1.5f;
  requests[5].sampling.repetition_penalty = 0.9f;
  requests[5].sampling.presence_penalty = -0.5f;
  requests[5].sampling.logit_bias = {{prompt[0], -100.0f}, {prompt[1], 5.0f}};
  return requests;
}

std::vector<GenerationRequest> budgeted_scheduler_requests(const std::vector<int32_t>& prompt,
                                                           int64_t base_max_tokens) {
  std::vector<GenerationRequest> requests = mixed_scheduler_requests(prompt, base_max_tokens);
  // Markers of the prompt's tokens (any of the vocabulary's do): a close of two, forced with a
  // token before it and one after.
  ReasoningBudget budget;
  budget.open = {prompt[10]};
  budget.close = {prompt[11], prompt[12]};
  budget.forced = {prompt[13], prompt[11], prompt[12], prompt[14]};
  budget.opened_by_prompt = true;
  const std::vector<std::pair<size_t, int64_t>> caps = {{0, 0}, {1, 3}, {3, 6}, {5, 2}};
  for (const auto& [request, max_tokens] : caps) {
    requests[request].reasoning_budget = budget;
    requests[request].reasoning_budget->max_tokens = max_tokens;
  }
  // Request 4 waits for reasoning to open: a request whose budget may never apply.
  requests[4].reasoning_budget = budget;
  requests[4].reasoning_budget->opened_by_prompt = false;
  requests[4].reasoning_budget->max_tokens = 1;
  return requests;
}

void expect_reasoning_capped(const std::vector<GenerationRequest>& requests,
                             const std::vector<std::vector<int32_t>>& tokens) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::optional<ReasoningBudget>& budget = requests[i].reasoning_budget;
    if (!budget || !budget->opened_by_prompt) continue;
    const auto cap = static_cast<size_t>(budget->max_tokens);
    ASSERT_GE(tokens[i].size(), cap + budget->forced.size()) << "request " << i;
    EXPECT_EQ(std::vector<int32_t>(tokens[i].begin() + cap, tokens[i].begin() + cap + budget->forced.size()),
              budget->forced)
        << "request " << i;
  }
}

std::vector<std::vector<int32_t>> solo_tokens(Model& model, const std::vector<GenerationRequest>& requests) {
  std::vector<std::vector<int32_t>> solo;
  for (const auto& request : requests) {
    GenerationOptions options;
    options.max_tokens = request.max_tokens;
    options.sampling = request.sampling;
    options.stop_ids = request.stop_ids;
    options.reasoning_budget = request.reasoning_budget;
    solo.push_back(generate(model, request.prompt, options).tokens);
  }
  return solo;
}

std::vector<std::vector<TokenEvent>> scheduled_events(Model& model, const std::vector<GenerationRequest>& requests,
                                                      int64_t context_tokens) {
  SchedulerOptions options;
  options.max_batch = 3;
  options.context_tokens = context_tokens;
  options.prefill_chunk = 64;
  Scheduler scheduler(model, options);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& request : requests) streams.push_back(scheduler.submit(request));
  std::vector<std::vector<TokenEvent>> events(streams.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    for (;;) {
      std::optional<TokenEvent> event = streams[i]->next(std::chrono::seconds(60));
      if (!event) {
        ADD_FAILURE() << "request " << i << ": no event within 60 s";
        break;
      }
      const bool finished = event->finished;
      events[i].push_back(std::move(*event));
      if (finished) break;
    }
  }
  return events;
}

namespace {

// The token ids of a request's events (the finishing event carries none when it is an error).
std::vector<int32_t> event_tokens(const std::vector<TokenEvent>& events) {
  std::vector<int32_t> tokens;
  for (const TokenEvent& event : events)
    if (event.token >= 0) tokens.push_back(event.token);
  return tokens;
}

}  // namespace

void expect_solo_results(const std::vector<std::vector<TokenEvent>>& events,
                         const std::vector<GenerationRequest>& requests, const std::vector<std::vector<int32_t>>& solo) {
  ASSERT_EQ(events.size(), requests.size());
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(event_tokens(events[i]), solo[i]) << "request " << i;
    if (requests[i].top_logprobs == 0) continue;
    for (const TokenEvent& event : events[i]) {
      if (event.token < 0) continue;
      ASSERT_EQ(event.top_logprobs.size(), 3u) << "request " << i;
      // Both are the raw distribution's, so the logprob is the top one's or below it.
      EXPECT_LE(event.logprob, event.top_logprobs.front().second + 1e-5f) << "request " << i;
      if (requests[i].sampling.processes_logits()) continue;  // penalised, greedy takes another token
      EXPECT_EQ(event.top_logprobs.front().first, event.token) << "greedy: the token is the top alternative";
      EXPECT_NEAR(event.top_logprobs.front().second, event.logprob, 1e-5);
    }
  }
}

}  // namespace kiln::testing
