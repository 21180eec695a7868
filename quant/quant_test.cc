// Quantizers against their plain-loop twins, and the properties docs/design.md §3.2
// promises: scale formula, saturation, NaN/Inf confined to their scaling
// group, tail rows never read, group tiles from valid rows only.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "hwy/targets.h"
#include "quant/quant_internal.h"
#include "quant/quant_test_util.h"

namespace fp8moe {
namespace {

using test::ForEachTarget;

constexpr QuantDType kDTypes[] = {QuantDType::kE4M3FN, QuantDType::kE4M3FNUZ,
                                  QuantDType::kE5M2, QuantDType::kE5M2FNUZ,
                                  QuantDType::kInt8};
const float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

class QuantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = test::TestSeed();
    trace_.emplace(__FILE__, __LINE__, test::SeedNote(seed_));
    rng_.seed(static_cast<uint32_t>(seed_ ^ (seed_ >> 32)));
  }
  // Values whose magnitude varies by row/channel over many binades, so some
  // groups reach the subnormal range of every format.
  std::vector<float> Random(size_t n, int64_t period) {
    std::vector<float> v(n);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> ex(-30, 20);
    float mag = 1.0f;
    for (size_t i = 0; i < n; ++i) {
      if (i % static_cast<size_t>(period) == 0) mag = std::ldexp(1.0f, ex(rng_));
      v[i] = nd(rng_) * mag;
    }
    return v;
  }
  uint64_t seed_ = 0;
  std::optional<::testing::ScopedTrace> trace_;  // names the seed on failure
  std::mt19937 rng_;
};

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(Bits(a[i]), Bits(b[i])) << "at " << i << ": " << a[i] << " vs " << b[i];
  }
}

constexpr ScaleArithmetic kXla = ScaleArithmetic::kXlaReciprocal;
const Calibration kCalibs[] = {Calibration::AbsMax(),
                               Calibration::Fixed(-224.0f, 224.0f),
                               Calibration::Fixed(-0.01f, 0.003f),
                               Calibration::AbsMax().With(kXla),
                               Calibration::Fixed(-224.0f, 224.0f).With(kXla),
                               Calibration::Fixed(-0.01f, 0.003f).With(kXla)};

TEST_F(QuantTest, TensorMatchesReference) {
  for (QuantDType d : kDTypes) {
    for (const Calibration& cal : kCalibs) {
      for (int64_t n : {0, 1, 7, 33, 1000, 300001}) {
        const auto x = Random(static_cast<size_t>(n), 1 << 30);
        std::vector<uint8_t> q1(n, 0xA5), q2(n, 0x5A);
        float s1 = kNaN, s2 = kNaN;
        ASSERT_TRUE(QuantizeTensor(x.data(), n, d, cal, q1.data(), &s1).ok());
        ASSERT_TRUE(reference::QuantizeTensor(x.data(), n, d, cal, q2.data(), &s2).ok());
        ASSERT_EQ(q1, q2) << QuantDTypeName(d) << " n " << n;
        ASSERT_EQ(Bits(s1), Bits(s2));
      }
    }
  }
}

TEST_F(QuantTest, RowsMatchReference) {
  for (QuantDType d : kDTypes) {
    for (const Calibration& cal : kCalibs) {
      for (int64_t block : {0, 128, 512, 5}) {
        for (auto [rows, cols, valid] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                                         {9, 1000, 7}, {3, 256, 3}, {64, 517, 0},
                                         {200, 1100, 150}}) {
          const auto x = Random(static_cast<size_t>(rows * cols), cols);
          const int64_t nb = NumBlocks(cols, block);
          std::vector<uint8_t> q1(rows * cols, 0xA5), q2(rows * cols, 0x5A);
          std::vector<float> s1(rows * nb, kNaN), s2(rows * nb, -kNaN);
          ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, valid, block, d, cal,
                                   q1.data(), s1.data()).ok());
          ASSERT_TRUE(reference::QuantizeRows(x.data(), rows, cols, valid, block,
                                              d, cal, q2.data(), s2.data()).ok());
          ASSERT_EQ(q1, q2) << QuantDTypeName(d) << " block " << block;
          ExpectSameBits(s1, s2);
        }
      }
    }
  }
}

TEST_F(QuantTest, ChannelsMatchReference) {
  for (QuantDType d : kDTypes) {
    for (const Calibration& cal : kCalibs) {
      for (auto [e, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                             {3, 17, 33}, {2, 256, 512}, {4, 0, 8}}) {
        const auto w = Random(static_cast<size_t>(e * k * n), 97);
        std::vector<uint8_t> q1(e * k * n, 0xA5), q2(e * k * n, 0x5A);
        std::vector<float> s1(e * n, kNaN), s2(e * n, -kNaN);
        ASSERT_TRUE(QuantizeChannels(w.data(), e, k, n, d, cal, q1.data(), s1.data()).ok());
        ASSERT_TRUE(reference::QuantizeChannels(w.data(), e, k, n, d, cal, q2.data(),
                                                s2.data()).ok());
        ASSERT_EQ(q1, q2);
        ExpectSameBits(s1, s2);
      }
    }
  }
}

TEST_F(QuantTest, GroupTilesMatchReferenceAndPerTileChannels) {
  const int64_t c = 37;
  const std::vector<int32_t> sizes = {5, 0, 64, 1, 0, 130, 0};
  int64_t valid = 0;
  for (int32_t s : sizes) valid += s;
  const int64_t m = valid + 11;  // tail rows
  for (QuantDType d : kDTypes) {
    for (int64_t tile_m : {0, 1, 16, 64, 1000}) {
     for (ScaleArithmetic arith : {ScaleArithmetic::kExactDivide, kXla}) {
      auto x = Random(static_cast<size_t>(m * c), c * 3);
      for (int64_t i = valid * c; i < m * c; ++i) x[i] = kNaN;  // poisoned tail
      const int64_t tiles = *NumGroupTiles(sizes.data(), 7, m, tile_m);
      std::vector<uint8_t> q1(m * c, 0xA5), q2(m * c, 0x5A);
      std::vector<float> s1(tiles * c, kNaN), s2(tiles * c, -kNaN);
      const Calibration cal = Calibration::AbsMax().With(arith);
      ASSERT_TRUE(QuantizeGroupTileChannels(x.data(), m, c, sizes.data(), 7, tile_m,
                                            d, cal, q1.data(), s1.data()).ok());
      ASSERT_TRUE(reference::QuantizeGroupTileChannels(x.data(), m, c, sizes.data(), 7,
                                                       tile_m, d, cal, q2.data(),
                                                       s2.data()).ok());
      ASSERT_EQ(q1, q2);
      ExpectSameBits(s1, s2);
      for (float s : s1) ASSERT_FALSE(std::isnan(s)) << "tail reached a scale";
      for (int64_t i = valid * c; i < m * c; ++i) ASSERT_EQ(q1[i], 0);
      // Independent construction: each tile alone through QuantizeChannels.
      int64_t row = 0, t = 0;
      for (int32_t size : sizes) {
        const int64_t step = tile_m ? tile_m : std::max<int64_t>(size, 1);
        for (int64_t t0 = 0; t0 < size || (tile_m == 0 && t0 == 0); t0 += step, ++t) {
          const int64_t rows = std::min<int64_t>(step, size - t0);
          std::vector<uint8_t> qt(rows * c);
          std::vector<float> st(c);
          ASSERT_TRUE(QuantizeChannels(x.data() + (row + t0) * c, 1, rows, c, d, cal,
                                       qt.data(), st.data()).ok());
          for (int64_t j = 0; j < c; ++j) ASSERT_EQ(Bits(st[j]), Bits(s1[t * c + j]));
          if (!qt.empty()) {
            ASSERT_EQ(0, std::memcmp(qt.data(), q1.data() + (row + t0) * c, qt.size()));
          }
        }
        row += size;
      }
      ASSERT_EQ(t, tiles);
      // Dequantize: valid rows match element-wise dequantization, tail is 0.
      std::vector<float> back(m * c, kNaN);
      ASSERT_TRUE(DequantizeGroupTileChannels(q1.data(), m, c, sizes.data(), 7, tile_m,
                                              s1.data(), d, back.data()).ok());
      for (int64_t i = valid * c; i < m * c; ++i) ASSERT_EQ(back[i], 0.0f);
     }
    }
  }
}

TEST(Quant, ScaleFormulaAndFixedCalibration) {
  EXPECT_EQ(ScaleFromAmax(448.0f, QuantDType::kE4M3FN), 1.0f);
  EXPECT_EQ(ScaleFromAmax(0.0f, QuantDType::kE4M3FN), 1e-12f / 448.0f);
  EXPECT_EQ(ScaleFromAmax(254.0f, QuantDType::kInt8), 2.0f);
  EXPECT_TRUE(std::isnan(ScaleFromAmax(kNaN, QuantDType::kE5M2)));
  const auto cal = *Calibration::Parse("fixed,-224,224");
  EXPECT_EQ(cal.ToString(), "fixed,-224,224");
  const std::vector<float> x = {1.0f, -300.0f, 224.0f, 500.0f, 0.25f};
  std::vector<uint8_t> q(x.size());
  float s = 0;
  ASSERT_TRUE(QuantizeTensor(x.data(), 5, QuantDType::kE4M3FN, cal, q.data(), &s).ok());
  EXPECT_EQ(s, 0.5f);  // docs/design.md §3.2: fixed,-224,224 gives e4m3fn scale 0.5
  EXPECT_EQ(DequantizeValue(q[1], s, QuantDType::kE4M3FN), -224.0f);  // clipped
  EXPECT_EQ(DequantizeValue(q[3], s, QuantDType::kE4M3FN), 224.0f);
  EXPECT_EQ(DequantizeValue(q[0], s, QuantDType::kE4M3FN), 1.0f);
  for (const char* bad : {"", "absmin", "fixed", "fixed,1", "fixed,a,2",
                          "fixed,1,inf", "fixed,0,0", "fixed,1,2x", "fixed,0x10,1",
                          "fixed, 1,2", "fixed,1,nan", "fixed,-inf,1"}) {
    EXPECT_FALSE(Calibration::Parse(bad).ok()) << bad;
  }
  EXPECT_TRUE(Calibration::Parse("absmax").ok());
}

TEST(Quant, XlaReciprocalScaleFormula) {
  EXPECT_EQ(ScaleArithmeticName(kXla), "xla_reciprocal");
  EXPECT_EQ(*ParseScaleArithmetic("exact_divide"), ScaleArithmetic::kExactDivide);
  EXPECT_EQ(*ParseScaleArithmetic("xla_reciprocal"), kXla);
  const auto bad = ParseScaleArithmetic("reciprocal");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("xla_reciprocal"), std::string::npos);

  const QuantDType d = QuantDType::kE4M3FN;
  const Calibration absmax = Calibration::AbsMax().With(kXla);
  // 100 / 448 and 100 * f32(1 / 448) differ by one ulp: the case XLA changes.
  const float r448 = 1.0f / 448.0f;
  ASSERT_NE(Bits(100.0f / 448.0f), Bits(100.0f * r448));
  EXPECT_EQ(Bits(CalibratedScale(100.0f, d, absmax)), Bits(100.0f * r448));
  EXPECT_EQ(Bits(CalibratedScale(100.0f, d, Calibration::AbsMax())),
            Bits(100.0f / 448.0f));
  // A fixed amax is a constant XLA folds exactly.
  EXPECT_EQ(Bits(CalibratedScale(0.0f, d, Calibration::Fixed(-100, 100).With(kXla))),
            Bits(100.0f / 448.0f));
  // qwix's floor instead of the 1e-12 epsilon: below 2^-63 the scale is 1.
  EXPECT_EQ(CalibratedScale(0.0f, d, absmax), 1.0f);
  EXPECT_EQ(CalibratedScale(1e-20f, d, absmax), 1.0f);
  const float edge = std::ldexp(1.0f, -63) * 448.0f;  // amax * r448 rounds to 2^-63
  EXPECT_EQ(CalibratedScale(edge, d, absmax), edge * r448);
  EXPECT_EQ(CalibratedScale(std::nextafter(edge * 0.5f, 0.0f), d, absmax), 1.0f);
  EXPECT_TRUE(std::isnan(CalibratedScale(kNaN, d, absmax)));
  EXPECT_TRUE(std::isinf(CalibratedScale(INFINITY, d, absmax)));
  EXPECT_EQ(CalibratedScale(0.0f, d, Calibration::AbsMax()), 1e-12f / 448.0f);
}

// Values next to the midpoints between fp8 codes (times the scale), where
// x / s and x * (1 / s) round to different codes: each arithmetic must give
// its own formula's codes, and the two must differ somewhere.
TEST(Quant, XlaReciprocalCodesNearMidpoints) {
 ForEachTarget([] {
  for (QuantDType d : {QuantDType::kE4M3FN, QuantDType::kE5M2, QuantDType::kInt8}) {
    const int64_t cols = 512;
    const std::vector<float> mids = test::CodeMidpoints(d);
    std::vector<float> x;
    const float amax = 100.0f;
    const float s = 100.0f * (1.0f / QuantMax(d));  // the xla scale of amax 100
    for (float m : mids) {
      float v = m * s;
      for (int k = 0; k < 6 && x.size() < static_cast<size_t>(cols) - 1; ++k) {
        if (std::fabs(v) < amax) x.push_back(v);
        v = std::nextafter(v, INFINITY);
      }
    }
    while (x.size() < static_cast<size_t>(cols) - 1) x.push_back(0.5f);
    x.push_back(amax);
    std::vector<uint8_t> q_div(cols), q_rcp(cols);
    float s_div = 0, s_rcp = 0;
    ASSERT_TRUE(QuantizeRows(x.data(), 1, cols, 1, 0, d, Calibration::AbsMax(),
                             q_div.data(), &s_div).ok());
    ASSERT_TRUE(QuantizeRows(x.data(), 1, cols, 1, 0, d,
                             Calibration::AbsMax().With(kXla), q_rcp.data(),
                             &s_rcp).ok());
    ASSERT_EQ(Bits(s_rcp), Bits(s));
    int differ = 0;
    for (int64_t i = 0; i < cols; ++i) {
      ASSERT_EQ(q_div[i], QuantizeValue(x[i], s_div, d)) << i;
      const float inv = 1.0f / s_rcp;
      const float v = x[i] * inv;
      const uint8_t want = d == QuantDType::kInt8
                               ? static_cast<uint8_t>(EncodeInt8(v))
                               : EncodeFp8(v, static_cast<Fp8Format>(d), true);
      ASSERT_EQ(q_rcp[i], want) << QuantDTypeName(d) << " at " << i;
      // Same scale, other arithmetic: count where only the reciprocal differs.
      differ += QuantizeValue(x[i], s_rcp, d) != q_rcp[i];
    }
    EXPECT_GT(differ, 0) << QuantDTypeName(d);
  }
 });
}

// Both arithmetics on every target: the per-lane (channels, group tiles) and
// one-scale (rows) SIMD paths against their plain-loop twins.
TEST_F(QuantTest, BothArithmeticsMatchReferenceOnEveryTarget) {
  const int64_t e = 2, k = 33, n = 37, rows = 9, cols = 300;
  const auto w = Random(static_cast<size_t>(e * k * n), 13);
  const auto x = Random(static_cast<size_t>(rows * cols), cols);
  const std::vector<int32_t> sizes = {3, 0, 5};
  ForEachTarget([&] {
    for (ScaleArithmetic a : {ScaleArithmetic::kExactDivide, kXla}) {
      for (QuantDType d : kDTypes) {
        const Calibration cal = Calibration::AbsMax().With(a);
        std::vector<uint8_t> q1(e * k * n), q2(e * k * n);
        std::vector<float> s1(e * n), s2(e * n);
        ASSERT_TRUE(QuantizeChannels(w.data(), e, k, n, d, cal, q1.data(), s1.data()).ok());
        ASSERT_TRUE(reference::QuantizeChannels(w.data(), e, k, n, d, cal, q2.data(),
                                                s2.data()).ok());
        ASSERT_EQ(q1, q2) << QuantDTypeName(d);
        ExpectSameBits(s1, s2);
        std::vector<uint8_t> r1(rows * cols), r2(rows * cols);
        std::vector<float> t1(rows * 3), t2(rows * 3);
        ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows - 1, 128, d, cal, r1.data(),
                                 t1.data()).ok());
        ASSERT_TRUE(reference::QuantizeRows(x.data(), rows, cols, rows - 1, 128, d, cal,
                                            r2.data(), t2.data()).ok());
        ASSERT_EQ(r1, r2) << QuantDTypeName(d);
        ExpectSameBits(t1, t2);
        std::vector<float> g1(3 * cols), g2(3 * cols);
        ASSERT_TRUE(QuantizeGroupTileChannels(x.data(), rows, cols, sizes.data(), 3, 0, d,
                                              cal, r1.data(), g1.data()).ok());
        ASSERT_TRUE(reference::QuantizeGroupTileChannels(x.data(), rows, cols, sizes.data(),
                                                         3, 0, d, cal, r2.data(),
                                                         g2.data()).ok());
        ASSERT_EQ(r1, r2) << QuantDTypeName(d);
        ExpectSameBits(g1, g2);
      }
    }
  });
}

TEST_F(QuantTest, ZeroRowsInfAndNaNStayInTheirGroup) {
  const int64_t rows = 6, cols = 300;
  for (QuantDType d : kDTypes) {
    auto x = Random(rows * cols, cols);
    std::fill(x.begin(), x.begin() + cols, 0.0f);  // row 0 all zero
    x[1 * cols + 17] = std::numeric_limits<float>::infinity();
    x[2 * cols + 3] = kNaN;
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> s(rows);
    ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, 0, d,
                             Calibration::AbsMax(), q.data(), s.data()).ok());
    EXPECT_EQ(s[0], 1e-12f / QuantMax(d));
    for (int64_t j = 0; j < cols; ++j) EXPECT_EQ(q[j], 0);
    // The xla arithmetic floors the zero row's scale at 1 (codes still 0).
    std::vector<uint8_t> qx(rows * cols, 0xA5);
    std::vector<float> sx(rows);
    ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, 0, d,
                             Calibration::AbsMax().With(kXla), qx.data(), sx.data()).ok());
    EXPECT_EQ(sx[0], 1.0f);
    for (int64_t j = 0; j < cols; ++j) EXPECT_EQ(qx[j], 0);
    EXPECT_TRUE(std::isinf(sx[1]));
    EXPECT_TRUE(std::isnan(sx[2]));
    EXPECT_TRUE(std::isinf(s[1]));
    EXPECT_TRUE(std::isnan(s[2]));
    // Rows 3..5 are exactly what quantizing them alone gives.
    std::vector<uint8_t> q_alone(3 * cols);
    std::vector<float> s_alone(3);
    ASSERT_TRUE(QuantizeRows(x.data() + 3 * cols, 3, cols, 3, 0, d,
                             Calibration::AbsMax(), q_alone.data(), s_alone.data()).ok());
    EXPECT_EQ(0, std::memcmp(q_alone.data(), q.data() + 3 * cols, 3 * cols));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(s_alone[i], s[3 + i]);
    // Per tensor: one NaN makes the one scale NaN.
    float st = 0;
    ASSERT_TRUE(QuantizeTensor(x.data(), rows * cols, d, Calibration::AbsMax(),
                               q.data(), &st).ok());
    EXPECT_TRUE(std::isnan(st));
  }
}

TEST_F(QuantTest, TailRowsNeverReachAScale) {
  const int64_t rows = 40, cols = 129, valid = 23;
  for (QuantDType d : kDTypes) {
    auto x = Random(rows * cols, cols);
    auto poisoned = x;
    for (int64_t i = valid * cols; i < rows * cols; ++i) {
      poisoned[i] = (i % 2) ? kNaN : std::numeric_limits<float>::infinity();
    }
    for (int64_t block : {0, 128}) {
      const int64_t nb = NumBlocks(cols, block);
      std::vector<uint8_t> q1(rows * cols), q2(rows * cols);
      std::vector<float> s1(rows * nb, kNaN), s2(rows * nb, kNaN);
      ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, valid, block, d,
                               Calibration::AbsMax(), q1.data(), s1.data()).ok());
      ASSERT_TRUE(QuantizeRows(poisoned.data(), rows, cols, valid, block, d,
                               Calibration::AbsMax(), q2.data(), s2.data()).ok());
      EXPECT_EQ(q1, q2);
      ExpectSameBits(s1, s2);
      for (int64_t i = valid * nb; i < rows * nb; ++i) EXPECT_EQ(s2[i], 0.0f);
      for (int64_t i = valid * cols; i < rows * cols; ++i) EXPECT_EQ(q2[i], 0);
    }
  }
}

TEST_F(QuantTest, DequantizeErrorIsWithinHalfAStep) {
  const int64_t rows = 50, cols = 256;
  for (QuantDType d : kDTypes) {
    const auto x = Random(rows * cols, cols);
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> s(rows), back(rows * cols);
    ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, 0, d, Calibration::AbsMax(),
                             q.data(), s.data()).ok());
    DequantizeRows(q.data(), rows, cols, 0, s.data(), d, back.data());
    // Relative half-ulp in the normal range, half the smallest step below it.
    const bool is_int8 = d == QuantDType::kInt8;
    const int man = (d == QuantDType::kE4M3FN || d == QuantDType::kE4M3FNUZ) ? 3 : 2;
    const float min_step = is_int8 ? 1.0f
                                   : DecodeFp8(1, static_cast<Fp8Format>(d));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) {
        const float v = x[r * cols + j], b = back[r * cols + j];
        ASSERT_EQ(b, DequantizeValue(q[r * cols + j], s[r], d));
        const double rel = is_int8 ? 0.0 : std::ldexp(1.0, -(man + 1));
        // Plus the f32 roundings around the rounding to the grid: x / s (or
        // x * (1/s)) is rounded before it is rounded to the grid, which can
        // move a value just past a midpoint by up to ~|x| 2^-23 (seen: int8,
        // x / s = 82.5000..., error 1.000001 half-steps), and q * s is
        // rounded again.
        const double bound = std::max(std::fabs(v) * rel, 0.5 * min_step * s[r]) +
                             (std::fabs(v) + std::fabs(b)) * std::ldexp(1.0, -23);
        ASSERT_LE(std::fabs(static_cast<double>(b) - v), bound)
            << QuantDTypeName(d) << " x " << v << " back " << b;
      }
    }
  }
}

TEST_F(QuantTest, ThreadCountDoesNotChangeBits) {
  const int64_t rows = 512, cols = 1024;
  const auto x = Random(rows * cols, cols);
  const int saved = omp_get_max_threads();
  std::vector<uint8_t> a(rows * cols), b(rows * cols);
  std::vector<float> sa(rows), sb(rows);
  float ta = 0, tb = 0;
  omp_set_num_threads(1);
  ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, 0, QuantDType::kE4M3FN,
                           Calibration::AbsMax(), a.data(), sa.data()).ok());
  ASSERT_TRUE(QuantizeTensor(x.data(), rows * cols, QuantDType::kInt8,
                             Calibration::AbsMax(), a.data(), &ta).ok());
  omp_set_num_threads(std::max(2, saved));
  ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, 0, QuantDType::kE4M3FN,
                           Calibration::AbsMax(), b.data(), sb.data()).ok());
  ASSERT_TRUE(QuantizeTensor(x.data(), rows * cols, QuantDType::kInt8,
                             Calibration::AbsMax(), b.data(), &tb).ok());
  omp_set_num_threads(saved);
  EXPECT_EQ(a, b);
  EXPECT_EQ(sa, sb);
  EXPECT_EQ(ta, tb);
}

// ---- The whole f32 range, every SIMD target (issue 12, part 1) -------------
//
// Scaling groups made of the edge values (+-0, subnormals, +-1e-30, +-1e30,
// +-FLT_MAX, +-inf, NaN), alone and mixed with ordinary values, through every
// granularity on every target this CPU runs: codes and scales must be the
// plain-loop twins' bits. Then the promises of docs/numerics.md: a group with
// a NaN has a NaN scale, a group with an inf has scale inf and codes 0 for its
// finite values, a group of zeros or subnormals has scale 1e-12 / fmax.

float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

std::vector<float> EdgeValues() {
  std::vector<float> v;
  for (float x : {0.0f, std::numeric_limits<float>::denorm_min(), FromBits(0x007FFFFFu),
                  std::numeric_limits<float>::min(), 1e-30f, 1e-12f, 1.0f, 448.0f, 57344.0f,
                  1e30f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity()}) {
    v.push_back(x);
    v.push_back(-x);
  }
  v.push_back(kNaN);
  v.push_back(-kNaN);
  return v;
}

TEST_F(QuantTest, EdgeValuesMatchReferenceOnEveryTarget) {
  const std::vector<float> edge = EdgeValues();
  const int64_t cols = 37;  // not a multiple of any vector width
  // Row r: edge value r alone (the rest zero), then the same value among
  // normal ones, then each value filling a whole row.
  std::vector<float> x;
  const auto normal = Random(edge.size() * cols, cols);
  for (size_t r = 0; r < edge.size(); ++r) {
    for (int64_t j = 0; j < cols; ++j) x.push_back(j == 5 ? edge[r] : 0.0f);
  }
  for (size_t r = 0; r < edge.size(); ++r) {
    for (int64_t j = 0; j < cols; ++j) x.push_back(j == 11 ? edge[r] : normal[r * cols + j]);
  }
  for (size_t r = 0; r < edge.size(); ++r) {
    for (int64_t j = 0; j < cols; ++j) x.push_back(edge[r]);
  }
  const int64_t rows = static_cast<int64_t>(x.size()) / cols;
  // Both arithmetics: x * (1 / s) once returned the scale's NaN for a NaN x
  // where the reference returned x's (the NaN code's sign differed).
  ForEachTarget([&] {
   for (ScaleArithmetic a : {ScaleArithmetic::kExactDivide, kXla}) {
    const Calibration cal = Calibration::AbsMax().With(a);
    for (QuantDType d : kDTypes) {
      SCOPED_TRACE(std::string(QuantDTypeName(d)) + " " + std::string(ScaleArithmeticName(a)));
      for (int64_t block : {0, 16}) {
        const int64_t nb = NumBlocks(cols, block);
        std::vector<uint8_t> q1(rows * cols, 0xA5), q2(rows * cols, 0x5A);
        std::vector<float> s1(rows * nb, 1.0f), s2(rows * nb, 2.0f);
        ASSERT_TRUE(QuantizeRows(x.data(), rows, cols, rows, block, d, cal,
                                 q1.data(), s1.data()).ok());
        ASSERT_TRUE(reference::QuantizeRows(x.data(), rows, cols, rows, block, d,
                                            cal, q2.data(), s2.data()).ok());
        ASSERT_EQ(q1, q2) << "rows, block " << block;
        ExpectSameBits(s1, s2);
      }
      // Channels: the matrix as [1, rows, cols] (a channel is a column).
      std::vector<uint8_t> q1(rows * cols), q2(rows * cols);
      std::vector<float> s1(cols), s2(cols);
      ASSERT_TRUE(QuantizeChannels(x.data(), 1, rows, cols, d, cal, q1.data(),
                                   s1.data()).ok());
      ASSERT_TRUE(reference::QuantizeChannels(x.data(), 1, rows, cols, d, cal,
                                              q2.data(), s2.data()).ok());
      ASSERT_EQ(q1, q2) << "channels";
      ExpectSameBits(s1, s2);
      // Group tiles of 5 rows over groups of 17, 0 and the rest.
      const int32_t sizes[3] = {17, 0, static_cast<int32_t>(rows - 17)};
      const int64_t tiles = *NumGroupTiles(sizes, 3, rows, 5);
      std::vector<float> t1(tiles * cols), t2(tiles * cols);
      ASSERT_TRUE(QuantizeGroupTileChannels(x.data(), rows, cols, sizes, 3, 5, d,
                                            cal, q1.data(), t1.data()).ok());
      ASSERT_TRUE(reference::QuantizeGroupTileChannels(x.data(), rows, cols, sizes, 3, 5, d,
                                                       cal, q2.data(),
                                                       t2.data()).ok());
      ASSERT_EQ(q1, q2) << "group tiles";
      ExpectSameBits(t1, t2);
      // Per tensor, each edge value alone with ordinary values.
      for (size_t r = 0; r < edge.size(); ++r) {
        const float* row = x.data() + (edge.size() + r) * cols;
        float a = 0, b = 0;
        ASSERT_TRUE(QuantizeTensor(row, cols, d, cal, q1.data(), &a).ok());
        ASSERT_TRUE(reference::QuantizeTensor(row, cols, d, cal, q2.data(), &b).ok());
        ASSERT_EQ(0, std::memcmp(q1.data(), q2.data(), cols)) << "tensor, value " << edge[r];
        ASSERT_EQ(Bits(a), Bits(b));
      }
    }
   }
  });
}

// A GMM's BF16 activation is quantized from its bf16 bits (no f32 copy):
// every one of the 65536 bf16 patterns, in rows of 37 (not a vector width)
// and 70 (past two vectors of 16-bit lanes), alone among zeros and among
// ordinary values, gives the codes and scales of the reference on the
// row widened to f32, in every format, arithmetic, calibration and block
// size, on every target.
TEST_F(QuantTest, Bf16RowsMatchReferenceOnTheWidenedRows) {
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = static_cast<uint16_t>(b);
  std::shuffle(all.begin(), all.end(), rng_);
  const std::vector<float> normal = Random(all.size(), 23);
  ForEachTarget([&] {
    for (int64_t cols : {37, 70}) {
      // Rows of random patterns, then each pattern among ordinary values
      // (every 97th pattern: a row each).
      std::vector<uint16_t> x(all);
      x.resize((x.size() + cols - 1) / cols * cols, 0);
      for (size_t i = 0; i < all.size(); i += 97) {
        for (int64_t j = 0; j < cols; ++j) {
          const uint32_t b = std::bit_cast<uint32_t>(normal[(i + j) % normal.size()]) >> 16;
          x.push_back(j == cols / 2 ? all[i] : static_cast<uint16_t>(b));
        }
      }
      const int64_t rows = static_cast<int64_t>(x.size()) / cols;
      std::vector<float> wide(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        wide[i] = std::bit_cast<float>(static_cast<uint32_t>(x[i]) << 16);
      }
      for (const Calibration& cal : kCalibs) {
        for (QuantDType d : kDTypes) {
          SCOPED_TRACE(std::string(QuantDTypeName(d)) + " " +
                       std::string(ScaleArithmeticName(cal.arithmetic)) + " cols " +
                       std::to_string(cols));
          for (int64_t block : {0, 16}) {
            const int64_t nb = NumBlocks(cols, block);
            std::vector<uint8_t> q1(x.size(), 0xA5), q2(x.size(), 0x5A);
            std::vector<float> s1(rows * nb, 1.0f), s2(rows * nb, 2.0f);
            for (int64_t r = 0; r < rows; ++r) {
              internal::QuantizeOneRowBf16(x.data() + r * cols, cols, block, d, cal,
                                           q1.data() + r * cols, s1.data() + r * nb);
            }
            ASSERT_TRUE(reference::QuantizeRows(wide.data(), rows, cols, rows, block, d, cal,
                                                q2.data(), s2.data()).ok());
            ASSERT_EQ(q1, q2) << "block " << block;
            ExpectSameBits(s1, s2);
          }
        }
      }
    }
  });
}

// A native fp8 GMM packs the values of its activation's codes
// (QuantizeOneRowValues, Fp8ValueBf16Vec) rather than the codes: they must
// be exactly what decoding the codes of QuantizeOneRow gives
// (DecodeFp8ToBf16Span, as the packing did), NaN bits included, with the
// same scales. Every f32 sign/exponent/top-mantissa pattern (the upper 16
// bits) with low halves that decide the rounding (0, 1, a half - 1, a
// half, a half + 1, all ones), in order (a scale of 1: the whole f32 range
// against the fp8 one) and shuffled (blocks of mixed magnitudes: absmax
// scales, blocks with NaN and inf and blocks without), in both formats of
// native fp8 (e4m3fn, e4m3fnuz), every arithmetic, calibration and block
// size, from f32 and from bf16 rows, on every target.
TEST_F(QuantTest, RowValuesAreTheDecodedCodes) {
  std::vector<float> ordered;
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      ordered.push_back(std::bit_cast<float>(hi << 16 | lo));
    }
  }
  std::vector<float> shuffled(ordered);
  std::shuffle(shuffled.begin(), shuffled.end(), rng_);
  const std::vector<float> normal = Random(1 << 16, 61);
  std::vector<uint16_t> bf16(shuffled.size());
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = static_cast<uint16_t>(Bits(shuffled[i]) >> 16);
  const int64_t cols = 4099;  // rows of 4099: no vector width divides it
  auto rows_of = [&](size_t n) { return static_cast<int64_t>(n) / cols; };
  ForEachTarget([&] {
    for (QuantDType d : {QuantDType::kE4M3FN, QuantDType::kE4M3FNUZ}) {  // native fp8's
      const float m = QuantMax(d);
      // Scale 1 (amax = max): the values themselves against the format.
      const Calibration unit[] = {Calibration::Fixed(-m, m), Calibration::Fixed(-m, m).With(kXla)};
      for (const Calibration& cal : {unit[0], unit[1], Calibration::AbsMax(),
                                     Calibration::AbsMax().With(kXla), kCalibs[2]}) {
        for (int64_t block : {int64_t{0}, int64_t{128}}) {
          SCOPED_TRACE(std::string(QuantDTypeName(d)) + " " +
                       std::string(ScaleArithmeticName(cal.arithmetic)) + " block " +
                       std::to_string(block));
          const Fp8Format f = static_cast<Fp8Format>(d);
          // x: f32, or bf16 bits; the f32 bits of x[i].
          auto bits_of = [](auto e) -> uint32_t {
            if constexpr (std::is_same_v<decltype(e), float>) {
              return Bits(e);
            } else {
              return static_cast<uint32_t>(e) << 16;
            }
          };
          auto check = [&](const auto& x, const char* what) {
            constexpr bool kF32 =
                std::is_same_v<typename std::decay_t<decltype(x)>::value_type, float>;
            const int64_t rows = rows_of(x.size()), nb = NumBlocks(cols, block);
            std::vector<uint8_t> q(static_cast<size_t>(rows * cols), 0xA5);
            std::vector<uint16_t> v(q.size(), 0x5A5A), want(q.size());
            std::vector<float> s1(static_cast<size_t>(rows * nb), 1.0f), s2(s1.size(), 2.0f);
            for (int64_t r = 0; r < rows; ++r) {
              if constexpr (kF32) {
                internal::QuantizeOneRow(x.data() + r * cols, cols, block, d, cal,
                                         q.data() + r * cols, s1.data() + r * nb);
              } else {
                internal::QuantizeOneRowBf16(x.data() + r * cols, cols, block, d, cal,
                                             q.data() + r * cols, s1.data() + r * nb);
              }
              internal::QuantizeOneRowValues(x.data() + r * cols, cols, block, d, cal,
                                             v.data() + r * cols, s2.data() + r * nb);
            }
            DecodeFp8ToBf16Span(q.data(), want.data(), q.size(), f);
            ExpectSameBits(s1, s2);
            for (size_t i = 0; i < v.size(); ++i) {
              ASSERT_EQ(v[i], want[i]) << what << " at " << i << ": x bits " << std::hex
                                       << bits_of(x[i]) << ", code " << static_cast<int>(q[i]);
            }
          };
          check(ordered, "ordered f32");
          check(shuffled, "shuffled f32");
          check(normal, "normal f32");
          check(bf16, "shuffled bf16");
        }
      }
    }
  });
}

TEST_F(QuantTest, EdgeValuePromises) {
  const float inf = std::numeric_limits<float>::infinity();
  for (QuantDType d : kDTypes) {
    SCOPED_TRACE(QuantDTypeName(d));
    const float tiny_scale = 1e-12f / QuantMax(d);
    // Rows: [NaN, 1, ...], [inf, 1, -2, ...], [0 ...], [subnormals ...],
    // [FLT_MAX, -FLT_MAX, 1].
    const int64_t cols = 9;
    std::vector<float> x(5 * cols, 1.0f);
    x[0] = kNaN;
    x[cols] = inf;
    x[cols + 2] = -2.0f;
    for (int64_t j = 0; j < cols; ++j) x[2 * cols + j] = j % 2 ? 0.0f : -0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      x[3 * cols + j] = (j % 2 ? -1.0f : 1.0f) * std::numeric_limits<float>::denorm_min() * (j + 1);
    }
    x[4 * cols] = std::numeric_limits<float>::max();
    x[4 * cols + 1] = -std::numeric_limits<float>::max();
    std::vector<uint8_t> q(5 * cols);
    std::vector<float> s(5);
    ASSERT_TRUE(QuantizeRows(x.data(), 5, cols, 5, 0, d, Calibration::AbsMax(), q.data(),
                             s.data()).ok());
    EXPECT_TRUE(std::isnan(s[0])) << "NaN in: NaN scale";
    EXPECT_EQ(s[1], inf) << "inf in: scale inf";
    // Finite values over an infinite scale are +-0.
    for (int64_t j = 1; j < cols; ++j) {
      EXPECT_EQ(DequantizeValue(q[cols + j], 1.0f, d), 0.0f) << j;
    }
    if (d != QuantDType::kInt8) {  // inf / inf is NaN: the NaN code
      EXPECT_TRUE(std::isnan(DequantizeValue(q[cols], 1.0f, d)));
    } else {
      EXPECT_EQ(q[cols], 0) << "int8 NaN codes are 0";
    }
    EXPECT_EQ(s[2], tiny_scale) << "zeros";
    EXPECT_EQ(s[3], tiny_scale) << "subnormals";
    for (int64_t j = 0; j < 2 * cols; ++j) {
      EXPECT_EQ(DequantizeValue(q[2 * cols + j], 1.0f, d), 0.0f) << "zeros and subnormals: code 0";
    }
    EXPECT_EQ(s[4], std::numeric_limits<float>::max() / QuantMax(d));
    EXPECT_EQ(DequantizeValue(q[4 * cols], 1.0f, d), QuantMax(d)) << "FLT_MAX -> +fmax";
    EXPECT_EQ(DequantizeValue(q[4 * cols + 1], 1.0f, d), -QuantMax(d));
    // Back: fmax * rounded(FLT_MAX / fmax) may round past FLT_MAX to inf
    // (it does for int8: 127 * scale).
    const float back = DequantizeValue(q[4 * cols], s[4], d);
    EXPECT_TRUE(back == std::numeric_limits<float>::max() || back == INFINITY) << back;
  }
}

TEST(Quant, BadArgumentsAreClearErrors) {
  float x[4] = {1, 2, 3, 4};
  uint8_t q[4];
  float s[4];
  const int32_t neg[2] = {2, -1};
  const int32_t big[2] = {3, 2};
  auto st = QuantizeGroupTileChannels(x, 4, 1, neg, 2, 0, QuantDType::kE4M3FN,
                                      Calibration::AbsMax(), q, s);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("group_sizes[1]"), std::string::npos) << st.message();
  st = QuantizeGroupTileChannels(x, 4, 1, big, 2, 0, QuantDType::kE4M3FN,
                                 Calibration::AbsMax(), q, s);
  EXPECT_NE(st.message().find("exceeds"), std::string::npos) << st.message();
  const int32_t ok[2] = {1, 1};
  EXPECT_FALSE(NumGroupTiles(ok, 2, 4, -1).ok());
  EXPECT_FALSE(QuantizeRows(x, 2, 2, 3, 0, QuantDType::kInt8, Calibration::AbsMax(), q, s).ok());
  EXPECT_FALSE(QuantizeRows(x, 2, 2, 2, -4, QuantDType::kInt8, Calibration::AbsMax(), q, s).ok());
  EXPECT_FALSE(ParseQuantDType("fp8").ok());
  EXPECT_EQ(*ParseQuantDType("int8"), QuantDType::kInt8);
  EXPECT_EQ(QuantStorageDType(QuantDType::kE5M2FNUZ), DType::kE5M2FNUZ);
}

}  // namespace
}  // namespace fp8moe
