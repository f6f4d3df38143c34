// The sizes a model is run at — sequences together, tokens per sequence, prompt tokens per prefill
// step — and the one check of them against the model's config. Every command that runs a model
// (generate, logits, bench, fit, serve) checks its sizes before any weight is read; the Scheduler
// and generate() check them again for library callers.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "io/config.h"

namespace kiln {

// Prefill splits fall on multiples of 64, the chunk of the hybrid models' Gated DeltaNet: split
// there, a chunked prefill gives the logits of a one-shot prefill bit for bit (DEVELOPERS.md).
inline constexpr int64_t kPrefillAlignment = 64;
inline constexpr int64_t kDefaultPrefillChunk = 256;
// A hybrid model's prefix cache keeps by default two snapshots of its recurrent state per sequence
// (engine/generation_core.h): room for each running conversation's last prompt and as many more,
// in twice the memory of the sequences' own recurrent states.
inline constexpr int64_t kPrefixSnapshotsPerSequence = 2;

struct ServingSizes {
  int32_t max_batch = 8;                         // sequences decoded together (cache slots)
  int64_t max_context = 0;                       // tokens per sequence, prompt and completion; 0: the model's
  int64_t prefill_chunk = kDefaultPrefillChunk;  // most prompt tokens a sequence prefills per step
  // Positions of the paged KV cache, which the sequences share (a multiple of 64, at least one
  // context's blocks); 0: a block for every position of every sequence, max_batch × context.
  int64_t kv_cache_tokens = 0;
  // The share of the device's memory everything may take, the KV pool sized to what the rest
  // leaves (kv_blocks_for_memory_share, engine/memory_plan.h); 0: kv_cache_tokens decides.
  double memory_share = 0.0;
  // Snapshots of a hybrid model's recurrent state that its prefix cache keeps (0: it reuses no
  // prefix; a model whose cache resumes anywhere takes none); -1: kPrefixSnapshotsPerSequence per
  // sequence.
  int64_t prefix_snapshots = -1;

  // Tokens per sequence: the model's context, or less when max_context asks; fails when neither
  // says.
  int64_t context(const ModelConfig& config) const;
  // The most tokens one step runs: every sequence prefilling a whole chunk, the step the memory
  // plan makes room for.
  int64_t step_token_budget() const { return max_batch * prefill_chunk; }
  // The KV pool's blocks (kKvBlockTokens positions each) for sequences of `context` tokens.
  int64_t kv_blocks(int64_t context) const;
  // The snapshot entries: prefix_snapshots, or its default.
  int64_t snapshots() const {
    return prefix_snapshots >= 0 ? prefix_snapshots : kPrefixSnapshotsPerSequence * max_batch;
  }
};

// Fails, naming the size at fault, unless the batch is at least 1, the prefill chunk a positive
// multiple of 64 and the context known (the model's or max_context).
void check_serving_sizes(const ServingSizes& sizes, const ModelConfig& config);

// Fails unless `chunk` is a positive multiple of kPrefillAlignment.
void check_prefill_chunk(int64_t chunk);

}  // namespace kiln
