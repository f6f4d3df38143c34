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
#include "engine/memory_plan.h"
#include "engine/sampler.h"
#include "engine/serving_sizes.h"
#include "model/loader.h"
#include "model/model.h"

namespace kiln::cli {

// --model for every command that reads a model: a folder, or a Hugging Face hub id
// ORG/NAME[@REVISION] (resolve_model).
CLI::Option* add_model_option(CLI::App& command, std::string& model, const std::string& description);

// The folder --model names: `model` itself when it is a folder, or when it is no hub id (the loader
// then names what is missing); a hub id's snapshot in the Hugging Face cache otherwise, fetched
// first when the cache lacks part of it (unless HF_HUB_OFFLINE is set, which makes that an error).
// A command calls it in its callback, before reading the model.
std::string resolve_model(const std::string& model);

struct ModelOptions {
  std::string model;      // --model as given
  std::string model_dir;  // the folder it names, set by resolve()
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;  // 0: all hardware threads
  bool hash_artifact = false;
  int tensor_parallel = 1;  // ranks the model is split over (model/tensor_parallel.h)
  bool mtp = false;         // keep the checkpoint's MTP head (--speculative mtp: LoadOptions::mtp)

  void add_to(CLI::App& command, bool with_dtype = true);
  // model_dir = resolve_model(model); the command's callback calls it first.
  void resolve();
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

// Reads the weights and constructs the model.
OpenedModel build_prepared_model(PreparedModel prepared);

// --max-batch, --max-context and --prefill-chunk (kiln serve, and kiln fit with serve's defaults).
void add_serving_size_options(CLI::App& command, ServingSizes& sizes);
// --prefill-chunk alone (kiln generate and kiln logits run one sequence at the model's context).
// Under --memory-share, request.kv_blocks ← the pool that the share leaves (engine/memory_plan.h's
// kv_blocks_for_memory_share); otherwise the request keeps the pool the sizes gave it.
void apply_memory_share(const ServingSizes& sizes, PreparedModel& prepared, MemoryRequest& request);

void add_prefill_chunk_option(CLI::App& command, ServingSizes& sizes);

// The sizes checked against the model's config.json (check_serving_sizes), then the model
// prepared: a size the model cannot be run at is refused before any weight is read.
PreparedModel prepare_model(const ModelOptions& options, const ServingSizes& sizes);
// prepare_model with `sizes`, then build_prepared_model.
OpenedModel open_model(const ModelOptions& options, const ServingSizes& sizes);

// The text of --chat-template FILE, or nothing when no file is named (the model's own template).
std::optional<std::string> read_chat_template(const std::string& path);

// --generation-config auto|none|FOLDER (kiln serve, kiln generate): whose generation_config.json
// gives the defaults of what a request (or the command line) does not set: the model folder's
// (auto), none (kiln's own: temperature 1, no top-k, top-p or min-p), or FOLDER's.
void add_generation_config_option(CLI::App& command, std::string& generation_config);
struct SamplingDefaults {
  SamplingParams sampling;                // kiln's defaults with the file's temperature, top_p, top_k,
                                          // min_p and repetition_penalty over them (do_sample is not
                                          // read, as vLLM does not)
  std::optional<int64_t> max_new_tokens;  // the file's, when it has one
};
// The defaults `generation_config` (the option's value) names for the model in `model_dir`; a value
// out of range is an error naming the file.
SamplingDefaults generation_defaults(const std::string& generation_config, const std::string& model_dir);

// "1,2,3" → {1, 2, 3}; an error names the bad element.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace kiln::cli
