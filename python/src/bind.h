// Helpers shared by the nanobind bindings of fp8moe._core: numpy arrays in
// (as views, never copied), numpy arrays out (fp8moe Tensors handed to numpy
// without a copy), and Status -> Python exception.
//
// Python's wrapper (python/fp8moe/_arrays.py) passes every array as
// (array, dtype name): ml_dtypes arrays (bfloat16, float8_*) arrive viewed as
// the unsigned integer type of the same width, because numpy can export them
// through neither DLPack nor the buffer protocol; the name says what the bytes
// are. Outputs come back the same way and Python views them as their ml_dtypes
// type, again without a copy.
#ifndef FP8MOE_PYTHON_SRC_BIND_H_
#define FP8MOE_PYTHON_SRC_BIND_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <string>
#include <string_view>

#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe::py {

namespace nb = nanobind;

// Any CPU array, any dtype and strides (checked by View).
using Array = nb::ndarray<nb::ro, nb::device::cpu>;

// Every call into the library runs under this lock, from Python and from the
// XLA FFI handlers alike. Each call already uses every core (OpenMP), so two
// at once would only oversubscribe them; and the kernels' per-thread scratch
// then never sees two calls interleaved.
std::mutex& LibraryLock();

// What every call into the library holds for its duration (one per entry
// point, from Python and from the XLA FFI handlers): LibraryLock, and IEEE
// subnormals (MXCSR's flush-to-zero and denormals-are-zero bits clear) on the
// calling thread and on every OpenMP worker of its team. Why: XLA runs its
// CPU computations, our FFI handlers among them, with FTZ/DAZ set, and a
// thread inherits MXCSR from the thread that creates it, so an OpenMP team
// first started inside an FFI call would flush subnormals in every later
// call too, and a kernel's result would depend on which thread computed
// which rows. The numerics contract (bit-exact with ml_dtypes) needs
// subnormals. The caller's MXCSR is restored at the end (XLA's own code
// after the handler keeps its mode); the workers are left IEEE (their
// default).
class LibraryCall {
 public:
  LibraryCall();
  ~LibraryCall();
  LibraryCall(const LibraryCall&) = delete;
  LibraryCall& operator=(const LibraryCall&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  unsigned caller_mxcsr_ = 0;
};

// Raises the Python exception for `s` with `fn` + ": " + s.message():
// ValueError for caller errors (invalid argument, not found, out of range,
// failed precondition), MemoryError for resource exhaustion, RuntimeError
// otherwise. Does nothing when s is ok.
void ThrowIfError(std::string_view fn, const Status& s);

// A read-only view of `a` (arrays come in read-only, nb::ro) whose bytes
// hold `dtype` (a DTypeName / ParseDType name). Raises ValueError naming `fn`
// and `name` when the dtype is unknown or does not match the array's element
// width, or when the array is not C-contiguous or not aligned to its element
// size (no copy is ever made).
ConstTensorView View(std::string_view fn, std::string_view name, const Array& a,
                     std::string_view dtype);

// A new numpy array of `dtype` and `shape` that owns a fp8moe Tensor (64-byte
// aligned, large ones on huge pages), and a view of it for the library to
// write. Elements of bf16 come out as uint16, fp8 as uint8 (Python views
// them as ml_dtypes). Raises MemoryError if the allocation fails.
struct NewArray {
  nb::object array;
  TensorView view;
};
NewArray MakeArray(std::string_view fn, DType dtype, const Shape& shape);

// (array, DTypeName(dtype)): how outputs return to Python.
nb::tuple Out(const NewArray& a);

// Registration of each group of bindings (one file each).
void BindNumerics(nb::module_& m);
void BindGmm(nb::module_& m);
void BindMoe(nb::module_& m);
// The XLA FFI handlers as {target name: PyCapsule}; empty when the module was
// built without the XLA FFI headers.
nb::dict FfiTargets();
#ifdef FP8MOE_WITH_XLA_FFI
void AddGmmFfiTargets(nb::dict& targets);  // ffi_gmm.cc
void AddMoeFfiTargets(nb::dict& targets);  // bind_moe.cc
#endif

// A numpy array that takes ownership of `t` (no copy).
NewArray Adopt(Tensor t);

}  // namespace fp8moe::py

#endif  // FP8MOE_PYTHON_SRC_BIND_H_
