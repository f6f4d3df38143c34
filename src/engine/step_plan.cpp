#include "engine/step_plan.h"

#include <algorithm>

#include "core/error.h"
#include "engine/serving_sizes.h"

namespace kiln {

int64_t prefill_chunk_end(int64_t prompt_length, int64_t prefilled, int64_t chunk) {
  const int64_t end = prefilled + std::min(chunk, prompt_length - prefilled);
  return end < prompt_length ? end / kPrefillAlignment * kPrefillAlignment : end;
}

StepPlan plan_step(std::span<const SequenceProgress> sequences, int64_t prefill_chunk, int64_t token_budget) {
  check_prefill_chunk(prefill_chunk);
  if (token_budget < 1) fail("a step's token budget must be at least 1, got {}", token_budget);
  std::vector<PlannedWork> planned(sequences.size());
  std::vector<bool> has_work(sequences.size(), false);
  int64_t left = token_budget;
  for (size_t index = 0; index < sequences.size() && left > 0; ++index) {
    const SequenceProgress& sequence = sequences[index];
    if (sequence.prefilled < sequence.prompt_length) continue;
    if (sequence.decode_tokens < 1)
      fail("sequence {} decodes {} tokens; a decode appends at least one", index, sequence.decode_tokens);
    if (sequence.decode_tokens > left) continue;
    planned[index] = {index, true, sequence.prompt_length, sequence.prompt_length, true, sequence.decode_tokens};
    has_work[index] = true;
    left -= sequence.decode_tokens;
  }
  for (size_t index = 0; index < sequences.size() && left > 0; ++index) {
    const SequenceProgress& sequence = sequences[index];
    if (sequence.prefilled >= sequence.prompt_length) continue;
    if (sequence.chunk_boundary % kPrefillAlignment != 0)
      fail("sequence {}: a chunk boundary at {} is not a multiple of {}", index, sequence.chunk_boundary,
           kPrefillAlignment);
    // The prompt up to the boundary first: the chunk's end stays a multiple of 64 or the prompt's end.
    const int64_t boundary = sequence.chunk_boundary;
    const int64_t until =
        sequence.prefilled < boundary && boundary < sequence.prompt_length ? boundary : sequence.prompt_length;
    const int64_t end = prefill_chunk_end(until, sequence.prefilled, std::min(prefill_chunk, left));
    if (end == sequence.prefilled) continue;
    planned[index] = {index, false, sequence.prefilled, end, end == sequence.prompt_length, 0};
    has_work[index] = true;
    left -= end - sequence.prefilled;
  }
  StepPlan plan;
  plan.every_sequence_decodes = true;
  for (size_t index = 0; index < sequences.size(); ++index) {
    if (!has_work[index] || !planned[index].decodes || planned[index].decode_tokens != 1)
      plan.every_sequence_decodes = false;
    if (!has_work[index]) continue;
    plan.tokens += planned[index].tokens();
    plan.work.push_back(planned[index]);
  }
  return plan;
}

}  // namespace kiln
