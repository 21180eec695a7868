// Scalar reference conversions: written for clarity, not speed. The SIMD span
// functions in convert-inl.h must give the same bits.
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "fp8moe/numerics.h"
#include "numerics/fp8_spec.h"

namespace fp8moe {
namespace {

constexpr std::string_view kNames[] = {"e4m3fn", "e4m3fnuz", "e5m2",
                                       "e5m2fnuz"};

// ml_dtypes decodes every NaN code to the canonical quiet NaN; the fnuz NaN
// (code 0x80) has its sign bit set, so it decodes to a negative NaN.
float QuietNaN(bool negative) {
  return std::bit_cast<float>(negative ? 0xFFC00000u : 0x7FC00000u);
}

}  // namespace

const Fp8Spec& GetFp8Spec(Fp8Format format) {
  return kFp8Specs[static_cast<int>(format)];
}

std::string_view Fp8FormatName(Fp8Format format) {
  return kNames[static_cast<int>(format)];
}

Result<Fp8Format> ParseFp8Format(std::string_view name) {
  if (name.substr(0, 7) == "float8_") name.remove_prefix(7);
  for (int i = 0; i < 4; ++i) {
    if (kNames[i] == name) return static_cast<Fp8Format>(i);
  }
  return InvalidArgument("unknown fp8 format '" + std::string(name) +
                         "'; expected one of: e4m3fn, e4m3fnuz, e5m2, "
                         "e5m2fnuz");
}

DType Fp8FormatDType(Fp8Format format) {
  constexpr DType kDTypes[] = {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2,
                               DType::kE5M2FNUZ};
  return kDTypes[static_cast<int>(format)];
}

Result<Fp8Format> Fp8FormatOf(DType dtype) {
  switch (dtype) {
    case DType::kE4M3FN: return Fp8Format::kE4M3FN;
    case DType::kE4M3FNUZ: return Fp8Format::kE4M3FNUZ;
    case DType::kE5M2: return Fp8Format::kE5M2;
    case DType::kE5M2FNUZ: return Fp8Format::kE5M2FNUZ;
    default:
      return InvalidArgument("dtype " + std::string(DTypeName(dtype)) +
                             " is not an fp8 format");
  }
}

float DecodeFp8(uint8_t code, Fp8Format format) {
  const Fp8Spec& s = GetFp8Spec(format);
  const bool negative = (code & 0x80) != 0;
  const int man_mask = (1 << s.mantissa_bits) - 1;
  const int exp_max = (1 << s.exponent_bits) - 1;
  const int exponent = (code & 0x7F) >> s.mantissa_bits;
  const int mantissa = code & man_mask;
  if (s.fnuz) {
    if (code == 0x80) return QuietNaN(true);
  } else if (s.has_inf) {
    if (exponent == exp_max) {
      if (mantissa == 0) {
        return negative ? -std::numeric_limits<float>::infinity()
                        : std::numeric_limits<float>::infinity();
      }
      return QuietNaN(negative);
    }
  } else if ((code & 0x7F) == 0x7F) {
    return QuietNaN(negative);
  }
  // value = significand * 2^(e - bias - mantissa_bits), with the implicit
  // leading one only for normal numbers; exact in f32 for every format.
  const int significand = exponent == 0 ? mantissa : (mantissa | (man_mask + 1));
  const int e = (exponent == 0 ? 1 : exponent) - s.bias - s.mantissa_bits;
  const float magnitude = std::ldexp(static_cast<float>(significand), e);
  return negative ? -magnitude : magnitude;
}

uint8_t EncodeFp8(float x, Fp8Format format, bool saturate) {
  const Fp8Spec& s = GetFp8Spec(format);
  const bool negative = std::signbit(x);
  const uint8_t sign = negative ? 0x80 : 0x00;  // fnuz NaN 0x80 absorbs it
  if (std::isnan(x)) return s.nan_code | sign;
  // What a value past max becomes without saturation.
  const uint8_t overflow = s.has_inf ? (0x7C | sign) : (s.nan_code | sign);

  float a = std::fabs(x);
  if (saturate && a > s.max) a = s.max;  // also maps inf to max
  if (std::isinf(a)) return overflow;

  // Round a to the grid of the format as if the exponent range were unbounded
  // above: the quantum is 2^(e - mantissa_bits) where e is the binade of a,
  // but never below the subnormal quantum 2^(1 - bias - mantissa_bits).
  // Division by a power of two is exact, so nearbyint (ties to even in the
  // default rounding mode) is the only rounding.
  const int min_exp = 1 - s.bias;
  int e = min_exp;
  if (a != 0.0f) {
    int frexp_exp;
    std::frexp(a, &frexp_exp);  // a = f * 2^frexp_exp, f in [0.5, 1)
    e = std::max(frexp_exp - 1, min_exp);
  }
  const float quantum = std::ldexp(1.0f, e - s.mantissa_bits);
  const float q = std::nearbyint(a / quantum);  // in [0, 2^(mantissa_bits+1)]
  if (q * quantum > s.max) return overflow;     // only when not saturating

  const int one = 1 << s.mantissa_bits;
  int significand = static_cast<int>(q);
  int biased_exp = e + s.bias;  // >= 1
  if (significand == 2 * one) {  // rounded up into the next binade
    significand = one;
    ++biased_exp;
  }
  int code;
  if (significand < one) {
    code = significand;  // subnormal (or zero): exponent field 0
  } else {
    code = (biased_exp << s.mantissa_bits) | (significand - one);
  }
  if (code == 0) return s.fnuz ? 0x00 : sign;  // fnuz has no -0
  return static_cast<uint8_t>(code | sign);
}

uint16_t F32ToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return (bits >> 16 & 0x8000) | 0x7FC0;
  // Round to nearest even on the 16 dropped bits; overflow carries into the
  // exponent and correctly produces inf.
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToF32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

int8_t EncodeInt8(float x_over_scale) {
  if (std::isnan(x_over_scale)) return 0;
  const float clamped = std::fmin(std::fmax(x_over_scale, -127.0f), 127.0f);
  return static_cast<int8_t>(std::nearbyint(clamped));
}

}  // namespace fp8moe
