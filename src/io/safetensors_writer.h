// Writing safetensors checkpoints: one file, or shards plus model.safetensors.index.json.
//
// A tensor's bytes come from memory or from a fill callback that produces them chunk by chunk, so
// a multi-gigabyte checkpoint is written without ever holding a whole tensor in RAM. Files are
// written under a temporary name and renamed into place, so a failed write leaves no half file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kiln {

// Produces the tensor's bytes [offset, offset + out.size()) into `out`. The writer calls it in
// increasing offset order; every offset is a multiple of 8 bytes, so chunks never split an element.
using TensorByteFill = std::function<void(uint64_t offset, std::span<uint8_t> out)>;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  std::vector<uint8_t> bytes = {};  // the data, when it is held in memory
  TensorByteFill fill = {};         // or the generator that streams it (used when set)

  uint64_t nbytes() const { return static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype); }
};

using SafetensorsMetadata = std::map<std::string, std::string>;

// Writes one safetensors file holding `entries`: the data of wider dtypes first, each dtype's
// tensors in the given order, so every tensor starts aligned to its element size.
void write_safetensors(const std::filesystem::path& file, const std::vector<SafetensorsEntry>& entries,
                       const SafetensorsMetadata& metadata = {{"format", "pt"}});

// Writes DIR/model.safetensors when all tensors fit in `max_shard_bytes`, else consecutive shards
// DIR/model-0000i-of-0000n.safetensors of at most `max_shard_bytes` each (a larger tensor gets a
// shard of its own) and DIR/model.safetensors.index.json, as transformers' save_pretrained does.
// Returns the files written, the index last.
std::vector<std::filesystem::path> write_sharded_safetensors(const std::filesystem::path& dir,
                                                             const std::vector<SafetensorsEntry>& entries,
                                                             uint64_t max_shard_bytes,
                                                             const SafetensorsMetadata& metadata = {{"format", "pt"}});

}  // namespace kiln
