// Tensor: an owning, 64-byte aligned, row-major buffer with a dtype and shape.
// TensorView: the non-owning (pointer, shape, dtype) currency between layers.
#ifndef FP8MOE_TENSOR_H_
#define FP8MOE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"

namespace fp8moe {

using Shape = std::vector<int64_t>;

// Number of elements of `shape`; an error if a dimension is negative or the
// product of its nonzero dimensions (times `elem_size` bytes) exceeds
// `max_bytes`. Zeros are left out of that product on purpose: [2^40, 2^40, 0]
// has no elements but is refused, so every partial product of an accepted
// shape's dimensions fits in int64 and index arithmetic on it cannot overflow.
Result<size_t> CheckedNumElements(const Shape& shape, size_t elem_size,
                                  size_t max_bytes = SIZE_MAX / 2);

// The product of `shape`'s dimensions, unchecked: for shapes that have
// already passed CheckedNumElements (a tensor's, a validated config's).
size_t NumElements(const Shape& shape);

// "[2, 3, 4]".
std::string ShapeToString(const Shape& shape);

// A read-write view of contiguous row-major data owned elsewhere.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  size_t num_elements() const;
  size_t num_bytes() const { return num_elements() * DTypeSize(dtype); }
  int rank() const { return static_cast<int>(shape.size()); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// Owns its bytes; 64-byte aligned; the padding up to a multiple of 64 bytes
// is zeroed so vector loads past the end read defined data.
class Tensor {
 public:
  Tensor() = default;
  // Allocates an uninitialized tensor; fails with a clear error when the shape
  // is invalid (InvalidArgument), too large to allocate, or would pass the
  // memory cap of memory.h (ResourceExhausted, checked before allocating).
  static Result<Tensor> Create(DType dtype, Shape shape);
  // As Create, but every byte is zero.
  static Result<Tensor> Zeros(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(static_cast<size_t>(i)); }
  int rank() const { return static_cast<int>(shape_.size()); }
  size_t num_elements() const { return num_elements_; }
  size_t num_bytes() const { return num_elements_ * DTypeSize(dtype_); }

  void* data() { return bytes_.get(); }
  const void* data() const { return bytes_.get(); }
  template <typename T>
  T* data_as() {
    return reinterpret_cast<T*>(bytes_.get());
  }
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(bytes_.get());
  }
  // A view of the whole tensor. Views carry a mutable pointer (they are the
  // currency between layers, inputs and outputs alike); a view of a const
  // tensor must only be read.
  TensorView view() const {
    return TensorView{const_cast<uint8_t*>(bytes_.get()), dtype_, shape_};
  }

  // Same bytes, new shape with the same number of elements.
  Status Reshape(Shape shape);

 private:
  struct Free {
    size_t bytes;  // allocated size, for memory accounting (set with the pointer)
    void operator()(uint8_t* p) const;
  };
  DType dtype_ = DType::kF32;
  Shape shape_;
  size_t num_elements_ = 0;
  std::unique_ptr<uint8_t[], Free> bytes_;
};

}  // namespace fp8moe

#endif  // FP8MOE_TENSOR_H_
