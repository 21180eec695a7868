// The router (moe/routing.cc) against plain double-precision loops written
// here from the semantics in include/fp8moe/moe.h: top-k with ties to the
// lower expert, the softmax over the selected logits and over all of them,
// the stable sort by expert, and the gathers and scatters (zero widths
// included). Then the promises of docs/numerics.md for logits over the whole
// f32 range: +-0, subnormals, +-1e-30, +-1e30, +-FLT_MAX, +-inf, NaN.
#include "moe/routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "fp8moe/numerics.h"

namespace fp8moe::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const double kU = std::ldexp(1.0, -24);

// The k experts of one token: stable sort by logit, largest first (equal
// logits keep index order). Only for logits without NaN.
std::vector<int32_t> RefTopK(const float* l, int64_t e, int64_t k) {
  std::vector<int32_t> idx(static_cast<size_t>(e));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// softmax of v in double: exp(v - max) / sum.
std::vector<double> RefSoftmax(const std::vector<double>& v) {
  double mx = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for (double x : v) {
    nan |= std::isnan(x);
    mx = std::max(mx, x);
  }
  std::vector<double> p(v.size());
  double sum = 0;
  for (size_t i = 0; i < v.size(); ++i) sum += (p[i] = std::exp(v[i] - mx));
  for (double& x : p) x = nan ? std::numeric_limits<double>::quiet_NaN() : x / sum;
  return p;
}

// got (f32 exp of f32 differences, f32 sums) against the double softmax:
// the difference l - max rounds by u |l - max|, exp and the sums add a few
// ulp each.
void ExpectSoftmaxClose(double got, double want, double diff, int64_t n, const char* what) {
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << what << " got " << got << " want NaN";
    return;
  }
  ASSERT_FALSE(std::isnan(got)) << what << " want " << want;
  const double bound =
      want == 0 ? 1e-45 : (std::fabs(diff) + 2.0 * static_cast<double>(n) + 8) * kU * want + 1e-45;
  ASSERT_LE(std::fabs(got - want), bound) << what << " got " << got << " want " << want;
}

// Logits of T tokens x E experts: random, ties, and the edge values.
std::vector<float> EdgeLogits(std::mt19937& rng, int64_t t, int64_t e) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const float edges[] = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), 1e-30f, -1e-30f,
                         1e30f, -1e30f, kMax, -kMax, 80.0f, -80.0f, 1e4f};
  std::vector<float> l(static_cast<size_t>(t * e));
  for (int64_t i = 0; i < t; ++i) {
    float* row = l.data() + i * e;
    for (int64_t x = 0; x < e; ++x) row[x] = nd(rng);
    switch (i % 6) {
      case 0: break;                                                   // random
      case 1: std::fill(row, row + e, 0.5f); break;                    // all tied
      case 2: row[rng() % e] = row[rng() % e]; break;                  // a tie
      case 3: row[rng() % e] = edges[rng() % std::size(edges)]; break;
      case 4:
        for (int64_t x = 0; x < e; ++x) row[x] = edges[rng() % std::size(edges)];
        break;
      case 5: row[rng() % e] = -kInf; row[rng() % e] = -kInf; break;
    }
  }
  return l;
}

TEST(Route, MatchesReferenceOverTheFiniteRangeAndMinusInf) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const auto& [t, e, k] : {std::tuple{60, 8, 2}, std::tuple{37, 5, 5}, std::tuple{20, 16, 1},
                               std::tuple{0, 4, 2}, std::tuple{13, 64, 8}}) {
    for (bool norm : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(t) + " E " + std::to_string(e) + " k " +
                   std::to_string(k) + (norm ? " norm" : ""));
      const std::vector<float> l = EdgeLogits(rng, t, e);
      const Routing r = Route(l.data(), t, e, k, norm);
      ASSERT_EQ(r.expert.size(), static_cast<size_t>(t * k));
      std::vector<int32_t> sizes(static_cast<size_t>(e), 0);
      for (int64_t i = 0; i < t; ++i) {
        const float* row = l.data() + i * e;
        const std::vector<int32_t> want = RefTopK(row, e, k);
        std::vector<double> sel(static_cast<size_t>(k)), all(row, row + e);
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(r.expert[static_cast<size_t>(i * k + j)], want[static_cast<size_t>(j)])
              << "token " << i << " slot " << j;
          sel[static_cast<size_t>(j)] = row[want[static_cast<size_t>(j)]];
          ++sizes[static_cast<size_t>(want[static_cast<size_t>(j)])];
        }
        std::vector<double> w = RefSoftmax(sel);
        if (norm) {  // divides by their sum once more (~1)
          const double s = std::accumulate(w.begin(), w.end(), 0.0);
          for (double& x : w) x /= s;
        }
        for (int64_t j = 0; j < k; ++j) {
          ExpectSoftmaxClose(r.weight[static_cast<size_t>(i * k + j)], w[static_cast<size_t>(j)],
                             sel[static_cast<size_t>(j)] - sel[0], norm ? 2 * k : k, "weight");
        }
        const std::vector<double> p = RefSoftmax(all);
        const double mx = *std::max_element(all.begin(), all.end());
        for (int64_t x = 0; x < e; ++x) {
          ExpectSoftmaxClose(r.probs[static_cast<size_t>(i * e + x)], p[static_cast<size_t>(x)],
                             all[static_cast<size_t>(x)] - mx, e, "prob");
        }
      }
      EXPECT_EQ(r.group_sizes, sizes);
      // The stable sort: rows expert by expert, pairs in increasing order
      // within an expert, and row_of_pair / pair_of_row inverse.
      ASSERT_EQ(r.pair_of_row.size(), static_cast<size_t>(t * k));
      int64_t row = 0;
      for (int64_t x = 0; x < e; ++x) {
        int64_t prev = -1;
        for (int32_t c = 0; c < sizes[static_cast<size_t>(x)]; ++c, ++row) {
          const int64_t p = r.pair_of_row[static_cast<size_t>(row)];
          EXPECT_EQ(r.expert[static_cast<size_t>(p)], x);
          EXPECT_GT(p, prev);
          prev = p;
          EXPECT_EQ(r.row_of_pair[static_cast<size_t>(p)], row);
        }
      }
    }
  }
}

// +inf, all -inf and NaN logits (docs/numerics.md, "Router"): the experts
// are always k distinct valid indices; +inf selected first; a token whose
// top selected logit is +inf, or whose selected logits are all -inf, or that
// selected a NaN, has NaN weights; any NaN logit makes the token's
// probabilities (the aux loss) NaN; -inf next to a finite top gets weight 0.
TEST(Route, InfinityAndNaNPromises) {
  const int64_t e = 6, k = 3;
  const std::vector<std::vector<float>> rows = {
      {1, 2, kInf, 3, 0, 0},           // +inf first, weights NaN
      {-kInf, -kInf, -kInf, -kInf, -kInf, -kInf},
      {kNaN, 1, 2, 3, 4, 5},           // NaN first expert: selected
      {1, 2, kNaN, 3, 4, 5},           // NaN elsewhere
      {kNaN, kNaN, kNaN, kNaN, kNaN, kNaN},
      {5, -kInf, 4, -kInf, -kInf, -kInf},  // -inf selected with weight 0
      {kMax, -kMax, 0, 1, 2, 3},          // differences overflow to -inf: weight 0
  };
  std::vector<float> l;
  for (const auto& r : rows) l.insert(l.end(), r.begin(), r.end());
  const int64_t t = static_cast<int64_t>(rows.size());
  const Routing r = Route(l.data(), t, e, k, /*norm_topk_prob=*/true);
  auto w = [&](int64_t i, int64_t j) { return r.weight[static_cast<size_t>(i * k + j)]; };
  auto ex = [&](int64_t i, int64_t j) { return r.expert[static_cast<size_t>(i * k + j)]; };
  auto p = [&](int64_t i, int64_t x) { return r.probs[static_cast<size_t>(i * e + x)]; };
  for (int64_t i = 0; i < t; ++i) {
    std::set<int32_t> seen;
    for (int64_t j = 0; j < k; ++j) {
      ASSERT_GE(ex(i, j), 0);
      ASSERT_LT(ex(i, j), e);
      seen.insert(ex(i, j));
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(k)) << "token " << i;
  }
  EXPECT_EQ(ex(0, 0), 2);
  for (int64_t j = 0; j < k; ++j) EXPECT_TRUE(std::isnan(w(0, j))) << "+inf top";
  for (int64_t j = 0; j < k; ++j) EXPECT_TRUE(std::isnan(w(1, j))) << "all -inf";
  EXPECT_EQ(ex(2, 0), 0);
  for (int64_t j = 0; j < k; ++j) EXPECT_TRUE(std::isnan(w(2, j))) << "NaN selected";
  for (int64_t x = 0; x < e; ++x) {
    EXPECT_TRUE(std::isnan(p(2, x)));
    EXPECT_TRUE(std::isnan(p(3, x))) << "a NaN anywhere: NaN probabilities";
    EXPECT_TRUE(std::isnan(p(4, x)));
  }
  EXPECT_EQ(ex(5, 0), 0);
  EXPECT_EQ(ex(5, 1), 2);
  EXPECT_EQ(ex(5, 2), 1);  // the first -inf, by index
  EXPECT_EQ(w(5, 2), 0.0f);
  EXPECT_NEAR(w(5, 0), 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_EQ(ex(6, 0), 0);
  EXPECT_EQ(w(6, 0), 1.0f);
  EXPECT_EQ(w(6, 1), 0.0f);
  EXPECT_EQ(w(6, 2), 0.0f);
  EXPECT_EQ(p(6, 0), 1.0f);
  EXPECT_EQ(p(6, 1), 0.0f);
}

// Gathers and scatters against plain loops, f32 and bf16 buffers, with
// widths 0, 1 and odd; corrupt indices are clamped into the buffer.
TEST(Route, GathersAndScattersMatchPlainLoops) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t t = 9, e = 4, k = 2, rows = t * k;
  std::vector<float> logits(static_cast<size_t>(t * e));
  for (float& v : logits) v = nd(rng);
  const Routing r = Route(logits.data(), t, e, k, false);
  for (int64_t cols : {0, 1, 7, 33}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE("cols " + std::to_string(cols) + " " + std::string(DTypeName(dt)));
      const size_t es = dt == DType::kF32 ? 4 : 2;
      auto rnd = [&](int64_t n) {
        std::vector<float> v(static_cast<size_t>(n) + 1);  // + 1: never a null data()
        for (float& x : v) x = nd(rng);
        return v;
      };
      auto round = [&](float v) { return dt == DType::kF32 ? v : Bf16ToF32(F32ToBf16(v)); };
      auto at = [&](const std::vector<uint8_t>& buf, int64_t i) {
        if (dt == DType::kF32) {
          float v;
          std::memcpy(&v, buf.data() + i * 4, 4);
          return v;
        }
        uint16_t h;
        std::memcpy(&h, buf.data() + i * 2, 2);
        return Bf16ToF32(h);
      };
      const std::vector<float> x = rnd(t * cols), dy = rnd(t * cols);
      std::vector<uint8_t> buf(static_cast<size_t>(rows * cols) * es + 8);
      GatherRows(r, x.data(), cols, buf.data(), dt);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t tok = r.pair_of_row[static_cast<size_t>(i)] / k;
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(at(buf, i * cols + c), round(x[static_cast<size_t>(tok * cols + c)]));
        }
      }
      std::vector<float> y(static_cast<size_t>(t * cols) + 1, kNaN);
      CombineRows(r, buf.data(), dt, cols, y.data());
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          double want = 0, mag = 0;
          for (int64_t j = 0; j < k; ++j) {
            const int64_t row = r.row_of_pair[static_cast<size_t>(i * k + j)];
            const double v = r.weight[static_cast<size_t>(i * k + j)] * at(buf, row * cols + c);
            want += v;
            mag += std::fabs(v);
          }
          ASSERT_NEAR(y[static_cast<size_t>(i * cols + c)], want, 4 * kU * mag);
        }
      }
      std::vector<uint8_t> dbuf(buf.size());
      std::vector<float> dw(static_cast<size_t>(rows), kNaN);
      CombineBackward(r, dy.data(), buf.data(), dt, cols, dbuf.data(), dw.data());
      for (int64_t p = 0; p < rows; ++p) {
        const int64_t tok = p / k, row = r.row_of_pair[static_cast<size_t>(p)];
        double d = 0, mag = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const double g = dy[static_cast<size_t>(tok * cols + c)];
          ASSERT_EQ(at(dbuf, row * cols + c), round(r.weight[static_cast<size_t>(p)] *
                                                    dy[static_cast<size_t>(tok * cols + c)]));
          d += g * at(buf, row * cols + c);
          mag += std::fabs(g * at(buf, row * cols + c));
        }
        ASSERT_NEAR(dw[static_cast<size_t>(p)], d, kU * mag + 1e-30) << "dweight " << p;
      }
      const std::vector<float> dsorted = rnd(rows * cols);
      std::vector<float> dx = rnd(t * cols), want = dx;
      ScatterAddRows(r, dsorted.data(), cols, dx.data());
      for (int64_t p = 0; p < rows; ++p) {
        const int64_t tok = p / k, row = r.row_of_pair[static_cast<size_t>(p)];
        for (int64_t c = 0; c < cols; ++c) {
          want[static_cast<size_t>(tok * cols + c)] += dsorted[static_cast<size_t>(row * cols + c)];
        }
      }
      for (int64_t i = 0; i < t * cols; ++i) {
        ASSERT_NEAR(dx[static_cast<size_t>(i)], want[static_cast<size_t>(i)],
                    4 * kU * (std::fabs(want[static_cast<size_t>(i)]) + 4));
      }
    }
  }
  // A corrupt index is clamped: it reads and writes inside the buffer.
  Routing bad = r;
  bad.pair_of_row[0] = 1 << 30;
  bad.row_of_pair[1] = -5;
  std::vector<float> x(static_cast<size_t>(t * 3), 1.0f), buf(static_cast<size_t>(rows * 3));
  GatherRows(bad, x.data(), 3, buf.data(), DType::kF32);
  std::vector<float> y(static_cast<size_t>(t * 3));
  CombineRows(bad, buf.data(), DType::kF32, 3, y.data());
  ScatterAddRows(bad, buf.data(), 3, y.data());
}

// The load-balancing loss and the router's backward against double loops
// (E * sum_e f_e mean_t p_te; the softmax Jacobians).
TEST(Route, LoadBalanceLossAndBackwardMatchPlainLoops) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const int64_t t = 23, e = 6, k = 2;
  std::vector<float> l(static_cast<size_t>(t * e)), dw(static_cast<size_t>(t * k));
  for (float& v : l) v = nd(rng);
  for (float& v : dw) v = nd(rng);
  for (bool norm : {false, true}) {
    const Routing r = Route(l.data(), t, e, k, norm);
    double loss = 0;
    for (int64_t x = 0; x < e; ++x) {
      double p = 0;
      for (int64_t i = 0; i < t; ++i) p += r.probs[static_cast<size_t>(i * e + x)];
      loss += r.group_sizes[static_cast<size_t>(x)] / double(t * k) * p / double(t);
    }
    std::vector<double> frac;
    LoadFractions(r, nullptr, &frac);  // this batch's own fractions
    EXPECT_NEAR(LoadBalanceLoss(r, frac, 0.01), 0.01 * e * loss, 1e-9);
    std::vector<float> dl(static_cast<size_t>(t * e));
    RouterBackward(r, frac, dw.data(), norm, 0.01, dl.data());
    for (int64_t i = 0; i < t; ++i) {
      const double* p = r.probs.data() + i * e;
      const float* w = r.weight.data() + i * k;
      std::vector<double> want(static_cast<size_t>(e), 0.0), f(static_cast<size_t>(e));
      double pf = 0;
      for (int64_t x = 0; x < e; ++x) {
        f[static_cast<size_t>(x)] = r.group_sizes[static_cast<size_t>(x)] / double(t * k);
        pf += p[x] * f[static_cast<size_t>(x)];
      }
      for (int64_t x = 0; x < e; ++x) {
        want[static_cast<size_t>(x)] = 0.01 * e / double(t) * p[x] * (f[static_cast<size_t>(x)] - pf);
      }
      // With norm_topk_prob the weights are already a softmax (sum 1), so the
      // renormalization's Jacobian only projects g: g - sum(g w).
      std::vector<double> g(dw.begin() + i * k, dw.begin() + (i + 1) * k);
      if (norm) {
        double gw = 0;
        for (int64_t j = 0; j < k; ++j) gw += g[static_cast<size_t>(j)] * w[j];
        for (double& v : g) v -= gw;
      }
      double gw = 0;
      for (int64_t j = 0; j < k; ++j) gw += g[static_cast<size_t>(j)] * w[j];
      for (int64_t j = 0; j < k; ++j) {
        want[static_cast<size_t>(r.expert[static_cast<size_t>(i * k + j)])] +=
            w[j] * (g[static_cast<size_t>(j)] - gw);
      }
      for (int64_t x = 0; x < e; ++x) {
        EXPECT_NEAR(dl[static_cast<size_t>(i * e + x)], want[static_cast<size_t>(x)], 1e-5)
            << "token " << i << " expert " << x;
      }
    }
  }
}

}  // namespace
}  // namespace fp8moe::internal
