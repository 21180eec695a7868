// The GMM / dLHS / TGMM of every backend (the fast CPU kernels and the
// reference twins) against the float64 oracle (gmm_oracle_test_util.h,
// which shares no code with either) on fresh random data, in every mode,
// with empty groups, NaN-poisoned tail rows and outputs, odd shapes, every
// thread count and several tilings.
//
// Error bound of every f32-accumulating mode: the oracle takes the exact
// operand values the mode defines (the quantized activation included) and
// sums their products in double, so a kernel differs from it only by its f32
// rounding: |got - exact| <= gamma_R * sum_r |a_r b_r| (gamma_R = R u /
// (1 - R u), u = 2^-24, R the roundings on the way: the reduction length,
// plus the block scales of native fp8), with sum |a b| from the oracle too.
// Gamma() adds 4u for the scales' products and the final rounding. bf16
// outputs add 2^-8 of the result's magnitude; SwiGLU and dSwiGLU propagate
// the bound through the activation. int8 sums exactly and rounds 3 times.
#include <omp.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "hwy/targets.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/line_walk.h"
#include "kernels/cpu/prefetch_target.h"
#include "kernels/gmm_oracle_test_util.h"
#include "kernels/gmm_test_util.h"

namespace fp8moe {
namespace {

using namespace gmm_test;  // NOLINT

struct FwdCase {
  GmmMode mode;
  DType lhs_dtype, rhs_dtype, out_dtype = DType::kF32;
  QuantDType fp8 = QuantDType::kE4M3FN;
  int64_t block = 0;
  bool swiglu = false;
  bool fixed_calibration = false;  // lhs scales from fixed,-2,2 (clips)
  // lhs codes from x * (1 / s) (scale_arithmetic=xla_reciprocal, the
  // Python package's JAX-matching mode) instead of x / s.
  bool xla_reciprocal = false;
};

std::string Name(const FwdCase& c) {
  return std::string(GmmModeName(c.mode)) + " lhs " + std::string(DTypeName(c.lhs_dtype)) +
         " rhs " + std::string(DTypeName(c.rhs_dtype)) + " out " +
         std::string(DTypeName(c.out_dtype)) + " block " + std::to_string(c.block) +
         (c.swiglu ? " swiglu" : "") + (c.fixed_calibration ? " fixed" : "") +
         (c.xla_reciprocal ? " xla_reciprocal" : "");
}

std::vector<FwdCase> AllFwdCases() {
  std::vector<FwdCase> v;
  for (DType out : {DType::kF32, DType::kBF16}) {
    for (bool sw : {false, true}) {
      v.push_back({GmmMode::kF32, DType::kF32, DType::kF32, out, QuantDType::kE4M3FN, 0, sw});
      v.push_back({GmmMode::kBf16, DType::kBF16, DType::kBF16, out, QuantDType::kE4M3FN, 0, sw});
      v.push_back({GmmMode::kFakeQat, DType::kBF16, DType::kE4M3FN, out, QuantDType::kE4M3FN, 0, sw});
      v.push_back({GmmMode::kFakeQat, DType::kBF16, DType::kE5M2, out, QuantDType::kE4M3FN, 0, sw});
      for (int64_t block : {0, 128, 512}) {
        v.push_back({GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN, out, QuantDType::kE4M3FN, block, sw});
      }
      v.push_back({GmmMode::kNativeFp8, DType::kF32, DType::kE4M3FNUZ, out, QuantDType::kE4M3FNUZ, 0, sw});
      v.push_back({GmmMode::kInt8, DType::kF32, DType::kI8, out, QuantDType::kE4M3FN, 0, sw});
      v.push_back({GmmMode::kInt8, DType::kBF16, DType::kI8, out, QuantDType::kE4M3FN, 0, sw});
    }
  }
  v.push_back({GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN, DType::kF32,
               QuantDType::kE4M3FN, 0, false, true});
  v.push_back({GmmMode::kInt8, DType::kF32, DType::kI8, DType::kF32, QuantDType::kE4M3FN, 0,
               true, true});
  for (int64_t block : {0, 128}) {
    v.push_back({GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN, DType::kF32,
                 QuantDType::kE4M3FN, block, block == 0, false, true});
  }
  v.push_back({GmmMode::kNativeFp8, DType::kF32, DType::kE4M3FN, DType::kBF16,
               QuantDType::kE4M3FN, 0, false, true, true});
  v.push_back({GmmMode::kInt8, DType::kF32, DType::kI8, DType::kF32, QuantDType::kE4M3FN, 0,
               false, false, true});
  return v;
}

// The reduction length r for Gamma(r), the bound of a forward element's f32
// rounding error against the exact value, per sum |a b| of its products:
// f32, bf16 and fake QAT round each of the K - 1 additions, and f32 each
// product too (bf16 products are exact in f32): at most K roundings.
// Native fp8 adds, per K-block, the block scale's product and the addition
// of the block sums (at most K + blocks). int8 sums exactly (int32) and
// rounds three times after (to f32, times each scale), within Gamma(0)'s
// 4u. Gamma(r) = r u / (1 - r u) + 4u; the 4u covers the channel scale's
// product and the final rounding of the result.
int64_t FwdRoundings(const GmmOptions& o, int64_t k) {
  if (o.mode == GmmMode::kInt8) return 0;
  if (o.mode == GmmMode::kNativeFp8) return k + NumBlocks(k, o.lhs_quant_block_size);
  return k;
}

// Runs one forward case on a fresh random problem on ctx's backend and
// checks it against the float64 oracle (gmm_oracle_test_util.h).
void CheckFwd(Context& ctx, TestRng& r, const FwdCase& c, int64_t m, int64_t k, int64_t n, int64_t e,
              const GmmTiles& tiles = {}) {
  SCOPED_TRACE(Name(c) + " M " + std::to_string(m) + " K " + std::to_string(k) + " N " +
               std::to_string(n) + " E " + std::to_string(e));
  if (c.swiglu) n += n % 2;
  std::vector<int32_t> sizes = Groups(r, e, m);
  const int64_t valid = Sum(sizes);
  Tensor gs = GroupSizes(sizes);
  Tensor lf = RandomF32(r, {m, k}, valid);
  Tensor lhs = c.lhs_dtype == DType::kF32 ? std::move(lf) : ToBf16(lf);
  Weight w = MakeWeight(r, c.rhs_dtype, e, k, n);
  GmmOptions o;
  o.mode = c.mode;
  o.fp8_dtype = c.fp8;
  o.lhs_quant_block_size = c.block;
  o.epilogue = c.swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
  o.tiles = tiles;
  if (c.fixed_calibration) o.lhs_calibration = Calibration::Fixed(-2.0f, 2.0f);
  if (c.xla_reciprocal) {
    o.lhs_calibration = o.lhs_calibration.With(ScaleArithmetic::kXlaReciprocal);
  }
  const int64_t oc = c.swiglu ? n / 2 : n;
  Tensor out = Poisoned(c.out_dtype, {m, oc});
  Tensor h = Poisoned(DType::kF32, {m, n});
  TensorView hv = h.view();
  ASSERT_TRUE(Gmm(ctx, o, lhs.view(), w.w.view(), w.Scale(), gs.view(), out.view(),
                  c.swiglu ? &hv : nullptr).ok());
  const OracleResult want = OracleGmm(o, lhs, w.w, w.codes ? &w.scale : nullptr, sizes);
  const double gamma = Gamma(FwdRoundings(o, k));
  std::vector<double> eh(want.abs_sum.size());
  for (size_t i = 0; i < eh.size(); ++i) eh[i] = gamma * want.abs_sum[i] + 1e-30;
  // A bf16 output is the f32 result rounded once more: half a bf16 ulp,
  // 2^-8 of its magnitude, which is at most |want| + the f32 error.
  auto bf16_rounding = [&](double want_abs, double e) {
    return c.out_dtype == DType::kBF16 ? std::ldexp(want_abs + e, -8) : 0.0;
  };
  if (!c.swiglu) {
    std::vector<double> b = eh;
    for (size_t i = 0; i < b.size(); ++i) b[i] += bf16_rounding(std::fabs(want.value[i]), eh[i]);
    ExpectNear(out, want.value, b, valid, "out");
    return;
  }
  ExpectNear(h, want.value, eh, valid, "h");
  // SwiGLU of the exact pre-activation: the f32 errors eg, eu of gate and
  // up propagate through silu(g) u to first order as |silu'(g) u| eg +
  // |silu(g)| eu, plus eg eu; the kernel's own f32 sigmoid and product add
  // 1e-5 relative.
  std::vector<double> want_out(static_cast<size_t>(m * oc), 0.0), b(want_out.size(), 0.0);
  for (int64_t i = 0; i < valid; ++i) {
    for (int64_t j = 0; j < oc; ++j) {
      const size_t gi = static_cast<size_t>(i * n + j), ui = static_cast<size_t>(i * n + oc + j);
      const double g = want.value[gi], u = want.value[ui];
      const double v = OracleSilu(g) * u;
      double bound = std::fabs(OracleSiluGrad(g) * u) * eh[gi] + std::fabs(OracleSilu(g)) * eh[ui] +
                     eh[gi] * eh[ui] + 1e-5 * std::fabs(v) + 1e-30;
      bound += bf16_rounding(std::fabs(v), bound);
      want_out[static_cast<size_t>(i * oc + j)] = v;
      b[static_cast<size_t>(i * oc + j)] = bound;
    }
  }
  ExpectNear(out, want_out, b, valid, "out");
}

TEST(Gmm, EveryModeMatchesTheOracleOnEveryBackend) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  for (BackendKind b : AllBackends()) {
    SCOPED_TRACE(BackendName(b));
    Context ctx(OnBackend(b));
    for (const FwdCase& c : AllFwdCases()) {
      CheckFwd(ctx, r, c, 200, 560, 72, 5);  // several row and reduction blocks
      CheckFwd(ctx, r, c, 37, 130, 70, 4);
    }
    ExpectRanOn(ctx, b);
  }
}


TEST(Gmm, SmallShapeSweepOnEveryBackend) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  const std::vector<FwdCase> cases = AllFwdCases();
  for (BackendKind b : AllBackends()) {
    SCOPED_TRACE(BackendName(b));
    Context ctx(OnBackend(b));
    // Every M, K and N in 1..67 and every E in 1..5 appears at least once.
    for (int v = 1; v <= 67; ++v) {
      const FwdCase& c = cases[static_cast<size_t>(v) % cases.size()];
      CheckFwd(ctx, r, c, v, r.Int(1, 67), r.Int(1, 67), r.Int(1, 5));
      CheckFwd(ctx, r, c, r.Int(1, 67), v, r.Int(1, 67), r.Int(1, 5));
      CheckFwd(ctx, r, c, r.Int(1, 67), r.Int(1, 67), v, r.Int(1, 5));
    }
    for (int e = 1; e <= 5; ++e) {
      for (const FwdCase& c : cases) CheckFwd(ctx, r, c, r.Int(1, 67), r.Int(1, 67), r.Int(1, 67), e);
    }
    ExpectRanOn(ctx, b);
  }
}

// ---- dLHS ------------------------------------------------------------------

struct DlhsCase {
  GmmMode mode;
  DType rhs_dtype;
  DType out_dtype = DType::kF32;
  bool dswiglu = false;
};

void CheckDlhs(Context& ctx, TestRng& r, const DlhsCase& c, int64_t m, int64_t k, int64_t n, int64_t e,
               const GmmTiles& tiles = {}) {
  SCOPED_TRACE(std::string(GmmModeName(c.mode)) + " rhs " + std::string(DTypeName(c.rhs_dtype)) +
               (c.dswiglu ? " dswiglu" : "") + " M " + std::to_string(m) + " K " +
               std::to_string(k) + " N " + std::to_string(n));
  std::vector<int32_t> sizes = Groups(r, e, m);
  const int64_t valid = Sum(sizes);
  Tensor gs = GroupSizes(sizes);
  Tensor df = RandomF32(r, {m, n}, valid);
  Tensor dout = c.mode == GmmMode::kF32 ? std::move(df) : ToBf16(df);
  Weight w = MakeWeight(r, c.rhs_dtype, e, k, n);
  GmmOptions o;
  o.mode = c.mode;
  o.epilogue = c.dswiglu ? GmmEpilogue::kDSwiGlu : GmmEpilogue::kNone;
  o.tiles = tiles;
  const int64_t oc = c.dswiglu ? 2 * k : k;
  Tensor hsave = RandomF32(r, {m, 2 * k}, valid);
  const ConstTensorView hv = hsave.view();
  Tensor out = Poisoned(c.out_dtype, {m, oc});
  ASSERT_TRUE(GmmDlhs(ctx, o, dout.view(), w.w.view(), w.Scale(), gs.view(), out.view(),
                      c.dswiglu ? &hv : nullptr).ok());
  // The product against the float64 oracle: N - 1 additions, and f32 mode's
  // products, rounded (Gamma(N)); bf16 outputs round once more (2^-8 of
  // at most |want| + that error).
  const OracleResult da = OracleDlhs(o, dout, w.w, w.codes ? &w.scale : nullptr, sizes);
  std::vector<double> want(static_cast<size_t>(m * oc), 0.0), b(want.size(), 0.0);
  auto bf16_rounding = [&](double want_abs, double e) {
    return c.out_dtype == DType::kBF16 ? std::ldexp(want_abs + e, -8) : 0.0;
  };
  for (int64_t i = 0; i < valid; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const double a = da.value[static_cast<size_t>(i * k + j)];
      const double eda = Gamma(n) * da.abs_sum[static_cast<size_t>(i * k + j)] + 1e-30;
      if (!c.dswiglu) {
        want[static_cast<size_t>(i * k + j)] = a;
        b[static_cast<size_t>(i * k + j)] = eda + bf16_rounding(std::fabs(a), eda);
        continue;
      }
      // dgate = da up silu'(g), dup = da silu(g) with the saved h's gate g
      // and up u: da's error times each coefficient, plus 1e-5 relative for
      // the kernel's f32 sigmoid and products.
      const double g = ValueAt(hsave, i * 2 * k + j), u = ValueAt(hsave, i * 2 * k + k + j);
      for (int half = 0; half < 2; ++half) {
        const double coef = half == 0 ? u * OracleSiluGrad(g) : OracleSilu(g);
        // silu'(g) = s (1 + g (1 - s)) cancels near g = -1.28, so its f32
        // rounding error scales with the terms, not with the result.
        const double terms = half == 0 ? std::fabs(u) * (1 + std::fabs(g)) : std::fabs(g);
        double bound = std::fabs(coef) * eda + 1e-5 * std::fabs(a) * terms + 1e-30;
        bound += bf16_rounding(std::fabs(a * coef), bound);
        want[static_cast<size_t>(i * oc + half * k + j)] = a * coef;
        b[static_cast<size_t>(i * oc + half * k + j)] = bound;
      }
    }
  }
  ExpectNear(out, want, b, valid, "dlhs");
}

std::vector<DlhsCase> AllDlhsCases() {
  std::vector<DlhsCase> v;
  for (DType out : {DType::kF32, DType::kBF16}) {
    for (bool ds : {false, true}) {
      v.push_back({GmmMode::kF32, DType::kF32, out, ds});
      v.push_back({GmmMode::kF32, DType::kE4M3FN, out, ds});
      v.push_back({GmmMode::kBf16, DType::kBF16, out, ds});
      v.push_back({GmmMode::kBf16, DType::kE4M3FN, out, ds});
      v.push_back({GmmMode::kFakeQat, DType::kE4M3FN, out, ds});
      v.push_back({GmmMode::kFakeQat, DType::kE5M2, out, ds});
    }
  }
  return v;
}

TEST(GmmDlhs, EveryModeMatchesTheOracleOnEveryBackend) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  for (BackendKind b : AllBackends()) {
    SCOPED_TRACE(BackendName(b));
    Context ctx(OnBackend(b));
    for (const DlhsCase& c : AllDlhsCases()) {
      CheckDlhs(ctx, r, c, 300, 96, 640, 5);
      CheckDlhs(ctx, r, c, 41, 70, 130, 3);
    }
    for (int v = 1; v <= 67; ++v) {
      const auto cases = AllDlhsCases();
      const DlhsCase& c = cases[static_cast<size_t>(v) % cases.size()];
      CheckDlhs(ctx, r, c, v, r.Int(1, 67), r.Int(1, 67), r.Int(1, 5));
      CheckDlhs(ctx, r, c, r.Int(1, 67), v, r.Int(1, 67), r.Int(1, 5));
      CheckDlhs(ctx, r, c, r.Int(1, 67), r.Int(1, 67), v, r.Int(1, 5));
    }
    ExpectRanOn(ctx, b);
  }
}

TEST(GmmDlhs, NativeFromCodesIsBitIdenticalToFakeQat) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  for (DType codes : {DType::kE4M3FN, DType::kE5M2}) {
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      const int64_t m = 333, k = 200, n = 520, e = 6;
      std::vector<int32_t> sizes = Groups(r, e, m);
      Tensor gs = GroupSizes(sizes);
      Tensor dout = ToBf16(RandomF32(r, {m, n}, Sum(sizes)));
      Weight w = MakeWeight(r, codes, e, k, n);
      const ConstTensorView sv = w.scale.view();
      Tensor a = Poisoned(out_dtype, {m, k}), b = Poisoned(out_dtype, {m, k});
      GmmOptions native, fake;
      native.mode = GmmMode::kBf16;
      fake.mode = GmmMode::kFakeQat;
      native.tiles.k = 64;  // different tilings must not matter either
      native.tiles.n = 48;
      ASSERT_TRUE(GmmDlhs(native, dout.view(), w.w.view(), &sv, gs.view(), a.view()).ok());
      ASSERT_TRUE(GmmDlhs(fake, dout.view(), w.w.view(), &sv, gs.view(), b.view()).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.num_bytes()));
    }
  }
}

// ---- Row-block order ----------------------------------------------------------

// Items of more than 512 rows (tiles.m 4096: whole groups; 1100 rows over 2
// groups leave at least one of 548) run in row-block order, B packed once
// for the whole reduction and C finished one block of rows at a time: one
// case per panel kind and epilogue against the reference, with odd N,
// several reduction blocks and K-blocks. (Every mode on every target gives
// the bits of the chunk order: RowBlockOrderGivesTheBitsOfChunkOrder.)
TEST(Gmm, TallItemsInRowBlockOrderMatchTheOracle) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  Context ctx;
  const GmmTiles tall{4096, std::nullopt, std::nullopt};
  const QuantDType e4 = QuantDType::kE4M3FN;
  const FwdCase fwd[] = {
      {GmmMode::kF32, DType::kF32, DType::kF32, DType::kF32, e4, 0, false},
      {GmmMode::kBf16, DType::kBF16, DType::kBF16, DType::kBF16, e4, 0, true},
      {GmmMode::kFakeQat, DType::kBF16, DType::kE5M2, DType::kF32, e4, 0, true},
      {GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN, DType::kF32, e4, 128, true},
      {GmmMode::kInt8, DType::kF32, DType::kI8, DType::kBF16, e4, 0, true}};
  for (const FwdCase& c : fwd) CheckFwd(ctx, r, c, 1100, 300, 71, 2, tall);
  const DlhsCase dlhs[] = {{GmmMode::kF32, DType::kF32, DType::kF32, false},
                           {GmmMode::kBf16, DType::kE4M3FN, DType::kBF16, true},
                           {GmmMode::kFakeQat, DType::kE4M3FN, DType::kF32, true}};
  for (const DlhsCase& c : dlhs) CheckDlhs(ctx, r, c, 1100, 71, 300, 2, tall);
  EXPECT_GT(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
}

// Group sizes (their sum the valid rows; the rest of m tail rows) and the
// operands over them: lhs [m, k] and dout [m, n], f32 and bf16 (the bf16
// lhs is the f32 one rounded).
struct GroupedOperands {
  GroupedOperands(TestRng& r, int64_t m, int64_t k, int64_t n, const std::vector<int32_t>& sizes)
      : valid(Sum(sizes)), gs(GroupSizes(sizes)),
        lhs32(RandomF32(r, {m, k}, valid)), lhs(ToBf16(lhs32)),
        dout32(RandomF32(r, {m, n}, valid)), dout(ToBf16(dout32)) {}
  int64_t valid;
  Tensor gs, lhs32, lhs, dout32, dout;
};

// Row-block order and chunk order (SetRowBlockOrder(false)) give the same
// bits on every target, for every panel kind (f32, bf16 pairs, int16 pairs)
// and epilogue, with a bf16 output, with empty groups and tail rows.
TEST(Gmm, RowBlockOrderGivesTheBitsOfChunkOrder) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  // Groups over and under 512 rows, an empty one, and 5 tail rows; both
  // reductions over several blocks of 256, the forward's last one odd (45).
  const int64_t m = 2000, k = 301, n = 302, e = 4;
  GroupedOperands ops(r, m, k, n, {1300, 0, 600, 95});
  Tensor &gs = ops.gs, &lhs32 = ops.lhs32, &lhs = ops.lhs, &dout32 = ops.dout32, &dout = ops.dout;
  Tensor hsave = RandomF32(r, {m, 2 * k}, ops.valid);
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (GmmMode mode : {GmmMode::kF32, GmmMode::kBf16, GmmMode::kFakeQat, GmmMode::kNativeFp8,
                         GmmMode::kInt8}) {
      Weight w = MakeWeight(r, WeightDTypeOf(mode), e, k, n);
      const ConstTensorView* scale = w.Scale();
      for (const int64_t block : {int64_t{0}, int64_t{128}}) {
        if (block > 0 && mode != GmmMode::kNativeFp8) continue;
        for (const bool swiglu : {false, true}) {
          SCOPED_TRACE(target.label + " fwd " + std::string(GmmModeName(mode)) + " block " +
                       std::to_string(block) + (swiglu ? " swiglu" : ""));
          GmmOptions o;
          o.mode = mode;
          o.lhs_quant_block_size = block;
          o.epilogue = swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
          o.tiles.m = 4096;
          const Tensor& l = mode == GmmMode::kF32 ? lhs32 : lhs;
          Tensor rows = Poisoned(DType::kBF16, {m, swiglu ? n / 2 : n});
          Tensor chunks = Poisoned(DType::kBF16, {m, swiglu ? n / 2 : n});
          Context ctx;
          ASSERT_TRUE(Gmm(ctx, o, l.view(), w.w.view(), scale, gs.view(), rows.view()).ok());
          EXPECT_GT(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
          internal::SetRowBlockOrder(false);
          ResetKernelCounts(ctx);
          const Status st = Gmm(ctx, o, l.view(), w.w.view(), scale, gs.view(), chunks.view());
          internal::SetRowBlockOrder(true);
          ASSERT_TRUE(st.ok());
          EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
          EXPECT_EQ(0, std::memcmp(rows.data(), chunks.data(), rows.num_bytes()));
        }
      }
      if (mode == GmmMode::kInt8) continue;
      // Native fp8's dLHS: bf16 from the codes.
      const GmmMode dlhs_mode = mode == GmmMode::kNativeFp8 ? GmmMode::kBf16 : mode;
      for (const bool dswiglu : {false, true}) {
        SCOPED_TRACE(target.label + " dlhs " + std::string(GmmModeName(mode)) +
                     (dswiglu ? " dswiglu" : ""));
        GmmOptions o;
        o.mode = dlhs_mode;
        o.epilogue = dswiglu ? GmmEpilogue::kDSwiGlu : GmmEpilogue::kNone;
        o.tiles.m = 4096;
        const Tensor& d = mode == GmmMode::kF32 ? dout32 : dout;
        const ConstTensorView hv = hsave.view();
        Tensor rows = Poisoned(DType::kF32, {m, dswiglu ? 2 * k : k});
        Tensor chunks = Poisoned(DType::kF32, {m, dswiglu ? 2 * k : k});
        Context ctx;
        ASSERT_TRUE(GmmDlhs(ctx, o, d.view(), w.w.view(), scale, gs.view(), rows.view(),
                            dswiglu ? &hv : nullptr).ok());
        EXPECT_GT(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
        internal::SetRowBlockOrder(false);
        const Status st = GmmDlhs(ctx, o, d.view(), w.w.view(), scale, gs.view(), chunks.view(),
                                  dswiglu ? &hv : nullptr);
        internal::SetRowBlockOrder(true);
        ASSERT_TRUE(st.ok());
        EXPECT_EQ(0, std::memcmp(rows.data(), chunks.data(), rows.num_bytes()));
      }
    }
  }
  test::UseDefaultSimd();
}

// The packs' prefetch ahead (PackPrefetch, chunk order) only moves lines:
// on and off give the same bits on every target, for forward (every mode,
// SwiGLU), dLHS and TGMM (f32, bf16, fp8 gradient), with items of several
// row blocks and reduction chunks, an odd last chunk, an empty group and
// tail rows.
TEST(Gmm, PackPrefetchKeepsTheBits) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  const int64_t m = 800, k = 301, n = 302, e = 4;
  GroupedOperands ops(r, m, k, n, {400, 0, 290, 95});
  Tensor &gs = ops.gs, &lhs32 = ops.lhs32, &lhs = ops.lhs, &dout32 = ops.dout32, &dout = ops.dout;
  // Runs `call` into out with the prefetch on, then off, and compares.
  auto same_bits = [](Tensor& on, Tensor& off, const std::function<Status(Tensor&)>& call) {
    ASSERT_TRUE(call(on).ok());
    internal::SetPackPrefetch(false);
    const Status st = call(off);
    internal::SetPackPrefetch(true);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(0, std::memcmp(on.data(), off.data(), on.num_bytes()));
  };
  GmmTiles tiles;
  tiles.m = 300;  // items of up to 300 rows: four row blocks, in chunk order
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    Context ctx;
    for (GmmMode mode : {GmmMode::kF32, GmmMode::kBf16, GmmMode::kFakeQat, GmmMode::kNativeFp8,
                         GmmMode::kInt8}) {
      Weight w = MakeWeight(r, WeightDTypeOf(mode), e, k, n);
      const ConstTensorView* scale = w.Scale();
      const Tensor& l = mode == GmmMode::kF32 ? lhs32 : lhs;
      for (const bool swiglu : {false, true}) {
        SCOPED_TRACE(target.label + " fwd " + std::string(GmmModeName(mode)) +
                     (swiglu ? " swiglu" : ""));
        GmmOptions o;
        o.mode = mode;
        o.epilogue = swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
        o.tiles = tiles;
        Tensor on = Poisoned(DType::kBF16, {m, swiglu ? n / 2 : n});
        Tensor off = Poisoned(DType::kBF16, {m, swiglu ? n / 2 : n});
        same_bits(on, off, [&](Tensor& out) {
          return Gmm(ctx, o, l.view(), w.w.view(), scale, gs.view(), out.view());
        });
      }
      if (mode == GmmMode::kInt8 || mode == GmmMode::kNativeFp8) continue;
      SCOPED_TRACE(target.label + " dlhs " + std::string(GmmModeName(mode)));
      GmmOptions o;
      o.mode = mode;
      o.tiles = tiles;
      const Tensor& d = mode == GmmMode::kF32 ? dout32 : dout;
      Tensor on = Poisoned(DType::kF32, {m, k}), off = Poisoned(DType::kF32, {m, k});
      same_bits(on, off, [&](Tensor& out) {
        return GmmDlhs(ctx, o, d.view(), w.w.view(), scale, gs.view(), out.view());
      });
    }
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(target.label + " tgmm " + std::to_string(variant));
      GmmOptions o;
      o.mode = variant == 1 ? GmmMode::kBf16 : GmmMode::kF32;
      o.tiles.k = 128;  // several A blocks of 96 per item, and a short one
      TgmmQuant q;
      if (variant == 2) q.dout_dtype = QuantDType::kE5M2;
      const Tensor& x = variant == 1 ? lhs : lhs32;
      const Tensor& d = variant == 1 ? dout : dout32;
      Tensor on = Poisoned(DType::kF32, {e, k, n}), off = Poisoned(DType::kF32, {e, k, n});
      same_bits(on, off, [&](Tensor& out) {
        return Tgmm(ctx, o, q, x.view(), d.view(), gs.view(), out.view());
      });
    }
  }
  test::UseDefaultSimd();
}

// ---- TGMM ------------------------------------------------------------------

struct TgmmCase {
  GmmMode mode;
  DType lhs_dtype;
  std::optional<QuantDType> quant;
  bool per_group = true;
  bool xla_reciprocal = false;  // dout codes from g * (1 / s)
};

void CheckTgmm(Context& ctx, TestRng& r, const TgmmCase& c, int64_t m, int64_t k, int64_t n, int64_t e,
               const GmmTiles& tiles = {}) {
  SCOPED_TRACE(std::string(GmmModeName(c.mode)) + " lhs " + std::string(DTypeName(c.lhs_dtype)) +
               (c.quant ? " quant " + std::string(QuantDTypeName(*c.quant)) : "") +
               (c.per_group ? "" : " per-tile") +
               (c.xla_reciprocal ? " xla_reciprocal" : "") + " M " + std::to_string(m) + " K " +
               std::to_string(k) + " N " + std::to_string(n));
  std::vector<int32_t> sizes = Groups(r, e, m);
  const int64_t valid = Sum(sizes);
  Tensor gs = GroupSizes(sizes);
  Tensor lf = RandomF32(r, {m, k}, valid);
  Tensor lhs;
  if (c.lhs_dtype == DType::kF32) {
    lhs = std::move(lf);
  } else if (c.lhs_dtype == DType::kBF16) {
    lhs = ToBf16(lf);
  } else {  // fp8 codes of the forward's quantized activation
    lhs = Make(c.lhs_dtype, {m, k});
    std::vector<float> s(static_cast<size_t>(m));
    ASSERT_TRUE(QuantizeRows(lf.data_as<float>(), m, k, valid, 0, *QuantDTypeOf(c.lhs_dtype),
                             Calibration::AbsMax(), lhs.data_as<uint8_t>(), s.data()).ok());
    for (int64_t i = valid * k; i < m * k; ++i) lhs.data_as<uint8_t>()[i] = 0x7F;  // NaN
  }
  Tensor dofs = RandomF32(r, {m, n}, valid);
  Tensor dout = (c.quant || c.mode == GmmMode::kF32) ? std::move(dofs) : ToBf16(dofs);
  GmmOptions o;
  o.mode = c.mode;
  o.tiles = tiles;
  TgmmQuant q;
  q.dout_dtype = c.quant;
  q.per_group = c.per_group;
  if (c.xla_reciprocal) q.calibration = q.calibration.With(ScaleArithmetic::kXlaReciprocal);
  Tensor got = Poisoned(DType::kF32, {e, k, n});
  ASSERT_TRUE(Tgmm(ctx, o, q, lhs.view(), dout.view(), gs.view(), got.view()).ok());
  // Against the float64 oracle: a group of R rows sums R products, each
  // rounded in f32 mode (Gamma(R)); a quantized dout's scale may be applied
  // to each product or to the sum (2 more roundings).
  const OracleResult want = OracleTgmm(o, q, lhs, dout, sizes);
  for (size_t i = 0; i < got.num_elements(); ++i) {
    const int64_t g = static_cast<int64_t>(i) / (k * n);
    const float gv = got.data_as<float>()[i];
    ASSERT_FALSE(std::isnan(gv)) << "NaN at " << i;
    if (sizes[static_cast<size_t>(g)] == 0) {
      ASSERT_EQ(std::bit_cast<uint32_t>(gv), 0u) << "empty group " << g << " not zero";
      continue;
    }
    const double bound = Gamma(sizes[static_cast<size_t>(g)] + 2) * want.abs_sum[i] + 1e-30;
    ASSERT_LE(std::fabs(static_cast<double>(gv) - want.value[i]), bound)
        << "element " << i << " got " << gv << " want " << want.value[i];
  }
}

std::vector<TgmmCase> AllTgmmCases() {
  return {
      {GmmMode::kF32, DType::kF32, std::nullopt},
      {GmmMode::kBf16, DType::kBF16, std::nullopt},
      {GmmMode::kBf16, DType::kE4M3FN, std::nullopt},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE5M2, true},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE4M3FN, true},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE5M2, false},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE4M3FN, false},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE5M2, true, true},
      {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE4M3FN, false, true},
  };
}

TEST(Tgmm, EveryModeMatchesTheOracleOnEveryBackend) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  for (BackendKind b : AllBackends()) {
    SCOPED_TRACE(BackendName(b));
    Context ctx(OnBackend(b));
    for (const TgmmCase& c : AllTgmmCases()) {
      CheckTgmm(ctx, r, c, 700, 96, 80, 5);
      CheckTgmm(ctx, r, c, 300, 37, 130, 4, GmmTiles{33, 16, 40});
    }
    const auto cases = AllTgmmCases();
    for (int v = 1; v <= 67; ++v) {
      const TgmmCase& c = cases[static_cast<size_t>(v) % cases.size()];
      CheckTgmm(ctx, r, c, v, r.Int(1, 67), r.Int(1, 67), r.Int(1, 5));
      CheckTgmm(ctx, r, c, r.Int(1, 67), v, r.Int(1, 67), r.Int(1, 5));
      CheckTgmm(ctx, r, c, r.Int(1, 67), r.Int(1, 67), v, r.Int(1, 5));
    }
    ExpectRanOn(ctx, b);
  }
}

// Groups of at most 12 rows with whole 32-column panels take the kernels that
// read the weight without packing it (bf16-pair CPUs); odd K, several
// reduction blocks, K-blocks and SwiGLU's two column runs included.
TEST(Gmm, SmallGroupsMatchTheOracle) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  Context ctx;
  for (int64_t k : {3, 257, 600}) {
    for (const FwdCase& c : AllFwdCases()) {
      CheckFwd(ctx, r, c, 40, k, 96, 8);
      CheckFwd(ctx, r, c, 12, k, 64, 1);
    }
  }
}

// Items of up to 8 rows, up to 12 rows and more rows take different kernels
// (on AVX2: MicroF32Direct in tiles of 1x8, 2x4, 4x2 and 8x1 vectors, on
// AVX3 1x8, 2x4, 4x4 (fp8) or 4x2 and 8x2, with native fp8 weights decoded
// raw, and the packed kernel; on bf16-pair CPUs
// byte-table fp8 decode, u16 decode, packed panels); the reduction order is
// the same, so the bits must be too.
TEST(Gmm, DirectAndPackedWeightPathsGiveTheSameBits) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  const int64_t m = 120, k = 300, e = 3;
  std::vector<int32_t> sizes = {50, 0, 61};
  Tensor gs = GroupSizes(sizes);
  // The direct kernels keep C in their accumulator order between reduction
  // chunks: several chunks (tile k 64 and 300 > 256), K-block scales and both
  // fp8 formats must still give the packed path's bits.
  struct Case {
    GmmMode mode;
    DType wdtype;
    int64_t block;
  };
  // Every SIMD target: AVX512-BF16 runs the pair kernels straight from the
  // weight, every other target (and f32 everywhere) MicroF32Direct; int8 on
  // AVX512-VNNI MicroI8PairsDirectVnni, elsewhere the packed kernel.
  // 128 and 96 columns: the direct strips of several blocks of columns and
  // the one-block strips of what is left of a run (96 = 64 + 32; SwiGLU's
  // 48-column runs take the packed kernel).
  for (const test::SimdTarget& target : test::SimdTargets()) {
  test::UseSimdTarget(target);
  for (const int64_t n : {int64_t{128}, int64_t{96}}) {
  for (const Case& c : {Case{GmmMode::kF32, DType::kF32, 0}, Case{GmmMode::kBf16, DType::kBF16, 0},
                        Case{GmmMode::kNativeFp8, DType::kE4M3FN, 0},
                        Case{GmmMode::kNativeFp8, DType::kE4M3FN, 128},
                        Case{GmmMode::kNativeFp8, DType::kE4M3FNUZ, 0},
                        Case{GmmMode::kInt8, DType::kI8, 0}}) {
    for (bool swiglu : {false, true}) {
      const GmmMode mode = c.mode;
      SCOPED_TRACE(target.label + " n " + std::to_string(n) + " " + std::string(GmmModeName(mode)) +
                   " " + std::string(DTypeName(c.wdtype)) + " block " + std::to_string(c.block) +
                   (swiglu ? " swiglu" : ""));
      Tensor lhs32 = RandomF32(r, {m, k}, Sum(sizes));
      Tensor lhs = mode == GmmMode::kF32 ? std::move(lhs32) : ToBf16(lhs32);
      Weight w = MakeWeight(r, c.wdtype, e, k, n);
      const ConstTensorView* scale = w.Scale();
      const int64_t oc = swiglu ? n / 2 : n;
      std::vector<Tensor> outs;
      // 16 rows: packed; 1 to 12: the direct kernels' tile shapes.
      for (int64_t tile_m : {16, 1, 2, 3, 4, 8, 12}) {
        for (int64_t tile_k : {int64_t{0}, int64_t{64}}) {
        // fp8 weights on bf16-pair CPUs: byte-table (VBMI) and u16 decode.
        for (bool tables : {true, false}) {
          if (!tables && !w.codes) continue;
          internal::SetFp8ByteTableDecode(tables);
          GmmOptions o;
          o.mode = mode;
          o.fp8_dtype = c.wdtype == DType::kE4M3FNUZ ? QuantDType::kE4M3FNUZ : QuantDType::kE4M3FN;
          o.lhs_quant_block_size = c.block;
          o.epilogue = swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
          o.tiles.m = tile_m;
          if (tile_k > 0) o.tiles.k = tile_k;
          outs.push_back(Make(DType::kF32, {m, oc}));
          ASSERT_TRUE(Gmm(o, lhs.view(), w.w.view(), scale, gs.view(),
                          outs.back().view()).ok());
          internal::SetFp8ByteTableDecode(true);
        }
        }
      }
      for (size_t i = 1; i < outs.size(); ++i) {
        ASSERT_EQ(0, std::memcmp(outs[0].data(), outs[i].data(), outs[0].num_bytes())) << i;
      }
    }
  }
  }
  }
  test::UseDefaultSimd();
}

// A NaN weight code makes its output column NaN for every row of the group,
// whichever kernel runs (the direct kernels decode native fp8 raw, where NaN
// codes are finite numbers, and set those columns afterwards); every other
// column has the same bits on every path.
TEST(Gmm, NaNWeightCodesGiveNaNColumnsOnEveryPath) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  const int64_t m = 40, k = 300, n = 64, e = 2;
  std::vector<int32_t> sizes = {17, 23};
  Tensor gs = GroupSizes(sizes);
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (DType wd : {DType::kE4M3FN, DType::kE4M3FNUZ}) {
      SCOPED_TRACE(target.label + " " + std::string(DTypeName(wd)));
      const bool fnuz = wd == DType::kE4M3FNUZ;
      Tensor lhs = ToBf16(RandomF32(r, {m, k}, Sum(sizes)));
      Weight w = MakeWeight(r, wd, e, k, n);
      // NaN codes: group 0 column 5 at k = 3, group 1 column 40 at k = 299
      // (the last chunk), and for e4m3fn also the negative NaN 0xFF.
      uint8_t* q = w.w.data_as<uint8_t>();
      q[(0 * k + 3) * n + 5] = fnuz ? 0x80 : 0x7F;
      q[(1 * k + 299) * n + 40] = fnuz ? 0x80 : 0xFF;
      const ConstTensorView sv = w.scale.view();
      std::vector<Tensor> outs;
      for (int64_t tile_m : {16, 1, 2, 4, 8}) {
        for (int64_t tile_k : {int64_t{0}, int64_t{64}}) {
          GmmOptions o;
          o.mode = GmmMode::kNativeFp8;
          o.fp8_dtype = fnuz ? QuantDType::kE4M3FNUZ : QuantDType::kE4M3FN;
          o.tiles.m = tile_m;
          if (tile_k > 0) o.tiles.k = tile_k;
          outs.push_back(Make(DType::kF32, {m, n}));
          ASSERT_TRUE(Gmm(o, lhs.view(), w.w.view(), &sv, gs.view(), outs.back().view()).ok());
        }
      }
      for (size_t t = 0; t < outs.size(); ++t) {
        const float* out = outs[t].data_as<float>();
        const float* first = outs[0].data_as<float>();
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const bool want_nan = (i < 17 && j == 5) || (i >= 17 && j == 40);
            const float v = out[i * n + j];
            ASSERT_EQ(std::isnan(v), want_nan) << "path " << t << " row " << i << " col " << j;
            if (!want_nan) {
              ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(first[i * n + j]))
                  << "path " << t << " row " << i << " col " << j;
            }
          }
        }
      }
    }
  }
  test::UseDefaultSimd();
}

// Every code of both e4m3 formats but their NaN codes (the test above has
// those), at even and odd columns alike, through the direct kernels (raw
// decode; on AVX2 two vectors per sign extension, LoadRawFp8Pair, whose
// accumulators hold even and odd columns) and through the packed kernel
// (exact decode): +-0, the exponent-0 codes (f32 subnormals in the raw
// decode), +-448 / +-240 all give the packed path's bits, over one and
// several reduction chunks (C loaded back in the paired order).
TEST(Gmm, DirectKernelsDecodeEveryFp8CodeAsThePackedPathDoes) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  const int64_t m = 56, k = 300, n = 128, e = 3;
  std::vector<int32_t> sizes = {32, 0, 16};  // 16-row tiles: all packed; 8 tail rows
  Tensor gs = GroupSizes(sizes);
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (DType wd : {DType::kE4M3FN, DType::kE4M3FNUZ}) {
      SCOPED_TRACE(target.label + " " + std::string(DTypeName(wd)));
      const bool fnuz = wd == DType::kE4M3FNUZ;
      std::vector<uint8_t> codes;
      for (int c = 0; c < 256; ++c) {
        const bool nan = fnuz ? c == 0x80 : (c & 0x7F) == 0x7F;
        if (!nan) codes.push_back(static_cast<uint8_t>(c));
      }
      Weight w = MakeWeight(r, wd, e, k, n);  // for its scales
      uint8_t* q = w.w.data_as<uint8_t>();
      // Column j of group g meets every code down its 300 rows.
      for (int64_t g = 0; g < e; ++g) {
        for (int64_t kk = 0; kk < k; ++kk) {
          for (int64_t j = 0; j < n; ++j) {
            q[(g * k + kk) * n + j] = codes[static_cast<size_t>(kk + 3 * j + 17 * g) % codes.size()];
          }
        }
      }
      const Tensor lhs = ToBf16(RandomF32(r, {m, k}, Sum(sizes)));
      std::vector<Tensor> outs;
      // 16 rows: the packed kernel; 1, 2, 3, 4, 8: the direct kernels' tiles.
      for (int64_t tile_m : {16, 1, 2, 3, 4, 8}) {
        for (int64_t tile_k : {int64_t{0}, int64_t{64}}) {
          for (bool tables : {true, false}) {
            internal::SetFp8ByteTableDecode(tables);
            GmmOptions o;
            o.mode = GmmMode::kNativeFp8;
            o.fp8_dtype = fnuz ? QuantDType::kE4M3FNUZ : QuantDType::kE4M3FN;
            o.tiles.m = tile_m;
            if (tile_k > 0) o.tiles.k = tile_k;
            outs.push_back(Poisoned(DType::kF32, {m, n}));
            ASSERT_TRUE(Gmm(o, lhs.view(), w.w.view(), w.Scale(), gs.view(),
                            outs.back().view()).ok());
            internal::SetFp8ByteTableDecode(true);
          }
        }
      }
      const float* first = outs[0].data_as<float>();
      for (int64_t i = 0; i < Sum(sizes) * n; ++i) {
        ASSERT_TRUE(std::isfinite(first[i])) << "element " << i;
      }
      for (size_t t = 1; t < outs.size(); ++t) {
        ASSERT_EQ(0, std::memcmp(first, outs[t].data(), outs[0].num_bytes())) << "path " << t;
      }
    }
  }
  test::UseDefaultSimd();
}

// The kernels of every SIMD target this CPU runs (AVX-512 with or without
// bf16 dot products, AVX2, SSE4, scalar) against the reference.
TEST(Gmm, EveryTargetMatchesTheOracle) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  Context ctx;
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    SCOPED_TRACE(target.label);
    for (const FwdCase& c : AllFwdCases()) CheckFwd(ctx, r, c, 45, 70, 40, 3);
    CheckDlhs(ctx, r, {GmmMode::kBf16, DType::kE4M3FN, DType::kF32, true}, 50, 40, 70, 3);
    CheckDlhs(ctx, r, {GmmMode::kF32, DType::kF32}, 50, 40, 70, 3);
    CheckDlhs(ctx, r, {GmmMode::kF32, DType::kE4M3FN}, 50, 40, 70, 3);
    CheckTgmm(ctx, r, {GmmMode::kBf16, DType::kBF16, std::nullopt}, 90, 40, 50, 3);
    CheckTgmm(ctx, r, {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE5M2, false}, 90, 40, 50, 3,
              GmmTiles{16, {}, {}});
    CheckTgmm(ctx, r, {GmmMode::kF32, DType::kE4M3FN, QuantDType::kE4M3FN, false, true}, 90, 40,
              50, 3, GmmTiles{16, {}, {}});
  }
  test::UseDefaultSimd();
}

// ---- Determinism: threads and tiles ------------------------------------------

// Runs fn (which fills `out`) under 1 and 2 threads and several tilings; all
// results must have the same bits.
void ExpectSameBitsEverywhere(const std::function<void(const GmmTiles&, Tensor*)>& fn,
                              Tensor* first) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  fn({}, first);
  const std::vector<GmmTiles> tilings = {{}, {GmmTiles{7, 2, 5}}, {GmmTiles{64, 64, 256}},
                                         {GmmTiles{1000, 1000, 1000}}};
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (const GmmTiles& t : tilings) {
      Tensor other = Make(first->dtype(), first->shape());
      fn(t, &other);
      ASSERT_EQ(0, std::memcmp(other.data(), first->data(), first->num_bytes()))
          << "threads " << threads << " tiles " << t.m.value_or(0) << "," << t.k.value_or(0)
          << "," << t.n.value_or(0);
    }
  }
  omp_set_num_threads(saved);
}

TEST(Gmm, BitsDoNotDependOnThreadsOrTiles) {
  FP8MOE_RANDOM_SEED(seed);
  TestRng r(seed);
  // Packed items (groups of ~128 rows), and direct ones (24 groups of ~2
  // rows: each thread takes its next item ahead and prefetches it).
  for (const auto& [m, k, n, e] : {std::array<int64_t, 4>{900, 300, 200, 7},
                                   std::array<int64_t, 4>{48, 300, 256, 24}}) {
    SCOPED_TRACE("m " + std::to_string(m) + " e " + std::to_string(e));
    std::vector<int32_t> sizes = Groups(r, e, m);
    Tensor gs = GroupSizes(sizes);
    Tensor lhs = ToBf16(RandomF32(r, {m, k}, Sum(sizes)));
    Tensor lhs32 = RandomF32(r, {m, k}, Sum(sizes));
    for (GmmMode mode : {GmmMode::kF32, GmmMode::kBf16, GmmMode::kNativeFp8, GmmMode::kInt8}) {
      SCOPED_TRACE(GmmModeName(mode));
      Weight w = MakeWeight(r, WeightDTypeOf(mode), e, k, n);
      const ConstTensorView* scale = w.Scale();
      Tensor& l = mode == GmmMode::kF32 ? lhs32 : lhs;
      Tensor first = Make(DType::kF32, {m, n / 2});
      ExpectSameBitsEverywhere(
          [&](const GmmTiles& t, Tensor* out) {
            GmmOptions o;
            o.mode = mode;
            o.tiles = t;
            o.epilogue = GmmEpilogue::kSwiGlu;
            ASSERT_TRUE(Gmm(o, l.view(), w.w.view(), scale, gs.view(),
                            out->view()).ok());
          },
          &first);
    }
    Tensor dout = RandomF32(r, {m, n}, Sum(sizes));
    Tensor first = Make(DType::kF32, {e, k, n});
    ExpectSameBitsEverywhere(
        [&](const GmmTiles& t, Tensor* out) {
          GmmOptions o;
          o.mode = GmmMode::kF32;
          o.tiles = t;
          ASSERT_TRUE(Tgmm(o, {}, lhs32.view(), dout.view(), gs.view(), out->view()).ok());
        },
        &first);
  }
}

// ---- Errors ----------------------------------------------------------------------

TEST(Gmm, BadArgumentsAreClearErrors) {
  Tensor lhs = Make(DType::kBF16, {10, 8}), rhs = Make(DType::kBF16, {2, 8, 6});
  Tensor out = Make(DType::kF32, {10, 6}), gs = Make(DType::kI32, {2});
  std::memset(lhs.data(), 0, lhs.num_bytes());
  std::memset(rhs.data(), 0, rhs.num_bytes());
  auto run = [&](const GmmOptions& o, std::vector<int32_t> sizes) {
    std::memcpy(gs.data(), sizes.data(), 8);
    return Gmm(o, lhs.view(), rhs.view(), nullptr, gs.view(), out.view());
  };
  GmmOptions o;
  EXPECT_TRUE(run(o, {3, 4}).ok());
  auto expect = [](const Status& s, const char* needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect(run(o, {3, -1}), "negative");
  expect(run(o, {8, 4}), "exceeds");
  GmmOptions t = o;
  t.tiles.m = 0;
  expect(run(t, {1, 1}), "tile m");
  t = o;
  t.tiles.k = 3;
  expect(run(t, {1, 1}), "multiple of 2");
  t = o;
  t.tiles.n = -5;
  expect(run(t, {1, 1}), "tile n");
  t = o;
  t.mode = GmmMode::kF32;
  expect(run(t, {1, 1}), "dtype bf16");
  t = o;
  t.mode = GmmMode::kNativeFp8;
  expect(run(t, {1, 1}), "codes");
  t = o;
  t.epilogue = GmmEpilogue::kSwiGlu;
  expect(run(t, {1, 1}), "shape");
  Tensor codes = Make(DType::kE4M3FN, {2, 8, 6});
  GmmOptions nat;
  nat.mode = GmmMode::kNativeFp8;
  expect(Gmm(nat, lhs.view(), codes.view(), nullptr, gs.view(), out.view()), "rhs_scale");
  Tensor dout = Make(DType::kBF16, {10, 6});
  Tensor drhs = Make(DType::kF32, {3, 8, 6});
  expect(Tgmm(o, {}, lhs.view(), dout.view(), gs.view(), drhs.view()), "entries");
}

// The look-ahead prefetch of the direct kernels visits every line of the next
// block once, in memory order, however the walk is cut into per-call shares.
TEST(LineWalk, VisitsEveryLineOfTheBlockOnceInOrder) {
  static uint8_t block[64 * 1024];
  for (const uint32_t nseg : {1u, 2u}) {
    for (const uint32_t seg_lines : {1u, 3u, 16u}) {
      internal::LineWalk w;
      w.ld = 4096;
      w.seg_delta = nseg > 1 ? 1536 : 0;
      w.seg_lines = seg_lines;
      w.nseg = nseg;
      const int64_t rows = 7, total = rows * nseg * seg_lines;
      std::vector<const uint8_t*> want;
      for (int64_t r = 0; r < rows; ++r) {
        for (uint32_t sg = 0; sg < nseg; ++sg) {
          for (uint32_t l = 0; l < seg_lines; ++l) {
            want.push_back(block + r * 4096 + sg * 1536 + l * 64);
          }
        }
      }
      for (const int64_t share : {int64_t{1}, int64_t{5}, total}) {
        std::vector<const uint8_t*> got;
        for (int64_t j = 0; j < total; j += share) {
          w.Start(block, j, std::min(share, total - j));
          while (const uint8_t* line = w.Next()) got.push_back(line);
        }
        EXPECT_EQ(got, want) << "nseg " << nseg << " seg_lines " << seg_lines << " share " << share;
      }
    }
  }
}

// A direct kernel call prefetches its item's next chunk; the last chunk, the
// first chunk of the item its thread runs next (when known), so no item but
// a thread's first starts cold; with nothing after it, nothing.
TEST(PrefetchTarget, NextChunkThenTheFollowingItemsFirst) {
  const internal::WorkItem it{3, 0, 1, 0, 1024, 100, 2048};  // reduction [100, 2148)
  const internal::WorkItem next{4, 1, 1, 0, 512, 0, 300};
  const internal::WorkItem empty{5, 2, 1, 0, 512, 0, 0};
  internal::ColumnRuns runs, next_runs;
  runs.count = 1024;
  next_runs.count = 512;
  next_runs.start[0] = 512;
  // Chunks of 256 rows: the next chunk, whole or the shorter last one.
  internal::PrefetchTarget t = internal::ChunkPrefetchTarget(it, runs, 100, 256, 256, &next, &next_runs, 512);
  EXPECT_EQ(t.item, &it);
  EXPECT_EQ(t.runs, &runs);
  EXPECT_EQ(t.r0, 356);
  EXPECT_EQ(t.rows, 256);
  t = internal::ChunkPrefetchTarget(it, runs, 1636, 256, 256, &next, &next_runs, 512);
  EXPECT_EQ(t.item, &it);
  EXPECT_EQ(t.r0, 1892);
  EXPECT_EQ(t.rows, 256);
  // The last chunk [1892, 2148): the following item's first chunk.
  t = internal::ChunkPrefetchTarget(it, runs, 1892, 256, 256, &next, &next_runs, 512);
  EXPECT_EQ(t.item, &next);
  EXPECT_EQ(t.runs, &next_runs);
  EXPECT_EQ(t.r0, 0);
  EXPECT_EQ(t.rows, 300);  // its whole reduction, shorter than its chunks
  t = internal::ChunkPrefetchTarget(it, runs, 1892, 256, 256, &next, &next_runs, 128);
  EXPECT_EQ(t.rows, 128);
  // Nothing known to follow, or an item that reduces nothing: no prefetch.
  EXPECT_EQ(internal::ChunkPrefetchTarget(it, runs, 1892, 256, 256, nullptr, nullptr, 0).item,
            nullptr);
  EXPECT_EQ(internal::ChunkPrefetchTarget(it, runs, 1892, 256, 256, &empty, &next_runs, 512).item,
            nullptr);
  // A shorter last chunk of the item itself.
  const internal::WorkItem short_it{3, 0, 1, 0, 1024, 100, 2000};  // [100, 2100)
  t = internal::ChunkPrefetchTarget(short_it, runs, 1636, 256, 256, &next, &next_runs, 512);
  EXPECT_EQ(t.item, &short_it);
  EXPECT_EQ(t.r0, 1892);
  EXPECT_EQ(t.rows, 208);
}

}  // namespace
}  // namespace fp8moe
