// kiln generate: prefill a prompt and decode, printing the generated token ids.
#include <cstdio>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/model_options.h"
#include "engine/generation.h"

namespace kiln::cli {
namespace {

struct GenerateCommand {
  ModelOptions model;
  std::string ids;
  int64_t max_tokens = 256;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  std::optional<uint64_t> seed;
  int64_t chunk = 0;
};

RegisterCommand register_generate([](CLI::App& app) {
  auto options = std::make_shared<GenerateCommand>();
  CLI::App* command = app.add_subcommand("generate", "Generate tokens from a prompt");
  options->model.add_to(*command);
  command->add_option("--ids", options->ids, "Prompt token ids, comma-separated")->required();
  command->add_option("--max-tokens", options->max_tokens, "Most tokens to generate")->check(CLI::NonNegativeNumber);
  command->add_option("--temperature", options->temperature, "Sampling temperature (0: greedy)");
  command->add_option("--top-k", options->top_k, "Keep the k most likely tokens (0: off)");
  command->add_option("--top-p", options->top_p, "Nucleus sampling mass (1: off)");
  command->add_option("--min-p", options->min_p, "Drop tokens below min-p × the top probability (0: off)");
  command->add_option("--seed", options->seed, "Random seed (same seed, same tokens)");
  command->add_option("--chunk", options->chunk, "Prefill in chunks of N tokens (0: one shot)")->check(CLI::NonNegativeNumber);
  command->callback([options] {
    OpenedModel opened = open_model(options->model);
    GenerationOptions generation;
    generation.max_tokens = options->max_tokens;
    generation.sampling = {options->temperature, options->top_k, options->top_p, options->min_p, options->seed};
    generation.sampling.validate();
    for (int64_t id : opened.model->config().eos_token_ids) generation.stop_ids.push_back(static_cast<int32_t>(id));
    generation.prefill_chunk = options->chunk;
    bool first = true;
    const GenerationResult result =
        generate(*opened.model, parse_token_ids(options->ids), generation, [&](const SampledToken& token) {
          fmt::print("{}{}", first ? "" : ",", token.token);
          std::fflush(stdout);
          first = false;
          return true;
        });
    fmt::print("\n");
    const double decode_rate = result.decode_seconds > 0 ? (result.tokens.size() - 1) / result.decode_seconds : 0;
    fmt::print(stderr, "kiln: {} tokens ({}), prefill {:.1f} ms, decode {:.1f} tok/s\n", result.tokens.size(),
               result.finish_reason, result.prefill_seconds * 1e3, decode_rate);
  });
});

}  // namespace
}  // namespace kiln::cli
