// kiln inspect --model DIR [--device cpu|cuda] [--hash-artifact]: how kiln would build the model
// in DIR (profile, fingerprints, implementation, capabilities, parameters, load plan) and, where it
// has a tokenizer, how its replies are parsed (the chat template's reasoning and tool-call syntax),
// as JSON, without reading a weight byte. A model kiln cannot build is an error on stderr.
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/model_options.h"
#include "model/loader.h"
#include "text/tokenizer_codec.h"

namespace kiln::cli {
namespace {

// Whether this binary carries a backend for `device`: the CPU backend always, the CUDA backend
// when it was compiled in.
bool backend_compiled_in(Device device) {
#ifdef KILN_HAVE_CUDA
  return true;
#else
  return device == Device::CPU;
#endif
}

struct InspectArguments {
  std::string model_dir;
  Device device = Device::CPU;
  bool hash_artifact = false;
};

const RegisterCommand kRegisterInspect([](CLI::App& app) {
  auto arguments = std::make_shared<InspectArguments>();
  CLI::App* command = app.add_subcommand("inspect", "Show how kiln would build a model, as JSON");
  add_model_option(*command, arguments->model_dir, "Model folder (config.json + safetensors)")->required();
  command->add_option("--device", arguments->device, "Backend to plan for")
      ->transform(CLI::CheckedTransformer(std::map<std::string, Device>{{"cpu", Device::CPU}, {"cuda", Device::CUDA}}));
  command->add_flag("--hash-artifact", arguments->hash_artifact,
                    "Fingerprint a folder that is not a Hugging Face snapshot by hashing its weight files");
  command->callback([arguments] {
    arguments->model_dir = resolve_model(arguments->model_dir);
    LoadOptions options;
    options.hash_artifact = arguments->hash_artifact;
    const ModelPlan plan = plan_model(arguments->model_dir, arguments->device,
                                      backend_compiled_in(arguments->device), options);
    nlohmann::json report = plan.to_json();
    report["chat_output"] = nullptr;
    if (std::filesystem::exists(std::filesystem::path(arguments->model_dir) / "tokenizer.json")) {
      const ChatOutputSyntax syntax = TokenizerCodec(arguments->model_dir, std::nullopt).chat_output_syntax();
      report["chat_output"] = {{"tool_calls", tool_call_syntax_name(syntax.tool_calls)}, {"reasoning", syntax.reasoning}};
    }
    std::fputs((report.dump(2) + "\n").c_str(), stdout);
  });
});

}  // namespace
}  // namespace kiln::cli
