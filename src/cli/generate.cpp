// kiln generate: prefill a prompt and decode. With --ids it prints the generated ids; with
// --prompt or --chat it streams text (through the library's TextModel, text/text_model.h) and stops
// at an end-of-sequence id or a --stop string.
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/model_options.h"
#include "cli/speculative_options.h"
#include "core/error.h"
#include "engine/generation.h"
#include "text/text_model.h"

namespace kiln::cli {
namespace {

struct GenerateCommand {
  ModelOptions model;
  std::string ids;
  std::string prompt;
  std::string chat;
  std::vector<std::string> stops;
  // Unset: the generation config's value (--generation-config), else kiln's default.
  std::optional<int64_t> max_tokens;
  std::optional<float> temperature;
  std::optional<int32_t> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;
  std::string generation_config = "auto";
  ServingSizes sizes{1, 0, kDefaultPrefillChunk};  // one sequence at the model's context
  SpeculativeOptions speculative;
};

void print_now(const std::string& text) {
  fmt::print("{}", text);
  std::fflush(stdout);
}

RegisterCommand register_generate([](CLI::App& app) {
  auto options = std::make_shared<GenerateCommand>();
  CLI::App* command = app.add_subcommand("generate", "Generate from a prompt (token ids, text, or a chat message)");
  options->model.add_to(*command);
  auto* ids = command->add_option("--ids", options->ids, "Prompt token ids, comma-separated (prints generated ids)");
  auto* prompt = command->add_option("--prompt", options->prompt, "Prompt text (streams the continuation)");
  auto* chat = command->add_option("--chat", options->chat, "A user message, rendered with the model's chat template");
  ids->excludes(prompt)->excludes(chat);
  prompt->excludes(chat);
  command->add_option("--stop", options->stops, "Stop at this text (repeatable; text modes)");
  command
      ->add_option("--max-tokens", options->max_tokens,
                   "Most tokens to generate (default: the generation config's max_new_tokens, else 256)")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--temperature", options->temperature,
                      "Sampling temperature (0: greedy; default: the generation config's, else 1)");
  command->add_option("--top-k", options->top_k, "Keep the k most likely tokens (0: off; default: the generation config's)");
  command->add_option("--top-p", options->top_p, "Nucleus sampling mass (1: off; default: the generation config's)");
  command->add_option("--min-p", options->min_p,
                      "Drop tokens below min-p × the top probability (0: off; default: the generation config's)");
  command->add_option("--repetition-penalty", options->repetition_penalty,
                      "Divide (or multiply, when negative) the logits of prompt and generated tokens (1: off; "
                      "default: the generation config's)");
  command->add_option("--presence-penalty", options->presence_penalty,
                      "Subtract from the logit of every token generated so far (-2 to 2)")
      ->capture_default_str();
  command->add_option("--frequency-penalty", options->frequency_penalty,
                      "Subtract this times its count from the logit of every generated token (-2 to 2)")
      ->capture_default_str();
  command->add_option("--seed", options->seed, "Random seed (same seed, same tokens)");
  add_generation_config_option(*command, options->generation_config);
  add_prefill_chunk_option(*command, options->sizes);
  options->speculative.add_to(*command);
  command->callback([options, ids, prompt, chat] {
    if (!*ids && !*prompt && !*chat) fail("generate needs one of --ids, --prompt or --chat");
    if (*ids && !options->stops.empty()) fail("--stop applies to text (--prompt or --chat), not to --ids");
    options->model.resolve();
    options->model.mtp = options->speculative.uses_mtp_head();
    PreparedModel prepared = prepare_model(options->model, options->sizes);
    if (options->speculative.enabled()) options->speculative.check(prepared);
    OpenedModel opened = build_prepared_model(std::move(prepared));
    SpeculativeSetup speculation;
    if (options->speculative.enabled())
      speculation = make_speculation(options->speculative, options->model, *opened.model, 1,
                                     options->sizes.context(opened.model->config()), options->sizes.prefill_chunk);
    // The flags win over the generation config, which wins over kiln's defaults.
    const SamplingDefaults defaults = generation_defaults(options->generation_config, options->model.model_dir);
    GenerationOptions generation;
    generation.max_tokens = options->max_tokens.value_or(defaults.max_new_tokens.value_or(256));
    generation.sampling = defaults.sampling;
    SamplingParams& sampling = generation.sampling;
    if (options->temperature) sampling.temperature = *options->temperature;
    if (options->top_k) sampling.top_k = *options->top_k;
    if (options->top_p) sampling.top_p = *options->top_p;
    if (options->min_p) sampling.min_p = *options->min_p;
    if (options->repetition_penalty) sampling.repetition_penalty = *options->repetition_penalty;
    sampling.presence_penalty = options->presence_penalty;
    sampling.frequency_penalty = options->frequency_penalty;
    sampling.seed = options->seed;
    sampling.validate();
    generation.prefill_chunk = options->sizes.prefill_chunk;
    generation.speculation = speculation.speculation;

    if (*ids) {
      for (int64_t id : opened.model->config().eos_token_ids) generation.stop_ids.push_back(static_cast<int32_t>(id));
      bool first = true;
      const GenerationResult result =
          generate(*opened.model, parse_token_ids(options->ids), generation, [&](const SampledToken& token) {
            print_now(fmt::format("{}{}", first ? "" : ",", token.token));
            first = false;
            return true;
          });
      fmt::print("\n");
      fmt::print(stderr, "kiln: {} tokens ({}), prefill {:.1f} ms, decode {:.1f} tok/s\n", result.tokens.size(),
                 finish_reason_name(result.finish_reason), result.prefill_seconds * 1e3,
                 result.decode_seconds > 0 ? (result.tokens.size() - 1) / result.decode_seconds : 0.0);
      if (const SpeculationCounts& counts = result.speculation; counts.verify_steps > 0)
        fmt::print(stderr,
                   "kiln: {} verify steps, {} of {} proposed tokens accepted ({:.1f} %), {:.2f} tokens per verify "
                   "step\n",
                   counts.verify_steps, counts.accepted, counts.proposed,
                   counts.proposed ? 100.0 * counts.accepted / counts.proposed : 0.0,
                   static_cast<double>(counts.verify_steps + counts.accepted) / counts.verify_steps);
      return;
    }

    TextOptions text_options;
    text_options.max_tokens = generation.max_tokens;
    text_options.sampling = generation.sampling;
    text_options.stop = options->stops;
    text_options.prefill_chunk = generation.prefill_chunk;
    text_options.speculation = generation.speculation;
    TextModel text(std::move(opened.model), options->model.model_dir);
    const auto print_text = [](std::string_view text) {
      print_now(std::string(text));
      return true;
    };
    if (*prompt) {
      print_now(options->prompt);
      text.generate(options->prompt, text_options, print_text);
    } else {
      text.chat(nlohmann::ordered_json::array({{{"role", "user"}, {"content", options->chat}}}), text_options,
                print_text);
    }
    fmt::print("\n");
  });
});

}  // namespace
}  // namespace kiln::cli
