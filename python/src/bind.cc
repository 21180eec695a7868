#include "python/src/bind.h"

#include <Python.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "fp8moe/dtype.h"

namespace fp8moe::py {

std::mutex& LibraryLock() {
  static std::mutex* mu = new std::mutex;  // never destroyed: FFI calls may outlive statics
  return *mu;
}

namespace {

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kFlushBits = 0x8000u | 0x0040u;  // MXCSR FTZ | DAZ
unsigned ReadMxcsr() { return _mm_getcsr(); }
void WriteMxcsr(unsigned v) { _mm_setcsr(v); }
#else
// The library's SIMD targets are x86's; elsewhere there is no MXCSR to mend.
constexpr unsigned kFlushBits = 0;
unsigned ReadMxcsr() { return 0; }
void WriteMxcsr(unsigned) {}
#endif

}  // namespace

LibraryCall::LibraryCall() : lock_(LibraryLock()), caller_mxcsr_(ReadMxcsr()) {
  if (kFlushBits == 0) return;
  WriteMxcsr(caller_mxcsr_ & ~kFlushBits);
  // One region with the team later regions of this call reuse (libgomp
  // keeps a team per calling thread): each worker clears its own bits.
#pragma omp parallel
  WriteMxcsr(ReadMxcsr() & ~kFlushBits);
}

LibraryCall::~LibraryCall() {
  if (kFlushBits != 0) WriteMxcsr(caller_mxcsr_);
}

void ThrowIfError(std::string_view fn, const Status& s) {
  if (s.ok()) return;
  const std::string msg = std::string(fn) + ": " + s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
      throw nb::value_error(msg.c_str());
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw nb::python_error();
    default:
      PyErr_SetString(PyExc_RuntimeError, msg.c_str());
      throw nb::python_error();
  }
}

namespace {

[[noreturn]] void Bad(std::string_view fn, const std::string& msg) {
  throw nb::value_error((std::string(fn) + ": " + msg).c_str());
}

// "[2, 3]": written out directly, since an array may have more dimensions
// than a Shape holds (the error that says so quotes it).
std::string ShapeOf(const Array& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// The element type numpy uses to hold `dtype`'s bytes.
nb::dlpack::dtype StorageDType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return nb::dtype<float>();
    case DType::kF64: return nb::dtype<double>();
    case DType::kI8: return nb::dtype<int8_t>();
    case DType::kI16: return nb::dtype<int16_t>();
    case DType::kI32: return nb::dtype<int32_t>();
    case DType::kI64: return nb::dtype<int64_t>();
    case DType::kU16: return nb::dtype<uint16_t>();
    case DType::kU32: return nb::dtype<uint32_t>();
    case DType::kU64: return nb::dtype<uint64_t>();
    case DType::kBool: return nb::dtype<bool>();
    case DType::kF16:
    case DType::kBF16: return nb::dtype<uint16_t>();
    default: return nb::dtype<uint8_t>();  // fp8 codes, u8
  }
}

}  // namespace

ConstTensorView View(std::string_view fn, std::string_view name, const Array& a,
                     std::string_view dtype) {
  auto parsed = ParseDType(dtype);
  if (!parsed.ok()) Bad(fn, std::string(name) + ": " + parsed.status().message());
  const DType d = *parsed;
  const size_t width = DTypeSize(d);
  if (a.itemsize() != width) {
    Bad(fn, std::string(name) + " holds " + std::to_string(a.itemsize()) +
                "-byte elements but was passed as " + std::string(dtype) + " (" +
                std::to_string(width) + " bytes)");
  }
  if (a.ndim() > static_cast<size_t>(kMaxRank)) {
    Bad(fn, std::string(name) + " with shape " + ShapeOf(a) + " has " +
                std::to_string(a.ndim()) + " dimensions; fp8moe takes at most " +
                std::to_string(kMaxRank));
  }
  ConstTensorView v;
  v.dtype = d;
  int64_t expect = 1;  // C-contiguous strides, in elements
  bool contiguous = true;
  for (size_t i = a.ndim(); i-- > 0;) {
    const int64_t n = static_cast<int64_t>(a.shape(i));
    if (n != 1 && a.stride(i) != expect) contiguous = false;
    expect *= n;
  }
  for (size_t i = 0; i < a.ndim(); ++i) v.shape.push_back(static_cast<int64_t>(a.shape(i)));
  if (!contiguous && expect > 0) {
    Bad(fn, std::string(name) + " with shape " + ShapeOf(a) +
                " is not C-contiguous; fp8moe reads arrays in place and never "
                "copies them: pass np.ascontiguousarray(" + std::string(name) + ")");
  }
  v.data = a.data();
  if (reinterpret_cast<uintptr_t>(v.data) % width != 0) {
    Bad(fn, std::string(name) + " is not aligned to its " + std::to_string(width) +
                "-byte elements; pass a copy (np.array(" + std::string(name) + "))");
  }
  return v;
}

NewArray MakeArray(std::string_view fn, DType dtype, const Shape& shape) {
  auto t = Tensor::Create(dtype, shape);
  ThrowIfError(fn, t.status());
  return Adopt(std::move(*t));
}

NewArray Adopt(Tensor t) {
  auto* owned = new Tensor(std::move(t));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  const Shape shape = owned->shape();
  std::vector<size_t> dims(shape.begin(), shape.end());
  // numpy wants a non-null pointer even for an empty array.
  alignas(64) static uint8_t empty[64];
  void* data = owned->num_elements() > 0 ? owned->data() : empty;
  nb::ndarray<nb::numpy> arr(data, dims.size(), dims.data(), owner, nullptr,
                             StorageDType(owned->dtype()));
  return {arr.cast(), TensorView{data, owned->dtype(), shape}};
}

nb::tuple Out(const NewArray& a) {
  return nb::make_tuple(a.array, std::string(DTypeName(a.view.dtype)));
}

}  // namespace fp8moe::py
