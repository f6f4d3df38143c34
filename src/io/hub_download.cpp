#include "io/hub_download.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/sha256.h"
#include "io/curl_library.h"
#include "io/pooling_config.h"

namespace kiln {
namespace fs = std::filesystem;

namespace {

// A transfer that fails part-way (a dropped connection, a stall) is resumed from what it wrote,
// this many times in all, as huggingface_hub retries its downloads.
constexpr int kTransferAttempts = 5;
// The file list is JSON of a few kilobytes (a few megabytes for repos of thousands of files).
constexpr size_t kMaxJsonBytes = 64u << 20;
// A relative redirect is the hub's for a renamed repo; more than a few is a loop.
constexpr int kMaxRedirects = 10;

using Headers = std::map<std::string, std::string>;  // lower-case names, of the last response

struct CurlDeleter {
  void operator()(CURL* curl) const { libcurl().easy_cleanup(curl); }
  void operator()(curl_slist* list) const { libcurl().slist_free_all(list); }
};
using CurlHandle = std::unique_ptr<CURL, CurlDeleter>;
using CurlHeaders = std::unique_ptr<curl_slist, CurlDeleter>;

size_t collect_header(char* data, size_t size, size_t count, void* user) {
  auto* headers = static_cast<Headers*>(user);
  std::string_view line(data, size * count);
  // Each response (a redirect's, then the final one's) starts with its status line.
  if (line.starts_with("HTTP/")) {
    headers->clear();
  } else if (const size_t colon = line.find(':'); colon != std::string_view::npos) {
    std::string name(line.substr(0, colon));
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && std::isspace(static_cast<unsigned char>(value.front()))) value.remove_prefix(1);
    while (!value.empty() && std::isspace(static_cast<unsigned char>(value.back()))) value.remove_suffix(1);
    (*headers)[name] = std::string(value);
  }
  return size * count;
}

std::string header(const Headers& headers, const std::string& name) {
  const auto found = headers.find(name);
  return found == headers.end() ? std::string() : found->second;
}

std::optional<uint64_t> header_number(const Headers& headers, const std::string& name) {
  const std::string value = header(headers, name);
  if (value.empty() || !std::all_of(value.begin(), value.end(), [](unsigned char c) { return std::isdigit(c); }))
    return std::nullopt;
  return std::stoull(value);
}

// Percent-encoding as Python's urllib.parse.quote (`keep_slashes`: its default safe="/").
std::string url_quote(std::string_view text, bool keep_slashes) {
  std::string quoted;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slashes && c == '/'))
      quoted += static_cast<char>(c);
    else
      quoted += fmt::format("%{:02X}", c);
  }
  return quoted;
}

// scheme://host[:port] of `url`, for a redirect's relative Location.
std::string url_origin(const std::string& url) {
  const size_t scheme_end = url.find("://");
  const size_t path_start = scheme_end == std::string::npos ? std::string::npos : url.find('/', scheme_end + 3);
  return path_start == std::string::npos ? url : url.substr(0, path_start);
}

// huggingface_hub's _normalize_etag: a weak validator's W/ and the quotes dropped.
std::string normalize_etag(std::string etag) {
  if (etag.starts_with("W/")) etag.erase(0, 2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') etag = etag.substr(1, etag.size() - 2);
  return etag;
}

bool is_sha256_hex(std::string_view text) {
  return text.size() == 64 &&
         std::all_of(text.begin(), text.end(), [](char c) { return std::isdigit(c) || (c >= 'a' && c <= 'f'); });
}

struct Response {
  CURLcode result = CURLE_OK;
  std::string curl_error;  // what libcurl said, when result is not CURLE_OK
  long status = 0;
  Headers headers;
  std::string body;  // of the API's answers and of error statuses (bounded)
};

// What the hub says of one file: where its bytes are and which blob they make.
struct FileMetadata {
  std::string name;
  std::string commit;
  std::string etag;
  std::optional<uint64_t> size;
  std::string url;
};

// A blob's lock file, held (flock, as Python's filelock takes it) while the blob is written, so two
// pulls of one model, kiln's or huggingface_hub's, never write the same .incomplete file.
class BlobLock {
 public:
  BlobLock(const fs::path& path, const std::string& file, const PullListener& listener) {
    fs::create_directories(path.parent_path());
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot open the lock file {}: {}", path.string(), std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
    if (listener.note) listener.note(fmt::format("{}: waiting for another download of it ({})", file, path.string()));
    if (::flock(fd_, LOCK_EX) != 0) fail("cannot lock {}: {}", path.string(), std::strerror(errno));
  }
  ~BlobLock() { ::close(fd_); }  // closing releases the lock
  BlobLock(const BlobLock&) = delete;
  BlobLock& operator=(const BlobLock&) = delete;

 private:
  int fd_ = -1;
};

// One download into a .incomplete file: appends a 206's bytes, starts over on a 200, keeps the
// sha256 of everything in the file when the blob's name is one.
struct BlobTransfer {
  CURL* curl = nullptr;
  int fd = -1;
  std::optional<Sha256> hash;
  uint64_t bytes = 0;     // in the file
  uint64_t received = 0;  // over the network, by every try
  DownloadProgress progress;
  const PullListener* listener = nullptr;
  bool status_checked = false;
  bool writing = false;  // false for an error status's body, which is kept in `error_body`
  std::string error_body;
  int write_errno = 0;
};

void restart_transfer(BlobTransfer& transfer) {
  if (::ftruncate(transfer.fd, 0) != 0) transfer.write_errno = errno;
  if (transfer.hash) transfer.hash.emplace();
  transfer.bytes = 0;
  transfer.progress.resumed_from = 0;
}

size_t write_blob(char* data, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<BlobTransfer*>(user);
  const size_t length = size * count;
  if (!transfer.status_checked) {
    transfer.status_checked = true;
    long status = 0;
    libcurl().easy_getinfo(transfer.curl, CURLINFO_RESPONSE_CODE, &status);
    transfer.writing = status == 200 || status == 206;
    // A 200 is the whole file: the server ignored the Range, so what the file held is replaced.
    if (status == 200 && transfer.bytes > 0) restart_transfer(transfer);
  }
  if (!transfer.writing) {
    if (transfer.error_body.size() < 4096) transfer.error_body.append(data, std::min<size_t>(length, 4096));
    return length;
  }
  for (size_t written = 0; written < length;) {
    const ssize_t result = ::write(transfer.fd, data + written, length - written);
    if (result < 0) {
      if (errno == EINTR) continue;
      transfer.write_errno = errno;
      return 0;  // aborts the transfer
    }
    written += static_cast<size_t>(result);
  }
  if (transfer.hash) transfer.hash->update(data, length);
  transfer.bytes += length;
  transfer.received += length;
  if (transfer.listener->progress) {
    transfer.progress.bytes = transfer.bytes;
    transfer.listener->progress(transfer.progress);
  }
  return length;
}

size_t append_bounded(char* data, size_t size, size_t count, void* user) {
  auto* body = static_cast<std::string*>(user);
  if (body->size() + size * count > kMaxJsonBytes) return 0;
  body->append(data, size * count);
  return size * count;
}

class HubClient {
 public:
  HubClient(const HubModelId& id, const HubSettings& settings, const PullListener& listener)
      : id_(id), settings_(settings), listener_(listener), cache_(settings.cache, id.repo) {
    libcurl();  // loaded (or its absence reported) before anything is asked of the hub
  }

  PulledModel pull() {
    const nlohmann::json info = repo_info();
    commit_ = info["sha"].get<std::string>();
    std::set<std::string> siblings;
    for (const auto& sibling : info["siblings"])
      if (sibling.is_object() && sibling.contains("rfilename") && sibling["rfilename"].is_string())
        siblings.insert(sibling["rfilename"].get<std::string>());
    if (!siblings.count("config.json"))
      fail("{}: the repo has no config.json, so it is not a transformers model (its files: {})", id_.to_string(),
           file_list(siblings));

    std::vector<FileMetadata> files;
    for (const std::string& name : hub_metadata_files())
      if (siblings.count(name)) files.push_back(metadata(name));
    if (siblings.count("modules.json")) {
      // An embedding model's sentence-transformers modules (kiln serve --embeddings reads their
      // pooling): modules.json names their folders, so it is fetched first.
      fetch({*std::find_if(files.begin(), files.end(), [](const FileMetadata& file) { return file.name == "modules.json"; })});
      for (const std::string& config : sentence_transformers_module_configs(cache_.snapshot(commit_) / "modules.json"))
        if (siblings.count(config)) files.push_back(metadata(config));
    }
    std::vector<std::string> weights;
    if (siblings.count("model.safetensors.index.json")) {
      // The index names the shards, so it is fetched first.
      fetch({*std::find_if(files.begin(), files.end(),
                           [](const FileMetadata& file) { return file.name == "model.safetensors.index.json"; })});
      weights = safetensors_index_shards(cache_.snapshot(commit_) / "model.safetensors.index.json");
      for (const std::string& shard : weights)
        if (!siblings.count(shard))
          fail("{}: model.safetensors.index.json names {}, which the repo does not have", id_.to_string(), shard);
    } else if (siblings.count("model.safetensors")) {
      weights = {"model.safetensors"};
    } else {
      fail("{}: the repo has neither model.safetensors nor model.safetensors.index.json; kiln runs safetensors "
           "checkpoints (its files: {})",
           id_.to_string(), file_list(siblings));
    }
    for (const std::string& shard : weights) files.push_back(metadata(shard));
    check_free_space(files);
    fetch(files);
    if (!is_commit_hash(id_.revision)) cache_.write_ref(id_.revision, commit_);
    pulled_.snapshot = cache_.snapshot(commit_);
    pulled_.commit = commit_;
    pulled_.files = static_cast<int>(files.size());
    return pulled_;
  }

 private:
  std::string file_list(const std::set<std::string>& names) const {
    std::vector<std::string> shown(names.begin(), std::next(names.begin(), std::min<size_t>(names.size(), 12)));
    if (names.size() > shown.size()) shown.push_back(fmt::format("and {} more", names.size() - shown.size()));
    return names.empty() ? "none" : fmt::format("{}", fmt::join(shown, ", "));
  }

  // Options every request shares; the token goes to the endpoint only (libcurl never sends an
  // Authorization header to the host a redirect leads to, as the hub's CDN is).
  CurlHandle start(const std::string& url, Response& response, CurlHeaders& request_headers) const {
    CurlHandle curl(libcurl().easy_init());
    if (!curl) fail("{}: cannot start libcurl", id_.to_string());
    if (settings_.token)
      request_headers.reset(libcurl().slist_append(nullptr, ("Authorization: Bearer " + *settings_.token).c_str()));
    libcurl().easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
    libcurl().easy_setopt(curl.get(), CURLOPT_HTTPHEADER, request_headers.get());
    libcurl().easy_setopt(curl.get(), CURLOPT_USERAGENT, "kiln/0.1.0");
    libcurl().easy_setopt(curl.get(), CURLOPT_HEADERFUNCTION, collect_header);
    libcurl().easy_setopt(curl.get(), CURLOPT_HEADERDATA, &response.headers);
    libcurl().easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
    // huggingface_hub's 10 s to connect; a transfer stalled for 30 s fails and is resumed.
    libcurl().easy_setopt(curl.get(), CURLOPT_CONNECTTIMEOUT, 10L);
    libcurl().easy_setopt(curl.get(), CURLOPT_LOW_SPEED_LIMIT, 1L);
    libcurl().easy_setopt(curl.get(), CURLOPT_LOW_SPEED_TIME, 30L);
    return curl;
  }

  void perform(CURL* curl, Response& response) const {
    char error[CURL_ERROR_SIZE] = {};
    libcurl().easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
    response.result = libcurl().easy_perform(curl);
    if (response.result != CURLE_OK) response.curl_error = *error ? error : libcurl().easy_strerror(response.result);
    libcurl().easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  }

  [[noreturn]] void fail_unreachable(const std::string& what, const std::string& url, const Response& response) const {
    fail("{}: {}: cannot reach {}: {}; with HF_HUB_OFFLINE=1 only the cache is used", id_.to_string(), what, url,
         response.curl_error);
  }

  // An HTTP error as huggingface_hub explains it, from the hub's X-Error-Code and X-Error-Message.
  [[noreturn]] void fail_status(const std::string& what, const std::string& url, const Response& response) const {
    const std::string code = header(response.headers, "x-error-code");
    std::string message = header(response.headers, "x-error-message");
    if (message.empty() && !response.body.empty() && response.body.size() < 300 &&
        response.body.find('\n') == std::string::npos)
      message = response.body;
    const std::string said = fmt::format("{} for {}{}", response.status, url, message.empty() ? "" : ": " + message);
    const std::string page = settings_.endpoint + "/" + id_.repo;
    const std::string token_hint =
        settings_.token ? "the token sent (HF_TOKEN, or the token file under HF_HOME) was refused: check that it is "
                          "valid and that its account has access"
                        : "set HF_TOKEN to a token of an account with access";
    if (response.status == 401 || response.status == 403) {
      if (code == "GatedRepo" || response.status == 403)
        fail("{}: {}: the model is gated ({}): accept its license at {} and {}", id_.to_string(), what, said, page,
             settings_.token ? "use a token of that account in HF_TOKEN" : "set HF_TOKEN to a token of that account");
      if (code == "RepoNotFound")
        fail("{}: no model {} on {} ({}); if it is private or gated, {}", id_.to_string(), id_.repo,
             settings_.endpoint, said, token_hint);
      fail("{}: {}: the hub refused access ({}): the model is private or gated: {} (and accept its license at {})",
           id_.to_string(), what, said, token_hint, page);
    }
    if (response.status == 404) {
      if (code == "RevisionNotFound")
        fail("{}: {} has no revision {} on {} ({})", id_.to_string(), id_.repo, id_.revision, settings_.endpoint,
             said);
      if (code == "EntryNotFound") fail("{}: {}: not in the repo ({})", id_.to_string(), what, said);
      fail("{}: no model {} on {} ({})", id_.to_string(), id_.repo, settings_.endpoint, said);
    }
    fail("{}: {}: the hub answered {}", id_.to_string(), what, said);
  }

  nlohmann::json repo_info() const {
    const std::string url =
        fmt::format("{}/api/models/{}/revision/{}", settings_.endpoint, id_.repo, url_quote(id_.revision, false));
    Response response;
    CurlHeaders request_headers;
    CurlHandle curl = start(url, response, request_headers);
    libcurl().easy_setopt(curl.get(), CURLOPT_FOLLOWLOCATION, 1L);
    libcurl().easy_setopt(curl.get(), CURLOPT_MAXREDIRS, static_cast<long>(kMaxRedirects));
    libcurl().easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, append_bounded);
    libcurl().easy_setopt(curl.get(), CURLOPT_WRITEDATA, &response.body);
    perform(curl.get(), response);
    if (response.result != CURLE_OK) fail_unreachable("the file list", url, response);
    if (response.status != 200) fail_status("the file list", url, response);
    nlohmann::json info = nlohmann::json::parse(response.body, nullptr, /*allow_exceptions=*/false);
    if (!info.is_object() || !info.contains("sha") || !info["sha"].is_string() ||
        !is_commit_hash(info["sha"].get<std::string>()) || !info.contains("siblings") || !info["siblings"].is_array())
      fail("{}: the answer of {} is not a model's file list (no commit sha and siblings)", id_.to_string(), url);
    return info;
  }

  // HEAD of the file's resolve URL. A relative redirect (a renamed repo) is followed; the hub's
  // redirect of an LFS file to its CDN is not: that response carries the file's headers.
  FileMetadata metadata(const std::string& name) const {
    if (!is_safe_repo_path(name))
      fail("{}: the hub lists a file named \"{}\", which kiln will not write", id_.to_string(), name);
    FileMetadata file{name, "", "", std::nullopt,
                      fmt::format("{}/{}/resolve/{}/{}", settings_.endpoint, id_.repo, commit_, url_quote(name, true))};
    std::string url = file.url;
    Response response;
    for (int redirect = 0;; ++redirect) {
      response = Response();
      CurlHeaders request_headers;
      CurlHandle curl = start(url, response, request_headers);
      libcurl().easy_setopt(curl.get(), CURLOPT_NOBODY, 1L);
      perform(curl.get(), response);
      if (response.result != CURLE_OK) fail_unreachable(name, url, response);
      const std::string location = header(response.headers, "location");
      if (response.status < 300 || response.status >= 400 || !location.starts_with("/") || redirect == kMaxRedirects)
        break;
      url = url_origin(url) + location;
    }
    if (response.status >= 400) fail_status(name, url, response);
    file.commit = header(response.headers, "x-repo-commit");
    file.etag = normalize_etag(header(response.headers, "x-linked-etag"));
    if (file.etag.empty()) file.etag = normalize_etag(header(response.headers, "etag"));
    file.size = header_number(response.headers, "x-linked-size");
    // A redirect's Content-Length is that of its own body.
    if (!file.size && response.status < 300) file.size = header_number(response.headers, "content-length");
    if (file.etag.empty()) fail("{}: {}: the hub sent no ETag for {}", id_.to_string(), name, url);
    if (!std::all_of(file.etag.begin(), file.etag.end(),
                     [](unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '.'; }) ||
        file.etag.front() == '.')
      fail("{}: {}: the hub's ETag \"{}\" cannot name a blob", id_.to_string(), name, file.etag);
    if (!file.commit.empty() && file.commit != commit_)
      fail("{}: {}: the hub resolved it at commit {}, not at {} which it listed", id_.to_string(), name, file.commit,
           commit_);
    return file;
  }

  // What the blobs still to be fetched need against the space left where they go.
  void check_free_space(const std::vector<FileMetadata>& files) const {
    uint64_t needed = 0;
    std::set<std::string> counted;
    for (const FileMetadata& file : files) {
      if (!file.size || fs::exists(cache_.blob(file.etag)) || !counted.insert(file.etag).second) continue;
      std::error_code ignored;
      const uintmax_t partial = fs::file_size(cache_.incomplete_blob(file.etag), ignored);
      needed += *file.size - std::min<uint64_t>(*file.size, ignored ? 0 : partial);
    }
    if (needed == 0) return;
    const fs::path blobs = cache_.blob("").parent_path();
    fs::create_directories(blobs);
    struct statvfs space {};
    if (::statvfs(blobs.c_str(), &space) != 0) return;
    const uint64_t free_bytes = static_cast<uint64_t>(space.f_bavail) * space.f_frsize;
    if (needed > free_bytes)
      fail("{}: not enough disk space: the files still to fetch take {} and {} has {} free", id_.to_string(),
           human_bytes(needed), blobs.string(), human_bytes(free_bytes));
  }

  void fetch(const std::vector<FileMetadata>& files) {
    for (const FileMetadata& file : files) {
      if (!fs::exists(cache_.blob(file.etag))) {
        const BlobLock lock(cache_.lock_file(file.etag), file.name, listener_);
        // Another process may have finished the blob while this one waited for the lock.
        if (!fs::exists(cache_.blob(file.etag))) {
          if (!download(file) && !download(file))
            fail("{}: {}: the bytes fetched twice do not match the hub's sha256 {}; the download was deleted",
                 id_.to_string(), file.name, file.etag);
          ++pulled_.fetched_files;
        }
      }
      cache_.link(commit_, file.name, file.etag);
    }
  }

  // Fetches the blob into its .incomplete file (resuming from what is there) and, when its bytes
  // are the ones the hub named, moves it into place. False, with the file deleted, when they are not.
  bool download(const FileMetadata& file) {
    const fs::path incomplete = cache_.incomplete_blob(file.etag);
    fs::create_directories(incomplete.parent_path());
    BlobTransfer transfer;
    transfer.fd = ::open(incomplete.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (transfer.fd < 0)
      fail("{}: {}: cannot open {}: {}", id_.to_string(), file.name, incomplete.string(), std::strerror(errno));
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{transfer.fd};
    // An LFS file's ETag is the sha256 of its bytes.
    if (is_sha256_hex(file.etag)) transfer.hash.emplace();
    transfer.bytes = static_cast<uint64_t>(fs::file_size(incomplete));
    if (file.size && transfer.bytes > *file.size) restart_transfer(transfer);
    if (transfer.bytes > 0) {
      if (listener_.note)
        listener_.note(fmt::format("{}: resuming at {} from {}", file.name, human_bytes(transfer.bytes),
                                   incomplete.string()));
      if (transfer.hash) hash_prefix(incomplete, transfer.bytes, *transfer.hash);
    }
    transfer.progress.file = file.name;
    transfer.progress.size = file.size;
    transfer.listener = &listener_;

    for (int attempt = 1;; ++attempt) {
      if (file.size && transfer.bytes == *file.size) break;  // whole already, but not yet moved into place
      Response response;
      CurlHeaders request_headers;
      CurlHandle curl = start(file.url, response, request_headers);
      libcurl().easy_setopt(curl.get(), CURLOPT_FOLLOWLOCATION, 1L);
      libcurl().easy_setopt(curl.get(), CURLOPT_MAXREDIRS, static_cast<long>(kMaxRedirects));
      const std::string range = fmt::format("{}-", transfer.bytes);
      if (transfer.bytes > 0) libcurl().easy_setopt(curl.get(), CURLOPT_RANGE, range.c_str());
      transfer.curl = curl.get();
      transfer.status_checked = false;
      transfer.error_body.clear();
      transfer.progress.resumed_from = transfer.bytes;
      libcurl().easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, write_blob);
      libcurl().easy_setopt(curl.get(), CURLOPT_WRITEDATA, &transfer);
      perform(curl.get(), response);
      if (transfer.write_errno)
        fail("{}: {}: cannot write {}: {}", id_.to_string(), file.name, incomplete.string(),
             std::strerror(transfer.write_errno));
      if (response.status == 416) {
        // The file on disk is not a prefix the server can continue: start over.
        restart_transfer(transfer);
      } else if (response.status >= 400) {
        response.body = transfer.error_body;
        fail_status(file.name, file.url, response);
      } else if (response.result == CURLE_OK) {
        break;
      } else if (attempt == kTransferAttempts) {
        fail("{}: {}: the download failed {} times, last: {}; the {} fetched so far stay in {} for the next pull",
             id_.to_string(), file.name, kTransferAttempts, response.curl_error, human_bytes(transfer.bytes),
             incomplete.string());
      } else {
        if (listener_.note)
          listener_.note(fmt::format("{}: {} at {}; resuming", file.name, response.curl_error,
                                     human_bytes(transfer.bytes)));
        std::this_thread::sleep_for(std::chrono::milliseconds(250 * attempt));
      }
    }
    pulled_.fetched_bytes += transfer.received;
    if (listener_.progress) {
      transfer.progress.bytes = transfer.bytes;
      transfer.progress.finished = true;
      listener_.progress(transfer.progress);
    }

    std::string problem;
    if (file.size && transfer.bytes != *file.size)
      problem = fmt::format("{} bytes arrived where the hub said {}", transfer.bytes, *file.size);
    else if (transfer.hash)
      if (const std::string digest = transfer.hash->finish_hex(); digest != file.etag)
        problem = fmt::format("the sha256 of the bytes is {}, not {}", digest, file.etag);
    if (!problem.empty()) {
      fs::remove(incomplete);
      if (listener_.note) listener_.note(fmt::format("{}: {}: deleted, fetching it again", file.name, problem));
      return false;
    }
    fs::rename(incomplete, cache_.blob(file.etag));
    return true;
  }

  void hash_prefix(const fs::path& path, uint64_t bytes, Sha256& hash) const {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("{}: cannot read {}: {}", id_.to_string(), path.string(), std::strerror(errno));
    std::vector<char> buffer(1 << 20);
    while (bytes > 0) {
      const ssize_t count = ::read(fd, buffer.data(), std::min<uint64_t>(bytes, buffer.size()));
      if (count <= 0) {
        ::close(fd);
        fail("{}: cannot read {}", id_.to_string(), path.string());
      }
      hash.update(buffer.data(), static_cast<size_t>(count));
      bytes -= static_cast<uint64_t>(count);
    }
    ::close(fd);
  }

  const HubModelId& id_;
  const HubSettings& settings_;
  const PullListener& listener_;
  HubRepoCache cache_;
  std::string commit_;
  PulledModel pulled_;
};

}  // namespace

std::string human_bytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.1f} GiB", bytes / double(1ull << 30));
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", bytes / double(1ull << 20));
  if (bytes >= (1ull << 10)) return fmt::format("{:.1f} KiB", bytes / double(1ull << 10));
  return fmt::format("{} B", bytes);
}

PulledModel pull_model(const HubModelId& id, const HubSettings& settings, const PullListener& listener) {
  if (settings.offline) {
    PulledModel cached;
    cached.snapshot = require_cached_model(settings, id);
    cached.commit = cached.snapshot.filename().string();
    for (const auto& entry : fs::recursive_directory_iterator(cached.snapshot))
      if (!entry.is_directory()) ++cached.files;
    return cached;
  }
  return HubClient(id, settings, listener).pull();
}

}  // namespace kiln
