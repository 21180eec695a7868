// Per-target SIMD conversions between f32, bf16 and the fp8 formats.
// Included once per Highway target (foreach_target.h); the vector helpers are
// also used by the packing code of the grouped matmul kernels.
//
// Decode: put the 7 magnitude bits where an f32's exponent and mantissa
// start and re-bias the exponent with an integer add (normal codes), or
// convert the mantissa to f32 and scale it by the subnormal step (subnormal
// codes). PERFORMANCE.md's single multiply by 2^(127 - bias) is also exact,
// but it feeds f32 subnormals to the multiplier, which cost a microcode
// assist per vector on the Zen 4 we measured (decode ran 5x slower on
// weights with subnormal codes). Special codes (NaN, e5m2 inf) are blended in
// afterwards. The span loops decode two vectors at a time in 16-bit lanes
// (DecodeFp8Bf16Vec: the same bits, about half the operations) and use
// DecodeFp8Vec for the last vector.
//
// Encode: in the normal range, add the round-to-nearest-even bias to the f32
// bits and shift away the dropped mantissa bits; in the subnormal range, add a
// magic constant whose ulp is the format's subnormal quantum so the FPU does
// the rounding. Both give the same bits as EncodeFp8 (fp8.cc).

#if defined(FP8MOE_NUMERICS_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_NUMERICS_CONVERT_INL_H_
#undef FP8MOE_NUMERICS_CONVERT_INL_H_
#else
#define FP8MOE_NUMERICS_CONVERT_INL_H_
#endif

#include <array>
#include <bit>
#include <cstring>

#include "fp8moe/numerics.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "numerics/fp8_spec.h"

#if HWY_TARGET == HWY_AVX3
#include <immintrin.h>

#ifndef FP8MOE_VBMI_TARGET
#define FP8MOE_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))
#endif
#endif

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// codes: u32 lanes holding fp8 codes (0..255) -> f32 lanes, exact.
template <Fp8Format kFormat, class DF>
HWY_INLINE hn::Vec<DF> DecodeFp8Vec(DF df,
                                    hn::Vec<hn::RebindToUnsigned<DF>> codes) {
  constexpr Fp8Spec s = SpecOf(kFormat);
  constexpr int kShift = 23 - s.mantissa_bits;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto mag = hn::And(codes, hn::Set(du, 0x7Fu));
  const auto sign = hn::ShiftLeft<24>(hn::And(codes, hn::Set(du, 0x80u)));
  // Normal codes: move exponent and mantissa into place and re-bias the
  // exponent with an integer add. Subnormal codes: the mantissa as an integer
  // times the subnormal step. Neither touches an f32 subnormal, which some
  // CPUs handle with a slow microcode assist.
  const auto normal = hn::Add(hn::ShiftLeft<kShift>(mag),
                              hn::Set(du, static_cast<uint32_t>(127 - s.bias) << 23));
  const auto sub = hn::BitCast(
      du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)),
                  hn::BitCast(df, hn::Set(du, Pow2Bits(1 - s.bias - s.mantissa_bits)))));
  const auto is_sub = hn::RebindMask(
      du, hn::Lt(hn::BitCast(di, mag), hn::Set(di, 1 << s.mantissa_bits)));
  auto bits = hn::Or(hn::IfThenElse(is_sub, sub, normal), sign);
  const auto qnan = hn::Or(sign, hn::Set(du, 0x7FC00000u));
  if constexpr (s.fnuz) {
    bits = hn::IfThenElse(hn::Eq(codes, hn::Set(du, 0x80u)),
                          hn::Set(du, 0xFFC00000u), bits);
  } else if constexpr (s.has_inf) {
    const auto inf = hn::Or(sign, hn::Set(du, 0x7F800000u));
    bits = hn::IfThenElse(hn::Eq(mag, hn::Set(du, 0x7Cu)), inf, bits);
    const auto is_nan = hn::RebindMask(
        du, hn::Gt(hn::BitCast(di, mag), hn::Set(di, 0x7C)));
    bits = hn::IfThenElse(is_nan, qnan, bits);
  } else {
    bits = hn::IfThenElse(hn::Eq(mag, hn::Set(du, 0x7Fu)), qnan, bits);
  }
  return hn::BitCast(df, bits);
}

#if HWY_TARGET != HWY_SCALAR
// ---- Decode through bf16 in 16-bit lanes --------------------------------
//
// Every fp8 value is a bf16 value, and a bf16 is an f32 whose low 16 bits are
// zero, so 16-bit lanes decode twice the codes per operation that f32 lanes
// do: normal codes by the same shift and exponent add; the at most 8
// subnormal values from a 16-byte table with one byte shuffle (a code m <
// 8 reads its low result byte at m and its high byte at m + 8), where
// DecodeFp8Vec converts and multiplies; sign and special codes blended in.
// Widening to f32 is then a zip with zero. Counted on AVX2 for e4m3fn, 16
// codes to f32: 16 operations against DecodeFp8Vec's 28; to bf16: 13 against
// 34. (Not on SCALAR: its one-lane vectors hold no 16-byte table.)

// The subnormal codes' bf16 bits, m * 2^(1 - bias - mantissa_bits) for m <
// 2^mantissa_bits: low bytes at [0, 8), high bytes at [8, 16).
template <Fp8Format kFormat>
struct SubnormalBf16Bytes {
  alignas(16) uint8_t bytes[16] = {};
  constexpr SubnormalBf16Bytes() {
    constexpr Fp8Spec s = SpecOf(kFormat);
    for (int m = 1; m < (1 << s.mantissa_bits); ++m) {
      int k = 0;  // m = 2^k * 1.f
      while ((m >> (k + 1)) != 0) ++k;
      const int exponent = 127 + 1 - s.bias - s.mantissa_bits + k;
      const int bits = exponent << 7 | ((m << (7 - k)) & 0x7F);
      bytes[m] = static_cast<uint8_t>(bits & 0xFF);
      bytes[m + 8] = static_cast<uint8_t>(bits >> 8);
    }
  }
};

// SubnormalBf16Bytes in every 128-bit block, as DecodeFp8Bf16Vec's table.
template <Fp8Format kFormat, class DI16>
HWY_INLINE hn::Vec<DI16> SubnormalBf16Table(DI16 d) {
  static constexpr SubnormalBf16Bytes<kFormat> kTable{};
  const hn::Repartition<uint8_t, DI16> d8;
  return hn::BitCast(d, hn::LoadDup128(d8, kTable.bytes));
}

// codes: i16 lanes holding sign-extended fp8 codes -> i16 lanes holding the
// bf16 bits of their values, exact (the same bits as the upper half of
// DecodeFp8Vec's f32); table: SubnormalBf16Table<kFormat>.
template <Fp8Format kFormat, class DI16>
HWY_INLINE hn::Vec<DI16> DecodeFp8Bf16Vec(DI16 d, hn::Vec<DI16> codes,
                                          hn::Vec<DI16> table) {
  constexpr Fp8Spec s = SpecOf(kFormat);
  auto set = [&](int v) { return hn::Set(d, static_cast<int16_t>(v)); };
  const auto mag = hn::And(codes, set(0x7F));
  const auto normal = hn::Add(hn::ShiftLeft<7 - s.mantissa_bits>(mag), set((127 - s.bias) << 7));
  // Byte indices m (low) and m | 8 (high): the table's entries for m < 8,
  // the only lanes that keep the lookup.
  const auto sub = hn::TableLookupBytes(table, hn::Or(hn::Mul(mag, set(0x0101)), set(0x0800)));
  auto v = hn::IfThenElse(hn::Lt(mag, set(1 << s.mantissa_bits)), sub, normal);
  if constexpr (s.has_inf) {
    v = hn::IfThenElse(hn::Eq(mag, set(0x7C)), set(0x7F80), v);
    v = hn::IfThenElse(hn::Gt(mag, set(0x7C)), set(0x7FC0), v);
  } else if constexpr (!s.fnuz) {
    v = hn::IfThenElse(hn::Eq(mag, set(0x7F)), set(0x7FC0), v);
  }
  v = hn::Or(v, hn::And(codes, set(-0x8000)));  // the sign, from the extension
  if constexpr (s.fnuz) v = hn::IfThenElse(hn::Eq(codes, set(-0x80)), set(-0x40), v);  // 0xFFC0
  return v;
}

// 2N sign-extended codes from p (N = lanes of DF).
template <class DF>
HWY_INLINE hn::Vec<hn::Repartition<int16_t, DF>> LoadFp8PairSx(DF,
                                                                const uint8_t* HWY_RESTRICT p) {
  const hn::Repartition<int16_t, DF> d16;
  const hn::Rebind<int8_t, decltype(d16)> d8;
  return hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
}

// bf16 bits in 2N 16-bit lanes -> f32 lanes [0, N) in *lo and [N, 2N) in
// *hi. Zips interleave within 128-bit blocks, so the 64-bit quarters are
// first put in the order that makes each zip's output contiguous (one
// permute; none with a single block).
template <class DF, class V16>
HWY_INLINE void WidenBf16Pair(DF df, V16 v, hn::Vec<DF>* lo, hn::Vec<DF>* hi) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Repartition<uint16_t, DF> du16;
  const hn::Repartition<uint64_t, DF> d64;
  auto q = hn::BitCast(d64, v);
  constexpr size_t kQuarters = hn::MaxLanes(decltype(d64)());
  if constexpr (kQuarters > 2) {
    // Lane j takes quarter j / 2 of the lower half (j even) or of the upper.
    alignas(64) static constexpr auto kOrder = [] {
      std::array<int64_t, kQuarters> o{};
      for (size_t j = 0; j < kQuarters; ++j) {
        o[j] = static_cast<int64_t>(j / 2 + (j % 2) * (kQuarters / 2));
      }
      return o;
    }();
    q = hn::TableLookupLanes(q, hn::SetTableIndices(d64, kOrder.data()));
  }
  const auto w = hn::BitCast(du16, q);
  *lo = hn::BitCast(df, hn::ZipLower(du, hn::Zero(du16), w));
  *hi = hn::BitCast(df, hn::ZipUpper(du, hn::Zero(du16), w));
}

// 2N codes from p -> their f32 values: [0, N) in *lo, [N, 2N) in *hi; table:
// SubnormalBf16Table<kFormat>.
template <Fp8Format kFormat, class DF>
HWY_INLINE void DecodeFp8PairToF32(DF df, const uint8_t* HWY_RESTRICT p,
                                   hn::Vec<hn::Repartition<int16_t, DF>> table,
                                   hn::Vec<DF>* lo, hn::Vec<DF>* hi) {
  const hn::Repartition<int16_t, DF> d16;
  WidenBf16Pair(df, DecodeFp8Bf16Vec<kFormat>(d16, LoadFp8PairSx(df, p), table), lo, hi);
}
#endif  // HWY_TARGET != HWY_SCALAR

// f32 lanes -> u32 lanes holding fp8 codes (0..255), round to nearest even.
// kNoNaN: the caller knows no lane is a NaN (a quantizer whose block amax is
// finite), so the NaN test and blend are left out.
template <Fp8Format kFormat, bool kSaturate, bool kNoNaN = false, class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> EncodeFp8Vec(DF df,
                                                          hn::Vec<DF> v) {
  constexpr Fp8Spec s = SpecOf(kFormat);
  constexpr int kShift = 23 - s.mantissa_bits;
  constexpr int kMinExp = 1 - s.bias;  // exponent of the smallest normal
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto sign = hn::And(bits, hn::Set(du, 0x80000000u));
  auto abs = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  // Non-negative f32 bit patterns order like the values, so integer
  // comparisons on them are exact and NaN (above inf's bits) is easy to find.
  // (Under kNoNaN the test is still written, for the masks' type, but its
  // result is never used, so the compiler drops it.)
  const auto is_nan = hn::RebindMask(
      du, hn::Gt(hn::BitCast(di, abs), hn::Set(di, 0x7F800000)));
  if constexpr (kSaturate) {
    // NaN lanes become max here; they are replaced by the NaN code below.
    abs = hn::BitCast(du, hn::Min(hn::BitCast(di, abs),
                                  hn::Set(di, std::bit_cast<int32_t>(s.max))));
  }
  // Normal range: round the mantissa to mantissa_bits, then re-bias.
  const auto lsb = hn::And(hn::ShiftRight<kShift>(abs), hn::Set(du, 1u));
  const auto rounded =
      hn::Add(abs, hn::Add(hn::Set(du, (1u << (kShift - 1)) - 1u), lsb));
  const auto normal =
      hn::Sub(hn::ShiftRight<kShift>(rounded),
              hn::Set(du, static_cast<uint32_t>(127 - s.bias)
                              << s.mantissa_bits));
  // Subnormal range: magic = 2^(kMinExp - mantissa_bits + 23) has an ulp equal
  // to the subnormal quantum, so abs + magic rounds abs to that quantum.
  const auto magic =
      hn::BitCast(df, hn::Set(du, Pow2Bits(kMinExp - s.mantissa_bits + 23)));
  const auto a = hn::BitCast(df, abs);
  const auto sub =
      hn::Sub(hn::BitCast(du, hn::Add(a, magic)), hn::BitCast(du, magic));
  const auto is_sub = hn::RebindMask(
      du, hn::Lt(a, hn::BitCast(df, hn::Set(du, Pow2Bits(kMinExp)))));
  auto mag = hn::IfThenElse(is_sub, sub, normal);

  auto special = is_nan;  // lanes whose magnitude is a NaN/inf code
  if constexpr (!kSaturate) {
    const auto overflow = hn::RebindMask(
        du, hn::Gt(hn::BitCast(di, mag), hn::Set(di, s.max_code)));
    mag = hn::IfThenElse(overflow, hn::Set(du, s.has_inf ? 0x7Cu : s.nan_code),
                         mag);
    special = kNoNaN ? overflow : hn::Or(special, overflow);
  }
  if constexpr (!kNoNaN) mag = hn::IfThenElse(is_nan, hn::Set(du, s.nan_code), mag);
  if constexpr (s.fnuz) {
    // No -0: the sign survives only on non-zero values. NaN is 0x80 itself.
    const auto sign8 = hn::IfThenElseZero(
        hn::RebindMask(du, hn::Ne(mag, hn::Zero(du))), hn::ShiftRight<24>(sign));
    if constexpr (kNoNaN && kSaturate) return hn::Or(mag, sign8);  // nothing special
    return hn::IfThenElse(special, hn::Set(du, 0x80u), hn::Or(mag, sign8));
  } else {
    return hn::Or(mag, hn::ShiftRight<24>(sign));
  }
}

// f32 lanes -> u32 lanes holding the bf16 bits of the value of
// EncodeFp8Vec<kFormat, true, kNoNaN>'s code (saturating): the same bits as
// DecodeFp8Bf16Vec of that code, NaN included, computed without the code.
// The mantissa is rounded in place (normal range: round to nearest even at
// bit kShift, then the bits below cleared) or to the subnormal quantum by
// the same magic add as the encode; a value of an fp8 format has at most 3
// (e4m3) or 2 (e5m2) mantissa bits, so its low 16 f32 bits are zero and the
// upper half is its bf16. About 11 operations per vector where encoding (~15)
// and decoding (~6 in 16-bit lanes, after a store and a load of the bytes)
// took ~21: a native forward's activation goes to the GEMM's packing as
// these values (QuantizeOneRowValues).
template <Fp8Format kFormat, bool kNoNaN = false, class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Fp8ValueBf16Vec(DF df, hn::Vec<DF> v) {
  constexpr Fp8Spec s = SpecOf(kFormat);
  constexpr int kShift = 23 - s.mantissa_bits;
  constexpr int kMinExp = 1 - s.bias;  // exponent of the smallest normal
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto sign16 = hn::ShiftRight<16>(hn::And(bits, hn::Set(du, 0x80000000u)));
  auto abs = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const auto is_nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, abs), hn::Set(di, 0x7F800000)));
  // Saturate (inf and NaN lanes become max; NaN is put back below).
  abs = hn::BitCast(du, hn::Min(hn::BitCast(di, abs),
                                hn::Set(di, std::bit_cast<int32_t>(s.max))));
  const auto lsb = hn::And(hn::ShiftRight<kShift>(abs), hn::Set(du, 1u));
  const auto normal = hn::And(hn::Add(abs, hn::Add(hn::Set(du, (1u << (kShift - 1)) - 1u), lsb)),
                              hn::Set(du, ~((1u << kShift) - 1u)));
  // Below the smallest normal: abs + magic rounds abs to the subnormal
  // quantum (magic's ulp), and taking magic away again is exact.
  const auto magic = hn::BitCast(df, hn::Set(du, Pow2Bits(kMinExp - s.mantissa_bits + 23)));
  const auto a = hn::BitCast(df, abs);
  const auto sub = hn::BitCast(du, hn::Sub(hn::Add(a, magic), magic));
  const auto is_sub =
      hn::RebindMask(du, hn::Lt(a, hn::BitCast(df, hn::Set(du, Pow2Bits(kMinExp)))));
  const auto mag = hn::ShiftRight<16>(hn::IfThenElse(is_sub, sub, normal));
  if constexpr (s.fnuz) {
    // No -0 (the sign only on non-zero values); every NaN is the code 0x80,
    // whose bf16 is 0xFFC0.
    const auto out = hn::Or(mag, hn::IfThenElseZero(hn::RebindMask(du, hn::Ne(mag, hn::Zero(du))),
                                                     sign16));
    if constexpr (kNoNaN) return out;
    return hn::IfThenElse(is_nan, hn::Set(du, 0xFFC0u), out);
  } else {
    const auto out = hn::Or(mag, sign16);
    if constexpr (kNoNaN) return out;
    return hn::IfThenElse(is_nan, hn::Or(sign16, hn::Set(du, 0x7FC0u)), out);
  }
}

// f32 lanes -> u32 lanes holding bf16 bits, round to nearest even.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> F32ToBf16Vec(DF df,
                                                          hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded =
      hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto qnan = hn::Or(hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u)),
                           hn::Set(du, 0x7FC0u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), qnan, rounded);
}

// ---- Span loops. Full vectors in the main loop; the tail goes through a
// small zero-padded buffer so no load or store passes the end of a span. ----

template <Fp8Format kFormat, bool kSaturate>
void EncodeFp8SpanT(const float* HWY_RESTRICT x, uint8_t* HWY_RESTRICT codes,
                    size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto c = EncodeFp8Vec<kFormat, kSaturate>(df, hn::LoadU(df, x + i));
    hn::StoreU(hn::DemoteTo(d8, hn::BitCast(di, c)), d8, codes + i);
  }
  if (i < n) {
    HWY_ALIGN float in[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint8_t out[hn::MaxLanes(df)];
    std::memcpy(in, x + i, (n - i) * sizeof(float));
    const auto c = EncodeFp8Vec<kFormat, kSaturate>(df, hn::Load(df, in));
    hn::Store(hn::DemoteTo(d8, hn::BitCast(di, c)), d8, out);
    std::memcpy(codes + i, out, n - i);
  }
}

// kStream: non-temporal stores for outputs far larger than the caches, so the
// output lines are not read before being overwritten (saves a third of the
// memory traffic when decoding 1 byte into 4).
template <Fp8Format kFormat, bool kStream>
void DecodeFp8SpanT(const uint8_t* HWY_RESTRICT codes, float* HWY_RESTRICT out,
                    size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  auto store = [&](hn::Vec<hn::ScalableTag<float>> v, float* o) {
    if constexpr (kStream) {
      hn::Stream(v, df, o);
    } else {
      hn::StoreU(v, df, o);
    }
  };
#if HWY_TARGET != HWY_SCALAR
  const hn::Repartition<int16_t, decltype(df)> d16;
  const auto table = SubnormalBf16Table<kFormat>(d16);
  for (; i + 2 * N <= n; i += 2 * N) {
    hn::Vec<hn::ScalableTag<float>> lo, hi;
    DecodeFp8PairToF32<kFormat>(df, codes + i, table, &lo, &hi);
    store(lo, out + i);
    store(hi, out + i + N);
  }
#endif
  for (; i + N <= n; i += N) {
    store(DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::LoadU(d8, codes + i))), out + i);
  }
  if (i < n) {
    HWY_ALIGN uint8_t in[hn::MaxLanes(df)] = {};
    HWY_ALIGN float tmp[hn::MaxLanes(df)];
    std::memcpy(in, codes + i, n - i);
    hn::Store(DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::Load(d8, in))),
              df, tmp);
    std::memcpy(out + i, tmp, (n - i) * sizeof(float));
  }
  if constexpr (kStream) hwy::FlushStream();
}

#if HWY_TARGET == HWY_AVX3
// ---- fp8 -> bf16 by byte tables (AVX512-VBMI) ---------------------------
//
// Every fp8 value is a bf16 value, so a code's bf16 is a function of its 7
// magnitude bits (two 128-entry byte tables: the low and the high byte,
// looked up with one vpermi2b each) with the sign bit OR-ed into the high
// byte; the fnuz formats' 0x80 is their NaN, not -0. About 10 instructions
// per 64 codes, against ~4 per 16 codes through f32 lanes: the packing of
// native fp8 operands spent ~8% of a forward GMM decoding.

// Whether the byte-table decodes may run: the CPU has AVX512-VBMI and the
// AVX-512 extensions are on (off under --simd AVX3).
inline bool UseFp8ByteTables() {
  static const bool has = __builtin_cpu_supports("avx512vbmi");
  return has && Avx512ExtensionsEnabled();
}

// Low and high bytes of bf16(decode(m)) for the 128 magnitudes m.
struct Fp8ByteTables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  explicit Fp8ByteTables(Fp8Format f) {
    for (int m = 0; m < 128; ++m) {
      const uint16_t b = F32ToBf16(DecodeFp8(static_cast<uint8_t>(m), f));
      lo[m] = static_cast<uint8_t>(b & 0xFF);
      hi[m] = static_cast<uint8_t>(b >> 8);
    }
  }
};

// kFormat's byte tables in registers: magnitudes 0-63 | 64-127 of the low
// and of the high bytes.
struct Fp8TableRegs {
  __m512i lo0, lo1, hi0, hi1;
};
template <Fp8Format kFormat>
FP8MOE_VBMI_TARGET HWY_INLINE Fp8TableRegs LoadFp8Tables() {
  static const Fp8ByteTables tables(kFormat);
  return {_mm512_load_si512(tables.lo), _mm512_load_si512(tables.lo + 64),
          _mm512_load_si512(tables.hi), _mm512_load_si512(tables.hi + 64)};
}

// The low (lo) and high (hi) bytes of the bf16 of 64 codes x.
template <Fp8Format kFormat>
FP8MOE_VBMI_TARGET HWY_INLINE void Fp8BytesToBf16Bytes(__m512i x, const Fp8TableRegs& t,
                                                      __m512i& lo, __m512i& hi) {
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
  hi = _mm512_or_si512(_mm512_permutex2var_epi8(t.hi0, x, t.hi1), _mm512_and_si512(x, sign_bit));
  if constexpr (SpecOf(kFormat).fnuz) {  // 0x80 is the NaN, not -0
    const __mmask64 nan = _mm512_cmpeq_epi8_mask(x, sign_bit);
    const uint16_t q = F32ToBf16(DecodeFp8(0x80, kFormat));
    lo = _mm512_mask_mov_epi8(lo, nan, _mm512_set1_epi8(static_cast<char>(q & 0xFF)));
    hi = _mm512_mask_mov_epi8(hi, nan, _mm512_set1_epi8(static_cast<char>(q >> 8)));
  }
}

// Decodes the whole 64-code blocks of codes [0, n) into out; returns how
// many codes it did (the caller does the rest).
template <Fp8Format kFormat>
FP8MOE_VBMI_TARGET size_t DecodeFp8ToBf16Vbmi(const uint8_t* HWY_RESTRICT codes,
                                             uint16_t* HWY_RESTRICT out, size_t n) {
  const Fp8TableRegs t = LoadFp8Tables<kFormat>();
  // The in-lane byte unpacks of 128-bit lane j take its bytes 0-7 (unpacklo)
  // and 8-15 (unpackhi); this order makes them codes 8j..8j+7 and
  // 32+8j..32+8j+7, so both stores are in natural order.
  alignas(64) static const uint8_t kOrder[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
      8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
      16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
      24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(kOrder);
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i x = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    __m512i lo, hi;
    Fp8BytesToBf16Bytes<kFormat>(x, t, lo, hi);
    _mm512_storeu_si512(out + i, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(out + i + 32, _mm512_unpackhi_epi8(lo, hi));
  }
  return i;
}
#endif

template <Fp8Format kFormat>
void DecodeFp8ToBf16SpanT(const uint8_t* HWY_RESTRICT codes,
                          uint16_t* HWY_RESTRICT out, size_t n) {
#if HWY_TARGET == HWY_AVX3
  if (n >= 64 && UseFp8ByteTables()) {
    const size_t done = DecodeFp8ToBf16Vbmi<kFormat>(codes, out, n);
    codes += done, out += done, n -= done;
  }
#endif
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  // Every fp8 value is a bf16 value, so the upper half of the f32 is exact.
  auto one = [&](const uint8_t* in, uint16_t* o) {
    const auto f = DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::LoadU(d8, in)));
    const auto hi = hn::ShiftRight<16>(hn::BitCast(du, f));
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, hi)), d16, o);
  };
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::Repartition<int16_t, decltype(df)> dw;
  const auto table = SubnormalBf16Table<kFormat>(dw);
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto v = DecodeFp8Bf16Vec<kFormat>(dw, LoadFp8PairSx(df, codes + i), table);
    hn::StoreU(hn::BitCast(hn::RebindToUnsigned<decltype(dw)>(), v),
               hn::RebindToUnsigned<decltype(dw)>(), out + i);
  }
#endif
  for (; i + N <= n; i += N) one(codes + i, out + i);
  if (i < n) {
    HWY_ALIGN uint8_t in[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint16_t tmp[hn::MaxLanes(df)];
    std::memcpy(in, codes + i, n - i);
    one(in, tmp);
    std::memcpy(out + i, tmp, (n - i) * sizeof(uint16_t));
  }
}

template <Fp8Format kFormat>
void DequantizeFp8ToBf16SpanT(const uint8_t* HWY_RESTRICT codes,
                              const float* HWY_RESTRICT scales,
                              uint16_t* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  // Decoded values v: times the scales at s, rounded to bf16, stored at o.
  auto finish = [&](hn::Vec<hn::ScalableTag<float>> v, const float* s, uint16_t* o) {
    const auto b = F32ToBf16Vec(df, hn::Mul(v, hn::LoadU(df, s)));
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, b)), d16, o);
  };
  auto decode = [&](const uint8_t* c) {
    return DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::LoadU(d8, c)));
  };
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::Repartition<int16_t, decltype(df)> dw;
  const auto table = SubnormalBf16Table<kFormat>(dw);
  for (; i + 2 * N <= n; i += 2 * N) {
    hn::Vec<hn::ScalableTag<float>> lo, hi;
    DecodeFp8PairToF32<kFormat>(df, codes + i, table, &lo, &hi);
    finish(lo, scales + i, out + i);
    finish(hi, scales + i + N, out + i + N);
  }
#endif
  for (; i + N <= n; i += N) finish(decode(codes + i), scales + i, out + i);
  if (i < n) {
    HWY_ALIGN uint8_t c[hn::MaxLanes(df)] = {};
    HWY_ALIGN float s[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint16_t o[hn::MaxLanes(df)];
    std::memcpy(c, codes + i, n - i);
    std::memcpy(s, scales + i, (n - i) * sizeof(float));
    finish(decode(c), s, o);
    std::memcpy(out + i, o, (n - i) * sizeof(uint16_t));
  }
}

inline void F32ToBf16SpanT(const float* HWY_RESTRICT x,
                           uint16_t* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const size_t N = hn::Lanes(df);
  auto one = [&](const float* in, uint16_t* o) {
    const auto b = F32ToBf16Vec(df, hn::LoadU(df, in));
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, b)), d16, o);
  };
  size_t i = 0;
  for (; i + N <= n; i += N) one(x + i, out + i);
  if (i < n) {
    HWY_ALIGN float in[hn::MaxLanes(df)] = {};
    HWY_ALIGN uint16_t tmp[hn::MaxLanes(df)];
    std::memcpy(in, x + i, (n - i) * sizeof(float));
    one(in, tmp);
    std::memcpy(out + i, tmp, (n - i) * sizeof(uint16_t));
  }
}

// Lanes(df) bf16 values at p as f32 lanes: the bits shifted up, exact.
template <class DF>
HWY_INLINE hn::Vec<DF> LoadBf16AsF32(DF df, const uint16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> d16;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

template <bool kStream>
void Bf16ToF32SpanT(const uint16_t* HWY_RESTRICT bits,
                    float* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = LoadBf16AsF32(df, bits + i);
    if constexpr (kStream) {
      hn::Stream(v, df, out + i);
    } else {
      hn::StoreU(v, df, out + i);
    }
  }
  for (; i < n; ++i) out[i] = Bf16ToF32(bits[i]);  // numerics.h
  if constexpr (kStream) hwy::FlushStream();
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
