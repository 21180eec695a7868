// The model's f32 pieces against their float64 twins (model/reference/):
// forward values, and gradients against central finite differences of the
// twins' scalar loss sum(out * dout). Inputs are fresh normal draws
// (FP8MOE_TEST_SEED replays a case).
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/heap_count_test_util.h"
#include "base/test_seed.h"
#include "base/test_util.h"
#include "model/layers.h"
#include "model/reference/layers_reference.h"

namespace fp8moe {
namespace {

std::vector<double> Normal(std::mt19937& rng, size_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<double> v(n);
  for (double& x : v) x = static_cast<float>(nd(rng));  // representable in f32
  return v;
}

std::vector<float> F32(const std::vector<double>& v) { return {v.begin(), v.end()}; }

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

// Checks grad [n] against central differences of loss(x) at every entry.
void CheckGrad(std::vector<double>* x, const std::vector<float>& grad,
               const std::function<double()>& loss, double tol, const char* what) {
  const double scale = MaxAbs(grad);
  ASSERT_GT(scale, 0) << what;
  for (size_t i = 0; i < x->size(); ++i) {
    const double v0 = (*x)[i], h = 1e-6 * std::max(1.0, std::fabs(v0));
    (*x)[i] = v0 + h;
    const double up = loss();
    (*x)[i] = v0 - h;
    const double down = loss();
    (*x)[i] = v0;
    EXPECT_NEAR(grad[i], (up - down) / (2 * h), tol * scale) << what << "[" << i << "]";
  }
}

TEST(ModelLayers, RmsNormMatchesReferenceAndFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<unsigned>(seed));
  const int64_t rows = 5, d = 12;
  const double eps = 1e-6;
  auto x = Normal(rng, rows * d), g = Normal(rng, d), dy = Normal(rng, rows * d);
  for (double& v : g) v += 1.0;
  Context ctx;
  std::vector<float> xf = F32(x), gf = F32(g), dyf = F32(dy), y(rows * d), inv(rows),
                     dx(rows * d, 0.0f), dg(d);
  ASSERT_TRUE(
      internal::RmsNormForward(ctx, xf.data(), gf.data(), rows, d, eps, y.data(), inv.data()).ok());
  std::vector<double> yr(rows * d);
  reference::RmsNorm(x.data(), g.data(), rows, d, eps, yr.data());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], yr[i], 1e-6 * std::fabs(yr[i]) + 1e-7);
  ASSERT_TRUE(internal::RmsNormBackward(ctx, xf.data(), gf.data(), inv.data(), dyf.data(), rows, d,
                                        dx.data(), dg.data())
                  .ok());
  auto loss = [&] {
    reference::RmsNorm(x.data(), g.data(), rows, d, eps, yr.data());
    double s = 0;
    for (size_t i = 0; i < yr.size(); ++i) s += yr[i] * dy[i];
    return s;
  };
  CheckGrad(&x, dx, loss, 1e-5, "dx");
  CheckGrad(&g, dg, loss, 1e-5, "dg");
}

// Rope + attention forward against the float64 twins, and the backward by
// central differences, on every SIMD target: a head width below one vector
// (hd 4) and one with a scalar tail after whole vectors (hd 20); multi-head,
// grouped-query (Hkv 2 of H 4 and 6) and multi-query (Hkv 1) attention.
TEST(ModelLayers, AttentionWithRopeMatchesReferenceAndFiniteDifferences) {
  struct Shape {
    int64_t B, S, H, Hkv, hd;
  };
  FP8MOE_RANDOM_SEED(seed);
  // Listed before any is forced: SimdTargets() lists what dispatch allows.
  const std::vector<test::SimdTarget> targets = test::SimdTargets();
  for (const Shape& sh : {Shape{2, 7, 3, 3, 4}, Shape{1, 19, 2, 2, 20}, Shape{2, 7, 4, 2, 4},
                          Shape{1, 9, 3, 1, 20}, Shape{1, 5, 6, 2, 6}}) {
    for (const test::SimdTarget& target : targets) [&] {
      test::UseSimdTarget(target);
      const int64_t B = sh.B, S = sh.S, H = sh.H, Hkv = sh.Hkv, hd = sh.hd,
                    W = (H + 2 * Hkv) * hd;
      SCOPED_TRACE(target.label + " H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) +
                   " hd " + std::to_string(hd));
      std::mt19937 rng(static_cast<unsigned>(seed));
      const double theta = 10000.0;
      auto qkv = Normal(rng, B * S * W), dout = Normal(rng, B * S * H * hd);
      Context ctx;
      std::vector<float> cos(S * hd / 2), sin(S * hd / 2);
      internal::RopeTables(S, hd, theta, cos.data(), sin.data());
      std::vector<float> q = F32(qkv), probs(B * H * S * S), out(B * S * H * hd), dq(B * S * W);
      ASSERT_TRUE(
          internal::RopeApply(ctx, q.data(), B, S, H, Hkv, hd, cos.data(), sin.data(), false).ok());
      ASSERT_TRUE(internal::AttentionForward(ctx, q.data(), B, S, H, Hkv, hd, probs.data(),
                                             out.data())
                      .ok());
      std::vector<double> rq, ro(out.size());
      auto ref = [&] {
        rq = qkv;
        reference::Rope(rq.data(), B, S, H, Hkv, hd, theta);
        reference::Attention(rq.data(), B, S, H, Hkv, hd, ro.data());
      };
      ref();
      for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ro[i], 1e-5) << i;
      // Causality: a row's probabilities above the diagonal are exactly zero.
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = i + 1; j < S; ++j) EXPECT_EQ(probs[i * S + j], 0.0f);
      }
      std::vector<float> doutf = F32(dout);
      ASSERT_TRUE(internal::AttentionBackward(ctx, q.data(), probs.data(), doutf.data(), B, S, H,
                                              Hkv, hd, dq.data())
                      .ok());
      ASSERT_TRUE(internal::RopeApply(ctx, dq.data(), B, S, H, Hkv, hd, cos.data(), sin.data(),
                                      /*inverse=*/true)
                      .ok());
      auto loss = [&] {
        ref();
        double s = 0;
        for (size_t i = 0; i < ro.size(); ++i) s += ro[i] * dout[i];
        return s;
      };
      CheckGrad(&qkv, dq, loss, 2e-5, "dqkv");
    }();
  }
  test::UseDefaultSimd();
}

// The vector attention (model/attention.cc) sums in one order per output
// with FMA and a lane-wise exp, so every SIMD target with FMA (AVX2 and
// wider) gives the same bits; the fallbacks without FMA (SSE4, scalar) round
// each product and are only held to the float64 twin. Every output element
// is written (outputs start NaN-poisoned). Shapes:
// the default model's head (S 64, hd 16), a sequence one past whole vectors,
// a single position, and a head width with a tail.
TEST(ModelLayers, AttentionGivesTheSameBitsOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  struct Shape {
    int64_t B, S, H, Hkv, hd;
  };
  const std::vector<test::SimdTarget> targets = test::SimdTargets();
  int compared = 0;  // targets held to the first one's bits
  const std::vector<Shape> shapes = {{2, 64, 2, 2, 16}, {1, 65, 3, 3, 16}, {2, 1, 1, 1, 8},
                                     {1, 33, 2, 2, 12}, {2, 33, 4, 2, 12}, {1, 17, 3, 1, 16}};
  for (const Shape& sh : shapes) {
    const int64_t B = sh.B, S = sh.S, H = sh.H, Hkv = sh.Hkv, hd = sh.hd, W = (H + 2 * Hkv) * hd;
    SCOPED_TRACE("B " + std::to_string(B) + " S " + std::to_string(S) + " H " +
                 std::to_string(H) + " Hkv " + std::to_string(Hkv) + " hd " + std::to_string(hd));
    std::mt19937 rng(static_cast<unsigned>(seed));
    const auto qkv = Normal(rng, B * S * W, 2.0), dout = Normal(rng, B * S * H * hd);
    const std::vector<float> qf = F32(qkv), df = F32(dout);
    std::vector<std::vector<float>> first;  // probs, out, dqkv of the first target
    std::string first_label;
    for (const test::SimdTarget& target : targets) [&] {
      test::UseSimdTarget(target);
      SCOPED_TRACE(target.label);
      Context ctx;
      std::vector<float> probs(B * H * S * S, NAN), out(B * S * H * hd, NAN), dq(B * S * W, NAN);
      ASSERT_TRUE(internal::AttentionForward(ctx, qf.data(), B, S, H, Hkv, hd, probs.data(),
                                             out.data())
                      .ok());
      ASSERT_TRUE(internal::AttentionBackward(ctx, qf.data(), probs.data(), df.data(), B, S, H,
                                              Hkv, hd, dq.data())
                      .ok());
      for (const auto* v : {&probs, &out, &dq}) {
        for (size_t i = 0; i < v->size(); ++i) {
          ASSERT_TRUE(std::isfinite((*v)[i])) << "element " << i << " not written";
        }
      }
      std::vector<double> ro(out.size());
      reference::Attention(qkv.data(), B, S, H, Hkv, hd, ro.data());
      for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ro[i], 2e-5) << i;
      if (target.hwy > HWY_AVX2) return;  // no FMA: other bits, same tolerance
      if (first.empty()) {
        first = {probs, out, dq};
        first_label = target.label;
        return;
      }
      ++compared;
      const char* names[] = {"probs", "out", "dqkv"};
      const std::vector<float>* now[] = {&probs, &out, &dq};
      for (int k = 0; k < 3; ++k) {
        for (size_t i = 0; i < now[k]->size(); ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>((*now[k])[i]), std::bit_cast<uint32_t>(first[k][i]))
              << names[k] << "[" << i << "] differs from " << first_label;
        }
      }
    }();
  }
  test::UseDefaultSimd();
  // On an AVX2-only machine there is nothing to compare with; elsewhere the
  // AVX3 targets were held to each other and to AVX2.
  int fma_targets = 0;
  for (const test::SimdTarget& t : targets) fma_targets += t.hwy <= HWY_AVX2;
  EXPECT_EQ(compared, static_cast<int>(shapes.size()) * (fma_targets - 1));
}

// Non-finite inputs reach the rows they touch and no others, on every
// target: a NaN in a query makes its row NaN, a NaN in a key every later row
// of its head, a score that overflows f32 (1e30 * 1e30) its row. (The vector
// exp returns 0 for NaN; attention.cc keeps the NaN.)
TEST(ModelLayers, AttentionSpreadsNaNToTheRowsItReaches) {
  const int64_t B = 1, S = 20, H = 2, hd = 16, W = 3 * H * hd;
  FP8MOE_RANDOM_SEED(seed);
  const std::vector<test::SimdTarget> targets = test::SimdTargets();
  for (const test::SimdTarget& target : targets) [&] {
    test::UseSimdTarget(target);
    SCOPED_TRACE(target.label);
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::vector<float> qkv = F32(Normal(rng, B * S * W));
    qkv[3 * W + 0] = NAN;                            // q of row 3, head 0
    qkv[7 * W + H * hd + hd + 1] = NAN;              // k of row 7, head 1
    for (int64_t t = 0; t < hd; ++t) qkv[11 * W + t] = 1e30f;       // q of row 11, head 0
    for (int64_t t = 0; t < hd; ++t) qkv[2 * W + H * hd + t] = 1e30f;  // k of row 2, head 0
    Context ctx;
    std::vector<float> probs(B * H * S * S), out(B * S * H * hd);
    ASSERT_TRUE(
        internal::AttentionForward(ctx, qkv.data(), B, S, H, H, hd, probs.data(), out.data()).ok());
    for (int64_t i = 0; i < S; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const bool nan_row = (h == 0 && i == 3) || (h == 1 && i >= 7) || (h == 0 && i == 11);
        for (int64_t t = 0; t < hd; ++t) {
          const float o = out[(i * H + h) * hd + t];
          ASSERT_EQ(std::isnan(o), nan_row) << "row " << i << " head " << h << " col " << t
                                            << ": " << o;
        }
      }
    }
  }();
  test::UseDefaultSimd();
}

TEST(ModelLayers, CrossEntropyMatchesReferenceAndFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<unsigned>(seed));
  const int64_t rows = 6, v = 11;
  auto logits = Normal(rng, rows * v, 3.0);
  std::vector<int32_t> targets(rows);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % v);
  Context ctx;
  std::vector<float> lf = F32(logits), dl(rows * v);
  auto loss = internal::CrossEntropy(ctx, lf.data(), targets.data(), rows, v, dl.data());
  ASSERT_TRUE(loss.ok());
  EXPECT_NEAR(*loss, reference::CrossEntropy(logits.data(), targets.data(), rows, v), 1e-6);
  CheckGrad(&logits, dl, [&] { return reference::CrossEntropy(logits.data(), targets.data(), rows, v); },
            1e-5, "dlogits");
  targets[2] = static_cast<int32_t>(v);
  auto bad = internal::CrossEntropy(ctx, lf.data(), targets.data(), rows, v, dl.data());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("outside the vocabulary"), std::string::npos);
}

// The vector loss on every SIMD target: against the float64 twin (value and
// finite-difference gradient) for a vocabulary of whole vectors and one with
// a tail, the same bits on every target with FMA, every gradient element
// written (NaN-poisoned first).
TEST(ModelLayers, CrossEntropyOnEveryTargetMatchesTheTwinWithTheSameBits) {
  FP8MOE_RANDOM_SEED(seed);
  const std::vector<test::SimdTarget> targets = test::SimdTargets();
  for (int64_t v : {256, 37}) {
    const int64_t rows = 9;
    std::mt19937 rng(static_cast<unsigned>(seed));
    auto logits = Normal(rng, rows * v, 4.0);
    std::vector<int32_t> tgt(rows);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % v);
    const std::vector<float> lf = F32(logits);
    const double want = reference::CrossEntropy(logits.data(), tgt.data(), rows, v);
    std::vector<float> first;
    double first_loss = 0;
    for (const test::SimdTarget& target : targets) [&] {
      test::UseSimdTarget(target);
      SCOPED_TRACE(target.label + " v " + std::to_string(v));
      Context ctx;
      std::vector<float> dl(rows * v, NAN);
      auto loss = internal::CrossEntropy(ctx, lf.data(), tgt.data(), rows, v, dl.data());
      ASSERT_TRUE(loss.ok());
      EXPECT_NEAR(*loss, want, 1e-6 * std::fabs(want));
      auto eval = internal::CrossEntropy(ctx, lf.data(), tgt.data(), rows, v, nullptr);
      ASSERT_TRUE(eval.ok());
      EXPECT_EQ(*eval, *loss) << "the loss without a gradient differs";
      for (float g : dl) ASSERT_TRUE(std::isfinite(g));
      if (target.hwy <= HWY_AVX2) {
        if (first.empty()) {
          first = dl;
          first_loss = *loss;
        } else {
          EXPECT_EQ(*loss, first_loss);
          for (size_t i = 0; i < dl.size(); ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(dl[i]), std::bit_cast<uint32_t>(first[i])) << i;
          }
        }
      }
      std::vector<double> x = logits;
      CheckGrad(&x, dl, [&] { return reference::CrossEntropy(x.data(), tgt.data(), rows, v); },
                1e-5, "dlogits");
    }();
  }
  test::UseDefaultSimd();
}

// The loss at the edges of the f32 range, on every target: finite logits up
// to +-FLT_MAX give a finite loss and gradient close to the twin's; a NaN or
// +inf logit makes its row's loss NaN; a -inf logit adds nothing (and as the
// target, makes the loss +inf).
TEST(ModelLayers, CrossEntropyAtTheEdgesOfTheF32Range) {
  const float kMax = std::numeric_limits<float>::max(), kInf = INFINITY;
  const float sub = std::numeric_limits<float>::denorm_min();
  const int64_t v = 5;
  struct Row {
    std::vector<float> l;
    int32_t target;
    const char* expect;  // "finite", "nan", "inf"
  };
  const std::vector<Row> cases = {
      {{kMax, -kMax, 0.0f, -0.0f, sub}, 1, "finite"},
      {{1e30f, -1e30f, 3.0f, -sub, kMax}, 4, "finite"},
      {{-kInf, 1.0f, 2.0f, -kInf, 0.5f}, 2, "finite"},
      {{-kInf, 1.0f, 2.0f, -kInf, 0.5f}, 0, "inf"},
      {{1.0f, NAN, 2.0f, 3.0f, 4.0f}, 0, "nan"},
      {{NAN, 1.0f, 2.0f, 3.0f, 4.0f}, 2, "nan"},
      {{1.0f, 2.0f, kInf, 3.0f, 4.0f}, 0, "nan"},
  };
  const std::vector<test::SimdTarget> targets = test::SimdTargets();
  for (const Row& row : cases) {
    const std::vector<double> ld(row.l.begin(), row.l.end());
    const double want = reference::CrossEntropy(ld.data(), &row.target, 1, v);
    for (const test::SimdTarget& target : targets) [&] {
      test::UseSimdTarget(target);
      SCOPED_TRACE(target.label + " logits " + std::to_string(row.l[0]) + " ... target " +
                   std::to_string(row.target));
      Context ctx;
      std::vector<float> dl(v, NAN);
      auto loss = internal::CrossEntropy(ctx, row.l.data(), &row.target, 1, v, dl.data());
      ASSERT_TRUE(loss.ok());
      const std::string expect = row.expect;
      if (expect == "finite") {
        EXPECT_NEAR(*loss, want, 1e-6 * std::max(1.0, std::fabs(want)));
        for (float g : dl) EXPECT_TRUE(std::isfinite(g));
      } else if (expect == "inf") {
        EXPECT_EQ(*loss, INFINITY);
      } else {
        EXPECT_TRUE(std::isnan(*loss)) << *loss;
        for (float g : dl) EXPECT_TRUE(std::isnan(g)) << g;
      }
    }();
  }
  test::UseDefaultSimd();
}

TEST(ModelLayers, EdgeValuesStayFinite) {
  // Large logits and a zero-variance norm row: no inf or NaN from overflow.
  Context ctx;
  std::vector<float> logits = {1e30f, -1e30f, 0.0f, 3e38f, 3e38f, -3e38f};
  std::vector<int32_t> targets = {1, 2};
  std::vector<float> dl(6);
  auto l = internal::CrossEntropy(ctx, logits.data(), targets.data(), 2, 3, dl.data());
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(std::isfinite(*l)) << *l;
  for (float v : dl) EXPECT_TRUE(std::isfinite(v));
  std::vector<float> x(8, 0.0f), g(8, 1.0f), y(8), inv(1);
  ASSERT_TRUE(
      internal::RmsNormForward(ctx, x.data(), g.data(), 1, 8, 1e-6f, y.data(), inv.data()).ok());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  EXPECT_TRUE(std::isfinite(inv[0]));
}

// Linear builds three views per call; their shapes are held inline
// (fp8moe/tensor.h), so once the GMM's scratch has grown a call makes no heap
// allocation at all (every operator new of this binary is counted).
TEST(ModelLayers, LinearMakesNoHeapAllocation) {
  const int64_t m = 5, k = 7, n = 3;
  std::vector<float> x(m * k, 0.5f), w(k * n, 0.25f), out(m * n);
  Tensor group = Tensor::Create(DType::kI32, {1}).value();
  group.data_as<int32_t>()[0] = static_cast<int32_t>(m);
  Context ctx;
  ASSERT_TRUE(internal::Linear(ctx, group.view(), x.data(), w.data(), m, k, n, out.data()).ok());
  const int64_t before = test::HeapAllocations();
  ASSERT_TRUE(internal::Linear(ctx, group.view(), x.data(), w.data(), m, k, n, out.data()).ok());
  EXPECT_EQ(test::HeapAllocations(), before);
  EXPECT_EQ(out[0], 0.5f * 0.25f * k);
}

}  // namespace
}  // namespace fp8moe
