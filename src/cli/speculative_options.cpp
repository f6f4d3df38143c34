#include "cli/speculative_options.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/draft_proposer.h"
#include "engine/mtp_proposer.h"

namespace kiln::cli {
namespace {

constexpr std::string_view kDraftPrefix = "draft:";

// What defines a tokenizer.json's mapping between text and ids: its model (vocabulary, merges) and
// its added tokens. Formatting and the other sections (normalizer options written differently, a
// post-processor) do not change which id a token is.
nlohmann::json tokenizer_identity(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) fail("{}: cannot be read", file.string());
  const nlohmann::json tokenizer = nlohmann::json::parse(in, nullptr, false);
  if (tokenizer.is_discarded()) fail("{}: is not JSON", file.string());
  return {tokenizer.value("model", nlohmann::json()), tokenizer.value("added_tokens", nlohmann::json())};
}

void check_same_tokenizer(const std::filesystem::path& target, const std::filesystem::path& draft) {
  const auto target_file = target / "tokenizer.json", draft_file = draft / "tokenizer.json";
  if (!std::filesystem::exists(target_file) || !std::filesystem::exists(draft_file))
    fail("--speculative draft:{}: both models need a tokenizer.json to check that they share the tokenizer",
         draft.string());
  if (tokenizer_identity(target_file) != tokenizer_identity(draft_file))
    fail("--speculative draft:{}: the draft's tokenizer differs from the target's (its tokenizer.json vocabulary or "
         "added tokens); a draft must share the target's tokenizer", draft.string());
}

}  // namespace

void SpeculativeOptions::add_to(CLI::App& command, bool with_oracle) {
  offers_oracle = with_oracle;
  command.add_option("--speculative", method,
                     std::string("Speculative decoding, exact (the output is the plain run's): ngram (prompt lookup), "
                                 "draft:DIR (a smaller model sharing the tokenizer), mtp (the checkpoint's "
                                 "multi-token-prediction head)") +
                         (with_oracle ? "; oracle (benchmarks only: replays the plain run, acceptance 1)" : ""));
  command.add_option("--num-speculative-tokens", tokens, "Most tokens proposed per verify step (1..16)")
      ->capture_default_str();
}

void SpeculativeOptions::check(const PreparedModel& target) const {
  check_speculative_tokens(tokens);
  if (method == "ngram" || (method == "oracle" && offers_oracle)) return;
  if (method == "mtp") {
    if (!target.options.mtp) fail("--speculative mtp: the model was prepared without its MTP head");
    if (target.options.tensor_parallel > 1)
      fail("--speculative mtp runs the MTP head on one device, not split over --tensor-parallel {} ranks",
           target.options.tensor_parallel);
    return;
  }
  if (method.starts_with(kDraftPrefix)) {
    const std::string draft = resolve_model(method.substr(kDraftPrefix.size()));
    if (!std::filesystem::is_directory(draft)) fail("--speculative {}: {} is not a model folder", method, draft);
    check_same_tokenizer(target.options.model_dir, draft);
    return;
  }
  fail("--speculative: unknown method '{}' (ngram, draft:DIR or mtp)", method);
}

std::optional<PreparedModel> SpeculativeOptions::prepare_draft(const ModelOptions& target_options,
                                                              const ServingSizes& sizes) const {
  if (!method.starts_with(kDraftPrefix)) return std::nullopt;
  ModelOptions draft_options = target_options;
  draft_options.model = method.substr(kDraftPrefix.size());
  draft_options.tensor_parallel = 1;
  draft_options.mtp = false;
  draft_options.resolve();
  return prepare_model(draft_options, sizes);
}

MemoryRequest SpeculativeOptions::memory_request(const ServingSizes& sizes, int64_t context, bool embeddings,
                                                 const std::optional<PreparedModel>& draft) const {
  MemoryRequest request{sizes.max_batch, context, sizes.prefill_chunk, embeddings, enabled()};
  request.kv_blocks = sizes.kv_blocks(context);
  // The embedding scheduler keeps no prefix cache.
  request.prefix_snapshots = embeddings ? 0 : sizes.snapshots();
  if (draft) {
    request.draft = &draft->plan;
    request.draft_load_dtype = draft->load_dtype;
  }
  request.mtp = uses_mtp_head();
  return request;
}

SpeculativeSetup make_speculation(const SpeculativeOptions& options, const ModelOptions& target_options, Model& target,
                                  int32_t slots, int64_t context_tokens, int64_t prefill_chunk,
                                  std::optional<PreparedModel> draft) {
  SpeculativeSetup setup;
  setup.speculation.tokens = options.tokens;
  if (options.method == "ngram") {
    setup.speculation.proposer = std::make_shared<NgramProposer>();
  } else if (options.uses_mtp_head()) {
    setup.speculation.proposer = std::make_shared<MtpProposer>(target, slots, context_tokens);
  } else if (options.method.starts_with(kDraftPrefix)) {
    if (!draft) draft = options.prepare_draft(target_options, {slots, context_tokens, prefill_chunk});
    setup.draft = build_prepared_model(std::move(*draft));
    check_draft_model(target.config(), *setup.draft.model);
    setup.speculation.proposer =
        std::make_shared<DraftModelProposer>(*setup.draft.model, slots, context_tokens, prefill_chunk);
  } else {
    fail("--speculative {}: not a method requests can use here", options.method);
  }
  return setup;
}

}  // namespace kiln::cli
