// NumPy .npy files (format 1.0/2.0, little-endian, C order): float32 / float64 / int32 arrays.
// kiln writes logits as .npy and reads the reference logits of the fixtures.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "core/tensor.h"

namespace kiln {

struct NpyArray {
  Shape shape;
  std::vector<double> values;  // widened exactly from '<f4', '<f8' or '<i4'
};

NpyArray read_npy(const std::filesystem::path& path);
// Writes a float32 array of `shape` (row-major).
void write_npy_f32(const std::filesystem::path& path, const Shape& shape, const float* values);

}  // namespace kiln
