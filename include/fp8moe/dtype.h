// Element types of tensors, with their sizes and names.
#ifndef FP8MOE_DTYPE_H_
#define FP8MOE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fp8moe/status.h"

namespace fp8moe {

enum class DType : uint8_t {
  kF32,
  kF64,
  kF16,
  kBF16,
  kE4M3FN,    // ml_dtypes float8_e4m3fn
  kE4M3FNUZ,  // ml_dtypes float8_e4m3fnuz
  kE5M2,      // ml_dtypes float8_e5m2
  kE5M2FNUZ,  // ml_dtypes float8_e5m2fnuz
  kBool,
  kI8,
  kU8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
};

// Bytes per element.
size_t DTypeSize(DType dtype);

// Our short name: "f32", "bf16", "e4m3fn", "int8", "int32", ...
std::string_view DTypeName(DType dtype);

// Parses DTypeName()'s names and common aliases ("float32", "bfloat16",
// "i8", ...). The error lists the accepted names.
Result<DType> ParseDType(std::string_view name);

// True for the four 8-bit float formats.
bool IsFp8(DType dtype);

}  // namespace fp8moe

#endif  // FP8MOE_DTYPE_H_
