// --speculative ngram|draft:DIR|mtp and --num-speculative-tokens K (kiln generate, serve, bench, fit):
// checked before the target's weights are read, then turned into the Speculation each request
// takes (engine/speculative.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/model_options.h"
#include "engine/memory_plan.h"
#include "engine/speculative.h"

namespace kiln::cli {

struct SpeculativeOptions {
  std::string method;  // "" (none), "ngram", "draft:DIR" or "mtp"
  int32_t tokens = 4;  // --num-speculative-tokens
  bool offers_oracle = false;  // kiln bench's benchmark-only "oracle"

  void add_to(CLI::App& command, bool with_oracle = false);
  bool enabled() const { return !method.empty(); }
  // Whether the target is loaded with its MTP head (ModelOptions::mtp, set before it is prepared:
  // preparing it then fails, in one line, for a checkpoint without MTP weights or a family without
  // an MTP head).
  bool uses_mtp_head() const { return method == "mtp"; }
  // Fails, in one line saying why, for a K out of 1..16, an unknown method, `mtp` split over
  // tensor-parallel ranks, a draft whose tokenizer or vocabulary is not the target's. Runs before
  // any weight of the target is read.
  void check(const PreparedModel& target) const;
  // The draft model of draft:DIR with the target's device, dtype and threads, planned before any
  // of its weights is read (what the memory check plans beside the target); nothing for the other
  // methods.
  std::optional<PreparedModel> prepare_draft(const ModelOptions& target_options, const ServingSizes& sizes) const;
  // What serving `sizes` at `context` tokens per sequence asks of memory with these options (kiln
  // serve's check, kiln fit): the prefix cache's snapshots, a hybrid cache's saved states when
  // speculating, and `draft` (prepare_draft's, which must outlive the request) beside the target.
  MemoryRequest memory_request(const ServingSizes& sizes, int64_t context, bool embeddings,
                               const std::optional<PreparedModel>& draft) const;
};

// What a command holds while it speculates: the draft model (when drafting) and the speculation
// requests take.
struct SpeculativeSetup {
  OpenedModel draft;
  Speculation speculation;
};

// The proposer the options name (check() passed, not the oracle) for requests on `target`: up to
// `slots` at once of `context_tokens` each. A draft model is opened with the target's device, dtype
// and threads; `draft` is prepare_draft's, where the caller planned it already (kiln serve's memory
// check), so that it is not prepared twice. The MTP head is the target's own.
SpeculativeSetup make_speculation(const SpeculativeOptions& options, const ModelOptions& target_options, Model& target,
                                  int32_t slots, int64_t context_tokens, int64_t prefill_chunk,
                                  std::optional<PreparedModel> draft = std::nullopt);

}  // namespace kiln::cli
