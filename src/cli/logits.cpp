// kiln logits: float32 logits [tokens, vocab] of every prompt position, written as .npy.
#include <fmt/format.h>

#include "cli/command.h"
#include "cli/model_options.h"
#include "engine/generation.h"
#include "io/npy.h"

namespace kiln::cli {
namespace {

struct LogitsCommand {
  ModelOptions model;
  std::string ids;
  std::string out;
  ServingSizes sizes{1, 0, kDefaultPrefillChunk};  // one sequence at the model's context
};

RegisterCommand register_logits([](CLI::App& app) {
  auto options = std::make_shared<LogitsCommand>();
  CLI::App* command = app.add_subcommand("logits", "Write the logits of every prompt position as a float32 .npy");
  options->model.add_to(*command);
  command->add_option("--ids", options->ids, "Prompt token ids, comma-separated")->required();
  command->add_option("--out", options->out, "Output .npy file")->required();
  add_prefill_chunk_option(*command, options->sizes);
  command->callback([options] {
    options->model.resolve();
    OpenedModel opened = open_model(options->model, options->sizes);
    const std::vector<int32_t> prompt = parse_token_ids(options->ids);
    Tensor logits = prompt_logits(*opened.model, prompt, options->sizes.prefill_chunk);
    write_npy_f32(options->out, logits.shape(), logits.data<float>());
    fmt::print(stderr, "kiln: wrote logits {} to {}\n", shape_string(logits.shape()), options->out);
  });
});

}  // namespace
}  // namespace kiln::cli
