// The grouped matmuls at the edges of f32 (issue 12, part 1): SwiGLU and
// dSwiGLU of gates far outside the range where sigmoid is representable, in
// every mode and on every SIMD target, through the public API. The
// elementwise functions themselves are swept in cpu/activation_test.cc.
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/gmm.h"
#include "hwy/targets.h"
#include "kernels/gmm_test_util.h"
#include "quant/quant_test_util.h"

namespace fp8moe {
namespace {

using namespace gmm_test;  // NOLINT

// A weight [1, K, N] from values: f32, bf16, or codes + per-channel scale
// (each channel's amax is its own value, so every value survives quantizing).
Weight WeightFromValues(DType dtype, const std::vector<float>& v, int64_t k, int64_t n) {
  Tensor f = Make(DType::kF32, {1, k, n});
  std::memcpy(f.data(), v.data(), v.size() * sizeof(float));
  Weight out;
  if (dtype == DType::kF32) {
    out.w = std::move(f);
  } else if (dtype == DType::kBF16) {
    out.w = ToBf16(f);
  } else {
    out.w = Make(dtype, {1, k, n});
    out.scale = Make(DType::kF32, {1, n});
    EXPECT_TRUE(QuantizeChannels(f.data_as<float>(), 1, k, n, *QuantDTypeOf(dtype),
                                 Calibration::AbsMax(), out.w.data_as<uint8_t>(),
                                 out.scale.data_as<float>()).ok());
    out.codes = true;
  }
  return out;
}

struct EdgeMode {
  GmmMode mode;
  DType lhs, rhs;
  QuantDType fp8 = QuantDType::kE4M3FN;
};

const std::vector<EdgeMode>& EdgeModes() {
  static const std::vector<EdgeMode> modes = {
      {GmmMode::kF32, DType::kF32, DType::kF32},
      {GmmMode::kBf16, DType::kBF16, DType::kBF16},
      {GmmMode::kFakeQat, DType::kBF16, DType::kE4M3FN},
      {GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN},
      {GmmMode::kNativeFp8, DType::kF32, DType::kE4M3FNUZ, QuantDType::kE4M3FNUZ},
      {GmmMode::kInt8, DType::kF32, DType::kI8},
  };
  return modes;
}

// The reproducer: lhs [[1]], rhs [[[-60, -200, -533, 2, 2, 2]]],
// SwiGLU. silu(-60) * 2 = -1.05e-24; below about -104 sigmoid is 0 in f32, so
// the other two outputs are -0 (they were -400 and NaN). Every mode, every
// SIMD target, 1 and 9 rows (the direct and the packed kernels).
TEST(Gmm, SwiGluOfVeryNegativeGatesIsZeroOnEveryTarget) {
  const std::vector<float> w = {-60, -200, -533, 2, 2, 2};
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const EdgeMode& em : EdgeModes()) {
      for (int64_t m : {1, 9}) {
        for (DType out_dtype : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(target.label + " " +
                       std::string(GmmModeName(em.mode)) + " rows " + std::to_string(m) +
                       " out " + std::string(DTypeName(out_dtype)));
          Tensor lf = Make(DType::kF32, {m, 1});
          for (int64_t i = 0; i < m; ++i) lf.data_as<float>()[i] = 1.0f;
          Tensor lhs = em.lhs == DType::kF32 ? std::move(lf) : ToBf16(lf);
          Weight wt = WeightFromValues(em.rhs, w, 1, 6);
          Tensor gs = GroupSizes({static_cast<int32_t>(m)});
          GmmOptions o;
          o.mode = em.mode;
          o.fp8_dtype = em.fp8;
          o.epilogue = GmmEpilogue::kSwiGlu;
          Tensor out = Poisoned(out_dtype, {m, 3}), ref = Poisoned(out_dtype, {m, 3});
          const ConstTensorView* scale = wt.Scale();
          ASSERT_TRUE(Gmm(o, lhs.view(), wt.w.view(), scale, gs.view(), out.view()).ok());
          ASSERT_TRUE(reference::Gmm(o, lhs.view(), wt.w.view(), scale, gs.view(), ref.view()).ok());
          for (int64_t i = 0; i < m; ++i) {
            const float g0 = ValueAt(out, static_cast<size_t>(i * 3));
            const float r0 = ValueAt(ref, static_cast<size_t>(i * 3));
            EXPECT_NEAR(g0, r0, 1e-2 * std::fabs(r0)) << "silu(-60) * 2";
            EXPECT_LT(g0, -1e-25f);
            EXPECT_GT(g0, -1e-23f);
            for (int64_t j : {1, 2}) {
              const float v = ValueAt(out, static_cast<size_t>(i * 3 + j));
              EXPECT_EQ(std::bit_cast<uint32_t>(v) & 0x7FFFFFFFu, 0u)
                  << "gate " << w[static_cast<size_t>(j)] << " gave " << v;
              EXPECT_EQ(ValueAt(ref, static_cast<size_t>(i * 3 + j)), 0.0f);
            }
          }
        }
      }
    }
  }
  test::UseDefaultSimd();
}

// dSwiGLU at the same gates: h = [[-60, -200, -533 | 2, 2, 2]], da = 1.
// dgate = 2 silu'(g) and dup = silu(g) are ~-1e-24 and then -0, never NaN.
TEST(GmmDlhs, DSwiGluOfVeryNegativeGatesIsZeroOnEveryTarget) {
  struct Case {
    GmmMode mode;
    DType dout, rhs;
  };
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const Case& c : {Case{GmmMode::kF32, DType::kF32, DType::kF32},
                          Case{GmmMode::kBf16, DType::kBF16, DType::kBF16},
                          Case{GmmMode::kBf16, DType::kBF16, DType::kE4M3FN},
                          Case{GmmMode::kFakeQat, DType::kBF16, DType::kE4M3FN}}) {
      for (int64_t m : {1, 9}) {
        SCOPED_TRACE(target.label + " " + std::string(GmmModeName(c.mode)) +
                     " rhs " + std::string(DTypeName(c.rhs)) + " rows " + std::to_string(m));
        // dout [m, 1] = 1, rhs [1, 3, 1] = 1: da [m, 3] = 1 exactly.
        Tensor df = Make(DType::kF32, {m, 1});
        for (int64_t i = 0; i < m; ++i) df.data_as<float>()[i] = 1.0f;
        Tensor dout = c.dout == DType::kF32 ? std::move(df) : ToBf16(df);
        Weight wt = WeightFromValues(c.rhs, {1, 1, 1}, 3, 1);
        Tensor h = Make(DType::kF32, {m, 6});
        for (int64_t i = 0; i < m; ++i) {
          const float row[6] = {-60, -200, -533, 2, 2, 2};
          std::memcpy(h.data_as<float>() + i * 6, row, sizeof row);
        }
        Tensor gs = GroupSizes({static_cast<int32_t>(m)});
        GmmOptions o;
        o.mode = c.mode;
        o.epilogue = GmmEpilogue::kDSwiGlu;
        const ConstTensorView* scale = wt.Scale();
        const ConstTensorView hv = h.view();
        Tensor out = Poisoned(DType::kF32, {m, 6}), ref = Poisoned(DType::kF32, {m, 6});
        ASSERT_TRUE(GmmDlhs(o, dout.view(), wt.w.view(), scale, gs.view(), out.view(), &hv).ok());
        ASSERT_TRUE(
            reference::GmmDlhs(o, dout.view(), wt.w.view(), scale, gs.view(), ref.view(), &hv).ok());
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < 6; ++j) {
            const size_t at = static_cast<size_t>(i * 6 + j);
            const float v = out.data_as<float>()[at], r = ref.data_as<float>()[at];
            ASSERT_FALSE(std::isnan(v)) << "column " << j;
            if (j % 3 == 0) {
              EXPECT_NEAR(v, r, 1e-5 * std::fabs(r)) << "column " << j;
              EXPECT_LT(v, -1e-25f) << "column " << j;
            } else {
              EXPECT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(-0.0f)) << "column " << j;
              EXPECT_EQ(std::bit_cast<uint32_t>(r), std::bit_cast<uint32_t>(-0.0f)) << "column " << j;
            }
          }
        }
      }
    }
  }
  test::UseDefaultSimd();
}

// Through the public API, gates over the whole f32 range (+-0, subnormals,
// +-1e-30, the exp limits, +-1e30, +-FLT_MAX, +-inf, NaN) with random ups:
// f32 mode with K = 1 and lhs = 1, so h is the weight exactly and the fast
// kernel must give the reference's silu(g) * up (NaN exactly where it is NaN).
TEST(Gmm, SwiGluOverTheWholeF32RangeMatchesReference) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  std::vector<float> gates;
  for (float x : {0.0f, 1e-30f, 1e-7f, 1.0f, 20.0f, 87.5f, 88.8f, 103.0f, 104.5f, 150.0f, 178.5f,
                  300.0f, 1e30f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min()}) {
    gates.push_back(x);
    gates.push_back(-x);
  }
  gates.push_back(kNaN);
  while (gates.size() % 64 != 0) gates.push_back(r.Normal() * 50);
  const int64_t f = static_cast<int64_t>(gates.size());
  std::vector<float> w(static_cast<size_t>(2 * f));
  for (int64_t j = 0; j < f; ++j) {
    w[static_cast<size_t>(j)] = gates[static_cast<size_t>(j)];
    w[static_cast<size_t>(f + j)] = r.Normal();
  }
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (int64_t m : {2, 20}) {
      SCOPED_TRACE(target.label + " rows " + std::to_string(m));
      Tensor lhs = Make(DType::kF32, {m, 1});
      for (int64_t i = 0; i < m; ++i) lhs.data_as<float>()[i] = 1.0f;
      Weight wt = WeightFromValues(DType::kF32, w, 1, 2 * f);
      Tensor gs = GroupSizes({static_cast<int32_t>(m)});
      GmmOptions o;
      o.mode = GmmMode::kF32;
      o.epilogue = GmmEpilogue::kSwiGlu;
      Tensor out = Poisoned(DType::kF32, {m, f}), ref = Poisoned(DType::kF32, {m, f});
      ASSERT_TRUE(Gmm(o, lhs.view(), wt.w.view(), nullptr, gs.view(), out.view()).ok());
      ASSERT_TRUE(reference::Gmm(o, lhs.view(), wt.w.view(), nullptr, gs.view(), ref.view()).ok());
      for (int64_t i = 0; i < m * f; ++i) {
        const float g = out.data_as<float>()[i], want = ref.data_as<float>()[i];
        const float gate = gates[static_cast<size_t>(i % f)];
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(g)) << "gate " << gate;
          continue;
        }
        ASSERT_FALSE(std::isnan(g)) << "gate " << gate;
        if (std::isinf(want)) {
          ASSERT_EQ(g, want) << "gate " << gate;
          continue;
        }
        ASSERT_LE(std::fabs(static_cast<double>(g) - want),
                  8 * std::ldexp(std::fabs(static_cast<double>(want)), -24) +
                      // sigmoid on the subnormal grid (below -87.3): see activation_test
                      (std::fabs(gate) + 1) * std::fabs(w[static_cast<size_t>(f + i % f)]) *
                          std::ldexp(1.0, -148) +
                      1e-44)
            << "gate " << gate << " got " << g << " want " << want;
      }
    }
  }
  test::UseDefaultSimd();
}

// The quantized forward's promise near FLT_MAX (docs/numerics.md): it computes
// (sum_k qa qw) * s_a * s_w in f32 left to right, as XLA evaluates
// dot(qa, qw) * s_a * s_w, so the intermediate (sum_k qa qw) * s_a can pass
// FLT_MAX although the exact product is finite. lhs [[FLT_MAX, 0.5]], one
// channel [0.25, 1]: s_a = FLT_MAX / qmax, the codes qmax and 0, the weight's
// codes qmax / 4 and qmax; the exact answer is about FLT_MAX / 4, the f32 one +inf
// on every target, in both row-count paths and with a K block. The reference
// twin (double, rounded once) gives the finite value; op_fuzz skips such rows.
TEST(Gmm, QuantizedForwardNearFltMaxIsF32LeftToRightOnEveryTarget) {
  const float big = std::numeric_limits<float>::max();
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const EdgeMode& em : EdgeModes()) {
      if (em.mode != GmmMode::kNativeFp8 && em.mode != GmmMode::kInt8) continue;
      for (int64_t block : {0, 128}) {
        if (block > 0 && em.mode == GmmMode::kInt8) continue;
        for (int64_t m : {1, 9}) {
          SCOPED_TRACE(target.label + " " +
                       std::string(GmmModeName(em.mode)) + " " +
                       std::string(QuantDTypeName(em.fp8)) + " block " + std::to_string(block) +
                       " rows " + std::to_string(m));
          Tensor lhs = Make(DType::kF32, {m, 2});
          for (int64_t i = 0; i < m; ++i) {
            lhs.data_as<float>()[2 * i] = big;
            lhs.data_as<float>()[2 * i + 1] = 0.5f;
          }
          Weight wt = WeightFromValues(em.rhs, {0.25f, 1.0f}, 2, 1);
          Tensor gs = GroupSizes({static_cast<int32_t>(m)});
          GmmOptions o;
          o.mode = em.mode;
          o.fp8_dtype = em.fp8;
          o.lhs_quant_block_size = block;
          Tensor out = Poisoned(DType::kF32, {m, 1}), ref = Poisoned(DType::kF32, {m, 1});
          const ConstTensorView sv = wt.scale.view();
          ASSERT_TRUE(Gmm(o, lhs.view(), wt.w.view(), &sv, gs.view(), out.view()).ok());
          ASSERT_TRUE(reference::Gmm(o, lhs.view(), wt.w.view(), &sv, gs.view(), ref.view()).ok());
          for (int64_t i = 0; i < m; ++i) {
            EXPECT_EQ(out.data_as<float>()[i], std::numeric_limits<float>::infinity());
            // FLT_MAX / 4 (int8: the weight's 0.25 is the code 32 of 127).
            EXPECT_NEAR(ref.data_as<float>()[i], big / 4, 0.01 * big);
          }
        }
      }
    }
  }
  test::UseDefaultSimd();
}

// The in-kernel quantization of lhs (native fp8, int8) in scale_arithmetic
// xla_reciprocal: codes of x * (1 / s), not x / s. A row of values next to
// the midpoints between codes (where the two arithmetics round apart) times
// an identity weight, so out[i, n] is lhs row i's n-th dequantized code (up
// to the f32 scaling's rounding) and one wrong code is a whole step off. The
// fast kernels must match the reference twin in both arithmetics on every
// target, and the two arithmetics must differ on this input.
TEST(Gmm, InKernelQuantizationFollowsTheScaleArithmeticOnEveryTarget) {
  const int64_t k = 256;
  std::vector<float> eye(static_cast<size_t>(k * k), 0.0f);
  for (int64_t i = 0; i < k; ++i) eye[static_cast<size_t>(i * k + i)] = 1.0f;
  for (const EdgeMode& em : EdgeModes()) {
    if (em.mode != GmmMode::kNativeFp8 && em.mode != GmmMode::kInt8) continue;
    const QuantDType qd = em.mode == GmmMode::kInt8 ? QuantDType::kInt8 : em.fp8;
    // Values within a few ulp of code midpoints at the xla scale of amax 100.
    const std::vector<float> mids = test::CodeMidpoints(qd);
    const float amax = 100.0f, s = amax * (1.0f / QuantMax(qd));
    std::vector<float> x;
    for (size_t j = 0; x.size() < static_cast<size_t>(3 * k); ++j) {
      const size_t r = x.size() / static_cast<size_t>(k);
      if (x.size() % static_cast<size_t>(k) == 0) x.push_back(amax);  // each row's amax
      float v = mids[(j / 4) % mids.size()] * s;
      for (size_t t = 0; t < j % 4; ++t) v = std::nextafter(v, r == 1 ? -INFINITY : INFINITY);
      if (std::fabs(v) < amax && x.size() % static_cast<size_t>(k) != 0) x.push_back(v);
    }
    Tensor lhs = Make(DType::kF32, {3, k});
    std::memcpy(lhs.data(), x.data(), x.size() * sizeof(float));
    Weight wt = WeightFromValues(em.rhs, eye, k, k);
    Tensor gs = GroupSizes({3});
    const ConstTensorView sv = wt.scale.view();
    std::vector<Tensor> refs;
    for (ScaleArithmetic a : {ScaleArithmetic::kExactDivide, ScaleArithmetic::kXlaReciprocal}) {
      GmmOptions o;
      o.mode = em.mode;
      o.fp8_dtype = em.fp8;
      o.lhs_calibration = Calibration::AbsMax().With(a);
      Tensor ref = Poisoned(DType::kF32, {3, k});
      ASSERT_TRUE(reference::Gmm(o, lhs.view(), wt.w.view(), &sv, gs.view(), ref.view()).ok());
      for (const test::SimdTarget& target : test::SimdTargets()) {
        test::UseSimdTarget(target);
        SCOPED_TRACE(target.label + " " +
                     std::string(GmmModeName(em.mode)) + " " +
                     std::string(QuantDTypeName(qd)) + " " + std::string(ScaleArithmeticName(a)));
        Tensor out = Poisoned(DType::kF32, {3, k});
        ASSERT_TRUE(Gmm(o, lhs.view(), wt.w.view(), &sv, gs.view(), out.view()).ok());
        for (int64_t i = 0; i < 3 * k; ++i) {
          const float f = out.data_as<float>()[i], w = ref.data_as<float>()[i];
          ASSERT_LE(std::fabs(f - w), 4 * std::ldexp(std::fabs(w), -23) + 1e-30f)
              << "element " << i << " (x " << x[static_cast<size_t>(i)] << "): fast " << f
              << ", reference " << w;
        }
      }
      test::UseDefaultSimd();
      refs.push_back(std::move(ref));
    }
    int differ = 0;
    for (int64_t i = 0; i < 3 * k; ++i) {
      const float a = refs[0].data_as<float>()[i], b = refs[1].data_as<float>()[i];
      differ += std::fabs(a - b) > 4 * std::ldexp(std::fabs(a), -23);
    }
    EXPECT_GT(differ, 0) << QuantDTypeName(qd) << ": the input does not tell the arithmetics apart";
  }
}

// The same for TGMM's quantized gradient (fp8_full): dout [M, N] quantized
// per (group, channel) or per (m-tile, channel) in each arithmetic, lhs the
// identity as e4m3fn codes of 1 (M = K), so drhs[k, n] is dout's dequantized
// code [k, n]. Column n: its amax 100 in row 0, then values next to code
// midpoints at the xla scale of amax 100.
TEST(Tgmm, InKernelQuantizationFollowsTheScaleArithmeticOnEveryTarget) {
  const int64_t m = 64, n = 48;
  const QuantDType qd = QuantDType::kE4M3FN;
  const std::vector<float> mids = test::CodeMidpoints(qd);
  const float amax = 100.0f, s = amax * (1.0f / QuantMax(qd));
  Tensor dout = Make(DType::kF32, {m, n});
  size_t next = 0;
  for (int64_t j = 0; j < n; ++j) {
    dout.data_as<float>()[j] = amax;
    for (int64_t i = 1; i < m; ++i) {
      float v;
      do {
        v = mids[next % mids.size()] * s;
        for (size_t t = 0; t < (next / mids.size()) % 4; ++t) v = std::nextafter(v, INFINITY);
        ++next;
      } while (!(std::fabs(v) < amax));
      dout.data_as<float>()[i * n + j] = v;
    }
  }
  Tensor lhs = Make(DType::kE4M3FN, {m, m});
  std::memset(lhs.data(), 0, lhs.num_bytes());
  for (int64_t i = 0; i < m; ++i) lhs.data_as<uint8_t>()[i * m + i] = 0x38;  // 1.0
  Tensor gs = GroupSizes({40, 24});
  for (bool per_group : {true, false}) {
    std::vector<Tensor> refs;
    for (ScaleArithmetic a : {ScaleArithmetic::kExactDivide, ScaleArithmetic::kXlaReciprocal}) {
      GmmOptions o;
      o.mode = GmmMode::kF32;
      o.tiles.m = 16;  // the per-tile path's quantization tile
      TgmmQuant q;
      q.dout_dtype = qd;
      q.per_group = per_group;
      q.calibration = Calibration::AbsMax().With(a);
      Tensor ref = Poisoned(DType::kF32, {2, m, n});
      ASSERT_TRUE(reference::Tgmm(o, q, lhs.view(), dout.view(), gs.view(), ref.view()).ok());
      for (const test::SimdTarget& target : test::SimdTargets()) {
        test::UseSimdTarget(target);
        SCOPED_TRACE(target.label + (per_group ? " per group " : " per tile ") +
                     std::string(ScaleArithmeticName(a)));
        Tensor got = Poisoned(DType::kF32, {2, m, n});
        ASSERT_TRUE(Tgmm(o, q, lhs.view(), dout.view(), gs.view(), got.view()).ok());
        for (int64_t i = 0; i < 2 * m * n; ++i) {
          const float f = got.data_as<float>()[i], w = ref.data_as<float>()[i];
          ASSERT_LE(std::fabs(f - w), 4 * std::ldexp(std::fabs(w), -23) + 1e-30f)
              << "element " << i << ": fast " << f << ", reference " << w;
        }
      }
      test::UseDefaultSimd();
      refs.push_back(std::move(ref));
    }
    int differ = 0;
    for (int64_t i = 0; i < 2 * m * n; ++i) {
      const float a = refs[0].data_as<float>()[i], b = refs[1].data_as<float>()[i];
      differ += std::fabs(a - b) > 4 * std::ldexp(std::fabs(a), -23);
    }
    EXPECT_GT(differ, 0) << "the input does not tell the arithmetics apart";
  }
}

}  // namespace
}  // namespace fp8moe
