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
  std::string quantize;  // "", "4", "8" or "fp8"
  int group_size = 64;
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
  command->add_option("--quantize", arguments->quantize,
                      "Write the weights quantized: MLX affine 4 or 8 bits, or fp8 (e4m3, 128x128 blocks)")
      ->check(CLI::IsMember({"4", "8", "fp8"}));
  command->add_option("--group-size", arguments->group_size, "MLX affine: inputs per scale and bias")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  command->add_flag("--mtp", arguments->options.mtp,
                    "Also write the multi-token-prediction head (mtp.*: Qwen3.5 shapes), for --speculative mtp");
  command->callback([arguments, layers] {
    SynthOptions options = arguments->options;
    options.dtype = arguments->dtype == "f32" ? DType::F32 : DType::BF16;
    if (layers->count() > 0) options.layers = arguments->layers;
    if (arguments->quantize == "fp8") options.quantize = SynthQuantization{QuantizeFormat::Fp8, {}};
    else if (!arguments->quantize.empty())
      options.quantize = SynthQuantization{QuantizeFormat::MlxAffine, {std::stoi(arguments->quantize), arguments->group_size}};
    const SynthResult result = write_synthetic_checkpoint(options);
    fmt::print("kiln synth: {} (num_hidden_layers {}, {}{}{}): {} tensors, {:.2f} GiB in {} files under {}\n",
               options.shape, result.config.num_hidden_layers, dtype_name(options.dtype),
               options.quantize ? ", quantized " + arguments->quantize : std::string(),
               options.mtp ? ", with the MTP head" : "", result.tensor_count,
               static_cast<double>(result.tensor_bytes) / (1ull << 30), result.files.size(), options.out.string());
  });
});

}  // namespace
}  // namespace kiln::cli
