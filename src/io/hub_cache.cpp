#include "io/hub_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln {
namespace fs = std::filesystem;

namespace {

const char* environment(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

// huggingface_hub expands a leading ~ in its path variables (os.path.expanduser).
fs::path expand_home(const std::string& path) {
  if (path == "~" || path.starts_with("~/"))
    if (const char* home = environment("HOME")) return fs::path(home) / path.substr(std::min<size_t>(path.size(), 2));
  return path;
}

std::string trimmed(std::string text) {
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  text.erase(text.begin(), std::find_if(text.begin(), text.end(), not_space));
  text.erase(std::find_if(text.rbegin(), text.rend(), not_space).base(), text.end());
  return text;
}

std::optional<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// huggingface_hub's validate_repo_id for one part: \b[\w\-.]+\b, without "--" or "..".
bool is_repo_part(std::string_view part, size_t max_length) {
  const auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  if (part.empty() || part.size() > max_length || !word(part.front()) || !word(part.back())) return false;
  if (part.find("--") != std::string_view::npos || part.find("..") != std::string_view::npos) return false;
  return std::all_of(part.begin(), part.end(), [&](char c) { return word(c) || c == '-' || c == '.'; });
}

// A name beside `path` that no other process writes (two pulls of one model may run at once).
fs::path temporary_beside(const fs::path& path) { return path.string() + ".kiln-" + std::to_string(::getpid()); }

// Written beside `path` and renamed over it, so a reader sees the old or the new file, never half.
void write_atomically(const fs::path& path, std::string_view text) {
  fs::create_directories(path.parent_path());
  const fs::path temporary = temporary_beside(path);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    if (!out.flush()) fail("cannot write {}", temporary.string());
  }
  fs::rename(temporary, path);
}

}  // namespace

std::string HubModelId::to_string() const { return revision == "main" ? repo : repo + "@" + revision; }

std::optional<HubModelId> parse_hub_model_id(std::string_view text) {
  HubModelId id;
  if (const size_t at = text.find('@'); at != std::string_view::npos) {
    id.revision = std::string(text.substr(at + 1));
    text = text.substr(0, at);
    // The revision names a file under refs/ (refs/pr/1 is a revision too).
    if (!is_safe_repo_path(id.revision) ||
        std::any_of(id.revision.begin(), id.revision.end(), [](unsigned char c) { return std::isspace(c); }))
      return std::nullopt;
  }
  const size_t slash = text.find('/');
  if (slash == std::string_view::npos || !is_repo_part(text.substr(0, slash), 256) ||
      !is_repo_part(text.substr(slash + 1), 96) || text.ends_with(".git"))
    return std::nullopt;
  id.repo = std::string(text);
  return id;
}

bool is_commit_hash(std::string_view revision) {
  return revision.size() == 40 && std::all_of(revision.begin(), revision.end(),
                                              [](char c) { return std::isdigit(c) || (c >= 'a' && c <= 'f'); });
}

HubSettings HubSettings::from_environment() {
  HubSettings settings;
  fs::path home;
  if (const char* hf_home = environment("HF_HOME"))
    home = expand_home(hf_home);
  else if (const char* xdg = environment("XDG_CACHE_HOME"))
    home = fs::path(xdg) / "huggingface";
  else if (const char* user_home = environment("HOME"))
    home = fs::path(user_home) / ".cache" / "huggingface";
  if (const char* cache = environment("HF_HUB_CACHE"))
    settings.cache = expand_home(cache);
  else if (!home.empty())
    settings.cache = home / "hub";
  else
    fail("cannot place the Hugging Face cache: none of HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME or HOME is set");

  settings.endpoint = environment("HF_ENDPOINT") ? environment("HF_ENDPOINT") : "https://huggingface.co";
  while (settings.endpoint.ends_with('/')) settings.endpoint.pop_back();

  if (const char* token = environment("HF_TOKEN")) {
    settings.token = trimmed(token);
  } else {
    fs::path token_file;
    if (const char* path = environment("HF_TOKEN_PATH"))
      token_file = expand_home(path);
    else if (!home.empty())
      token_file = home / "token";
    if (std::optional<std::string> text = token_file.empty() ? std::nullopt : read_text(token_file))
      settings.token = trimmed(text->substr(0, text->find('\n')));
  }
  if (settings.token && settings.token->empty()) settings.token.reset();

  if (const char* offline = environment("HF_HUB_OFFLINE")) {
    std::string value = offline;
    std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::toupper(c); });
    settings.offline = value == "1" || value == "ON" || value == "YES" || value == "TRUE";
  }
  return settings;
}

HubRepoCache::HubRepoCache(const fs::path& cache, std::string_view repo) : cache_(cache) {
  folder_name_ = "models--";
  for (char c : repo) c == '/' ? folder_name_ += "--" : folder_name_ += c;
  folder_ = cache / folder_name_;
}

fs::path HubRepoCache::blob(std::string_view etag) const { return folder_ / "blobs" / etag; }

fs::path HubRepoCache::incomplete_blob(std::string_view etag) const {
  return folder_ / "blobs" / (std::string(etag) + ".incomplete");
}

fs::path HubRepoCache::lock_file(std::string_view etag) const {
  return cache_ / ".locks" / folder_name_ / (std::string(etag) + ".lock");
}

fs::path HubRepoCache::snapshot(std::string_view commit) const { return folder_ / "snapshots" / commit; }

std::optional<std::string> HubRepoCache::commit_of(std::string_view revision) const {
  if (is_commit_hash(revision)) return std::string(revision);
  std::optional<std::string> text = read_text(folder_ / "refs" / revision);
  if (!text) return std::nullopt;
  std::string commit = trimmed(*text);
  if (!is_commit_hash(commit)) return std::nullopt;
  return commit;
}

void HubRepoCache::write_ref(std::string_view revision, std::string_view commit) const {
  write_atomically(folder_ / "refs" / revision, commit);
}

void HubRepoCache::link(std::string_view commit, std::string_view file, std::string_view etag) const {
  const fs::path entry = snapshot(commit) / file;
  fs::create_directories(entry.parent_path());
  // Relative, as huggingface_hub makes it, so the cache folder can be moved or mounted elsewhere:
  // up from the file's folder to the repo folder, then into blobs/.
  std::string target;
  for (size_t depth = std::count(file.begin(), file.end(), '/') + 2; depth > 0; --depth) target += "../";
  target += "blobs/" + std::string(etag);
  const fs::path temporary = temporary_beside(entry);
  fs::remove(temporary);
  fs::create_symlink(target, temporary);
  fs::rename(temporary, entry);
}

bool is_safe_repo_path(std::string_view name) {
  if (name.empty() || name.front() == '/' || name.find('\\') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos)
    return false;
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('/', start), name.size());
    const std::string_view part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

const std::vector<std::string>& hub_metadata_files() {
  // What the loader and the tokenizer read (io/config.cpp, tokenizer/tokenizer.cpp), an embedding
  // model's sentence-transformers modules (io/pooling_config.h), and the index that names the
  // weight shards.
  static const std::vector<std::string> files = {
      "config.json",         "generation_config.json", "tokenizer.json",
      "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
      "chat_template.json",  "modules.json",           "model.safetensors.index.json"};
  return files;
}

std::vector<std::string> safetensors_index_shards(const fs::path& index) {
  const std::optional<std::string> text = read_text(index);
  if (!text) fail("{}: cannot read", index.string());
  const nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object())
    fail("{}: not a safetensors index (no weight_map object)", index.string());
  std::vector<std::string> shards;
  std::set<std::string> seen;
  for (const auto& [tensor, file] : json["weight_map"].items()) {
    if (!file.is_string() || !is_safe_repo_path(file.get<std::string>()))
      fail("{}: weight_map[\"{}\"] is not a file in the repo: {}", index.string(), tensor, file.dump());
    if (seen.insert(file.get<std::string>()).second) shards.push_back(file.get<std::string>());
  }
  if (shards.empty()) fail("{}: weight_map names no file", index.string());
  return shards;
}

std::vector<std::string> missing_model_files(const fs::path& snapshot) {
  std::vector<std::string> missing;
  if (!fs::exists(snapshot / "config.json")) missing.push_back("config.json");
  if (fs::exists(snapshot / "model.safetensors.index.json")) {
    for (const std::string& shard : safetensors_index_shards(snapshot / "model.safetensors.index.json"))
      if (!fs::exists(snapshot / shard)) missing.push_back(shard);
  } else if (!fs::exists(snapshot / "model.safetensors")) {
    missing.push_back("model.safetensors");
  }
  return missing;
}

std::optional<fs::path> find_cached_model(const HubSettings& settings, const HubModelId& id) {
  const HubRepoCache cache(settings.cache, id.repo);
  const std::optional<std::string> commit = cache.commit_of(id.revision);
  if (!commit || !fs::is_directory(cache.snapshot(*commit)) || !missing_model_files(cache.snapshot(*commit)).empty())
    return std::nullopt;
  return cache.snapshot(*commit);
}

fs::path require_cached_model(const HubSettings& settings, const HubModelId& id) {
  const HubRepoCache cache(settings.cache, id.repo);
  const std::optional<std::string> commit = cache.commit_of(id.revision);
  if (!commit)
    fail("{}: HF_HUB_OFFLINE is set and the cache has no {} (the model was never fetched into {}); unset "
         "HF_HUB_OFFLINE to fetch it",
         id.to_string(), (cache.folder() / "refs" / id.revision).string(), settings.cache.string());
  const fs::path snapshot = cache.snapshot(*commit);
  std::vector<std::string> missing = fs::is_directory(snapshot) ? missing_model_files(snapshot)
                                                                : std::vector<std::string>{"config.json"};
  if (!missing.empty())
    fail("{}: HF_HUB_OFFLINE is set and {} is not in the cache ({}); unset HF_HUB_OFFLINE to fetch it", id.to_string(),
         fmt::format("{}", fmt::join(missing, ", ")), snapshot.string());
  return snapshot;
}

}  // namespace kiln
