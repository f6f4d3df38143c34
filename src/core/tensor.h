// Tensor: a dense, row-major, contiguous n-d array on one device.
//
// A Tensor is a cheap handle: copies share the storage. It either owns its memory (allocated by
// Tensor::empty or a backend allocator) or borrows it (a memory-mapped checkpoint range) while
// holding a keep-alive reference to the owner, so a view can never outlive its bytes.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace kiln {

enum class Device : uint8_t { CPU, CUDA };

using Shape = std::vector<int64_t>;

std::string shape_string(const Shape& shape);
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // A new host tensor, 64-byte aligned, contents unspecified.
  static Tensor empty(Shape shape, DType dtype);
  static Tensor zeros(Shape shape, DType dtype);
  // A tensor over memory owned by `owner` (kept alive as long as any view exists).
  static Tensor borrow(void* data, Shape shape, DType dtype, std::shared_ptr<const void> owner,
                       Device device = Device::CPU);
  // A tensor of this shape and dtype with no storage, for dry runs that only follow shapes (the
  // measuring backend, shape-only weights); `owner`, when given, is kept alive as for borrow. Its
  // data address lies in a reserved range with no access rights, so that reading or writing
  // through it faults instead of touching memory, and is its own (ops compare addresses to find
  // aliases) among the last million unbacked tensors made.
  static Tensor unbacked(Shape shape, DType dtype, Device device = Device::CPU,
                         std::shared_ptr<const void> owner = nullptr);

  bool defined() const { return data_ != nullptr || numel() == 0; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int axis) const;  // negative axes count from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

  // Same storage, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [start, start + count) along axis 0, sharing storage.
  Tensor slice_rows(int64_t start, int64_t count) const;

 private:
  std::shared_ptr<const void> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

}  // namespace kiln
