// SwiGLU's elementwise functions (sigmoid, silu, silu', the SwiGLU and
// dSwiGLU rows of the GMM epilogues) over the whole f32 range on every SIMD
// target, against the double references of kernels/gmm_problem.h, and the
// promises of docs/numerics.md at +-0, +-inf and NaN.
#include "kernels/cpu/activation.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/numerics.h"
#include "hwy/targets.h"
#include "kernels/gmm_problem.h"

namespace fp8moe {
namespace {

using internal::SigmoidRef;
using internal::SiluGradRef;
using internal::SiluRef;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();
const double kU = std::ldexp(1.0, -24);       // f32 unit roundoff
const double kTiny = std::ldexp(1.0, -147);   // two steps of the subnormal grid

// Below x = -87.3 sigmoid(x) is subnormal (and 0 below -104): it keeps only
// a few significant bits, and silu = x * sigmoid and silu' ~ (1 + x) sigmoid
// inherit its rounding on the subnormal grid times |x| + 1. The promise
// there is absolute: (|x| + 1) 2^-148, on values below 1e-36.
double SubnormalSigmoidError(double x) {
  return std::isfinite(x) ? (std::fabs(x) + 1) * std::ldexp(1.0, -148) : 0.0;
}

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// +-0, subnormals, +-1e-30, the places where exp over- and underflows in f32
// (+-87..89, +-103..105, +-178: where 1/(1+exp(-x)) used to fail), silu''s
// zero at -1.278, +-1e30, +-FLT_MAX, +-inf, NaNs; then every 997th f32 bit
// pattern and dense random values.
std::vector<float> Inputs(uint64_t seed) {
  std::vector<float> v;
  for (float x : {0.0f, 1e-30f, 1e-10f, 1e-7f, 0.5f, 1.0f, 1.2784645f, 2.0f, 10.0f, 15.9f,
                  16.7f, 30.0f, 60.0f, 87.3f, 88.72f, 89.0f, 100.0f, 103.97f, 104.0f, 104.1f,
                  150.0f, 177.0f, 178.0f, 200.0f, 533.0f, 1e4f, 1e30f, kMax, kInf,
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  FromBits(0x007FFFFFu)}) {
    v.push_back(x);
    v.push_back(-x);
  }
  for (uint32_t b : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFA12345u}) v.push_back(FromBits(b));
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 997) v.push_back(FromBits(static_cast<uint32_t>(b)));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
  for (int i = 0; i < 200000; ++i) v.push_back(nd(rng));
  for (int i = 0; i < 200000; ++i) v.push_back(wide(rng));
  return v;
}

using test::ForEachTarget;  // every target, AVX3 and AVX3_SPR apart

// got against the double reference want: NaN exactly where want is NaN, the
// same infinity, a zero of the same sign where want rounds to zero, else
// within `bound`.
std::string At(float x);

// what: the function's name; x its argument (named only on failure).
void ExpectClose(float got, double want, double bound, const char* fn, float x) {
  auto what = [&] { return std::string(fn) + " " + At(x); };
  const float wf = static_cast<float>(want);
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << what() << " got " << got << " want NaN";
    return;
  }
  ASSERT_FALSE(std::isnan(got)) << what() << " got NaN want " << want;
  if (std::isinf(wf)) {
    ASSERT_EQ(got, wf) << what();
    return;
  }
  if (wf == 0.0f && got == 0.0f) {
    ASSERT_EQ(std::signbit(got), std::signbit(wf)) << what() << " sign of zero";
    return;
  }
  ASSERT_LE(std::fabs(static_cast<double>(got) - want), bound)
      << what() << " got " << got << " want " << want;
}

std::string At(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "x=%.9g (0x%08x)", x, Bits(x));
  return buf;
}

TEST(Activation, PromisesAtInfinityNaNAndZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ForEachTarget([&] {
    const std::vector<float> x = {-kInf, kInf, nan, -nan, 0.0f, -0.0f, -200.0f, -533.0f, -1e30f,
                                  -kMax};
    std::vector<float> s(x.size()), si(x.size()), sg(x.size());
    internal::SigmoidSpan(x.data(), static_cast<int64_t>(x.size()), s.data());
    internal::SiluSpan(x.data(), static_cast<int64_t>(x.size()), si.data());
    internal::SiluGradSpan(x.data(), static_cast<int64_t>(x.size()), sg.data());
    EXPECT_EQ(Bits(s[0]), Bits(0.0f));   // sigmoid(-inf) = +0
    EXPECT_EQ(s[1], 1.0f);               // sigmoid(+inf) = 1
    EXPECT_EQ(Bits(si[0]), Bits(-0.0f));  // silu(-inf) = -0
    EXPECT_EQ(si[1], kInf);              // silu(+inf) = +inf
    EXPECT_EQ(Bits(sg[0]), Bits(-0.0f));  // silu'(-inf) = -0
    EXPECT_EQ(sg[1], 1.0f);              // silu'(+inf) = 1
    for (size_t i : {size_t{2}, size_t{3}}) {
      EXPECT_TRUE(std::isnan(s[i]) && std::isnan(si[i]) && std::isnan(sg[i])) << "NaN in";
    }
    EXPECT_EQ(s[4], 0.5f);
    EXPECT_EQ(s[5], 0.5f);
    EXPECT_EQ(Bits(si[4]), Bits(0.0f));
    EXPECT_EQ(Bits(si[5]), Bits(-0.0f));
    EXPECT_EQ(sg[4], 0.5f);
    for (size_t i = 6; i < x.size(); ++i) {  // far below: silu and silu' are -0
      EXPECT_EQ(Bits(si[i]), Bits(-0.0f)) << x[i];
      EXPECT_EQ(Bits(sg[i]), Bits(-0.0f)) << x[i];
      EXPECT_EQ(Bits(s[i]), Bits(0.0f)) << x[i];
    }
  });
}

TEST(Activation, WholeF32RangeMatchesReferenceOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  const std::vector<float> x = Inputs(seed);
  const int64_t n = static_cast<int64_t>(x.size());
  ForEachTarget([&] {
    std::vector<float> s(x.size()), si(x.size()), sg(x.size());
    internal::SigmoidSpan(x.data(), n, s.data());
    internal::SiluSpan(x.data(), n, si.data());
    internal::SiluGradSpan(x.data(), n, sg.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const double xd = x[i];
      const double sr = SigmoidRef(xd);
      // Exp (1 ulp), 1 + t and the division: 4 ulp; subnormal results also
      // carry Exp's rounding on the subnormal grid.
      ExpectClose(s[i], sr, 4 * kU * std::fabs(sr) + kTiny, "sigmoid", x[i]);
      const double silu = SiluRef(xd);
      ExpectClose(si[i], silu, 5 * kU * std::fabs(silu) + SubnormalSigmoidError(xd) + kTiny,
                  "silu", x[i]);
      // silu'(x) = s + s x (1 - s) cancels near x = -1.28: bound by the terms.
      const double grad = SiluGradRef(xd);
      const double terms = std::isfinite(xd) ? std::fabs(sr) * (1 + std::fabs(xd) * (1 - sr)) : 0;
      ExpectClose(sg[i], grad, 8 * kU * terms + SubnormalSigmoidError(xd) + kTiny,
                  "silu'", x[i]);
      if (::testing::Test::HasFatalFailure()) return;
    }
  });
}

// The epilogue rows are the f32 products of the checked functions above:
// out = silu(gate) * up, dup = da * silu(gate), dgate = da * (up *
// silu'(gate)), each product rounded once (so the same bits as those
// products, NaN where they are NaN), at every length (the padded tail) and
// with dgate aliasing da. up and da are random or special (+-0, +-inf, NaN,
// 1e30, 1e-30).
TEST(Activation, SwiGluRowsAreTheProductsOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  const std::vector<float> gate = Inputs(seed);
  const size_t n = gate.size();
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> up(n), da(n);
  const float specials[] = {0.0f, -0.0f, kInf, -kInf, std::numeric_limits<float>::quiet_NaN(),
                            1e30f, 1e-30f};
  for (size_t i = 0; i < n; ++i) {
    up[i] = i % 17 == 0 ? specials[(i / 17) % 7] : nd(rng);
    da[i] = i % 19 == 0 ? specials[(i / 19) % 7] : nd(rng);
  }
  auto same = [](float got, float want) {
    return std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want) ||
           (std::isnan(got) && std::isnan(want));
  };
  ForEachTarget([&] {
    std::vector<float> silu(n), grad(n);
    internal::SiluSpan(gate.data(), static_cast<int64_t>(n), silu.data());
    internal::SiluGradSpan(gate.data(), static_cast<int64_t>(n), grad.data());
    for (size_t len : {n, size_t{1}, size_t{3}, size_t{7}, size_t{8}, size_t{9}, size_t{17}}) {
      std::vector<float> out(len + 1, 12345.0f), dgate(da.begin(), da.begin() + len),
          dup(len + 1, 12345.0f);
      dgate.push_back(12345.0f);
      const int64_t l = static_cast<int64_t>(len);
      internal::SwiGluSpan(gate.data(), up.data(), l, out.data());
      internal::DSwiGluSpan(dgate.data(), gate.data(), up.data(), l, dgate.data(), dup.data());
      ASSERT_EQ(out[len], 12345.0f) << "wrote past the end";
      ASSERT_EQ(dgate[len], 12345.0f) << "wrote past the end";
      ASSERT_EQ(dup[len], 12345.0f) << "wrote past the end";
      for (size_t i = 0; i < len; ++i) {
        if (same(out[i], silu[i] * up[i]) && same(dup[i], da[i] * silu[i]) &&
            same(dgate[i], da[i] * (up[i] * grad[i]))) {
          continue;
        }
        FAIL() << At(gate[i]) << " up " << up[i] << " da " << da[i] << " at " << i << ": out "
               << out[i] << " dup " << dup[i] << " dgate " << dgate[i];
      }
    }
  });
}

}  // namespace
}  // namespace fp8moe
