// kiln quantize --model DIR --out DIR [--bits 4|8] [--group-size 64] [--mixed FILE] [--format mlx|fp8]:
// writes a quantized copy of a checkpoint (model/quantize.h): MLX affine by default, or FP8 blocks.
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "model/quantize.h"

namespace kiln::cli {
namespace {

struct QuantizeArguments {
  std::string model;  // --model as given (resolve_model)
  QuantizeOptions options;
  std::string format = "mlx";
  std::string mixed;
};

const RegisterCommand kQuantizeCommand([](CLI::App& app) {
  auto* command = app.add_subcommand("quantize", "Write a quantized copy of a checkpoint (MLX affine or FP8 blocks)");
  auto arguments = std::make_shared<QuantizeArguments>();
  add_model_option(*command, arguments->model, "Model folder (config.json + safetensors)")->required();
  command->add_option("--out", arguments->options.out, "Directory to create (must be new or empty)")->required();
  command->add_option("--format", arguments->format, "mlx (affine, round to nearest) or fp8 (e4m3, 128x128 blocks)")
      ->check(CLI::IsMember({"mlx", "fp8"}))
      ->capture_default_str();
  command->add_option("--bits", arguments->options.scheme.bits, "MLX: bits per weight")
      ->check(CLI::IsMember({2, 3, 4, 5, 6, 8}))
      ->capture_default_str();
  command->add_option("--group-size", arguments->options.scheme.group_size, "MLX: inputs per scale and bias")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  command->add_option("--mixed", arguments->mixed, "MLX: JSON file of module path -> bits, or false to keep it");
  command->callback([arguments] {
    QuantizeOptions options = arguments->options;
    options.model = resolve_model(arguments->model);
    if (arguments->format == "fp8") {
      options.format = QuantizeFormat::Fp8;
      if (!arguments->mixed.empty()) fail("quantize: --mixed applies to --format mlx, not fp8");
    }
    if (!arguments->mixed.empty())
      options.module_schemes = read_module_schemes(arguments->mixed, options.scheme.group_size);
    const QuantizeResult result = quantize_checkpoint(options);
    fmt::print("kiln quantize: {} ({}): {} matrices quantized, {} tensors kept, {:.3f} GiB in {} files under {}\n",
               options.model.string(),
               options.format == QuantizeFormat::Fp8
                   ? std::string("fp8 e4m3, 128x128 blocks")
                   : fmt::format("mlx affine {}-bit, group {}", options.scheme.bits, options.scheme.group_size),
               result.quantized, result.kept, static_cast<double>(result.tensor_bytes) / (1ull << 30),
               result.files.size(), options.out.string());
  });
});

}  // namespace
}  // namespace kiln::cli
