// The Hugging Face hub's cache on disk, laid out and read as huggingface_hub does, so a model kiln
// pulls is found by transformers and one transformers downloaded is found by kiln. No network here
// (io/hub_download.h fetches what is missing).
//
//   {cache}/models--ORG--NAME/blobs/{etag}             each file's bytes, named by the hub's ETag
//                            /snapshots/{commit}/{file} relative symlinks to ../../blobs/{etag}
//                            /refs/{revision}           the commit a branch or tag named when fetched
//   {cache}/.locks/models--ORG--NAME/{etag}.lock       held while that blob is written
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// A model named on the hub: ORG/NAME, or ORG/NAME@REVISION (a branch, a tag or a commit).
struct HubModelId {
  std::string repo;  // ORG/NAME
  std::string revision = "main";

  // As the user would write it: the repo, with @revision unless it is main.
  std::string to_string() const;
};

// `text` as a hub id, or nothing when it does not read as one. The repo follows huggingface_hub's
// rules (validate_repo_id): ORG and NAME of letters, digits, '-', '_' and '.', neither starting nor
// ending with '-' or '.', no "--" or "..", NAME at most 96 characters.
std::optional<HubModelId> parse_hub_model_id(std::string_view text);

// Whether `revision` is a full commit hash (40 lower-case hex digits).
bool is_commit_hash(std::string_view revision);

// Where and how the hub is reached, from the environment variables huggingface_hub reads.
struct HubSettings {
  // HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
  // ~/.cache/huggingface/hub.
  std::filesystem::path cache;
  // HF_ENDPOINT (without a trailing '/'), else https://huggingface.co.
  std::string endpoint;
  // HF_TOKEN, else the first line of the file HF_TOKEN_PATH or $HF_HOME/token (where
  // `huggingface-cli login` writes it); sent as a Bearer token to the endpoint only.
  std::optional<std::string> token;
  // HF_HUB_OFFLINE is 1, ON, YES or TRUE: only the cache is read.
  bool offline = false;

  static HubSettings from_environment();
};

// One repo's folder in the cache.
class HubRepoCache {
 public:
  HubRepoCache(const std::filesystem::path& cache, std::string_view repo);

  const std::filesystem::path& folder() const { return folder_; }
  std::filesystem::path blob(std::string_view etag) const;
  // Where a blob's bytes are written until they are whole (huggingface_hub resumes from it too).
  std::filesystem::path incomplete_blob(std::string_view etag) const;
  std::filesystem::path lock_file(std::string_view etag) const;
  std::filesystem::path snapshot(std::string_view commit) const;

  // The commit `revision` names: itself when it is a commit hash, else what refs/{revision} holds;
  // nothing when that revision was never fetched.
  std::optional<std::string> commit_of(std::string_view revision) const;
  void write_ref(std::string_view revision, std::string_view commit) const;
  // snapshots/{commit}/{file} made a relative symlink to the blob (replacing what was there).
  void link(std::string_view commit, std::string_view file, std::string_view etag) const;

 private:
  std::filesystem::path cache_;
  std::string folder_name_;
  std::filesystem::path folder_;
};

// Whether `name` (a repo-relative path from the hub or an index) may be written under a snapshot:
// relative, without "." or ".." parts or backslashes.
bool is_safe_repo_path(std::string_view name);

// The files of a repo kiln runs a model from besides the weights, fetched when the repo has them:
// config.json, generation_config.json, the tokenizer's files, modules.json (with it, the config.json
// of each sentence-transformers module it lists) and model.safetensors.index.json.
const std::vector<std::string>& hub_metadata_files();

// The weight files model.safetensors.index.json at `index` names (its weight_map's values, each
// once, in order); an error names the index and the bad entry.
std::vector<std::string> safetensors_index_shards(const std::filesystem::path& index);

// What a snapshot folder lacks for kiln to run the model (config.json, and the index's shards or
// model.safetensors), as paths relative to it; empty when the model can run from it.
std::vector<std::string> missing_model_files(const std::filesystem::path& snapshot);

// The snapshot of `id` in the cache when it holds the whole model, else nothing.
std::optional<std::filesystem::path> find_cached_model(const HubSettings& settings, const HubModelId& id);

// find_cached_model, or an error saying what the cache lacks and that HF_HUB_OFFLINE kept kiln
// from fetching it.
std::filesystem::path require_cached_model(const HubSettings& settings, const HubModelId& id);

}  // namespace kiln
