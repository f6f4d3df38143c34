// kiln tokenize: token ids of text, for checking kiln's tokenizer against others.
//   kiln tokenize (--model DIR | --tokenizer DIR_OR_FILE) (--text T | --jsonl F)
// --text prints one JSON array of ids; with --jsonl each input line is one JSON string and each
// output line the JSON array of its ids. Special tokens are added only with --add-special-tokens.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "cli/jsonl.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace kiln::cli {
namespace {

struct TokenizeOptions {
  std::string model_dir;
  std::string tokenizer_path;
  std::string text;
  std::string jsonl_path;
  bool add_special_tokens = false;
};

void print_ids(const std::vector<int32_t>& ids) { fmt::print("{}\n", nlohmann::json(ids).dump()); }

void run_tokenize(const TokenizeOptions& options) {
  const Tokenizer tokenizer =
      Tokenizer::load(options.model_dir.empty() ? options.tokenizer_path : resolve_model(options.model_dir));
  if (options.jsonl_path.empty()) {
    print_ids(tokenizer.encode(options.text, options.add_special_tokens));
    return;
  }
  for_each_jsonl_line(options.jsonl_path, [&](const nlohmann::ordered_json& value, const std::string& where) {
    if (!value.is_string()) fail("{}: each line must be one JSON string", where);
    print_ids(tokenizer.encode(value.get<std::string>(), options.add_special_tokens));
  });
}

const RegisterCommand kRegisterTokenize([](CLI::App& app) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* command = app.add_subcommand("tokenize", "Print the token ids of text");
  CLI::Option_group* source = command->add_option_group("source", "where the tokenizer is");
  add_model_option(*source, options->model_dir, "model directory holding tokenizer.json");
  source->add_option("--tokenizer", options->tokenizer_path, "tokenizer.json, or a directory holding it");
  source->require_option(1);
  CLI::Option_group* input = command->add_option_group("input", "what to tokenize");
  input->add_option("--text", options->text, "the text");
  input->add_option("--jsonl", options->jsonl_path, "a file (or - for stdin) of JSON strings, one per line");
  input->require_option(1);
  command->add_flag("--add-special-tokens", options->add_special_tokens,
                    "add the tokens the tokenizer puts around a sequence (e.g. BOS)");
  command->callback([options] { run_tokenize(*options); });
});

}  // namespace
}  // namespace kiln::cli
