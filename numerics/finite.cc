#include "fp8moe/finite.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "fp8moe/numerics.h"

namespace fp8moe {
namespace {

// Element i as a double: the exact value for every floating dtype.
double ValueAt(const ConstTensorView& t, size_t i) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data);
  switch (t.dtype) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      // Only the class matters here: exponent all ones is Inf (mantissa 0)
      // or NaN; everything else is finite and its value is not reported.
      if ((h & 0x7C00) != 0x7C00) return 0.0;
      const double inf = (h & 0x8000) ? -INFINITY : INFINITY;
      return (h & 0x03FF) ? NAN : inf;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return Bf16ToF32(b);
    }
    default:
      return DecodeFp8(p[i], *Fp8FormatOf(t.dtype));
  }
}

}  // namespace

bool IsFloatingDType(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kF16 ||
         dtype == DType::kBF16 || IsFp8(dtype);
}

NonFinite FindNonFinite(const ConstTensorView& t) {
  NonFinite r;
  if (!IsFloatingDType(t.dtype) || t.data == nullptr) return r;
  const size_t n = t.num_elements();
  for (size_t i = 0; i < n; ++i) {
    const double v = ValueAt(t, i);
    if (std::isfinite(v)) continue;
    if (r.count == 0) {
      r.first = static_cast<int64_t>(i);
      r.first_value = v;
    }
    ++r.count;
  }
  return r;
}

Status CheckFinite(std::string_view name, const ConstTensorView& t) {
  const NonFinite nf = FindNonFinite(t);
  if (nf.count == 0) return OkStatus();
  // The multi-index of the first, row-major.
  Shape index(t.shape.size(), 0);
  int64_t rest = nf.first;
  for (size_t d = t.shape.size(); d-- > 0;) {
    const int64_t dim = t.shape[d];
    if (dim > 0) {
      index[d] = rest % dim;
      rest /= dim;
    }
  }
  const std::string value = std::isnan(nf.first_value) ? "nan"
                            : nf.first_value > 0     ? "inf"
                                                     : "-inf";
  return InvalidArgument("tensor '" + std::string(name) + "' (" +
                         std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) +
                         ") holds " + std::to_string(nf.count) + " NaN or Inf value" +
                         (nf.count == 1 ? "" : "s") + "; the first is " + value +
                         " at index " + std::to_string(nf.first) + " " +
                         ShapeToString(index));
}

}  // namespace fp8moe
