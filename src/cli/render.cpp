// kiln render: the prompt a model's chat template makes of conversations.
//   kiln render (--model DIR | --tokenizer DIR) --jsonl F
// Each input line is a JSON object {"messages": [...]} with optionally "tools",
// "add_generation_prompt" (default false) and "enable_thinking"; any other key becomes a template
// variable. Each output line is the rendered prompt as a JSON string.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "cli/jsonl.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::cli {
namespace {

struct RenderOptions {
  std::string model_dir;
  std::string tokenizer_dir;
  std::string jsonl_path;
};

void run_render(const RenderOptions& options) {
  const Tokenizer tokenizer =
      Tokenizer::load(options.model_dir.empty() ? options.tokenizer_dir : resolve_model(options.model_dir));
  const ChatTemplate chat_template = ChatTemplate::for_tokenizer(tokenizer);
  for_each_jsonl_line(options.jsonl_path, [&](const nlohmann::ordered_json& request, const std::string& where) {
    if (!request.is_object() || !request.contains("messages")) fail("{}: expected an object with \"messages\"", where);
    ChatTemplateOptions render_options;
    for (const auto& [key, value] : request.items()) {
      if (key == "messages") continue;
      if (key == "tools") {
        render_options.tools = value;
      } else if (key == "add_generation_prompt" || key == "enable_thinking") {
        if (!value.is_boolean()) fail("{}: \"{}\" must be true or false", where, key);
        if (key == "add_generation_prompt")
          render_options.add_generation_prompt = value.get<bool>();
        else
          render_options.enable_thinking = value.get<bool>();
      } else {
        render_options.extra[key] = value;
      }
    }
    const std::string prompt = chat_template.render(request.at("messages"), render_options);
    fmt::print("{}\n", nlohmann::ordered_json(prompt).dump());
  });
}

const RegisterCommand kRegisterRender([](CLI::App& app) {
  auto options = std::make_shared<RenderOptions>();
  CLI::App* command = app.add_subcommand("render", "Print the prompts a model's chat template makes of conversations");
  CLI::Option_group* source = command->add_option_group("source", "where the tokenizer is");
  add_model_option(*source, options->model_dir, "model directory");
  source->add_option("--tokenizer", options->tokenizer_dir,
                     "directory holding tokenizer.json and tokenizer_config.json");
  source->require_option(1);
  command->add_option("--jsonl", options->jsonl_path, "a file (or - for stdin) of JSON requests, one per line")
      ->required();
  command->callback([options] { run_render(*options); });
});

}  // namespace
}  // namespace kiln::cli
