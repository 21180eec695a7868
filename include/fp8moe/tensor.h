// Tensor: an owning, 64-byte aligned, row-major buffer with a dtype and shape.
// ConstTensorView / TensorView: the non-owning (pointer, dtype, shape)
// currency between layers, read-only for what an op reads, read-write for
// what it writes.
#ifndef FP8MOE_TENSOR_H_
#define FP8MOE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"

namespace fp8moe {

// The most dimensions a shape holds. The model's tensors need 4 (attention
// probabilities [B, H, S, S]); 8 leaves room for the tensors of other
// models' safetensors files (a 3D convolution's weight has 5), which a
// reader must still be able to list. Readers of outside shapes (files,
// numpy arrays) refuse more with a clear error before building a Shape.
inline constexpr int kMaxRank = 8;

// The dimensions of a tensor, held inline (no heap allocation: a Shape, and
// with it a TensorView, is built in every layer call of a step). Reads like
// the std::vector<int64_t> it replaces: size, [], iteration, ==, push_back.
// Building one of more than kMaxRank dimensions is a programming error
// (callers with outside input check the rank first) and aborts.
class Shape {
 public:
  using value_type = int64_t;
  using size_type = size_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  constexpr Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    for (int64_t d : dims) push_back(d);
  }
  // `count` dimensions of `value` (count <= kMaxRank).
  Shape(size_t count, int64_t value) {
    for (size_t i = 0; i < count; ++i) push_back(value);
  }
  template <std::input_iterator It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }

  size_t size() const { return rank_; }
  bool empty() const { return rank_ == 0; }
  static constexpr size_t max_size() { return kMaxRank; }
  int64_t& operator[](size_t i) { return dims_[i]; }
  const int64_t& operator[](size_t i) const { return dims_[i]; }
  // Checked: an index past the rank aborts (as std::vector's at throws).
  const int64_t& at(size_t i) const {
    if (i >= rank_) OutOfRange(i);
    return dims_[i];
  }
  int64_t* data() { return dims_; }
  const int64_t* data() const { return dims_; }
  int64_t* begin() { return dims_; }
  int64_t* end() { return dims_ + rank_; }
  const int64_t* begin() const { return dims_; }
  const int64_t* end() const { return dims_ + rank_; }
  int64_t& front() { return dims_[0]; }
  int64_t& back() { return dims_[rank_ - 1]; }
  const int64_t& front() const { return dims_[0]; }
  const int64_t& back() const { return dims_[rank_ - 1]; }

  void push_back(int64_t d) {
    if (rank_ == kMaxRank) TooManyDims();
    dims_[rank_++] = d;
  }
  void pop_back() { dims_[--rank_] = 0; }
  void clear() { *this = Shape(); }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (size_t i = 0; i < a.rank_; ++i) {
      if (a.dims_[i] != b.dims_[i]) return false;
    }
    return true;
  }

 private:
  [[noreturn]] static void TooManyDims();
  [[noreturn]] void OutOfRange(size_t i) const;

  // Dimensions past the rank stay zero, so a copy never reads an
  // indeterminate value.
  int64_t dims_[kMaxRank] = {};
  size_t rank_ = 0;
};

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

// A view of contiguous row-major data owned elsewhere: (pointer, dtype,
// shape), the currency between layers. One template, two kinds:
//  ConstTensorView (Void = const void): read-only, the type of every input
//    of an op; as<T>() gives const T*.
//  TensorView (Void = void): read-write, the type of every output (passed by
//    const reference: the view is fixed, the bytes it points at are written).
//    It converts implicitly to the ConstTensorView of the same bytes, so a
//    buffer just written is handed on as the next op's input; nothing
//    converts back, so a view of a const Tensor cannot reach an output.
template <class Void>
struct BasicTensorView {
  Void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  size_t num_elements() const { return NumElements(shape); }
  size_t num_bytes() const { return num_elements() * DTypeSize(dtype); }
  int rank() const { return static_cast<int>(shape.size()); }
  template <typename T>
  auto* as() const {
    return static_cast<std::conditional_t<std::is_const_v<Void>, const T, T>*>(data);
  }
  operator BasicTensorView<const void>() const
    requires(!std::is_const_v<Void>)
  {
    return {data, dtype, shape};
  }
};
using ConstTensorView = BasicTensorView<const void>;
using TensorView = BasicTensorView<void>;

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
  // A view of the whole tensor: read-write from a mutable tensor, read-only
  // from a const one.
  TensorView view() { return TensorView{bytes_.get(), dtype_, shape_}; }
  ConstTensorView view() const { return ConstTensorView{bytes_.get(), dtype_, shape_}; }

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
