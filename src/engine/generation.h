// Running a model: single steps over several sequences, whole-prompt logits, and one request
// generated on the calling thread (a one-request client of engine/generation_core.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "engine/finish_reason.h"
#include "engine/reasoning_budget.h"
#include "engine/sampler.h"
#include "engine/serving_sizes.h"
#include "engine/speculative.h"
#include "model/model.h"

namespace kiln {

// One sequence's contribution to a step: `tokens` continue the sequence in `slot` at
// `first_position`. Its logits rows are every token's (all_logits), or those of its last
// `last_logits` tokens (a verify step's rows; the last token's alone by default). With
// `hidden_states`, every token's final hidden state comes back too (run_step's `hidden`).
struct SequenceStep {
  int32_t slot = 0;
  int32_t first_position = 0;
  std::vector<int32_t> tokens;
  bool all_logits = false;
  int32_t last_logits = 1;
  bool hidden_states = false;
};

// The batch of a step's sequences (in order): their spans and token ids, each checked to carry a
// token and to end within `cache` (`what` names the cache in the messages).
struct StepBatch {
  std::vector<SequenceSpan> spans;
  std::vector<int32_t> token_ids;
};
StepBatch step_batch(const std::vector<SequenceStep>& sequences, const ModelCache& cache, const char* what);

// Row indices (a step's logit or hidden-state rows) as an I32 tensor on the backend.
Tensor upload_row_indices(Backend& backend, const std::vector<int32_t>& indices);

// Runs one forward over the sequences (in order) and returns their logit rows, f32 [rows, vocab]
// sequence by sequence, on the backend's device (run_step downloads them).
Tensor forward_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences,
                    Tensor* hidden = nullptr);

// Runs one forward over the sequences (in order) and returns their logit rows as a host
// f32 tensor [rows, vocab], sequence by sequence. When some sequence asks for its hidden states,
// `hidden` receives them from the same forward (Model::forward_with_hidden): [rows, hidden_size]
// in the activation dtype on the backend's device, every token of those sequences in order.
Tensor run_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences, Tensor* hidden = nullptr);

// Logits of every prompt position [T, vocab], prefilled in chunks of `chunk` tokens split as a
// step plan splits them (prefill_chunk_end; a chunk is a positive multiple of 64), or with
// kWholePrompt in one step.
inline constexpr int64_t kWholePrompt = 0;
Tensor prompt_logits(Model& model, const std::vector<int32_t>& prompt, int64_t chunk);

struct GenerationOptions {
  int64_t max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (it is reported)
  int64_t prefill_chunk = kDefaultPrefillChunk;  // most prompt tokens prefilled per step (a multiple of 64)
  std::optional<ReasoningBudget> reasoning_budget;  // GenerationRequest::reasoning_budget
  Speculation speculation;                          // GenerationRequest::speculation
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  FinishReason finish_reason = FinishReason::Length;  // Stop: a stop id, or the callback asked
  double prefill_seconds = 0;
  double decode_seconds = 0;
  SpeculationCounts speculation;  // its verify steps (none without speculation)
};

// Prefills `prompt` and decodes up to max_tokens tokens (bounded by the model's context), through
// the same core, plan and stop rules as the Scheduler. on_token is called for each new token and
// may return false to stop early. A failed step is thrown as a kiln::Error.
GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& options,
                          const std::function<bool(const SampledToken&)>& on_token = {});

}  // namespace kiln
