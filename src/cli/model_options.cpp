#include "cli/model_options.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <climits>
#include <filesystem>
#include <sstream>
#include <thread>

#include "cli/hub_progress.h"
#include "cli/load_progress.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/hub_cache.h"
#include "io/hub_download.h"
#include "model/family.h"
#include "model/loader.h"
#include "model/tensor_parallel.h"
#include "tokenizer/tokenizer.h"
#ifdef KILN_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace kiln::cli {

CLI::Option* add_model_option(CLI::App& command, std::string& model, const std::string& description) {
  return command.add_option("--model", model, description + ", or a Hugging Face hub id ORG/NAME[@REVISION]");
}

std::string resolve_model(const std::string& model) {
  if (std::filesystem::is_directory(model)) return model;
  const std::optional<HubModelId> id = parse_hub_model_id(model);
  if (!id) return model;
  try {
    const HubSettings settings = HubSettings::from_environment();
    if (settings.offline) return require_cached_model(settings, *id).string();
    if (std::optional<std::filesystem::path> cached = find_cached_model(settings, *id)) return cached->string();
    fmt::print(stderr, "kiln: {} is not a folder; fetching the model from {} into {}\n", model, settings.endpoint,
               settings.cache.string());
    return pull_model(*id, settings, stderr_pull_listener()).snapshot.string();
  } catch (const Error& error) {
    // Says what was tried: the folder first, then the hub.
    fail("--model {}: no such folder, and as a Hugging Face hub id: {}", model, error.what());
  }
}

void ModelOptions::add_to(CLI::App& command, bool with_dtype) {
  add_model_option(command, model, "Model folder (config.json + *.safetensors)")->required();
  command.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  if (with_dtype)
    command.add_option("--dtype", dtype, "Weight dtype: auto (as stored), f32 or bf16")
        ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  command.add_option("--threads", threads, "CPU threads (0: all)")->check(CLI::NonNegativeNumber);
  command.add_option("--tensor-parallel", tensor_parallel,
                     "Split the model over N ranks (on the CPU: N simulated ranks sharing --threads)")
      ->check(CLI::PositiveNumber);
  command.add_flag("--hash-artifact", hash_artifact, "Fingerprint a plain folder by hashing its weight files");
}

void ModelOptions::resolve() { model_dir = resolve_model(model); }

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
#ifdef KILN_HAVE_CUDA
  if (device == "cuda") return make_cuda_backend();
#endif
  fail("device '{}' is not available: this kiln was built without its backend", device);
}


namespace {

PreparedModel prepare_model(const ModelOptions& options) {
  if (options.tensor_parallel < 1) fail("--tensor-parallel must be at least 1, got {}", options.tensor_parallel);
  if (options.tensor_parallel > 1 && options.device != "cpu")
    fail("--tensor-parallel {} on {}: NCCL tensor parallelism is not built yet (only --device cpu splits a model)",
         options.tensor_parallel, options.device);
  if (options.threads > 0) ThreadPool::set_global_threads(options.threads);
  LoadOptions load;
  if (options.dtype == "f32") load.dtype = DType::F32;
  if (options.dtype == "bf16") load.dtype = DType::BF16;
  load.hash_artifact = options.hash_artifact;
  load.mtp = options.mtp;
  const Device device = options.device == "cuda" ? Device::CUDA : Device::CPU;
#ifdef KILN_HAVE_CUDA
  if (device == Device::CUDA) {
    // The CUDA backend's activations follow the weights (f32 CUDA-core path for f32/f16
    // checkpoints, bf16 tensor cores for bf16 ones and bf16-scaled quantized ones), so the plan is
    // made before the backend.
    ModelPlan plan = plan_model(options.model_dir, Device::CUDA, /*backend_present=*/true, load);
    const DType weights = load.dtype ? *load.dtype : planned_float_dtype(plan);
    auto backend = make_cuda_backend(0, cuda_activation_dtype_for(weights));
    return {options, std::move(plan), load.dtype, std::move(backend), {}};
  }
#endif
  auto backend = make_backend(options.device);  // names a device this binary was built without
  ModelPlan plan = plan_model(options.model_dir, device, /*backend_present=*/true, load);
  // Under --tensor-parallel on the CPU, each rank has its own backend.
  std::vector<std::unique_ptr<Backend>> rank_backends;
  for (int rank = 1; rank < options.tensor_parallel; ++rank) rank_backends.push_back(make_cpu_backend());
  return {options, std::move(plan), load.dtype, std::move(backend), std::move(rank_backends)};
}

}  // namespace

OpenedModel build_prepared_model(PreparedModel prepared) {
  OpenedModel opened;
  const ModelOptions& options = prepared.options;
  if (options.tensor_parallel > 1) {
    // Each rank gets an equal share of the threads.
    std::vector<Backend*> ranks{prepared.backend.get()};
    for (auto& backend : prepared.rank_backends) ranks.push_back(backend.get());
    const int threads = options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());
    opened.model = build_tensor_parallel_model(prepared.plan, ranks, prepared.load_dtype,
                                               std::max(1, threads / options.tensor_parallel));
  } else if (planned_weight_bytes(prepared.plan, prepared.load_dtype) >= kLoadProgressMinBytes) {
    LoadProgressPrinter printer(stderr, ::isatty(STDERR_FILENO) == 1);
    const auto start = std::chrono::steady_clock::now();
    const auto seconds = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    opened.model = build_model(prepared.plan, *prepared.backend, prepared.load_dtype,
                               [&](const LoadProgress& progress) { printer.update(progress, seconds()); });
    printer.finish(seconds());
  } else {
    opened.model = build_model(prepared.plan, *prepared.backend, prepared.load_dtype);
  }
  opened.backend = std::move(prepared.backend);
  opened.rank_backends = std::move(prepared.rank_backends);
  return opened;
}

PreparedModel prepare_model(const ModelOptions& options, const ServingSizes& sizes) {
  // Only config.json is read before the sizes are checked: a size the model cannot be run at is
  // named first, even when the checkpoint itself is missing or broken.
  check_serving_sizes(sizes, load_model_config(options.model_dir));
  return prepare_model(options);
}

OpenedModel open_model(const ModelOptions& options, const ServingSizes& sizes) {
  return build_prepared_model(prepare_model(options, sizes));
}

void add_serving_size_options(CLI::App& command, ServingSizes& sizes) {
  command.add_option("--max-batch", sizes.max_batch, "Sequences decoded together (KV-cache slots)");
  command.add_option("--max-context", sizes.max_context, "Tokens per sequence (default: the model's context)");
  command.add_option("--kv-cache-tokens", sizes.kv_cache_tokens,
                     "Positions of the paged KV cache the sequences share, a multiple of 64 (default: max batch x "
                     "context): smaller lets more sequences run than whole contexts fit");
  command.add_option("--memory-share", sizes.memory_share,
                     "Share of the device's memory to take (above 0, at most 1): the KV cache gets what the weights, "
                     "steps and graphs leave of it, ended requests' prefixes staying cached in the rest");
  command.add_option("--prefix-snapshots", sizes.prefix_snapshots,
                     "Snapshots of a hybrid model's recurrent state (Qwen3.5, Qwen3-Next) its prefix cache keeps, "
                     "each the size of one sequence's state (default: 2 per sequence; 0: such a model reuses no "
                     "prefix)");
  add_prefill_chunk_option(command, sizes);
}

void apply_memory_share(const ServingSizes& sizes, PreparedModel& prepared, MemoryRequest& request) {
  if (sizes.memory_share > 0.0)
    request.kv_blocks =
        kv_blocks_for_memory_share(prepared.plan, *prepared.backend, prepared.load_dtype, request, sizes.memory_share);
}

void add_prefill_chunk_option(CLI::App& command, ServingSizes& sizes) {
  command.add_option("--prefill-chunk", sizes.prefill_chunk,
                     "Most prompt tokens a sequence prefills per step (a positive multiple of 64)");
}

std::optional<std::string> read_chat_template(const std::string& path) {
  if (path.empty()) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--chat-template {}: cannot open the file", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void add_generation_config_option(CLI::App& command, std::string& generation_config) {
  command
      .add_option("--generation-config", generation_config,
                  "Sampling defaults for what is not set: auto (the model's generation_config.json), none, or a "
                  "folder holding a generation_config.json")
      ->capture_default_str();
}

SamplingDefaults generation_defaults(const std::string& generation_config, const std::string& model_dir) {
  if (generation_config == "none") return {};
  const std::filesystem::path path =
      std::filesystem::path(generation_config == "auto" ? model_dir : generation_config) / "generation_config.json";
  if (!std::filesystem::exists(path)) {
    if (generation_config == "auto") return {};
    fail("--generation-config {}: no generation_config.json in that folder (or give auto or none)", generation_config);
  }
  const GenerationDefaults file = read_generation_config(path);
  SamplingDefaults defaults;
  SamplingParams& sampling = defaults.sampling;
  if (file.temperature) sampling.temperature = static_cast<float>(*file.temperature);
  if (file.top_p) sampling.top_p = static_cast<float>(*file.top_p);
  // transformers and vLLM read top_k ≤ 0 as off.
  if (file.top_k) sampling.top_k = static_cast<int32_t>(std::clamp<int64_t>(*file.top_k, 0, INT32_MAX));
  if (file.min_p) sampling.min_p = static_cast<float>(*file.min_p);
  if (file.repetition_penalty) sampling.repetition_penalty = static_cast<float>(*file.repetition_penalty);
  try {
    sampling.validate();
  } catch (const Error& error) {
    fail("{}: {}", path.string(), error.what());
  }
  if (file.max_new_tokens && *file.max_new_tokens < 1)
    fail("{}: max_new_tokens must be ≥ 1, got {}", path.string(), *file.max_new_tokens);
  defaults.max_new_tokens = file.max_new_tokens;
  return defaults;
}

std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    size_t consumed = 0;
    long long value = -1;
    try {
      value = std::stoll(item, &consumed);
    } catch (const std::exception&) {
      consumed = 0;
    }
    if (item.empty() || consumed != item.size() || value < 0 || value > INT32_MAX)
      fail("--ids: '{}' is not a token id (expected comma-separated non-negative integers)", item);
    ids.push_back(static_cast<int32_t>(value));
    start = end + 1;
  }
  if (ids.empty()) fail("--ids: no token ids given");
  return ids;
}

}  // namespace kiln::cli
