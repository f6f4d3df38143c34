#include "io/pooling_config.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hub_cache.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// sentence-transformers' module classes, as modules.json names them.
constexpr std::string_view kTransformer = "sentence_transformers.models.Transformer";
constexpr std::string_view kPooling = "sentence_transformers.models.Pooling";
constexpr std::string_view kNormalize = "sentence_transformers.models.Normalize";

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open ({})", path.string(), std::strerror(errno));
  try {
    return json::parse(in);
  } catch (const json::exception& error) {
    fail("{}: not valid JSON ({})", path.string(), error.what());
  }
}

struct Module {
  std::string type;
  std::string path;  // relative to the model folder ("" for the folder itself)
};

std::vector<Module> read_modules(const fs::path& modules_json) {
  const json modules = read_json(modules_json);
  if (!modules.is_array()) fail("{}: expected a list of modules", modules_json.string());
  std::vector<Module> read;
  for (size_t index = 0; index < modules.size(); ++index) {
    const json& entry = modules[index];
    const auto text = [&](const char* field) {
      if (!entry.is_object() || !entry.contains(field) || !entry[field].is_string())
        fail("{}: module {} has no \"{}\" string", modules_json.string(), index, field);
      return entry[field].get<std::string>();
    };
    Module module{text("type"), text("path")};
    if (!module.path.empty() && !is_safe_repo_path(module.path))
      fail("{}: module {} has path \"{}\", not a folder inside the model's", modules_json.string(), index, module.path);
    read.push_back(std::move(module));
  }
  return read;
}

// The pooling mode a Pooling module's config.json sets: exactly one of the modes kiln computes.
PoolingMode read_pooling_mode(const fs::path& config_path, int64_t hidden_size) {
  const json config = read_json(config_path);
  if (!config.is_object()) fail("{}: expected an object", config_path.string());
  // sentence-transformers' Pooling flags; it concatenates the poolings of every flag set.
  const std::vector<std::pair<std::string, PoolingMode>> supported = {{"pooling_mode_lasttoken", PoolingMode::LastToken},
                                                                      {"pooling_mode_mean_tokens", PoolingMode::Mean},
                                                                      {"pooling_mode_cls_token", PoolingMode::Cls}};
  std::vector<std::string> set;
  PoolingMode mode = PoolingMode::LastToken;
  for (const auto& item : config.items()) {
    // Named, not a structured binding: clang 14 (the fuzz build) refuses a binding in a lambda.
    const std::string& key = item.key();
    const json& value = item.value();
    if (!key.starts_with("pooling_mode_")) continue;
    if (!value.is_boolean()) fail("{}: {} is {}, not true or false", config_path.string(), key, value.dump());
    if (!value.get<bool>()) continue;
    const auto known = std::find_if(supported.begin(), supported.end(), [&](const auto& entry) { return entry.first == key; });
    if (known == supported.end())
      fail("{}: {} is true, a pooling kiln does not compute (it pools by pooling_mode_lasttoken, "
           "pooling_mode_mean_tokens or pooling_mode_cls_token)",
           config_path.string(), key);
    set.push_back(key);
    mode = known->second;
  }
  if (set.empty()) fail("{}: sets no pooling_mode_* flag to true", config_path.string());
  if (set.size() > 1)
    fail("{}: sets {} together; sentence-transformers would concatenate those poolings, kiln computes one",
         config_path.string(), fmt::join(set, " and "));
  if (config.contains("word_embedding_dimension")) {
    const json& dimension = config["word_embedding_dimension"];
    if (!dimension.is_number_integer() || dimension.get<int64_t>() != hidden_size)
      fail("{}: word_embedding_dimension is {}, but the model's hidden_size is {}", config_path.string(),
           dimension.dump(), hidden_size);
  }
  return mode;
}

}  // namespace

std::string_view pooling_mode_name(PoolingMode mode) {
  switch (mode) {
    case PoolingMode::LastToken: return "last-token";
    case PoolingMode::Mean: return "mean";
    case PoolingMode::Cls: return "cls";
  }
  return "unknown";
}

PoolingConfig read_pooling_config(const fs::path& model_dir, int64_t hidden_size) {
  const fs::path modules_json = model_dir / "modules.json";
  if (!fs::exists(modules_json))
    return {PoolingMode::LastToken, true, "the default without modules.json"};
  const std::vector<Module> modules = read_modules(modules_json);
  const auto refuse = [&](size_t index) {
    fail("{}: module {} is {}; kiln runs a {} at the model's folder, then a {}, then optionally a {}",
         modules_json.string(), index, modules[index].type, kTransformer, kPooling, kNormalize);
  };
  if (modules.size() < 2 || modules.size() > 3) {
    fail("{}: lists {} modules; kiln runs a {} at the model's folder, then a {}, then optionally a {}",
         modules_json.string(), modules.size(), kTransformer, kPooling, kNormalize);
  }
  if (modules[0].type != kTransformer || !modules[0].path.empty()) refuse(0);
  if (modules[1].type != kPooling) refuse(1);
  if (modules.size() == 3 && modules[2].type != kNormalize) refuse(2);
  const fs::path pooling_config = model_dir / modules[1].path / "config.json";
  PoolingConfig config;
  config.mode = read_pooling_mode(pooling_config, hidden_size);
  config.normalize = modules.size() == 3;
  config.source = fmt::format("{} and {}", modules_json.string(), pooling_config.string());
  return config;
}

std::vector<std::string> sentence_transformers_module_configs(const fs::path& modules_json) {
  std::vector<std::string> configs;
  for (const Module& module : read_modules(modules_json))
    if (!module.path.empty()) configs.push_back(module.path + "/config.json");
  return configs;
}

}  // namespace kiln
