#include "core/tensor.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace kiln {

std::string shape_string(const Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

Tensor Tensor::empty(Shape shape, DType dtype) {
  for (int64_t extent : shape)
    if (extent < 0) fail("tensor shape {} has a negative extent", shape_string(shape));
  Tensor tensor;
  tensor.shape_ = std::move(shape);
  tensor.dtype_ = dtype;
  // 64-byte alignment serves every SIMD width kiln uses; round the size up as aligned_alloc needs.
  size_t bytes = (tensor.nbytes() + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  void* memory = std::aligned_alloc(64, bytes);
  if (!memory) fail("out of host memory allocating {} bytes for tensor {}", bytes, shape_string(tensor.shape_));
  tensor.owner_ = std::shared_ptr<void>(memory, std::free);
  tensor.data_ = memory;
  return tensor;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor tensor = empty(std::move(shape), dtype);
  std::memset(tensor.data_, 0, tensor.nbytes());
  return tensor;
}

Tensor Tensor::borrow(void* data, Shape shape, DType dtype, std::shared_ptr<const void> owner,
                      Device device) {
  Tensor tensor;
  tensor.owner_ = std::move(owner);
  tensor.data_ = data;
  tensor.shape_ = std::move(shape);
  tensor.dtype_ = dtype;
  tensor.device_ = device;
  return tensor;
}

Tensor Tensor::unbacked(Shape shape, DType dtype, Device device, std::shared_ptr<const void> owner) {
  for (int64_t extent : shape)
    if (extent < 0) fail("tensor shape {} has a negative extent", shape_string(shape));
  // Address space with no access rights and no memory behind it, reserved once and never
  // unmapped; addresses are handed out a granule apart, round the range.
  constexpr size_t kReserved = size_t{64} << 20, kGranule = 64;
  static char* const inaccessible = [] {
    void* range = ::mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (range == MAP_FAILED) fail("cannot reserve the address range of unbacked tensors");
    return static_cast<char*>(range);
  }();
  static std::atomic<size_t> made{0};
  char* data = inaccessible + made.fetch_add(1, std::memory_order_relaxed) % (kReserved / kGranule) * kGranule;
  return borrow(data, std::move(shape), dtype, std::move(owner), device);
}

int64_t Tensor::dim(int axis) const {
  int resolved = axis < 0 ? axis + ndim() : axis;
  if (resolved < 0 || resolved >= ndim()) fail("axis {} out of range for tensor {}", axis, shape_string(shape_));
  return shape_[resolved];
}

Tensor Tensor::reshape(Shape shape) const {
  if (shape_numel(shape) != numel())
    fail("cannot reshape tensor {} to {}", shape_string(shape_), shape_string(shape));
  Tensor view = *this;
  view.shape_ = std::move(shape);
  return view;
}

Tensor Tensor::slice_rows(int64_t start, int64_t count) const {
  if (ndim() == 0 || start < 0 || count < 0 || start + count > shape_[0])
    fail("row slice [{}, {}) out of range for tensor {}", start, start + count, shape_string(shape_));
  Tensor view = *this;
  const int64_t row_elements = shape_[0] ? numel() / shape_[0] : 0;
  view.data_ = static_cast<char*>(data_) + start * row_elements * static_cast<int64_t>(dtype_size(dtype_));
  view.shape_[0] = count;
  return view;
}

}  // namespace kiln
