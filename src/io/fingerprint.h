// Fingerprints that bind a model profile to one exact artifact.
//
// A config fingerprint identifies the graph a config.json describes: a SHA-256 over a canonical
// serialisation of the fields that shape the family's graph: the fields every family shares
// (common_graph_shaping_fields, documented in fingerprint.cpp) and those its family spec adds
// (model/family.h, whose config_fingerprint(config) picks the family of a config). Two configs with
// the same fingerprint build the same graph.
//
// An artifact fingerprint identifies the weights:
//   - `hf:org/name@<commit>` when the folder is a Hugging Face cache snapshot
//     (`…/models--org--name/snapshots/<40 hex>/`): the commit names the bytes;
//   - `sha256:<64 hex>`, on request, a content hash of the weight files of any other folder,
//     memoised per folder and recomputed when any weight file's size, mtime or inode changes;
//   - none for a plain folder otherwise: such an artifact is never "exact".
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/config.h"

namespace kiln {

// A field that shapes a graph: its name in the hashed object and its value in a config. A family
// field whose value is null for a config (one that does not apply to it) is left out of the object.
struct GraphShapingField {
  std::string_view name;
  std::function<nlohmann::json(const ModelConfig&)> value;
};

// The fields every supported family's graph is shaped by.
const std::vector<GraphShapingField>& common_graph_shaping_fields();

// The object the fingerprint hashes: the common fields of `config` and its family's `family_fields`.
nlohmann::json graph_shaping_fields(const ModelConfig& config, const std::vector<GraphShapingField>& family_fields);
// "sha256:<64 hex>" over graph_shaping_fields(config, family_fields).
std::string config_fingerprint(const ModelConfig& config, const std::vector<GraphShapingField>& family_fields);

// "hf:org/name@<commit>" when `model_dir` is a Hugging Face cache snapshot folder, else nothing.
std::optional<std::string> hf_snapshot_fingerprint(const std::filesystem::path& model_dir);

// The memo of content hashes: $KILN_ARTIFACT_HASH_MEMO, else
// $XDG_CACHE_HOME/kiln/artifact-hashes.json, else ~/.cache/kiln/artifact-hashes.json.
std::filesystem::path default_artifact_hash_memo();

// "sha256:<64 hex>" over the weight files of `model_dir` (every *.safetensors file and
// model.safetensors.index.json, by name), taken from `memo_file` when every file's size, mtime and
// inode still match what was recorded, else hashed and recorded there.
std::string content_fingerprint(const std::filesystem::path& model_dir, const std::filesystem::path& memo_file);

// The artifact fingerprint of `model_dir`: the Hugging Face snapshot identity when it is one, else
// the content hash when `hash_artifact` is set, else nothing.
std::optional<std::string> artifact_fingerprint(const std::filesystem::path& model_dir, bool hash_artifact);

}  // namespace kiln
