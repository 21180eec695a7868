// Finding NaN and Inf in tensors: the check behind `fp8moe op ...
// check_finite=true`, for any caller that wants to refuse non-finite inputs
// by name (a trainer checking a batch or a loaded checkpoint).
#ifndef FP8MOE_FINITE_H_
#define FP8MOE_FINITE_H_

#include <cstdint>
#include <string_view>

#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {

// The non-finite elements of a tensor.
struct NonFinite {
  int64_t count = 0;    // NaN and +-Inf elements
  int64_t first = -1;   // flat index of the first, or -1
  double first_value = 0;  // its value (NaN or +-Inf)
};

// Whether a dtype holds floating-point values that can be NaN or Inf: F64,
// F32, F16, BF16 and the four fp8 formats (whose NaN and Inf codes follow
// ml_dtypes). Integer and BOOL tensors are always finite.
bool IsFloatingDType(DType dtype);

// Counts the NaN and Inf elements of `t` (0 for non-floating dtypes).
NonFinite FindNonFinite(const ConstTensorView& t);

// OkStatus, or InvalidArgument naming the tensor, the count and the first
// one: "tensor 'lhs' (f32 [4, 8]) holds 3 NaN or Inf values; the first is nan
// at index 9 [1, 1]".
Status CheckFinite(std::string_view name, const ConstTensorView& t);

}  // namespace fp8moe

#endif  // FP8MOE_FINITE_H_
