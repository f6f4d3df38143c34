// Which work one step does: a pure function of the running sequences' progress, the prefill chunk
// and a token budget (vLLM's v1 scheduler is the model). Prefill and decode are the same kind of
// work — tokens of a sequence run in one forward — so a step mixes them freely: a sequence still
// prefilling gets its next chunk of the prompt, a sequence past its prompt its decode tokens: one,
// or for a speculative sequence the row-set that verifies its proposals (engine/speculative.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kiln {

struct SequenceProgress {
  int64_t prompt_length = 0;
  int64_t prefilled = 0;  // prompt tokens already in the cache; all of them: the sequence decodes
  // Tokens its decode appends: 1, or the tokens it runs again after a rollback, the last sampled one
  // and its proposals (engine/speculative.h).
  int64_t decode_tokens = 1;
  // A position (a multiple of kPrefillAlignment) at which one of its prefill chunks must end, for
  // the engine to keep the state there (a hybrid model's prefix snapshot, GenerationCore); 0: none.
  int64_t chunk_boundary = 0;
};

struct PlannedWork {
  size_t sequence = 0;  // index into the progress the plan was made from
  bool decodes = false;
  int64_t begin = 0;  // a prefill's prompt tokens [begin, end)
  int64_t end = 0;
  // Whether the work's last logit row chooses a token: a decode, or the prefill of a prompt's last
  // chunk (that sequence is not decoding yet in this step).
  bool samples = false;
  int64_t decode_tokens = 0;  // a decode's tokens (SequenceProgress::decode_tokens)
  int64_t tokens() const { return decodes ? decode_tokens : end - begin; }
};

struct StepPlan {
  std::vector<PlannedWork> work;  // in sequence order; a sequence the budget leaves out has none
  int64_t tokens = 0;
  // Each sequence has work, and all of it is a one-token decode: the step a decode graph runs.
  bool every_sequence_decodes = false;
};

// The end of the prefill chunk that starts at `prefilled`: up to `chunk` tokens, split only at a
// multiple of kPrefillAlignment unless the prompt ends first.
int64_t prefill_chunk_end(int64_t prompt_length, int64_t prefilled, int64_t chunk);

// Plans one step of at most `token_budget` tokens. Decoding sequences come first, each with all its
// decode tokens, in order (prefills never starve a decode; a decode that does not fit what is left
// waits for the next step); the rest of the budget goes to prefilling sequences in
// order, each up to `prefill_chunk` tokens (a positive multiple of kPrefillAlignment), its chunk
// cut short at an aligned split when the budget runs low and left out when no aligned split fits,
// and ended at its chunk_boundary when it would run past it.
StepPlan plan_step(std::span<const SequenceProgress> sequences, int64_t prefill_chunk, int64_t token_budget);

}  // namespace kiln
