#include "io/npy.h"

#include <cstring>
#include <fstream>
#include <regex>
#include <string>

#include "core/error.h"

namespace kiln {

NpyArray read_npy(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  char magic[8];
  in.read(magic, 8);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) fail("{}: not a .npy file", path.string());
  uint32_t header_length = 0;
  if (magic[6] == 1) {
    uint16_t length16;
    in.read(reinterpret_cast<char*>(&length16), 2);
    header_length = length16;
  } else {
    in.read(reinterpret_cast<char*>(&header_length), 4);
  }
  std::string header(header_length, '\0');
  in.read(header.data(), header_length);
  if (!in) fail("{}: truncated header", path.string());

  std::smatch match;
  if (!std::regex_search(header, match, std::regex("'descr':\\s*'([^']+)'")))
    fail("{}: header has no descr", path.string());
  const std::string descr = match[1];
  if (header.find("'fortran_order': False") == std::string::npos)
    fail("{}: only C-order arrays are supported", path.string());
  if (!std::regex_search(header, match, std::regex("'shape':\\s*\\(([^)]*)\\)")))
    fail("{}: header has no shape", path.string());
  NpyArray array;
  const std::string dims = match[1];
  const std::regex number("\\d+");
  for (std::sregex_iterator it(dims.begin(), dims.end(), number), end; it != end; ++it)
    array.shape.push_back(std::stoll(it->str()));

  const int64_t count = shape_numel(array.shape);
  array.values.resize(count);
  auto read_as = [&](auto sample) {
    using T = decltype(sample);
    std::vector<T> raw(count);
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(count * sizeof(T)));
    if (!in) fail("{}: truncated data ({} elements expected)", path.string(), count);
    for (int64_t i = 0; i < count; ++i) array.values[i] = static_cast<double>(raw[i]);
  };
  if (descr == "<f4") read_as(float{});
  else if (descr == "<f8") read_as(double{});
  else if (descr == "<i4") read_as(int32_t{});
  else fail("{}: unsupported dtype '{}'", path.string(), descr);
  return array;
}

void write_npy_f32(const std::filesystem::path& path, const Shape& shape, const float* values) {
  std::string dims;
  for (int64_t extent : shape) dims += std::to_string(extent) + ",";
  if (shape.size() > 1) dims.pop_back();
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Pad so that magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) fail("{}: cannot create", path.string());
  out.write("\x93NUMPY\x01\x00", 8);
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.write(reinterpret_cast<const char*>(&length), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(values), static_cast<std::streamsize>(shape_numel(shape) * 4));
  if (!out) fail("{}: write failed", path.string());
}

}  // namespace kiln
