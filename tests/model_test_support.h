// Opening models in tests through the same path the CLI uses (profiles + registry).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "engine/scheduler.h"
#include "core/tensor.h"
#include "io/npy.h"
#include "model/model.h"

namespace kiln::testing {

struct TestModel {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// Loads DIR on the CPU backend; `dtype` converts weights at load ("auto": as stored).
TestModel open_cpu_model(const std::filesystem::path& dir, const std::string& dtype = "auto");

// Per row r: max_v |ours[r, v] − ref[r, v]| / max_v |ref[r, v]|.
std::vector<double> row_relative_errors(const Tensor& ours, const NpyArray& reference);

// Row errors (row_relative_errors) against the float64 reference of a fixture's bf16 checkpoint
// folder: ours, and transformers' own bf16 run's (ref_logits_torch_bf16.npy), row for row.
struct Bf16RowErrors {
  std::vector<double> ours, transformers;
};
Bf16RowErrors bf16_row_errors(const Tensor& logits, const std::filesystem::path& bf16_dir);

// The fixture's prompt ids (ref.json "prompt_ids").
std::vector<int32_t> fixture_prompt(const std::filesystem::path& fixture_dir);

// Expects greedy decoding of `model` (the fixture's f32 checkpoint, on any backend) to continue the
// fixture's prompt, cut to ref.json "greedy_prompt_len", with exactly ref.json "greedy_f64".
void expect_greedy_continuation_of_float64_reference(Model& model, const std::filesystem::path& fixture_dir);

// Logits [prompt length, vocab] of every prompt position, the prompt prefilled in steps that end at
// each of `cuts` (ascending; the last step runs to the end of the prompt).
Tensor logits_with_cuts(Model& model, const std::vector<int32_t>& prompt, std::vector<size_t> cuts);

// The prompt's first 100 tokens prefilled and then one more decoded, alone and as the middle
// sequence of a batch of three (two other windows of the prompt prefilled and decoded beside it
// in other slots): that sequence's logits rows from each run. Needs a prompt of 150 tokens.
struct AloneAndBatched {
  Tensor alone_prefill, alone_decode, batched_prefill, batched_decode;
};
AloneAndBatched alone_and_in_a_batch_of_three(Model& model, const std::vector<int32_t>& prompt);

// Six requests over windows of `prompt` (lengths 20..170) mixing greedy and sampled decoding,
// top-k / top-p / min-p, and top logprobs on request 2: each must equal its solo generate() run
// however the scheduler batches it. max_tokens is base_max_tokens + i.
std::vector<GenerationRequest> mixed_scheduler_requests(const std::vector<int32_t>& prompt, int64_t base_max_tokens);
// mixed_scheduler_requests with logit bias and penalties on four of them (greedy and sampled, with
// and without top logprobs), which the host sampler applies on every backend: the same rule.
std::vector<GenerationRequest> penalised_scheduler_requests(const std::vector<int32_t>& prompt,
                                                            int64_t base_max_tokens);

// mixed_scheduler_requests with reasoning budgets (engine/reasoning_budget.h) on five of them:
// four open reasoning in the prompt, capped at 0, 3, 6 and 2 tokens (a close of two tokens forced
// with one before and one after), one waits for a marker its model may never write.
std::vector<GenerationRequest> budgeted_scheduler_requests(const std::vector<int32_t>& prompt,
                                                           int64_t base_max_tokens);
// Expects each request whose prompt opened reasoning to have its forced tokens right after its cap.
void expect_reasoning_capped(const std::vector<GenerationRequest>& requests,
                             const std::vector<std::vector<int32_t>>& tokens);

// Each request's tokens from generate() on its own (the reference a scheduled run must equal).
std::vector<std::vector<int32_t>> solo_tokens(Model& model, const std::vector<GenerationRequest>& requests);

// Submits every request to one scheduler of 3 slots (context `context_tokens`, 64-token prefill
// chunks) at once and returns each request's events up to its finishing one; a request whose
// next event does not come within 60 s fails the test.
std::vector<std::vector<TokenEvent>> scheduled_events(Model& model, const std::vector<GenerationRequest>& requests,
                                                      int64_t context_tokens);
// Expects each request's scheduled tokens to equal its solo run and, for a request with top
// logprobs (greedy), each token to head its 3 alternatives with its own logprob.
void expect_solo_results(const std::vector<std::vector<TokenEvent>>& events,
                         const std::vector<GenerationRequest>& requests, const std::vector<std::vector<int32_t>>& solo);

}  // namespace kiln::testing
