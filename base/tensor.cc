#include "fp8moe/tensor.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

#include "fp8moe/memory.h"

namespace fp8moe {

constexpr size_t kAlign = 64;
constexpr size_t kHugeAlign = size_t{2} << 20;
constexpr size_t kHugeMin = size_t{4} << 20;
// Freed large blocks are kept for reuse, up to this many bytes: a training
// step allocates the same activation and gradient buffers every step, and
// fresh memory costs a page fault and a page clear per page (a quarter of a
// MoE layer step before this pool).
constexpr size_t kPoolMaxBytes = size_t{2} << 30;

class LargeBlockPool {
 public:
  // A cached block of exactly `bytes`, or nullptr.
  void* Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(bytes);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    cached_ -= bytes;
    return p;
  }
  // Keeps the block if there is room; else the caller frees it.
  bool Give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + bytes > kPoolMaxBytes) return false;
    free_.emplace(bytes, p);
    cached_ += bytes;
    return true;
  }

 private:
  std::mutex mu_;
  std::unordered_multimap<size_t, void*> free_;
  size_t cached_ = 0;
};

LargeBlockPool& Pool() {
  static LargeBlockPool* pool = new LargeBlockPool;  // never destroyed: outlives tensors
  return *pool;
}

Result<size_t> CheckedNumElements(const Shape& shape, size_t elem_size,
                                  size_t max_bytes) {
  // The nonzero dimensions are multiplied on their own, so a zero-element
  // shape such as [2^40, 2^40, 0] is refused like [2^40, 2^40]: every partial
  // product of a shape's dimensions (the strides and offsets kernels compute)
  // then fits, and no index arithmetic on the shape can overflow.
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) {
      return InvalidArgument("shape " + ShapeToString(shape) +
                             " has a negative dimension");
    }
    zero = zero || d == 0;
  }
  const auto too_large = [&] {
    return ResourceExhausted(
        "shape " + ShapeToString(shape) + " of " + std::to_string(elem_size) +
        "-byte elements is too large: " +
        (zero ? "its nonzero dimensions need more than " + std::to_string(max_bytes) +
                    " bytes (refused although a 0 makes it empty, so that no index "
                    "arithmetic on the shape can overflow)"
              : "it needs more than " + std::to_string(max_bytes) + " bytes"));
  };
  size_t nonzero = 1;
  for (int64_t d : shape) {
    if (d == 0) continue;
    const size_t ud = static_cast<size_t>(d);
    if (nonzero > max_bytes / ud) return too_large();
    nonzero *= ud;
  }
  if (elem_size != 0 && nonzero > max_bytes / elem_size) return too_large();
  return zero ? size_t{0} : nonzero;
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

void Shape::TooManyDims() {
  std::fprintf(stderr, "fp8moe: a Shape holds at most %d dimensions (kMaxRank); a reader of "
               "outside shapes must refuse more before building one\n", kMaxRank);
  std::abort();
}

void Shape::OutOfRange(size_t i) const {
  std::fprintf(stderr, "fp8moe: dimension %zu of the shape %s does not exist\n", i,
               ShapeToString(*this).c_str());
  std::abort();
}

size_t NumElements(const Shape& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

void Tensor::Free::operator()(uint8_t* p) const {
  internal::TrackRelease(static_cast<int64_t>(bytes));
  if (bytes >= kHugeMin && Pool().Give(p, bytes)) return;
  std::free(p);
}

Result<Tensor> Tensor::Create(DType dtype, Shape shape) {
  auto n = CheckedNumElements(shape, DTypeSize(dtype));
  if (!n.ok()) return n.status();
  const size_t bytes = *n * DTypeSize(dtype);
  // Refused before anything is allocated when it would pass the memory cap.
  FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest(
      "a tensor " + std::string(DTypeName(dtype)) + " " + ShapeToString(shape), bytes));
  // Large tensors (weights, activations) sit on 2 MiB-aligned memory marked
  // for transparent huge pages: kernels walk weights down K with a stride of
  // a row, touching a new 4 KiB page on every step, and TLB misses then cost
  // more than the arithmetic (measured on the decode GMM shape).
  const bool huge = bytes >= kHugeMin;
  const size_t align = huge ? kHugeAlign : kAlign;
  const size_t padded = (bytes + kAlign + align - 1) / align * align;
  auto* p = huge ? static_cast<uint8_t*>(Pool().Take(padded)) : nullptr;
  if (p == nullptr) {
    p = static_cast<uint8_t*>(std::aligned_alloc(align, padded));
    if (p != nullptr && huge) madvise(p, padded, MADV_HUGEPAGE);  // a hint: failure is fine
  }
  if (p == nullptr) {
    return ResourceExhausted("cannot allocate " + FormatBytes(bytes) +
                             " for a tensor of shape " + ShapeToString(shape) +
                             ": the system is out of memory (the memory cap is " +
                             FormatBytes(MemoryCap()) + ")");
  }
  std::memset(p + bytes, 0, std::min(padded - bytes, kAlign));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.num_elements_ = *n;
  t.bytes_ = std::unique_ptr<uint8_t[], Free>(p, Free{padded});
  internal::TrackAllocation(static_cast<int64_t>(padded));
  return t;
}

Result<Tensor> Tensor::Zeros(DType dtype, Shape shape) {
  auto t = Create(dtype, std::move(shape));
  if (t.ok()) std::memset(t->data(), 0, t->num_bytes());
  return t;
}

Status Tensor::Reshape(Shape shape) {
  auto n = CheckedNumElements(shape, DTypeSize(dtype_));
  if (!n.ok()) return n.status();
  if (*n != num_elements_) {
    return InvalidArgument("cannot reshape " + ShapeToString(shape_) + " to " +
                           ShapeToString(shape) +
                           ": the element counts differ");
  }
  shape_ = std::move(shape);
  return OkStatus();
}

}  // namespace fp8moe
