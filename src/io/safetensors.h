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

// A read-only POSIX mmap of one whole file; the mapping lives as long as the object.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const uint8_t* data() const { return static_cast<const uint8_t*>(base_); }
  uint64_t size() const { return size_; }

 private:
  std::filesystem::path path_;
  void* base_ = nullptr;
  uint64_t size_ = 0;
};

// Reads and validates the header of one mapped safetensors file: every tensor's dtype, shape and
// byte range (absolute offsets into the file). Errors name the file and the tensor.
std::vector<TensorInfo> read_safetensors_header(const MappedFile& file);

class Checkpoint {
 public:
  // Opens DIR/model.safetensors.index.json if present, else DIR/model.safetensors,
  // else the single *.safetensors file in DIR (more than one without an index is an error).
  static Checkpoint open(const std::filesystem::path& model_dir);
  // Opens explicit files (used by tests and tools).
  static Checkpoint open_files(const std::vector<std::filesystem::path>& files);

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  // The same files under another table of tensors: a view for planning only (e.g. a quantized
  // checkpoint as its family's sanitizer sees it, model/quantized_checkpoint.h); never read bytes
  // through it for a tensor the table changed.
  Checkpoint with_table(std::map<std::string, TensorInfo> tensors) const {
    Checkpoint view = *this;
    view.tensors_ = std::move(tensors);
    return view;
  }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // error names the checkpoint and tensor
  // A zero-copy view of the stored bytes (the mapping stays alive while the view does). The
  // mapping is read-only: writing through the view faults. A tensor stored at an offset that is
  // not a multiple of its element size (never the case for files transformers writes) is copied
  // into aligned memory instead.
  Tensor view(const std::string& name) const;
  const std::vector<std::filesystem::path>& files() const { return files_; }
  uint64_t total_bytes() const;
  // What the checkpoint was opened from (the model directory, or the file for one explicit
  // file), for error messages.
  const std::filesystem::path& location() const { return location_; }

 private:
  // Maps and validates one file and adds its tensors; returns their names.
  std::vector<std::string> add_file(const std::filesystem::path& file);

  std::filesystem::path location_;
  std::vector<std::filesystem::path> files_;
  std::map<std::filesystem::path, std::shared_ptr<MappedFile>> mappings_;
  std::map<std::string, TensorInfo> tensors_;
};

}  // namespace kiln
