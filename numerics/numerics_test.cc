// Exhaustive and randomized tests of the fp8 / bf16 / int8 numerics.
//
// The oracle here is independent of fp8.cc: it builds each format's value
// table from the definition (sign, exponent, mantissa) in double precision and
// rounds by searching for the nearest table entry, with ties going to the even
// code. The scalar functions are checked against it, and the SIMD spans are
// checked against the scalar functions on every Highway target this CPU runs.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"

#include "fp8moe/numerics.h"
#include "hwy/targets.h"

namespace fp8moe {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ,
                                  Fp8Format::kE5M2, Fp8Format::kE5M2FNUZ};

float FromBits(uint32_t b) { return std::bit_cast<float>(b); }
uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

// ---- Independent oracle -------------------------------------------------

struct Oracle {
  int man_bits, bias;
  bool fnuz, has_inf, fn;  // fn: e4m3fn (only 0x7F/0xFF are NaN)
  // values[c] for the non-negative finite codes c = 0..max_code, ascending.
  std::vector<double> values;
  double sentinel;  // the value one step past max, as if the grid went on

  explicit Oracle(Fp8Format f) {
    const bool e4 = f == Fp8Format::kE4M3FN || f == Fp8Format::kE4M3FNUZ;
    man_bits = e4 ? 3 : 2;
    fnuz = f == Fp8Format::kE4M3FNUZ || f == Fp8Format::kE5M2FNUZ;
    has_inf = f == Fp8Format::kE5M2;
    fn = f == Fp8Format::kE4M3FN;
    bias = (e4 ? 7 : 15) + (fnuz ? 1 : 0);
    const int last = fn ? 0x7E : has_inf ? 0x7B : 0x7F;
    for (int c = 0; c <= last; ++c) values.push_back(Value(c));
    const int e_max = last >> man_bits;
    sentinel = values.back() + std::ldexp(1.0, e_max - bias - man_bits);
  }
  double Value(int c) const {  // c in 0..0x7F, finite
    const int e = c >> man_bits, m = c & ((1 << man_bits) - 1);
    if (e == 0) return std::ldexp(m, 1 - bias - man_bits);
    return std::ldexp(1.0 + std::ldexp(m, -man_bits), e - bias);
  }
  double Max() const { return values.back(); }
  uint8_t NaNCode(bool neg) const {
    if (fnuz) return 0x80;
    return (has_inf ? 0x7E : 0x7F) | (neg ? 0x80 : 0);
  }
  uint8_t Overflow(bool neg) const {
    if (has_inf) return 0x7C | (neg ? 0x80 : 0);
    return NaNCode(neg);
  }
  uint8_t Encode(float x, bool saturate) const {
    const bool neg = std::signbit(x);
    if (std::isnan(x)) return NaNCode(neg);
    double a = std::fabs(static_cast<double>(x));
    if (saturate) a = std::min(a, Max());
    if (std::isinf(a)) return Overflow(neg);
    if (a >= sentinel) return Overflow(neg);
    // Bracket: values[lo] <= a < values[lo+1] (or the sentinel).
    const size_t hi = static_cast<size_t>(
        std::upper_bound(values.begin(), values.end(), a) - values.begin());
    const size_t lo = hi - 1;  // values[0] == 0 <= a
    const double v_lo = values[lo];
    const double v_hi = hi < values.size() ? values[hi] : sentinel;
    size_t pick;
    if (a - v_lo < v_hi - a) {
      pick = lo;
    } else if (a - v_lo > v_hi - a) {
      pick = hi;
    } else {
      pick = (lo % 2 == 0) ? lo : hi;  // tie: the even code
    }
    if (pick == values.size()) return Overflow(neg);
    if (pick == 0) return (neg && !fnuz) ? 0x80 : 0x00;
    return static_cast<uint8_t>(pick | (neg ? 0x80 : 0));
  }
};

// All the f32 inputs worth checking for one format: every code value, every
// midpoint and its f32 neighbours, the overflow edge, subnormal edges,
// specials, and at least 10^6 random values (random bit patterns, which cover
// every binade, and uniform draws inside the format's range).
std::vector<float> EncodeInputs(const Oracle& o, uint64_t seed) {
  std::vector<float> in;
  auto add_around = [&](double v) {
    const float f = static_cast<float>(v);
    for (float g : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY)}) {
      in.push_back(g);
      in.push_back(-g);
    }
  };
  std::vector<double> all = o.values;
  all.push_back(o.sentinel);
  for (size_t i = 0; i < all.size(); ++i) {
    add_around(all[i]);
    if (i + 1 < all.size()) add_around((all[i] + all[i + 1]) / 2);  // exact
  }
  add_around(o.values[1] / 2);  // half the smallest subnormal: ties to 0
  add_around(o.values[1] / 4);
  add_around(1e-30);
  add_around(3.0e38);
  for (uint32_t b : {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u,
                     0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFA12345u,
                     0x00000001u, 0x80000001u, 0x007FFFFFu, 0x7F7FFFFFu}) {
    in.push_back(FromBits(b));
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(-1.25 * o.Max(), 1.25 * o.Max());
  for (int i = 0; i < 600000; ++i) in.push_back(FromBits(static_cast<uint32_t>(rng())));
  for (int i = 0; i < 600000; ++i) in.push_back(static_cast<float>(uni(rng)));
  std::uniform_real_distribution<double> small(-4 * o.values[8], 4 * o.values[8]);
  for (int i = 0; i < 100000; ++i) in.push_back(static_cast<float>(small(rng)));
  return in;
}

using test::ForEachTarget;


// ---- Decode ------------------------------------------------------------

TEST(Fp8Decode, AllCodesMatchTheDefinition) {
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(Fp8FormatName(f));
    const Oracle o(f);
    int nan_count = 0;
    for (int c = 0; c < 256; ++c) {
      const float got = DecodeFp8(static_cast<uint8_t>(c), f);
      const bool neg = c & 0x80;
      const int mag = c & 0x7F;
      if (o.fnuz && c == 0x80) {
        EXPECT_EQ(Bits(got), 0xFFC00000u);  // ml_dtypes: negative quiet NaN
        ++nan_count;
      } else if (o.fn && mag == 0x7F) {
        EXPECT_EQ(Bits(got), neg ? 0xFFC00000u : 0x7FC00000u);
        ++nan_count;
      } else if (o.has_inf && mag >= 0x7C) {
        if (mag == 0x7C) {
          EXPECT_EQ(got, neg ? -INFINITY : INFINITY);
        } else {
          EXPECT_EQ(Bits(got), neg ? 0xFFC00000u : 0x7FC00000u);
          ++nan_count;
        }
      } else {
        const double want = (neg ? -1 : 1) * o.Value(mag);
        EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
        EXPECT_EQ(std::signbit(got), neg) << "code " << c;
      }
    }
    EXPECT_EQ(nan_count, o.fnuz ? 1 : o.has_inf ? 6 : 2);
  }
  EXPECT_EQ(DecodeFp8(0x7E, Fp8Format::kE4M3FN), 448.0f);
  EXPECT_EQ(DecodeFp8(0x01, Fp8Format::kE4M3FN), std::ldexp(1.0f, -9));
  EXPECT_EQ(DecodeFp8(0x7F, Fp8Format::kE4M3FNUZ), 240.0f);
  EXPECT_EQ(DecodeFp8(0x7B, Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(DecodeFp8(0x01, Fp8Format::kE5M2FNUZ), std::ldexp(1.0f, -17));
}

TEST(Fp8Decode, SpansMatchScalarOnEveryTarget) {
  std::vector<uint8_t> codes(256 * 3 + 5);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7 + 3);
  ForEachTarget([&] {
    for (Fp8Format f : kFormats) {
      SCOPED_TRACE(Fp8FormatName(f));
      // Every length up to 67 and an unaligned start exercise the tail path.
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9},
                       size_t{31}, size_t{67}, codes.size() - 1}) {
        std::vector<float> out(n + 8, FromBits(0x7FA5A5A5u));
        std::vector<uint16_t> out16(n + 8, 0xA5A5);
        DecodeFp8Span(codes.data() + 1, out.data(), n, f);
        DecodeFp8ToBf16Span(codes.data() + 1, out16.data(), n, f);
        for (size_t i = 0; i < n; ++i) {
          const float want = DecodeFp8(codes[i + 1], f);
          ASSERT_EQ(Bits(out[i]), Bits(want)) << "i " << i;
          ASSERT_EQ(out16[i], Bits(want) >> 16) << "i " << i;
          ASSERT_EQ(out16[i], F32ToBf16(want)) << "fp8 values are bf16 values";
        }
        for (size_t i = n; i < n + 8; ++i) {
          ASSERT_EQ(Bits(out[i]), 0x7FA5A5A5u) << "wrote past the end";
          ASSERT_EQ(out16[i], 0xA5A5) << "wrote past the end";
        }
      }
    }
  });
}

TEST(Fp8Decode, DequantizeToBf16MatchesScalarOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> us(1e-6f, 4.0f);
  std::vector<uint8_t> codes(256 * 5 + 3);
  std::vector<float> scales(codes.size());
  // Scales at the edges of the f32 range too (inf, NaN, 0, huge, subnormal), on
  // codes that are finite and non-zero (a NaN code times a NaN scale may keep
  // either NaN's sign, by operand order), spread over the span.
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // (NaNs with payloads too: their product keeps it, and bits + the rounding
  // bias would carry out of 0x7FFFFFFF.)
  const float edges[] = {kInf, -kInf, std::numeric_limits<float>::quiet_NaN(),
                         std::bit_cast<float>(0x7FFFFFFFu), std::bit_cast<float>(0xFFE12345u),
                         0.0f, -0.0f,
                         std::numeric_limits<float>::max(), 1e30f, 1e-30f, 1e-40f,
                         std::numeric_limits<float>::min(), -2.5f};
  size_t next_edge = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    codes[i] = static_cast<uint8_t>(i);
    scales[i] = us(rng);
    if (i % 256 >= 0x10 && i % 256 < 0x70 && i % 5 == 0) {
      scales[i] = edges[next_edge++ % std::size(edges)];
    }
  }
  ForEachTarget([&] {
    for (Fp8Format f : kFormats) {
      std::vector<uint16_t> out(codes.size() + 8, 0xA5A5);
      DequantizeFp8ToBf16Span(codes.data(), scales.data(), out.data(), codes.size() - 1, f);
      for (size_t i = 0; i + 1 < codes.size(); ++i) {
        ASSERT_EQ(out[i], F32ToBf16(DecodeFp8(codes[i], f) * scales[i])) << i;
      }
      ASSERT_EQ(out[codes.size() - 1], 0xA5A5);
    }
  });
}

// ---- Encode ------------------------------------------------------------

TEST(Fp8Encode, KnownEdges) {
  const auto fn = Fp8Format::kE4M3FN;
  EXPECT_EQ(EncodeFp8(464.0f, fn, false), 0x7E);  // tie at the edge -> 448
  EXPECT_EQ(EncodeFp8(465.0f, fn, false), 0x7F);  // NaN
  EXPECT_EQ(EncodeFp8(465.0f, fn, true), 0x7E);
  EXPECT_EQ(EncodeFp8(INFINITY, fn, false), 0x7F);
  EXPECT_EQ(EncodeFp8(-INFINITY, fn, true), 0xFE);
  EXPECT_EQ(EncodeFp8(-0.0f, fn, false), 0x80);
  EXPECT_EQ(EncodeFp8(-0.0f, Fp8Format::kE4M3FNUZ, false), 0x00);
  EXPECT_EQ(EncodeFp8(248.0f, Fp8Format::kE4M3FNUZ, false), 0x80);
  EXPECT_EQ(EncodeFp8(61440.0f, Fp8Format::kE5M2, false), 0x7C);
  EXPECT_EQ(EncodeFp8(-61440.0f, Fp8Format::kE5M2, false), 0xFC);
  EXPECT_EQ(EncodeFp8(59392.0f, Fp8Format::kE5M2, false), 0x7B);
  EXPECT_EQ(EncodeFp8(std::ldexp(1.0f, -10), fn, false), 0x00);  // tie -> 0
  EXPECT_EQ(EncodeFp8(3 * std::ldexp(1.0f, -10), fn, false), 0x02);
  EXPECT_EQ(EncodeFp8(-NAN, Fp8Format::kE5M2, true), 0xFE);
}

TEST(Fp8Encode, ScalarMatchesOracleExhaustively) {
  FP8MOE_RANDOM_SEED(seed);
  for (Fp8Format f : kFormats) {
    SCOPED_TRACE(Fp8FormatName(f));
    const Oracle o(f);
    const std::vector<float> in = EncodeInputs(o, seed);
    ASSERT_GE(in.size(), 1000000u);
    for (bool sat : {false, true}) {
      for (float x : in) {
        ASSERT_EQ(EncodeFp8(x, f, sat), o.Encode(x, sat))
            << "x " << x << " bits 0x" << std::hex << Bits(x) << " sat " << sat;
      }
    }
    // Every code decodes and re-encodes to itself (NaNs to the canonical one).
    for (int c = 0; c < 256; ++c) {
      const float v = DecodeFp8(static_cast<uint8_t>(c), f);
      if (std::isnan(v)) continue;
      if (o.fnuz && c == 0x80) continue;
      EXPECT_EQ(EncodeFp8(v, f, false), c);
    }
  }
}

TEST(Fp8Encode, SpansMatchScalarOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  ForEachTarget([&] {
    for (Fp8Format f : kFormats) {
      SCOPED_TRACE(Fp8FormatName(f));
      const std::vector<float> in = EncodeInputs(Oracle(f), seed);
      for (bool sat : {false, true}) {
        std::vector<uint8_t> out(in.size() + 16, 0xA5);
        EncodeFp8Span(in.data(), out.data(), in.size(), f, sat);
        for (size_t i = 0; i < in.size(); ++i) {
          ASSERT_EQ(out[i], EncodeFp8(in[i], f, sat))
              << "x " << in[i] << " bits 0x" << std::hex << Bits(in[i]);
        }
        for (size_t i = in.size(); i < out.size(); ++i) ASSERT_EQ(out[i], 0xA5);
        for (size_t n = 0; n < 67; ++n) {  // short spans, unaligned starts
          std::vector<uint8_t> o2(n + 8, 0xA5);
          EncodeFp8Span(in.data() + 3, o2.data(), n, f, sat);
          for (size_t i = 0; i < n; ++i) ASSERT_EQ(o2[i], out[i + 3]);
          for (size_t i = n; i < n + 8; ++i) ASSERT_EQ(o2[i], 0xA5);
        }
      }
    }
  });
}

TEST(Fp8Encode, ThreadCountDoesNotChangeBits) {
  const size_t n = (size_t{1} << 20) + 77;  // above the parallel threshold
  std::vector<float> x(n);
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 100.0f);
  for (float& v : x) v = nd(rng);
  const int saved = omp_get_max_threads();
  std::vector<uint8_t> a(n), b(n);
  std::vector<float> da(n), db(n);
  omp_set_num_threads(1);
  EncodeFp8Span(x.data(), a.data(), n, Fp8Format::kE4M3FN, true);
  DecodeFp8Span(a.data(), da.data(), n, Fp8Format::kE4M3FN);
  omp_set_num_threads(std::max(2, saved));
  EncodeFp8Span(x.data(), b.data(), n, Fp8Format::kE4M3FN, true);
  DecodeFp8Span(b.data(), db.data(), n, Fp8Format::kE4M3FN);
  omp_set_num_threads(saved);
  EXPECT_EQ(a, b);
  EXPECT_EQ(0, std::memcmp(da.data(), db.data(), n * sizeof(float)));
}

// ---- BF16 --------------------------------------------------------------

// Nearest-even bf16 by comparing the two neighbouring bf16 values in double.
uint16_t Bf16Oracle(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFFC0 : 0x7FC0;
  const uint32_t b = Bits(x);
  const uint16_t lo = static_cast<uint16_t>(b >> 16);  // truncation toward 0
  if ((b & 0xFFFF) == 0) return lo;
  const uint16_t hi = lo + 1;  // next magnitude (may be inf)
  const double dx = std::fabs(static_cast<double>(x));
  const double dlo = std::fabs(static_cast<double>(Bf16ToF32(lo)));
  const double dhi = std::fabs(static_cast<double>(Bf16ToF32(hi)));
  // Past the largest bf16 the next value is inf; the midpoint is then at
  // max + half an ulp, exactly as if the exponent went on.
  const double dhi_grid = std::isinf(dhi) ? dlo + std::ldexp(1.0, 127 - 7) : dhi;
  if (dx - dlo < dhi_grid - dx) return lo;
  if (dx - dlo > dhi_grid - dx) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16, ScalarMatchesOracle) {
  for (uint32_t h = 0; h < 65536; ++h) {  // every bf16 value round-trips
    const float v = Bf16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    ASSERT_EQ(F32ToBf16(v), h);
  }
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int i = 0; i < 1000000; ++i) {
    const float x = FromBits(rng());
    ASSERT_EQ(F32ToBf16(x), Bf16Oracle(x)) << std::hex << Bits(x);
  }
  for (uint32_t h = 0; h < 65536; ++h) {  // every midpoint and its neighbours
    const uint32_t mid = (h << 16) | 0x8000;
    for (uint32_t b : {mid - 1, mid, mid + 1}) {
      ASSERT_EQ(F32ToBf16(FromBits(b)), Bf16Oracle(FromBits(b))) << std::hex << b;
    }
  }
  EXPECT_EQ(F32ToBf16(FromBits(0x7F7FFFFFu)), 0x7F80);  // rounds to inf
  EXPECT_EQ(F32ToBf16(FromBits(0xFFA00001u)), 0xFFC0);
}

TEST(Bf16, SpansMatchScalarOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<float> x(100003);
  for (float& v : x) v = FromBits(rng());
  for (uint32_t b : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u,
                     0x00008000u, 0x00018000u, 0x7F7FFFFFu}) {
    x.push_back(FromBits(b));
  }
  ForEachTarget([&] {
    for (size_t n : {size_t{0}, size_t{5}, size_t{16}, size_t{17}, x.size()}) {
      std::vector<uint16_t> h(n + 8, 0xA5A5);
      F32ToBf16Span(x.data(), h.data(), n);
      std::vector<float> back(n + 8, FromBits(0x7FA5A5A5u));
      Bf16ToF32Span(h.data(), back.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(h[i], F32ToBf16(x[i])) << std::hex << Bits(x[i]);
        ASSERT_EQ(Bits(back[i]), static_cast<uint32_t>(h[i]) << 16);
      }
      for (size_t i = n; i < n + 8; ++i) {
        ASSERT_EQ(h[i], 0xA5A5);
        ASSERT_EQ(Bits(back[i]), 0x7FA5A5A5u);
      }
    }
  });
}

// ---- int8 --------------------------------------------------------------

TEST(Int8, RoundHalfEvenAndClamp) {
  EXPECT_EQ(EncodeInt8(0.5f), 0);
  EXPECT_EQ(EncodeInt8(1.5f), 2);
  EXPECT_EQ(EncodeInt8(2.5f), 2);
  EXPECT_EQ(EncodeInt8(-2.5f), -2);
  EXPECT_EQ(EncodeInt8(-3.5f), -4);
  EXPECT_EQ(EncodeInt8(126.5f), 126);
  EXPECT_EQ(EncodeInt8(127.4f), 127);
  EXPECT_EQ(EncodeInt8(1e9f), 127);
  EXPECT_EQ(EncodeInt8(-INFINITY), -127);
  EXPECT_EQ(EncodeInt8(NAN), 0);
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<double> u(-130, 130);
  for (int i = 0; i < 100000; ++i) {
    const float x = static_cast<float>(u(rng));
    const double r = std::nearbyint(std::clamp(static_cast<double>(x), -127.0, 127.0));
    ASSERT_EQ(EncodeInt8(x), static_cast<int>(r)) << x;
  }
}

TEST(Formats, NamesAndDTypes) {
  for (Fp8Format f : kFormats) {
    EXPECT_EQ(*ParseFp8Format(Fp8FormatName(f)), f);
    EXPECT_EQ(*Fp8FormatOf(Fp8FormatDType(f)), f);
  }
  EXPECT_EQ(*ParseFp8Format("float8_e5m2"), Fp8Format::kE5M2);
  EXPECT_FALSE(ParseFp8Format("e4m3").ok());
  EXPECT_FALSE(Fp8FormatOf(DType::kI8).ok());
}

}  // namespace
}  // namespace fp8moe
