// Per-target SIMD pieces of quantization: amax by integer max over |x| bits
// (non-negative f32 bit patterns order like their values and NaN sorts above
// inf, so one integer max is exact and propagates NaN), and the division by
// the scale (or the multiplication by its reciprocal, for
// ScaleArithmetic::kXlaReciprocal) fused with the saturating fp8 encode or the
// int8 round and clamp.

#if defined(FP8MOE_QUANT_QUANTIZE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_QUANT_QUANTIZE_INL_H_
#undef FP8MOE_QUANT_QUANTIZE_INL_H_
#else
#define FP8MOE_QUANT_QUANTIZE_INL_H_
#endif

#include <algorithm>
#include <cstring>

#include "fp8moe/quant.h"
#include "hwy/highway.h"
#include "numerics/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// |x| bits as i32 lanes.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> AbsBits(DF df, hn::Vec<DF> v) {
  const hn::RebindToSigned<DF> di;
  return hn::And(hn::BitCast(di, v), hn::Set(di, 0x7FFFFFFF));
}

// max over i of |x[i]| bits; > 0x7F800000 means a NaN was seen.
inline uint32_t AbsMaxBitsT(const float* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const size_t N = hn::Lanes(df);
  auto m0 = hn::Zero(di), m1 = hn::Zero(di);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, AbsBits(df, hn::LoadU(df, x + i)));
    m1 = hn::Max(m1, AbsBits(df, hn::LoadU(df, x + i + N)));
  }
  int32_t m = hn::GetLane(hn::MaxOfLanes(di, hn::Max(m0, m1)));
  for (; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, x + i, 4);
    m = std::max(m, b & 0x7FFFFFFF);
  }
  return static_cast<uint32_t>(m);
}

// The same for x as bf16 bits: widening bf16 to f32 is a shift by 16, so
// the max of the 16-bit |x| patterns, shifted, is the f32 AbsMaxBitsT of the
// widened row (NaN still above inf) without widening it.
inline uint32_t AbsMaxBitsBf16T(const uint16_t* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<uint16_t> d;
  const size_t N = hn::Lanes(d);
  const auto mask = hn::Set(d, uint16_t{0x7FFF});
  auto m0 = hn::Zero(d), m1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::And(hn::LoadU(d, x + i), mask));
    m1 = hn::Max(m1, hn::And(hn::LoadU(d, x + i + N), mask));
  }
  uint32_t m = hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
  for (; i < n; ++i) m = std::max<uint32_t>(m, x[i] & 0x7FFFu);
  return m << 16;
}

// acc[i] = max(acc[i], |x[i]| bits) for i < n: the per-channel amax of a
// row-major matrix, one row at a time.
inline void AbsMaxAccumulateT(const float* HWY_RESTRICT x, size_t n,
                              int32_t* HWY_RESTRICT acc) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::Max(hn::LoadU(di, acc + i), AbsBits(df, hn::LoadU(df, x + i))),
               di, acc + i);
  }
  for (; i < n; ++i) {
    int32_t b;
    std::memcpy(&b, x + i, 4);
    acc[i] = std::max(acc[i], b & 0x7FFFFFFF);
  }
}

// x / factor (kMultiply false: a true division, as docs/design.md §3.2 asks) or
// x * factor (a reciprocal scale): what is rounded to a code. A NaN x keeps
// its own bits (its sign picks the NaN code): x / s returns x's NaN, but in
// x * (1 / s) with both NaN which one comes out depends on which operand the
// compiler put first (multiplication commutes).
template <bool kMultiply, bool kFinite, class V>
HWY_INLINE V ScaledForQuantize(V x, V factor) {
  return !kMultiply ? hn::Div(x, factor)
         : kFinite  ? hn::Mul(x, factor)
                    : hn::IfThenElse(hn::IsNaN(x), x, hn::Mul(x, factor));
}

// Codes of x / factor (kMultiply false: a true division, as docs/design.md §3.2 asks)
// or x * factor (kMultiply true: factor is a reciprocal scale) in u32 lanes
// (int8 codes as their byte value).
// kFinite: the caller knows every x is finite and the factor finite and
// non-zero (a block whose amax is finite, quantized by its own scale), so no
// quotient is a NaN and the NaN handling is left out.
template <QuantDType kDType, bool kMultiply, bool kFinite, class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> QuantizeVec(DF df, hn::Vec<DF> x,
                                                       hn::Vec<DF> factor) {
  const hn::RebindToSigned<DF> di;
  const auto v = ScaledForQuantize<kMultiply, kFinite>(x, factor);
  if constexpr (kDType == QuantDType::kInt8) {
    const auto clamped = hn::Min(hn::Max(kFinite ? v : hn::IfThenZeroElse(hn::IsNaN(v), v),
                                         hn::Set(df, -127.0f)),
                                 hn::Set(df, 127.0f));
    return hn::And(hn::ConvertTo(di, hn::Round(clamped)), hn::Set(di, 0xFF));
  } else {
    constexpr Fp8Format f = static_cast<Fp8Format>(kDType);
    return hn::BitCast(di, EncodeFp8Vec<f, true, kFinite>(df, v));
  }
}

// N f32 lanes from f32, or from bf16 bits widened in the register (exact).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadAsF32(DF df, const float* HWY_RESTRICT p) {
  return hn::LoadU(df, p);
}
template <class DF>
HWY_INLINE hn::Vec<DF> LoadAsF32(DF df, const uint16_t* HWY_RESTRICT p) {
  return LoadBf16AsF32(df, p);
}
inline float ScalarAsF32(float v) { return v; }
inline float ScalarAsF32(uint16_t v) { return Bf16ToF32(v); }

// Codes in i32 lanes (0..255, QuantizeVec) as bytes: U8FromU32 (for values
// already in range: a byte shuffle and one permute on AVX-512, a shuffle and
// an or on AVX2), where DemoteTo's saturating packs took four instructions
// per vector on AVX-512.
template <class DF>
HWY_INLINE hn::Vec<hn::Rebind<uint8_t, DF>> CodesToBytes(DF, hn::Vec<hn::RebindToSigned<DF>> c) {
  const hn::RebindToUnsigned<DF> du;
  return hn::U8FromU32(hn::BitCast(du, c));
}

// q[i] = code of x[i] / scales[per_lane ? i : 0], or of x[i] * scales[...]
// with kMultiply (the caller passes reciprocal scales); kFinite as
// QuantizeVec (the tail's padding lanes are x = 0 and a finite scale); x is f32 or bf16
// bits (TIn uint16_t: a GMM's BF16 activation, quantized without an f32
// copy of the row).
template <QuantDType kDType, bool kPerLane, bool kMultiply, bool kFinite = false,
          class TIn = float>
void QuantizeSpanT(const TIn* HWY_RESTRICT x, size_t n,
                   const float* HWY_RESTRICT scales, uint8_t* HWY_RESTRICT q) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  const auto one_scale = hn::Set(df, scales[0]);
  auto scale_at = [&](const float* s) {
    if constexpr (kPerLane) {
      return hn::LoadU(df, s);
    } else {
      return one_scale;
    }
  };
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto c = QuantizeVec<kDType, kMultiply, kFinite>(df, LoadAsF32(df, x + i),
                                                           scale_at(scales + i));
    hn::StoreU(CodesToBytes(df, c), d8, q + i);
  }
  if (i < n) {
    HWY_ALIGN float xin[hn::MaxLanes(df)] = {};
    HWY_ALIGN float sin[hn::MaxLanes(df)];
    HWY_ALIGN uint8_t out[hn::MaxLanes(df)];
    for (size_t j = 0; j < n - i; ++j) xin[j] = ScalarAsF32(x[i + j]);
    for (size_t j = 0; j < N; ++j) sin[j] = kPerLane ? 1.0f : scales[0];
    if (kPerLane) std::memcpy(sin, scales + i, (n - i) * sizeof(float));
    const auto c =
        QuantizeVec<kDType, kMultiply, kFinite>(df, hn::Load(df, xin), hn::Load(df, sin));
    hn::Store(CodesToBytes(df, c), d8, out);
    std::memcpy(q + i, out, n - i);
  }
}

// values[i] = bf16 bits of the value of the code QuantizeSpanT<kDType,
// false, kMultiply, kFinite> gives x[i] with the one `factor`: the same bits
// as decoding that code to bf16 (Fp8ValueBf16Vec), for a GMM that packs the
// values of the codes rather than the codes (fp8 dtypes only).
template <QuantDType kDType, bool kMultiply, bool kFinite = false, class TIn = float>
void QuantizeValuesSpanT(const TIn* HWY_RESTRICT x, size_t n, float factor,
                         uint16_t* HWY_RESTRICT values) {
  static_assert(kDType != QuantDType::kInt8, "fp8 values only");
  constexpr Fp8Format f = static_cast<Fp8Format>(kDType);
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  const auto fv = hn::Set(df, factor);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = ScaledForQuantize<kMultiply, kFinite>(LoadAsF32(df, x + i), fv);
    hn::StoreU(hn::TruncateTo(d16, Fp8ValueBf16Vec<f, kFinite>(df, v)), d16, values + i);
  }
  if (i < n) {
    HWY_ALIGN float xin[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint16_t out[hn::MaxLanes(df)];
    for (size_t j = 0; j < n - i; ++j) xin[j] = ScalarAsF32(x[i + j]);
    const auto v = ScaledForQuantize<kMultiply, kFinite>(hn::Load(df, xin), fv);
    hn::Store(hn::TruncateTo(d16, Fp8ValueBf16Vec<f, kFinite>(df, v)), d16, out);
    std::memcpy(values + i, out, (n - i) * sizeof(uint16_t));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
