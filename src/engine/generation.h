// Running a model: single steps over several sequences, whole-prompt logits, and the
// prefill + decode loop for one request.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "engine/sampler.h"
#include "model/model.h"

namespace kiln {

// One sequence's contribution to a step: `tokens` continue the sequence in `slot` at
// `first_position`. Its logits rows are every token's (all_logits) or only the last one's.
struct SequenceStep {
  int32_t slot = 0;
  int32_t first_position = 0;
  std::vector<int32_t> tokens;
  bool all_logits = false;
};

// Runs one forward over the sequences (in order) and returns their logit rows as a host
// f32 tensor [rows, vocab], sequence by sequence.
Tensor run_step(Model& model, ModelCache& cache, const std::vector<SequenceStep>& sequences);

// Logits of every prompt position [T, vocab], prefilled in chunks of `chunk` tokens (0: one shot).
Tensor prompt_logits(Model& model, const std::vector<int32_t>& prompt, int64_t chunk);

struct GenerationOptions {
  int64_t max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (it is reported)
  int64_t prefill_chunk = 0;      // 0: the whole prompt in one step
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  std::string finish_reason;  // "stop" (a stop id, or the callback asked) | "length"
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

// Prefills `prompt` and decodes up to max_tokens tokens. on_token is called for each new token
// and may return false to stop early.
GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& options,
                          const std::function<bool(const SampledToken&)>& on_token = {});

}  // namespace kiln
