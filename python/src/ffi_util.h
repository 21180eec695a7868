// Helpers of the XLA FFI handlers (compiled only with the XLA FFI headers,
// jax.ffi.include_dir()): XLA buffers as views (no copy: the kernels read
// XLA's operands through ConstTensorViews and write XLA's results in place
// through TensorViews), attributes, and Status -> ffi::Error.
#ifndef FP8MOE_PYTHON_SRC_FFI_UTIL_H_
#define FP8MOE_PYTHON_SRC_FFI_UTIL_H_

#include <optional>
#include <string>
#include <string_view>

#include "fp8moe/status.h"
#include "fp8moe/tensor.h"
#include "xla/ffi/api/ffi.h"

namespace fp8moe::py::ffi_util {

namespace ffi = ::xla::ffi;

// The fp8moe dtype of an XLA element type, or nullopt for one fp8moe does
// not know (then ToView reports it).
std::optional<DType> FromXla(ffi::DataType t);

// A view of an XLA buffer (XLA buffers are dense row-major). XLA's API hands
// out a mutable pointer for operands and results alike; Arg makes an
// operand's view read-only.
Result<TensorView> ToView(std::string_view name, const ffi::AnyBuffer& b);

// `fn` + ": " + s.message() with the matching XLA error code.
ffi::Error ToError(std::string_view fn, const Status& s);

// Attribute `name` of `attrs`, or an error naming it.
template <typename T>
Result<T> GetAttr(const ffi::Dictionary& attrs, std::string_view name) {
  auto v = attrs.get<T>(name);
  if (!v.has_value()) {
    return InvalidArgument("attribute '" + std::string(name) + "': " +
                           v.error().message());
  }
  return T(*v);
}

// Operand `i` of a variadic handler as a read-only view, result `i` as a
// writable one.
Result<ConstTensorView> Arg(const ffi::RemainingArgs& args, size_t i, std::string_view name);
Result<TensorView> Ret(const ffi::RemainingRets& rets, size_t i, std::string_view name);

}  // namespace fp8moe::py::ffi_util

#endif  // FP8MOE_PYTHON_SRC_FFI_UTIL_H_
