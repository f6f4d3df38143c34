#include "io/fingerprint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/sha256.h"

namespace kiln {
namespace {

// --- config fingerprint -------------------------------------------------------------------------

// Deliberately not hashed: max_position_embeddings (a context limit the engine enforces; the
// llama3 RoPE scaling reads original_max_position_embeddings, which is hashed), torch_dtype (the
// stored dtype belongs to the artifact, which the artifact fingerprint covers), bos/eos token ids
// (generation, not the graph), architectures and the file path (names only).

// Bumped whenever the field lists or the serialisation change, so old fingerprints stop matching.
constexpr std::string_view kConfigFingerprintDomain = "kiln config fingerprint v1\n";

// --- artifact fingerprint -----------------------------------------------------------------------

struct FileStamp {
  std::string name;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  uint64_t device = 0;

  bool operator==(const FileStamp&) const = default;
};

nlohmann::json stamp_json(const FileStamp& stamp) {
  return {{"name", stamp.name}, {"size", stamp.size}, {"mtime_ns", stamp.mtime_ns},
          {"inode", stamp.inode}, {"device", stamp.device}};
}

FileStamp stamp_of(const std::filesystem::path& file) {
  struct stat info;
  if (::stat(file.c_str(), &info) != 0) fail("cannot stat weight file {}", file.string());
  FileStamp stamp;
  stamp.name = file.filename().string();
  stamp.size = static_cast<uint64_t>(info.st_size);
  stamp.mtime_ns = static_cast<int64_t>(info.st_mtim.tv_sec) * 1'000'000'000 + info.st_mtim.tv_nsec;
  stamp.inode = static_cast<uint64_t>(info.st_ino);
  stamp.device = static_cast<uint64_t>(info.st_dev);
  return stamp;
}

// The files whose bytes define the weights, sorted by name.
std::vector<std::filesystem::path> weight_files(const std::filesystem::path& model_dir) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  std::filesystem::directory_iterator entries(model_dir, error);
  if (error) fail("cannot list model folder {}: {}", model_dir.string(), error.message());
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string();
    const bool weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
    if (weights && entry.is_regular_file()) files.push_back(entry.path());
  }
  if (files.empty()) fail("model folder {} holds no *.safetensors weight files to hash", model_dir.string());
  std::sort(files.begin(), files.end());
  return files;
}

std::string file_sha256(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot read weight file {}", file.string());
  Sha256 hash;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    hash.update(buffer.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) fail("error reading weight file {}", file.string());
  return hash.finish_hex();
}

// The memo is only a cache of hashes already computed: an unreadable or malformed memo is
// ignored and rewritten, which changes how long fingerprinting takes, never its result.
nlohmann::json read_memo(const std::filesystem::path& memo_file) {
  std::ifstream in(memo_file);
  if (!in) return nlohmann::json::object();
  nlohmann::json memo = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!memo.is_object()) return nlohmann::json::object();
  return memo;
}

void write_memo(const std::filesystem::path& memo_file, const nlohmann::json& memo) {
  std::error_code error;
  std::filesystem::create_directories(memo_file.parent_path(), error);
  if (error) fail("cannot create the artifact hash memo folder {}: {}", memo_file.parent_path().string(), error.message());
  // Written beside the memo and renamed over it, so a concurrent reader sees the old or the new
  // memo, never a torn one.
  const auto temporary = memo_file.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << memo.dump(2) << '\n';
    if (!out) fail("cannot write the artifact hash memo {}", temporary);
  }
  std::filesystem::rename(temporary, memo_file, error);
  if (error) fail("cannot replace the artifact hash memo {}: {}", memo_file.string(), error.message());
}

}  // namespace

const std::vector<GraphShapingField>& common_graph_shaping_fields() {
  // Each field, and why it shapes the graph.
  static const std::vector<GraphShapingField> fields = {
      // Picks the family's graph and its conventions (e.g. qwen2's q/k/v bias).
      {"model_type", [](const ModelConfig& c) { return c.model_type; }},
      // Width of the residual stream: every projection's input or output.
      {"hidden_size", [](const ModelConfig& c) { return c.hidden_size; }},
      // Width of the gated MLP.
      {"intermediate_size", [](const ModelConfig& c) { return c.intermediate_size; }},
      // Depth of the stack.
      {"num_hidden_layers", [](const ModelConfig& c) { return c.num_hidden_layers; }},
      // Query heads, key/value heads (GQA grouping) and head width shape attention and the KV cache.
      {"num_attention_heads", [](const ModelConfig& c) { return c.num_attention_heads; }},
      {"num_key_value_heads", [](const ModelConfig& c) { return c.num_key_value_heads; }},
      {"head_dim", [](const ModelConfig& c) { return c.head_dim; }},
      // Rows of the embedding table and of the output head.
      {"vocab_size", [](const ModelConfig& c) { return c.vocab_size; }},
      // Enters every RMSNorm.
      {"rms_norm_eps", [](const ModelConfig& c) { return c.rms_norm_eps; }},
      // The MLP's activation.
      {"hidden_act", [](const ModelConfig& c) { return c.hidden_act; }},
      // The rotary frequencies: type, base, rotating fraction and llama3 scaling.
      {"rope.type", [](const ModelConfig& c) { return c.rope.type; }},
      {"rope.theta", [](const ModelConfig& c) { return c.rope.theta; }},
      {"rope.partial_rotary_factor", [](const ModelConfig& c) { return c.rope.partial_rotary_factor; }},
      {"rope.factor", [](const ModelConfig& c) { return c.rope.factor; }},
      {"rope.low_freq_factor", [](const ModelConfig& c) { return c.rope.low_freq_factor; }},
      {"rope.high_freq_factor", [](const ModelConfig& c) { return c.rope.high_freq_factor; }},
      {"rope.original_max_position_embeddings",
       [](const ModelConfig& c) { return c.rope.original_max_position_embeddings; }},
      // Whether the output head is the embedding table.
      {"tie_word_embeddings", [](const ModelConfig& c) { return c.tie_word_embeddings; }},
      // Bias terms of the attention and MLP projections.
      {"attention_bias", [](const ModelConfig& c) { return c.attention_bias; }},
      {"mlp_bias", [](const ModelConfig& c) { return c.mlp_bias; }},
      // Qwen3's RMSNorm of q and k before RoPE.
      {"qk_norm", [](const ModelConfig& c) { return c.qk_norm; }},
  };
  return fields;
}

nlohmann::json graph_shaping_fields(const ModelConfig& config, const std::vector<GraphShapingField>& family_fields) {
  nlohmann::json fields = nlohmann::json::object();
  for (const auto& field : common_graph_shaping_fields()) fields[std::string(field.name)] = field.value(config);
  // A family field that does not apply to this config is null and left out (model/moe.cpp).
  for (const auto& field : family_fields)
    if (nlohmann::json value = field.value(config); !value.is_null()) fields[std::string(field.name)] = std::move(value);
  return fields;
}

std::string config_fingerprint(const ModelConfig& config, const std::vector<GraphShapingField>& family_fields) {
  // nlohmann::json orders object keys and prints numbers in their shortest round-trip form, so
  // the dump is canonical.
  Sha256 hash;
  hash.update(kConfigFingerprintDomain);
  hash.update(graph_shaping_fields(config, family_fields).dump());
  return "sha256:" + hash.finish_hex();
}

std::optional<std::string> hf_snapshot_fingerprint(const std::filesystem::path& model_dir) {
  std::filesystem::path path = std::filesystem::absolute(model_dir).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  const std::string commit = path.filename().string();
  const std::filesystem::path snapshots = path.parent_path();
  const std::string repo_folder = snapshots.parent_path().filename().string();
  static const std::regex commit_pattern("[0-9a-f]{40}");
  // huggingface_hub names a repo's cache folder models--{id with '/' → '--'}; repo ids never hold
  // "--" themselves, so the folder name splits unambiguously into an optional owner and a name.
  static const std::regex repo_pattern("models--(?:((?:[A-Za-z0-9_.]|-(?!-))+)--)?((?:[A-Za-z0-9_.]|-(?!-))+)");
  std::smatch repo;
  if (snapshots.filename() != "snapshots" || !std::regex_match(commit, commit_pattern) ||
      !std::regex_match(repo_folder, repo, repo_pattern))
    return std::nullopt;
  const std::string owner = repo[1].matched ? repo[1].str() + "/" : "";
  return "hf:" + owner + repo[2].str() + "@" + commit;
}

std::filesystem::path default_artifact_hash_memo() {
  if (const char* memo = std::getenv("KILN_ARTIFACT_HASH_MEMO"); memo && *memo) return memo;
  if (const char* cache = std::getenv("XDG_CACHE_HOME"); cache && *cache)
    return std::filesystem::path(cache) / "kiln" / "artifact-hashes.json";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::filesystem::path(home) / ".cache" / "kiln" / "artifact-hashes.json";
  fail("cannot place the artifact hash memo: none of KILN_ARTIFACT_HASH_MEMO, XDG_CACHE_HOME, HOME is set");
}

std::string content_fingerprint(const std::filesystem::path& model_dir, const std::filesystem::path& memo_file) {
  std::error_code error;
  const std::filesystem::path folder = std::filesystem::canonical(model_dir, error);
  if (error) fail("cannot resolve model folder {}: {}", model_dir.string(), error.message());
  const auto files = weight_files(folder);
  nlohmann::json stamps = nlohmann::json::array();
  for (const auto& file : files) stamps.push_back(stamp_json(stamp_of(file)));

  nlohmann::json memo = read_memo(memo_file);
  const nlohmann::json& recorded = memo.contains(folder.string()) ? memo[folder.string()] : nlohmann::json();
  if (recorded.is_object() && recorded.value("files", nlohmann::json()) == stamps &&
      recorded.contains("fingerprint") && recorded["fingerprint"].is_string())
    return recorded["fingerprint"].get<std::string>();

  Sha256 hash;
  hash.update("kiln artifact fingerprint v1\n");
  for (const auto& file : files)
    hash.update(fmt::format("{}\n{}\n{}\n", file.filename().string(), std::filesystem::file_size(file),
                            file_sha256(file)));
  const std::string fingerprint = "sha256:" + hash.finish_hex();
  // Stamps taken after hashing would hide a file rewritten while it was read; the ones taken
  // before are recorded, so such a file is hashed again next time.
  memo[folder.string()] = {{"files", stamps}, {"fingerprint", fingerprint}};
  write_memo(memo_file, memo);
  return fingerprint;
}

std::optional<std::string> artifact_fingerprint(const std::filesystem::path& model_dir, bool hash_artifact) {
  if (auto snapshot = hf_snapshot_fingerprint(model_dir)) return snapshot;
  if (hash_artifact) return content_fingerprint(model_dir, default_artifact_hash_memo());
  return std::nullopt;
}

}  // namespace kiln
