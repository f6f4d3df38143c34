#include "io/safetensors_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln {
namespace {

using nlohmann::json;

// Streamed tensors are produced in chunks of this size: large enough that the fill callback can
// spread one chunk over threads, small enough that writing needs little memory.
constexpr uint64_t kChunkBytes = 16ull << 20;

using EntryList = std::vector<const SafetensorsEntry*>;

void check_entries(const std::filesystem::path& file, const EntryList& entries) {
  std::set<std::string> names;
  for (const SafetensorsEntry* pointer : entries) {
    const SafetensorsEntry& entry = *pointer;
    if (entry.name.empty() || entry.name == "__metadata__")
      fail("{}: cannot write a tensor named '{}'", file.string(), entry.name);
    if (!names.insert(entry.name).second) fail("{}: tensor '{}' is given twice", file.string(), entry.name);
    for (int64_t extent : entry.shape)
      if (extent < 0) fail("{}: tensor '{}': shape {} is negative", file.string(), entry.name, shape_string(entry.shape));
    if (!entry.fill && entry.bytes.size() != entry.nbytes())
      fail("{}: tensor '{}': shape {} × {} needs {} bytes but {} were given", file.string(), entry.name,
           shape_string(entry.shape), dtype_name(entry.dtype), entry.nbytes(), entry.bytes.size());
  }
}

// The header text, padded with spaces so the data section starts 8-byte aligned (as the
// safetensors reference writer does).
std::string header_text(const EntryList& entries, const SafetensorsMetadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsEntry* entry : entries) {
    header[entry->name] = {{"dtype", std::string(dtype_name(entry->dtype))},
                           {"shape", entry->shape},
                           {"data_offsets", {offset, offset + entry->nbytes()}}};
    offset += entry->nbytes();
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  return text;
}

// Writes `file` through a temporary sibling, renamed into place only when complete.
template <typename WriteBody>
void write_atomically(const std::filesystem::path& file, WriteBody&& body) {
  const std::filesystem::path partial = file.string() + ".partial";
  try {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) fail("{}: cannot create ({})", partial.string(), std::strerror(errno));
    body(out);
    out.close();
    if (!out) fail("{}: write failed ({})", partial.string(), std::strerror(errno));
    std::error_code error;
    std::filesystem::rename(partial, file, error);
    if (error) fail("{}: cannot rename into place ({})", file.string(), error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(partial, ignored);
    throw;
  }
}

void write_bytes(std::ofstream& out, const void* data, uint64_t size, const std::filesystem::path& file) {
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) fail("{}: write failed ({})", file.string(), std::strerror(errno));
}

void write_entries(const std::filesystem::path& file, const EntryList& given, const SafetensorsMetadata& metadata) {
  check_entries(file, given);
  // Wider dtypes first (as the safetensors reference writer orders them): with the data section
  // 8-byte aligned, every tensor then starts aligned to its element size, so readers can map it
  // in place.
  EntryList entries = given;
  std::stable_sort(entries.begin(), entries.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return dtype_size(a->dtype) > dtype_size(b->dtype);
  });
  const std::string header = header_text(entries, metadata);
  write_atomically(file, [&](std::ofstream& out) {
    uint8_t length[8];
    for (int byte = 0; byte < 8; ++byte) length[byte] = static_cast<uint8_t>(header.size() >> (8 * byte));
    write_bytes(out, length, 8, file);
    write_bytes(out, header.data(), header.size(), file);
    std::vector<uint8_t> chunk;
    for (const SafetensorsEntry* entry : entries) {
      if (!entry->fill) {
        write_bytes(out, entry->bytes.data(), entry->bytes.size(), file);
        continue;
      }
      const uint64_t total = entry->nbytes();
      chunk.resize(std::max(chunk.size(), std::min(total, kChunkBytes)));
      for (uint64_t offset = 0; offset < total; offset += kChunkBytes) {
        const uint64_t size = std::min(kChunkBytes, total - offset);
        entry->fill(offset, std::span<uint8_t>(chunk.data(), size));
        write_bytes(out, chunk.data(), size, file);
      }
    }
  });
}

}  // namespace

void write_safetensors(const std::filesystem::path& file, const std::vector<SafetensorsEntry>& entries,
                       const SafetensorsMetadata& metadata) {
  EntryList list;
  for (const SafetensorsEntry& entry : entries) list.push_back(&entry);
  write_entries(file, list, metadata);
}

std::vector<std::filesystem::path> write_sharded_safetensors(const std::filesystem::path& dir,
                                                             const std::vector<SafetensorsEntry>& entries,
                                                             uint64_t max_shard_bytes,
                                                             const SafetensorsMetadata& metadata) {
  if (max_shard_bytes == 0) fail("{}: the shard size limit must be positive", dir.string());
  EntryList all;
  for (const SafetensorsEntry& entry : entries) all.push_back(&entry);
  check_entries(dir, all);
  std::filesystem::create_directories(dir);
  // Consecutive runs of entries, each within the limit unless one tensor alone exceeds it.
  std::vector<EntryList> shards(1);
  uint64_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (const SafetensorsEntry& entry : entries) {
    if (!shards.back().empty() && shard_bytes + entry.nbytes() > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&entry);
    shard_bytes += entry.nbytes();
    total_bytes += entry.nbytes();
  }
  if (shards.size() == 1) {
    write_entries(dir / "model.safetensors", shards.front(), metadata);
    return {dir / "model.safetensors"};
  }

  std::vector<std::filesystem::path> written;
  json weight_map = json::object();
  for (size_t index = 0; index < shards.size(); ++index) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, shards.size());
    write_entries(dir / name, shards[index], metadata);
    for (const SafetensorsEntry* entry : shards[index]) weight_map[entry->name] = name;
    written.push_back(dir / name);
  }
  const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  const auto index_path = dir / "model.safetensors.index.json";
  write_atomically(index_path, [&](std::ofstream& out) {
    const std::string text = index.dump(2) + "\n";
    write_bytes(out, text.data(), text.size(), index_path);
  });
  written.push_back(index_path);
  return written;
}

}  // namespace kiln
