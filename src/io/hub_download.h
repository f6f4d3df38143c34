// Fetching a model from the Hugging Face hub into its cache (io/hub_cache.h) over libcurl, the way
// huggingface_hub's snapshot_download does, so either can resume or reuse what the other fetched:
//   - the file list: GET {endpoint}/api/models/{repo}/revision/{revision} (sha, siblings[].rfilename);
//   - each file: HEAD {endpoint}/{repo}/resolve/{commit}/{file}, whose X-Repo-Commit names the
//     commit and X-Linked-Etag / ETag the blob (an LFS file's is its sha256), X-Linked-Size /
//     Content-Length its size; then GET, following the hub's redirect of LFS files to its CDN
//     (the token is never sent to another host), into blobs/{etag}.incomplete, resumed with a Range
//     from what an earlier try left there, under blobs' lock file;
//   - an LFS file's sha256 is checked: on a mismatch the blob is deleted and fetched once more.
// Only the files kiln reads are fetched (hub_metadata_files() and the weights).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "io/hub_cache.h"

namespace kiln {

// One file's transfer, reported as bytes arrive (and once more when it ends).
struct DownloadProgress {
  std::string file;
  uint64_t bytes = 0;            // on disk so far, counting what a resumed try started from
  uint64_t resumed_from = 0;     // what was on disk when this transfer began
  std::optional<uint64_t> size;  // the whole file, when the hub said
  bool finished = false;
};

// Where a pull tells what it is doing; either may be empty.
struct PullListener {
  std::function<void(const DownloadProgress&)> progress;
  // One line about the pull (a resumed or repeated download, a wait for another process's lock).
  std::function<void(const std::string&)> note;
};

struct PulledModel {
  std::filesystem::path snapshot;  // {cache}/models--ORG--NAME/snapshots/{commit}
  std::string commit;
  int files = 0;               // the files of the model in the snapshot
  int fetched_files = 0;       // of them, those whose bytes were fetched now
  uint64_t fetched_bytes = 0;  // bytes received now
};

// Fetches what the cache lacks of `id`'s model (every file when none of it is there), writes
// refs/{revision}, and returns its snapshot. Errors are one line naming the repo (and the file, the
// URL or the HTTP status): a 401 or 403 says to set HF_TOKEN or accept the model's license, and
// an id the hub does not know says what was asked of which endpoint. With settings.offline only
// the cache is read (require_cached_model).
PulledModel pull_model(const HubModelId& id, const HubSettings& settings, const PullListener& listener = {});

// A byte count as the pull's messages write it: "12.3 MiB".
std::string human_bytes(uint64_t bytes);

}  // namespace kiln
