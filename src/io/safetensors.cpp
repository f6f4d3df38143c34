#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <string_view>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln {
namespace {

using nlohmann::json;

// The safetensors reference implementation refuses headers above 100 MB (MAX_HEADER_SIZE in
// huggingface/safetensors safetensors/src/tensor.rs); a larger length is corruption, not a model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// dtype names the safetensors format defines that kiln does not read (yet).
constexpr std::array<std::string_view, 14> kUnsupportedDtypes = {
    "F64", "I64", "I16", "I8", "U64", "U16", "U8", "BOOL", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"};

std::string describe(const std::filesystem::path& path) { return path.string(); }

DType checkpoint_dtype(const std::string& name, const std::filesystem::path& file, const std::string& tensor) {
  // U32, I32 and F8_E4M3 hold quantized weights' parts (core/weight.h).
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::U32, DType::I32, DType::F8E4M3})
    if (dtype_name(dtype) == name) return dtype;
  if (std::find(kUnsupportedDtypes.begin(), kUnsupportedDtypes.end(), name) != kUnsupportedDtypes.end())
    fail("{}: tensor '{}': unsupported dtype '{}' (kiln reads F32, F16, BF16, and U32, I32 and F8_E4M3 in "
         "quantized weights)",
         describe(file), tensor, name);
  fail("{}: tensor '{}': unknown dtype '{}' (kiln reads F32, F16, BF16, U32, I32 and F8_E4M3)", describe(file), tensor,
       name);
}

// The JSON type of `value` in words, for "is a …, not a …" messages.
std::string json_kind(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

Shape read_shape(const json& entry, const std::filesystem::path& file, const std::string& tensor) {
  const json& shape_json = entry.at("shape");
  if (!shape_json.is_array())
    fail("{}: tensor '{}': 'shape' is a JSON {}, not an array", describe(file), tensor, json_kind(shape_json));
  Shape shape;
  for (size_t axis = 0; axis < shape_json.size(); ++axis) {
    const json& extent = shape_json[axis];
    if (!extent.is_number_integer())
      fail("{}: tensor '{}': shape entry {} is {}, not an integer", describe(file), tensor, axis, extent.dump());
    if (extent.is_number_unsigned()) {
      if (extent.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail("{}: tensor '{}': shape entry {} is {}, too large", describe(file), tensor, axis, extent.dump());
    } else if (extent.get<int64_t>() < 0) {
      fail("{}: tensor '{}': shape entry {} is {}, negative", describe(file), tensor, axis, extent.dump());
    }
    shape.push_back(extent.get<int64_t>());
  }
  return shape;
}

// Byte count of `shape` × `dtype`, failing (instead of wrapping) when it exceeds 64 bits.
uint64_t shape_bytes(const Shape& shape, DType dtype, const std::filesystem::path& file, const std::string& tensor) {
  uint64_t bytes = dtype_size(dtype);
  for (int64_t extent : shape)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes))
      fail("{}: tensor '{}': shape {} × {} overflows 64 bits", describe(file), tensor, shape_string(shape),
           dtype_name(dtype));
  return bytes;
}

std::pair<uint64_t, uint64_t> read_offsets(const json& entry, const std::filesystem::path& file,
                                           const std::string& tensor) {
  const json& offsets = entry.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    fail("{}: tensor '{}': 'data_offsets' is {}, not [begin, end] with two non-negative integers", describe(file),
         tensor, offsets.dump());
  const uint64_t begin = offsets[0].get<uint64_t>();
  const uint64_t end = offsets[1].get<uint64_t>();
  if (begin > end)
    fail("{}: tensor '{}': data_offsets [{}, {}] end before they begin", describe(file), tensor, begin, end);
  return {begin, end};
}

void check_metadata(const json& metadata, const std::filesystem::path& file) {
  if (!metadata.is_object())
    fail("{}: '__metadata__' is a JSON {}, not an object of strings", describe(file), json_kind(metadata));
  for (const auto& [key, value] : metadata.items())
    if (!value.is_string())
      fail("{}: '__metadata__' entry '{}' is a JSON {}, not a string", describe(file), key, json_kind(value));
}

// A tensor's byte range relative to the data section, for the overlap check.
struct ByteRange {
  uint64_t begin;
  uint64_t end;
  const std::string* tensor;
};

json parse_json_rejecting_duplicate_keys(std::string_view text, const std::filesystem::path& file,
                                         const char* what) {
  // nlohmann keeps the last of two equal keys silently; a duplicated tensor name is corruption.
  std::set<std::string> top_level_keys;
  json::parser_callback_t reject_duplicates = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      std::string key = parsed.get<std::string>();
      if (!top_level_keys.insert(key).second) fail("{}: {} lists '{}' twice", describe(file), what, key);
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), reject_duplicates);
  } catch (const json::exception& error) {  // parse_error, or out_of_range for a number beyond a double
    fail("{}: {} is not valid JSON ({})", describe(file), what, error.what());
  }
}

}  // namespace

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open ({})", describe(path), std::strerror(errno));
  struct stat status {};
  if (::fstat(fd, &status) != 0) {
    const int error = errno;
    ::close(fd);
    fail("{}: cannot stat ({})", describe(path), std::strerror(error));
  }
  if (!S_ISREG(status.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", describe(path));
  }
  size_ = static_cast<uint64_t>(status.st_size);
  if (size_ > 0) {
    base_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base_ == MAP_FAILED) {
      const int error = errno;
      base_ = nullptr;
      ::close(fd);
      fail("{}: cannot mmap {} bytes ({})", describe(path), size_, std::strerror(error));
    }
  }
  ::close(fd);  // the mapping keeps the file contents reachable
}

MappedFile::~MappedFile() {
  if (base_) ::munmap(base_, size_);
}

std::vector<TensorInfo> read_safetensors_header(const MappedFile& file) {
  const auto& path = file.path();
  if (file.size() < 8)
    fail("{}: file is {} bytes, shorter than the 8-byte safetensors header length", describe(path), file.size());
  uint64_t header_length = 0;
  for (int byte = 7; byte >= 0; --byte) header_length = header_length << 8 | file.data()[byte];  // little-endian
  if (header_length > kMaxHeaderBytes)
    fail("{}: header length {} is absurd (safetensors allows at most {} bytes)", describe(path), header_length,
         kMaxHeaderBytes);
  if (header_length > file.size() - 8)
    fail("{}: header length {} runs past the end of the file ({} bytes)", describe(path), header_length,
         file.size());

  const std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, header_length);
  const json header = parse_json_rejecting_duplicate_keys(text, path, "header");
  if (!header.is_object())
    fail("{}: header is a JSON {}, not an object", describe(path), json_kind(header));

  const uint64_t data_start = 8 + header_length;
  const uint64_t data_size = file.size() - data_start;
  std::vector<TensorInfo> tensors;
  std::vector<ByteRange> ranges;
  tensors.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      check_metadata(entry, path);
      continue;
    }
    if (!entry.is_object())
      fail("{}: tensor '{}': entry is a JSON {}, not an object", describe(path), name, json_kind(entry));
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(key)) fail("{}: tensor '{}': entry has no '{}'", describe(path), name, key);
    for (const auto& [key, value] : entry.items())
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        fail("{}: tensor '{}': unexpected key '{}' in the entry", describe(path), name, key);
    if (!entry["dtype"].is_string())
      fail("{}: tensor '{}': 'dtype' is a JSON {}, not a string", describe(path), name, json_kind(entry["dtype"]));

    TensorInfo info;
    info.name = name;
    info.file = path;
    info.dtype = checkpoint_dtype(entry["dtype"].get<std::string>(), path, name);
    info.shape = read_shape(entry, path, name);
    const auto [begin, end] = read_offsets(entry, path, name);
    const uint64_t expected = shape_bytes(info.shape, info.dtype, path, name);
    if (end - begin != expected)
      fail("{}: tensor '{}': shape {} × {} = {} bytes but data_offsets span {}", describe(path), name,
           shape_string(info.shape), dtype_name(info.dtype), expected, end - begin);
    if (end > data_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data section ({} bytes)", describe(path),
           name, begin, end, data_size);
    info.offset = data_start + begin;
    info.nbytes = expected;
    tensors.push_back(std::move(info));
  }

  for (const TensorInfo& info : tensors)
    if (info.nbytes > 0) ranges.push_back({info.offset - data_start, info.offset - data_start + info.nbytes, &info.name});
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].begin < ranges[i - 1].end)
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]", describe(path),
           *ranges[i].tensor, ranges[i].begin, ranges[i].end, *ranges[i - 1].tensor, ranges[i - 1].begin,
           ranges[i - 1].end);
  return tensors;
}

std::vector<std::string> Checkpoint::add_file(const std::filesystem::path& file) {
  auto mapping = std::make_shared<MappedFile>(file);
  std::vector<std::string> names;
  for (TensorInfo& info : read_safetensors_header(*mapping)) {
    if (auto existing = tensors_.find(info.name); existing != tensors_.end())
      fail("{}: tensor '{}' is also stored in {}", describe(file), info.name, describe(existing->second.file));
    names.push_back(info.name);
    tensors_.emplace(info.name, std::move(info));
  }
  files_.push_back(file);
  mappings_.emplace(file, std::move(mapping));
  return names;
}

Checkpoint Checkpoint::open_files(const std::vector<std::filesystem::path>& files) {
  if (files.empty()) fail("no safetensors files given to open");
  Checkpoint checkpoint;
  checkpoint.location_ = files.size() == 1 ? files.front() : files.front().parent_path();
  for (const auto& file : files) checkpoint.add_file(file);
  return checkpoint;
}

Checkpoint Checkpoint::open(const std::filesystem::path& model_dir) {
  if (!std::filesystem::is_directory(model_dir)) fail("{}: not a model directory", describe(model_dir));
  const auto index_path = model_dir / "model.safetensors.index.json";
  if (!std::filesystem::exists(index_path)) {
    if (std::filesystem::exists(model_dir / "model.safetensors")) {
      Checkpoint checkpoint = open_files({model_dir / "model.safetensors"});
      checkpoint.location_ = model_dir;
      return checkpoint;
    }
    std::vector<std::filesystem::path> candidates;
    for (const auto& entry : std::filesystem::directory_iterator(model_dir))
      if (entry.path().extension() == ".safetensors") candidates.push_back(entry.path());
    std::sort(candidates.begin(), candidates.end());
    if (candidates.empty())
      fail("{}: no model.safetensors.index.json, model.safetensors or other *.safetensors file", describe(model_dir));
    if (candidates.size() > 1)
      fail("{}: {} *.safetensors files ({}, {}, …) but no model.safetensors.index.json to say which to load",
           describe(model_dir), candidates.size(), candidates[0].filename().string(),
           candidates[1].filename().string());
    Checkpoint checkpoint = open_files(candidates);
    checkpoint.location_ = model_dir;
    return checkpoint;
  }

  std::ifstream in(index_path, std::ios::binary);
  if (!in) fail("{}: cannot open", describe(index_path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const json index = parse_json_rejecting_duplicate_keys(text, index_path, "index");
  if (!index.is_object()) fail("{}: index is a JSON {}, not an object", describe(index_path), json_kind(index));
  if (!index.contains("weight_map")) fail("{}: index has no 'weight_map'", describe(index_path));
  const json& weight_map = index["weight_map"];
  if (!weight_map.is_object())
    fail("{}: 'weight_map' is a JSON {}, not an object", describe(index_path), json_kind(weight_map));
  if (index.contains("metadata") && !index["metadata"].is_object())
    fail("{}: 'metadata' is a JSON {}, not an object", describe(index_path), json_kind(index["metadata"]));

  // Shard file → the tensors the index places there.
  std::map<std::string, std::set<std::string>> shard_tensors;
  for (const auto& [tensor, shard_json] : weight_map.items()) {
    if (!shard_json.is_string())
      fail("{}: tensor '{}': shard is a JSON {}, not a file name", describe(index_path), tensor, json_kind(shard_json));
    const std::string shard = shard_json.get<std::string>();
    const std::filesystem::path shard_path(shard);
    if (shard.empty() || shard_path.has_parent_path() || shard == "." || shard == "..")
      fail("{}: tensor '{}': shard '{}' is not a file name in the model directory", describe(index_path), tensor,
           shard);
    if (!std::filesystem::exists(model_dir / shard_path))
      fail("{}: tensor '{}': shard '{}' does not exist", describe(index_path), tensor, shard);
    shard_tensors[shard].insert(tensor);
  }
  if (shard_tensors.empty()) fail("{}: 'weight_map' lists no tensors", describe(index_path));

  Checkpoint checkpoint;
  checkpoint.location_ = model_dir;
  for (const auto& [shard, listed] : shard_tensors) {
    const auto shard_path = model_dir / shard;
    for (const std::string& name : checkpoint.add_file(shard_path)) {
      if (!weight_map.contains(name))
        fail("{}: tensor '{}' is not listed in {}", describe(shard_path), name, describe(index_path));
      if (!listed.count(name))
        fail("{}: tensor '{}' is listed in {} under shard '{}'", describe(shard_path), name, describe(index_path),
             weight_map.at(name).get<std::string>());
    }
    for (const std::string& name : listed)
      if (auto held = checkpoint.tensors_.find(name); held == checkpoint.tensors_.end() || held->second.file != shard_path)
        fail("{}: tensor '{}' is listed in {} but the shard does not hold it", describe(shard_path), name,
             describe(index_path));
  }
  return checkpoint;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto found = tensors_.find(name);
  if (found == tensors_.end()) fail("{}: tensor '{}' is not in the checkpoint", describe(location_), name);
  return found->second;
}

Tensor Checkpoint::view(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  const std::shared_ptr<MappedFile>& mapping = mappings_.at(tensor.file);
  const uint8_t* stored = mapping->data() + tensor.offset;
  if (reinterpret_cast<uintptr_t>(stored) % dtype_size(tensor.dtype) != 0) {
    // Writers that do not order tensors by dtype width can leave one misaligned for its
    // element type; it is copied (the same bytes) so kernels always see aligned elements.
    Tensor copy = Tensor::empty(tensor.shape, tensor.dtype);
    std::memcpy(copy.raw(), stored, tensor.nbytes);
    return copy;
  }
  // The mapping is PROT_READ; Tensor's data pointer is non-const only because Tensor serves
  // writable buffers too.
  return Tensor::borrow(const_cast<uint8_t*>(stored), tensor.shape, tensor.dtype, mapping);
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, tensor] : tensors_) total += tensor.nbytes;
  return total;
}

}  // namespace kiln
