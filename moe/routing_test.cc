// The router (moe/routing.cc and the ops of kernels/ops.h it runs) against
// plain double-precision loops written here from the semantics in
// include/fp8moe/moe.h: top-k with ties to the lower expert, the softmax
// over the selected logits and over all of them, the stable sort by expert,
// and the gathers and scatters (zero widths included), on the cpu and the
// reference backend. Then the promises of docs/numerics.md for logits over
// the whole f32 range: +-0, subnormals, +-1e-30, +-1e30, +-FLT_MAX, +-inf,
// NaN.
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
#include "base/test_util.h"
#include "fp8moe/numerics.h"
#include "kernels/ops.h"

namespace fp8moe::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const double kU = std::ldexp(1.0, -24);

Context& Ctx(BackendKind kind) { return test::ContextOf(kind); }
constexpr BackendKind kBackends[] = {BackendKind::kCpu, BackendKind::kReference};

// The routing of logits [t, e] on the backend.
Routing Routed(BackendKind kind, const float* l, int64_t t, int64_t e, int64_t k, bool norm) {
  Routing r;
  const Status s = Route(Ctx(kind), l, t, e, k, RouteScoring{.norm_topk_prob = norm}, &r);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

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
    for (const auto& [norm, kind] : {std::pair{false, BackendKind::kCpu},
                                     std::pair{true, BackendKind::kCpu},
                                     std::pair{false, BackendKind::kReference},
                                     std::pair{true, BackendKind::kReference}}) {
      SCOPED_TRACE("T " + std::to_string(t) + " E " + std::to_string(e) + " k " +
                   std::to_string(k) + (norm ? " norm" : "") + " on " +
                   std::string(BackendName(kind)));
      const std::vector<float> l = EdgeLogits(rng, t, e);
      const Routing r = Routed(kind, l.data(), t, e, k, norm);
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
  for (BackendKind kind : kBackends) {
    SCOPED_TRACE(BackendName(kind));
    const Routing r = Routed(kind, l.data(), t, e, k, /*norm_topk_prob=*/true);
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
}

// The maps of the pairs of experts [first, first + count) (all of them: the
// single-rank layer's; a window: an expert ring's local experts, the other
// pairs without a row).
struct Maps {
  std::vector<int64_t> row_of_pair, pair_of_row;
  int64_t rows = 0;
};
Maps SortedPairs(BackendKind kind, const Routing& r, int64_t first, int64_t count) {
  const size_t pairs = r.expert.size();
  Maps m;
  m.row_of_pair.assign(pairs, 7);  // overwritten, -1 included
  m.pair_of_row.assign(pairs + 1, -3);
  std::vector<int32_t> sizes(static_cast<size_t>(count) + 1);
  std::vector<int64_t> next(static_cast<size_t>(count) + 1);
  auto rows = SortByExpert(Ctx(kind), r.expert.data(), static_cast<int64_t>(pairs), first, count,
                           sizes.data(), m.row_of_pair.data(), m.pair_of_row.data(), next.data());
  EXPECT_TRUE(rows.ok()) << rows.status().ToString();
  m.rows = rows.ok() ? *rows : 0;
  int64_t want = 0;
  for (int64_t p = 0; p < static_cast<int64_t>(pairs); ++p) {
    const int32_t e = r.expert[static_cast<size_t>(p)];
    const bool ours = e >= first && e < first + count;
    want += ours;
    if (!ours) {
      EXPECT_EQ(m.row_of_pair[static_cast<size_t>(p)], -1) << "pair " << p;
    }
  }
  EXPECT_EQ(m.rows, want);
  return m;
}

// n + 1 normal draws (+ 1: never a null data()).
std::vector<float> Normals(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n) + 1);
  for (float& x : v) x = nd(rng);
  return v;
}

// ScatterAddRows of the maps m onto dx [r.tokens, cols], added to and
// overwritten, against plain loops.
void CheckScatterAdd(Context& ctx, const Routing& r, const Maps& m, int64_t cols,
                     std::mt19937& rng) {
  const int64_t t = r.tokens, k = r.k;
  const std::vector<float> dsorted = Normals(rng, m.rows * cols);
  for (bool accumulate : {true, false}) {
    std::vector<float> dx = Normals(rng, t * cols), want = dx;
    if (!accumulate) std::fill(want.begin(), want.end(), 0.0f);
    ASSERT_TRUE(ScatterAddRows(ctx, dsorted.data(), m.rows, cols, m.row_of_pair.data(), t, k,
                               accumulate, dx.data())
                    .ok());
    for (int64_t p = 0; p < t * k; ++p) {
      const int64_t tok = p / k, row = m.row_of_pair[static_cast<size_t>(p)];
      for (int64_t c = 0; row >= 0 && c < cols; ++c) {
        want[static_cast<size_t>(tok * cols + c)] += dsorted[static_cast<size_t>(row * cols + c)];
      }
    }
    for (int64_t i = 0; i < t * cols; ++i) {
      ASSERT_NEAR(dx[static_cast<size_t>(i)], want[static_cast<size_t>(i)],
                  4 * kU * (std::fabs(want[static_cast<size_t>(i)]) + 4));
    }
  }
}

// PermuteRows, CombineRows and CombineRowsBackward of the routing r over the
// maps m, cols wide, buffers of dtype dt, against plain loops. Outputs start
// NaN.
void CheckPermuteAndCombine(Context& ctx, const Routing& r, const Maps& m, int64_t cols,
                            DType dt, std::mt19937& rng) {
  const int64_t t = r.tokens, k = r.k, rows = m.rows;
  const size_t es = dt == DType::kF32 ? 4 : 2;
  auto rnd = [&](int64_t n) { return Normals(rng, n); };
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
  auto row_of = [&](int64_t p) { return m.row_of_pair[static_cast<size_t>(p)]; };
  const std::vector<float> x = rnd(t * cols), dy = rnd(t * cols);
  std::vector<uint8_t> buf(static_cast<size_t>(rows * cols) * es + 8, 0xFF);  // NaN
  ASSERT_TRUE(PermuteRows(ctx, x.data(), DType::kF32, t, cols, k, m.pair_of_row.data(), rows,
                          buf.data(), dt)
                  .ok());
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t tok = m.pair_of_row[static_cast<size_t>(i)] / k;
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(at(buf, i * cols + c), round(x[static_cast<size_t>(tok * cols + c)]));
    }
  }
  std::vector<float> y(static_cast<size_t>(t * cols) + 1, kNaN);
  ASSERT_TRUE(CombineRows(ctx, buf.data(), dt, rows, cols, m.row_of_pair.data(),
                          r.weight.data(), t, k, y.data())
                  .ok());
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t c = 0; c < cols; ++c) {
      double want = 0, mag = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (row_of(i * k + j) < 0) continue;
        const double v =
            r.weight[static_cast<size_t>(i * k + j)] * at(buf, row_of(i * k + j) * cols + c);
        want += v;
        mag += std::fabs(v);
      }
      ASSERT_NEAR(y[static_cast<size_t>(i * cols + c)], want, 4 * kU * mag);
    }
  }
  std::vector<uint8_t> dbuf(buf.size(), 0xFF);
  std::vector<float> dw(static_cast<size_t>(t * k), kNaN);
  ASSERT_TRUE(CombineRowsBackward(ctx, dy.data(), buf.data(), dt, rows, cols,
                                  m.row_of_pair.data(), r.weight.data(), t, k, dbuf.data(),
                                  dw.data())
                  .ok());
  for (int64_t p = 0; p < t * k; ++p) {
    const int64_t tok = p / k, row = row_of(p);
    double d = 0, mag = 0;
    for (int64_t c = 0; row >= 0 && c < cols; ++c) {
      const double g = dy[static_cast<size_t>(tok * cols + c)];
      ASSERT_EQ(at(dbuf, row * cols + c), round(r.weight[static_cast<size_t>(p)] *
                                                dy[static_cast<size_t>(tok * cols + c)]));
      d += g * at(buf, row * cols + c);
      mag += std::fabs(g * at(buf, row * cols + c));
    }
    ASSERT_NEAR(dw[static_cast<size_t>(p)], d, kU * mag + 1e-30) << "dweight " << p;
  }
}

// Gathers and scatters against plain loops, f32 and bf16 buffers, with
// widths 0, 1 and odd, over the maps of every pair and of a window of
// experts (pairs without a row: the combine skips them, their dweight is 0).
TEST(Route, GathersAndScattersMatchPlainLoops) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t t = 9, e = 4, k = 2;
  std::vector<float> logits(static_cast<size_t>(t * e));
  for (float& v : logits) v = nd(rng);
  for (BackendKind kind : kBackends) {
    Context& ctx = Ctx(kind);
    const Routing r = Routed(kind, logits.data(), t, e, k, false);
    for (const auto& [first, count] : {std::pair<int64_t, int64_t>{0, e}, {1, 2}}) {
      const Maps m = SortedPairs(kind, r, first, count);
      for (int64_t cols : {0, 1, 7, 33}) {
        for (DType dt : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE("cols " + std::to_string(cols) + " " + std::string(DTypeName(dt)) +
                       " experts [" + std::to_string(first) + ", " +
                       std::to_string(first + count) + ") on " + std::string(BackendName(kind)));
          CheckPermuteAndCombine(ctx, r, m, cols, dt, rng);
          CheckScatterAdd(ctx, r, m, cols, rng);
        }
      }
    }
  }
}

// A map entry outside its buffer is refused by name before anything is
// written.
TEST(Route, ACorruptMapEntryIsRefusedAndNothingIsWritten) {
  const int64_t t = 5, e = 3, k = 2, rows = t * k, cols = 3;
  std::vector<float> logits(static_cast<size_t>(t * e));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 7) % 5);
  for (BackendKind kind : kBackends) {
    SCOPED_TRACE(BackendName(kind));
    Context& ctx = Ctx(kind);
    Routing bad = Routed(kind, logits.data(), t, e, k, false);
    bad.pair_of_row[0] = 1 << 30;
    bad.row_of_pair[1] = -5;
    bad.row_of_pair[2] = rows;
    std::vector<float> x(static_cast<size_t>(t * cols), 1.0f);
    std::vector<float> buf(static_cast<size_t>(rows * cols), kNaN),
        y(static_cast<size_t>(t * cols), kNaN), dw(static_cast<size_t>(rows), kNaN);
    auto refused = [&](const Status& s, const std::string& what) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
      for (float v : buf) EXPECT_TRUE(std::isnan(v));
      for (float v : y) EXPECT_TRUE(std::isnan(v));
      for (float v : dw) EXPECT_TRUE(std::isnan(v));
    };
    refused(PermuteRows(ctx, x.data(), DType::kF32, t, cols, k, bad.pair_of_row.data(), rows,
                        buf.data(), DType::kF32),
            "permute_rows: pair_of_row[0] = 1073741824 is outside [0, 10)");
    refused(CombineRows(ctx, x.data(), DType::kF32, rows, cols, bad.row_of_pair.data(),
                        bad.weight.data(), t, k, y.data()),
            "combine_rows: row_of_pair[1] = -5 is outside [-1, 10)");
    bad.row_of_pair[1] = -1;  // no row: allowed
    refused(CombineRowsBackward(ctx, y.data(), x.data(), DType::kF32, rows, cols,
                                bad.row_of_pair.data(), bad.weight.data(), t, k, buf.data(),
                                dw.data()),
            "combine_rows_backward: row_of_pair[2] = 10 is outside [-1, 10)");
    refused(ScatterAddRows(ctx, x.data(), rows, cols, bad.row_of_pair.data(), t, k, true, y.data()),
            "scatter_add_rows: row_of_pair[2] = 10");
  }
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
  for (const auto& [norm, kind] : {std::pair{false, BackendKind::kCpu},
                                   std::pair{true, BackendKind::kCpu},
                                   std::pair{false, BackendKind::kReference},
                                   std::pair{true, BackendKind::kReference}}) {
    SCOPED_TRACE(std::string(norm ? "norm on " : "on ") + std::string(BackendName(kind)));
    const Routing r = Routed(kind, l.data(), t, e, k, norm);
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
    ASSERT_TRUE(RouterBackward(Ctx(kind), r.expert.data(), r.softmax.data(), r.probs.data(),
                               dw.data(), frac.data(), t, e, k,
                               RouteScoring{.norm_topk_prob = norm}, 0.01, dl.data())
                    .ok());
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
