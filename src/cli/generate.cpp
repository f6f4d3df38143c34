// kiln generate: prefill a prompt and decode. With --ids it prints the generated ids; with
// --prompt or --chat it streams text (through the library's TextModel, text/text_model.h) and stops
// at an end-of-sequence id or a --stop string.
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/model_options.h"
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
  int64_t max_tokens = 256;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  std::optional<uint64_t> seed;
  ServingSizes sizes{1, 0, kDefaultPrefillChunk};  // one sequence at the model's context
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
  command->add_option("--max-tokens", options->max_tokens, "Most tokens to generate")->check(CLI::NonNegativeNumber);
  command->add_option("--temperature", options->temperature, "Sampling temperature (0: greedy)");
  command->add_option("--top-k", options->top_k, "Keep the k most likely tokens (0: off)");
  command->add_option("--top-p", options->top_p, "Nucleus sampling mass (1: off)");
  command->add_option("--min-p", options->min_p, "Drop tokens below min-p × the top probability (0: off)");
  command->add_option("--seed", options->seed, "Random seed (same seed, same tokens)");
  add_prefill_chunk_option(*command, options->sizes);
  command->callback([options, ids, prompt, chat] {
    if (!*ids && !*prompt && !*chat) fail("generate needs one of --ids, --prompt or --chat");
    if (*ids && !options->stops.empty()) fail("--stop applies to text (--prompt or --chat), not to --ids");
    options->model.resolve();
    OpenedModel opened = open_model(options->model, options->sizes);
    GenerationOptions generation;
    generation.max_tokens = options->max_tokens;
    generation.sampling = {options->temperature, options->top_k, options->top_p, options->min_p, options->seed};
    generation.sampling.validate();
    generation.prefill_chunk = options->sizes.prefill_chunk;

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
      return;
    }

    TextOptions text_options;
    text_options.max_tokens = generation.max_tokens;
    text_options.sampling = generation.sampling;
    text_options.stop = options->stops;
    text_options.prefill_chunk = generation.prefill_chunk;
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
