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
    planned[index] = {index, true, sequence.prompt_length, sequence.prompt_length, true};
    has_work[index] = true;
    --left;
  }
  for (size_t index = 0; index < sequences.size() && left > 0; ++index) {
    const SequenceProgress& sequence = sequences[index];
    if (sequence.prefilled >= sequence.prompt_length) continue;
    const int64_t end =
        prefill_chunk_end(sequence.prompt_length, sequence.prefilled, std::min(prefill_chunk, left));
    if (end == sequence.prefilled) continue;
    planned[index] = {index, false, sequence.prefilled, end, end == sequence.prompt_length};
    has_work[index] = true;
    left -= end - sequence.prefilled;
  }
  StepPlan plan;
  plan.every_sequence_decodes = true;
  for (size_t index = 0; index < sequences.size(); ++index) {
    if (!has_work[index] || !planned[index].decodes) plan.every_sequence_decodes = false;
    if (!has_work[index]) continue;
    plan.tokens += planned[index].tokens();
    plan.work.push_back(planned[index]);
  }
  return plan;
}

}  // namespace kiln
