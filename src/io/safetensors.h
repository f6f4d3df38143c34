// safetensors checkpoints: one file or sharded (model.safetensors.index.json), memory-mapped.
//
// Opening validates everything before any tensor is used: header length, header JSON, dtype
// names, shape × dtype size equal to the byte range, ranges inside the file and not
// overlapping, index entries pointing at existing shards that hold the tensor. Every error is a
// kiln::Error that names the file and, where there is one, the tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kiln {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  std::filesystem::path file;
  uint64_t offset = 0;  // absolute byte offset of the data in `file`
  uint64_t nbytes = 0;
};

class MappedFile;  // read-only mmap of one file

class Checkpoint {
 public:
  // Opens DIR/model.safetensors.index.json if present, else DIR/model.safetensors,
  // else the single *.safetensors file in DIR (more than one without an index is an error).
  static Checkpoint open(const std::filesystem::path& model_dir);
  // Opens explicit files (used by tests and tools).
  static Checkpoint open_files(const std::vector<std::filesystem::path>& files);

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // error names the checkpoint and tensor
  // A zero-copy view of the stored bytes (the mapping stays alive while the view does).
  Tensor view(const std::string& name) const;
  const std::vector<std::filesystem::path>& files() const { return files_; }
  uint64_t total_bytes() const;

 private:
  std::vector<std::filesystem::path> files_;
  std::map<std::filesystem::path, std::shared_ptr<MappedFile>> mappings_;
  std::map<std::string, TensorInfo> tensors_;
};

}  // namespace kiln
