// kiln synth: writes a random-weight checkpoint with a published model's exact config.
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/command.h"
#include "model/synth.h"

namespace kiln::cli {
namespace {

struct SynthArguments {
  SynthOptions options;
  std::string dtype = "bf16";
  int64_t layers = 0;
};

const RegisterCommand kSynthCommand([](CLI::App& app) {
  auto* command = app.add_subcommand(
      "synth", "Write a checkpoint with a real model's config.json and deterministic random weights");
  auto arguments = std::make_shared<SynthArguments>();
  std::vector<std::string> shape_names;
  for (const SynthShape& shape : synth_shapes()) shape_names.push_back(shape.name);
  command->add_option("--shape", arguments->options.shape, "Model shape")->required()->check(CLI::IsMember(shape_names));
  command->add_option("--dtype", arguments->dtype, "Weight dtype")->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  command->add_option("--out", arguments->options.out, "Directory to create (must be new or empty)")->required();
  command->add_option("--seed", arguments->options.seed, "Random seed")->capture_default_str();
  auto* layers = command->add_option("--layers", arguments->layers, "Override num_hidden_layers")
                     ->check(CLI::PositiveNumber);
  command->callback([arguments, layers] {
    SynthOptions options = arguments->options;
    options.dtype = arguments->dtype == "f32" ? DType::F32 : DType::BF16;
    if (layers->count() > 0) options.layers = arguments->layers;
    const SynthResult result = write_synthetic_checkpoint(options);
    fmt::print("kiln synth: {} (num_hidden_layers {}, {}): {} tensors, {:.2f} GiB in {} files under {}\n", options.shape,
               result.config.num_hidden_layers, dtype_name(options.dtype), result.tensor_count,
               static_cast<double>(result.tensor_bytes) / (1ull << 30), result.files.size(), options.out.string());
  });
});

}  // namespace
}  // namespace kiln::cli
