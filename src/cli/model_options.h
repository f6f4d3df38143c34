// Options every model-running command shares (--model, --device, --dtype, --threads,
// --tensor-parallel), and the
// one way the CLI opens a model: through the profile resolver and the implementation registry.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "backend/backend.h"
#include "model/loader.h"
#include "model/model.h"

namespace kiln::cli {

struct ModelOptions {
  std::string model_dir;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;  // 0: all hardware threads
  bool hash_artifact = false;
  int tensor_parallel = 1;  // ranks the model is split over (model/tensor_parallel.h)

  void add_to(CLI::App& command, bool with_dtype = true);
};

struct OpenedModel {
  std::unique_ptr<Backend> backend;  // rank 0's under --tensor-parallel
  std::vector<std::unique_ptr<Backend>> rank_backends;  // ranks 1..N−1 (declared before the model: they outlive it)
  std::unique_ptr<Model> model;
};

// The backend named by --device (an error names a device this binary was built without).
std::unique_ptr<Backend> make_backend(const std::string& device);

// The model resolved, validated and planned on its backend (and its ranks' backends), before any
// weight is read: what `kiln fit` and the server's memory check look at.
struct PreparedModel {
  ModelOptions options;
  ModelPlan plan;
  std::optional<DType> load_dtype;  // --dtype, or nothing: as stored
  std::unique_ptr<Backend> backend;
  std::vector<std::unique_ptr<Backend>> rank_backends;
};

PreparedModel prepare_model(const ModelOptions& options);
// Reads the weights and constructs the model.
OpenedModel build_prepared_model(PreparedModel prepared);
// prepare_model, then build_prepared_model.
OpenedModel open_model(const ModelOptions& options);

// The sizes a served model's memory follows (kiln serve, and kiln fit with serve's defaults).
struct ServingSizes {
  int32_t max_batch = 8;
  int64_t max_context = 0;  // 0: the model's context
  int64_t prefill_chunk = 256;

  void add_to(CLI::App& command);
  // Tokens per sequence: the model's context, or less when --max-context asks.
  int64_t context(const ModelConfig& config) const;
};

// "1,2,3" → {1, 2, 3}; an error names the bad element.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace kiln::cli
