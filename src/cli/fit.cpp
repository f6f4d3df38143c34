// kiln fit --model DIR [--device cpu|cuda] [--dtype …] [--max-batch N] [--max-context T]
// [--prefill-chunk C] [--embeddings] [--speculative …]: whether the model, with N sequences of T tokens served as `kiln serve`
// would serve them (its flags and defaults), fits the device's memory — weights, cache, step
// scratch, the decode graphs' buffers, the backend's reserve and a draft model (--speculative
// draft:DIR) against what the device has
// available — decided before any weight is read. Exit status 0: it fits; 2: it does not (the
// plan says by how much, and the longest context that would fit); 1: an error.
#include <cstdio>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/model_options.h"
#include "cli/speculative_options.h"
#include "engine/memory_plan.h"

namespace kiln::cli {
namespace {

struct FitCommand {
  ModelOptions model;
  ServingSizes sizes;  // kiln serve's, with its defaults
  bool embeddings = false;
  SpeculativeOptions speculative;  // a hybrid cache's saved states, a draft model beside the target
};

void fit(const FitCommand& options) {
  PreparedModel prepared = prepare_model(options.model, options.sizes);
  const int64_t context = options.sizes.context(prepared.plan.config);
  if (options.speculative.enabled()) options.speculative.check(prepared);
  const std::optional<PreparedModel> draft =
      options.speculative.prepare_draft(options.model, {options.sizes.max_batch, context, options.sizes.prefill_chunk});
  MemoryRequest request = options.speculative.memory_request(options.sizes, context, options.embeddings, draft);
  apply_memory_share(options.sizes, prepared, request);
  Backend& backend = *prepared.backend;
  const MemoryPlan plan = plan_memory(prepared.plan, backend, prepared.load_dtype, request);
  std::fputs((describe_memory_plan(plan, backend.name()) + "\n").c_str(), stdout);
  if (plan.fits()) return;
  const int64_t longest = longest_fitting_context(prepared.plan, backend, prepared.load_dtype, plan);
  std::fputs((longest > 0 ? fmt::format("the longest context that fits {} sequences: {} tokens\n", request.sequences,
                                        longest)
                          : fmt::format("not even a one-token context fits {} sequences\n", request.sequences))
                 .c_str(),
             stdout);
  throw CommandExit{2};
}

const RegisterCommand kRegisterFit([](CLI::App& app) {
  auto options = std::make_shared<FitCommand>();
  CLI::App* command =
      app.add_subcommand("fit", "Say, before loading, whether a model and its context fit the device's memory");
  options->model.add_to(*command);
  add_serving_size_options(*command, options->sizes);
  command->add_flag("--embeddings", options->embeddings, "Plan for kiln serve --embeddings (no decode graphs)");
  options->speculative.add_to(*command);
  command->callback([options] {
    options->model.resolve();
    options->model.mtp = options->speculative.uses_mtp_head();
    fit(*options);
  });
});

}  // namespace
}  // namespace kiln::cli
