// Every op of the backend registry (kernels/backend.h) on every backend, the
// test-backend-ops idea: the same fresh random inputs through the cpu
// backend (on every SIMD target where the op is vectorized) and through the
// reference backend, the cpu results held to the reference's within a
// bound argued at each op. Inputs have odd shapes, empty sizes and the edges
// of the f32 range (+-0, subnormals, +-1e30, +-inf, NaN); outputs start
// NaN-poisoned, so an element an implementation does not write fails. A
// NaN matches a NaN; an infinity matches the same infinity.
//
// The reference backend's ops are plain loops written from the formulas of
// kernels/ops.h (kernels/reference/ops_reference.cc): they are the oracle.
// The GMMs, whose reference is not a plain loop of the formula (it decodes,
// quantizes, runs the epilogues), are held to a float64 oracle written for
// the tests in kernels/gmm_test.cc (kGmmTests below names those tests).
//
// Also here: a backend that supports some ops only (a device backend in the
// making) makes the entry points refuse the others by name, and nothing
// falls back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace fp8moe {
namespace {

using internal::Op;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The edges of the f32 range the inputs are salted with.
const std::vector<float>& Edges() {
  static const std::vector<float> edges = {0.0f,
                                           -0.0f,
                                           std::numeric_limits<float>::denorm_min(),
                                           -1e-40f /* subnormal */,
                                           1e30f,
                                           -1e30f,
                                           kInf,
                                           -kInf,
                                           kNaN};
  return edges;
}

// n normal draws (sd `sd`); with `edges`, about one element in eight is
// replaced by an edge value (each edge at least once where n allows).
std::vector<float> Values(std::mt19937& rng, int64_t n, bool edges, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(rng);
  if (edges && n > 0) {
    const std::vector<float>& e = Edges();
    for (size_t i = 0; i < e.size() && i < v.size(); ++i) v[rng() % v.size()] = e[i];
    for (size_t i = 0; i < v.size() / 8; ++i) v[rng() % v.size()] = e[rng() % e.size()];
  }
  return v;
}

std::vector<int32_t> Tokens(std::mt19937& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

std::vector<float> Poisoned(int64_t n) { return std::vector<float>(static_cast<size_t>(n), kNaN); }

// got within abs[i] + rel * |want| of want, elementwise; a NaN matches a
// NaN and an infinity the same infinity; a NaN or infinite abs[i] accepts
// any value there. abs[i] = rel = 0: the same value (and the same sign of
// zero).
void ExpectCloseWithin(const std::vector<float>& got, const std::vector<float>& want,
                       const std::vector<double>& abs, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(abs.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    const float g = got[i], w = want[i];
    bool ok;
    if (!std::isfinite(abs[i])) {
      ok = true;
    } else if (std::isnan(w) || std::isnan(g) || std::isinf(w) || std::isinf(g)) {
      ok = (std::isnan(w) && std::isnan(g)) || g == w;
    } else if (abs[i] == 0 && rel == 0) {
      ok = g == w && std::signbit(g) == std::signbit(w);
    } else {
      ok = std::fabs(static_cast<double>(g) - w) <= abs[i] + rel * std::fabs(static_cast<double>(w));
    }
    if (!ok) {
      ++reported;
      ADD_FAILURE() << what << "[" << i << "]: cpu " << g << ", reference " << w
                    << " (bound " << abs[i] << " + " << rel << " |reference|)";
    }
  }
}

// As ExpectCloseWithin with the same absolute bound for every element.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double abs,
                 double rel, const std::string& what) {
  ExpectCloseWithin(got, want, std::vector<double>(want.size(), abs), rel, what);
}

Context& Ctx(BackendKind kind) { return test::ContextOf(kind); }

// Runs `run(ctx, outputs)` on the reference backend, then on the cpu backend
// (on every SIMD target when `per_target`), each on fresh copies of
// `outputs` (the poisoned or starting values), and compares each output
// with the bound {abs, rel}.
using Outputs = std::vector<std::vector<float>>;
void CompareBackends(const Outputs& start, bool per_target, double abs, double rel,
                     const std::string& what,
                     const std::function<Status(Context&, Outputs&)>& run) {
  Outputs want = start;
  ASSERT_TRUE(run(Ctx(BackendKind::kReference), want).ok()) << what;
  auto check = [&] {
    Outputs got = start;
    ASSERT_TRUE(run(Ctx(BackendKind::kCpu), got).ok()) << what;
    for (size_t o = 0; o < got.size(); ++o) {
      ExpectClose(got[o], want[o], abs, rel, what + " output " + std::to_string(o));
    }
  };
  if (per_target) {
    test::ForEachTarget(check);
  } else {
    check();
  }
}

std::string Dims(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

// ---- The ops -----------------------------------------------------------------

// Copies and a scatter-add in token order: the same adds in the same order
// on both backends, so the same bits.
void CheckEmbedding(std::mt19937& rng, bool edges) {
  for (auto [n, vocab, d] : {std::tuple<int64_t, int64_t, int64_t>{13, 11, 17},
                             {0, 5, 3},
                             {7, 5, 0},
                             {1, 1, 1},
                             {40, 3, 9}}) {
    const std::string what = "embedding " + Dims({n, vocab, d});
    const std::vector<float> table = Values(rng, vocab * d, edges);
    const std::vector<float> dout = Values(rng, n * d, edges);
    const std::vector<int32_t> tok = Tokens(rng, n, vocab);
    CompareBackends(
        {Poisoned(n * d)}, false, 0, 0, what + " gather", [&](Context& ctx, Outputs& o) {
          return internal::EmbeddingGather(ctx, table.data(), tok.data(), n, vocab, d, o[0].data());
        });
    CompareBackends({Poisoned(vocab * d)}, false, 0, 0, what + " scatter_add",
                    [&](Context& ctx, Outputs& o) {
                      return internal::EmbeddingScatterAdd(ctx, dout.data(), tok.data(), n, vocab,
                                                           d, o[0].data());
                    });
  }
}

// Elementwise f32 adds: the same bits; in place as the model calls it.
void CheckAdd(std::mt19937& rng, bool edges) {
  for (int64_t n : {0, 1, 37, 1000}) {
    const std::vector<float> a = Values(rng, n, edges), b = Values(rng, n, edges);
    CompareBackends({Poisoned(n)}, false, 0, 0, "add " + std::to_string(n),
                    [&](Context& ctx, Outputs& o) {
                      return internal::Add(ctx, a.data(), b.data(), n, o[0].data());
                    });
    CompareBackends({a}, false, 0, 0, "add in place " + std::to_string(n),
                    [&](Context& ctx, Outputs& o) {
                      return internal::Add(ctx, o[0].data(), b.data(), n, o[0].data());
                    });
  }
}

// RMSNorm: both backends sum squares in double in index order and round
// the same f32 expressions, one row or column per thread on the cpu: the
// same bits. dx is added to, so it starts from values, not poison.
void CheckRmsNorm(std::mt19937& rng, bool edges) {
  for (auto [rows, d] : {std::pair<int64_t, int64_t>{5, 12}, {0, 7}, {3, 1}, {17, 33}, {2, 0}}) {
    const std::string what = "rms_norm " + Dims({rows, d});
    const std::vector<float> x = Values(rng, rows * d, edges), g = Values(rng, d, edges),
                             dy = Values(rng, rows * d, edges), dx0 = Values(rng, rows * d, false);
    const float eps = 1e-6f;
    CompareBackends({Poisoned(rows * d), Poisoned(rows)}, false, 0, 0, what + " forward",
                    [&](Context& ctx, Outputs& o) {
                      return internal::RmsNormForward(ctx, x.data(), g.data(), rows, d, eps,
                                                      o[0].data(), o[1].data());
                    });
    std::vector<float> y(static_cast<size_t>(rows * d)), inv(static_cast<size_t>(rows));
    ASSERT_TRUE(internal::RmsNormForward(Ctx(BackendKind::kReference), x.data(), g.data(), rows, d,
                                         eps, y.data(), inv.data())
                    .ok());
    CompareBackends(
        {dx0, Poisoned(d)}, false, 0, 0, what + " backward", [&](Context& ctx, Outputs& o) {
          return internal::RmsNormBackward(ctx, x.data(), g.data(), inv.data(), dy.data(), rows, d,
                                           o[0].data(), o[1].data());
        });
  }
}

// RoPE: per element the same two f32 products and a sum: the same bits,
// forward and inverse; grouped-query (kv heads 2 of 4) and multi-query
// (1 of 3) rows, whose v heads stay as they are; and MLA's partial rotation
// (only the last rope_dim columns of each head, halves or interleaved pairs).
void CheckRope(std::mt19937& rng, bool edges) {
  for (auto [batch, seq, heads, kv, hd, rope_dim, vd] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>{2, 7, 3, 3, 4,
                                                                                   4, 4},
        {1, 19, 2, 2, 10, 10, 10},
        {0, 3, 1, 1, 2, 2, 2},
        {1, 1, 1, 1, 2, 2, 2},
        {2, 3, 1, 1, 0, 0, 0},
        {2, 5, 4, 2, 6, 6, 6},
        {1, 7, 3, 1, 10, 10, 10},
        {2, 5, 3, 3, 10, 4, 10},
        {1, 9, 2, 2, 8, 2, 8},
        {1, 4, 2, 1, 6, 0, 6},
        // MLA's rows: value heads of their own width, untouched.
        {2, 5, 3, 3, 10, 4, 7},
        {1, 6, 2, 2, 6, 2, 13},
        // An odd head (MLA's qk_nope_head_dim odd) whose even rope span
        // rotates.
        {2, 5, 3, 3, 7, 4, 5},
        {1, 4, 1, 1, 5, 2, 5}}) {
    const std::string what = "rope " + Dims({batch, seq, heads, kv, hd, rope_dim, vd});
    const std::vector<float> qkv =
        Values(rng, batch * seq * ((heads + kv) * hd + kv * vd), edges);
    const std::vector<float> cos = Values(rng, seq * rope_dim / 2, false),
                             sin = Values(rng, seq * rope_dim / 2, false);
    for (bool interleaved : {false, true}) {
      for (bool inverse : {false, true}) {
        CompareBackends({qkv}, false, 0, 0,
                        what + (inverse ? " inverse" : "") + (interleaved ? " interleaved" : ""),
                        [&](Context& ctx, Outputs& o) {
                          return internal::RopeApply(ctx, o[0].data(), batch, seq, heads, kv, hd,
                                                     cos.data(), sin.data(), inverse, rope_dim,
                                                     interleaved, vd);
                        });
      }
    }
  }
}

// CopyColumns: copies and f32 sums in block order on both backends: the
// same bits. MLA's uses: a contiguous split, blocks per head with gaps, a
// broadcast (src step 0), a sum over blocks (dst step 0), empty sizes.
void CheckCopyColumns(std::mt19937& rng, bool edges) {
  struct Case {
    int64_t rows, src_cols, src_offset, src_step, blocks, width, dst_cols, dst_offset, dst_step;
    bool accumulate;
  };
  for (const Case& k : {Case{5, 9, 0, 0, 1, 6, 6, 0, 0, false},
                        Case{7, 9, 6, 0, 4, 3, 20, 2, 5, false},
                        Case{3, 20, 1, 5, 4, 3, 3, 0, 0, true},
                        Case{4, 13, 2, 5, 2, 3, 11, 1, 4, true},
                        Case{0, 4, 0, 1, 2, 1, 4, 0, 2, false},
                        Case{3, 4, 0, 1, 0, 1, 4, 0, 2, false},
                        Case{3, 4, 0, 1, 2, 0, 4, 0, 0, false}}) {
    const std::string what = "copy_columns " + Dims({k.rows, k.src_cols, k.src_offset, k.src_step,
                                                     k.blocks, k.width, k.dst_cols, k.dst_offset,
                                                     k.dst_step}) +
                             (k.accumulate ? " accumulate" : "");
    const std::vector<float> src = Values(rng, k.rows * k.src_cols, edges);
    // The dst columns no block names stay as they were: start NaN-poisoned
    // only where a copy writes every column; an accumulate adds to values.
    const std::vector<float> dst =
        k.accumulate ? Values(rng, k.rows * k.dst_cols, edges) : Poisoned(k.rows * k.dst_cols);
    CompareBackends({dst}, false, 0, 0, what, [&](Context& ctx, Outputs& o) {
      return internal::CopyColumns(ctx, src.data(), k.rows, k.src_cols, k.src_offset, k.src_step,
                                   k.blocks, k.width, o[0].data(), k.dst_cols, k.dst_offset,
                                   k.dst_step, k.accumulate);
    });
    // A written element is a source element (or the sum of the ones the
    // blocks name), checked here without either backend.
    if (k.accumulate || k.rows == 0) continue;
    std::vector<float> out = dst;
    ASSERT_TRUE(internal::CopyColumns(Ctx(BackendKind::kCpu), src.data(), k.rows, k.src_cols,
                                      k.src_offset, k.src_step, k.blocks, k.width, out.data(),
                                      k.dst_cols, k.dst_offset, k.dst_step, false)
                    .ok());
    for (int64_t r = 0; r < k.rows; ++r) {
      for (int64_t b = 0; b < k.blocks; ++b) {
        for (int64_t j = 0; j < k.width; ++j) {
          const float want = src[r * k.src_cols + k.src_offset + b * k.src_step + j];
          const float got = out[r * k.dst_cols + k.dst_offset + b * k.dst_step + j];
          EXPECT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << what;
        }
      }
    }
  }
}

// Attention: the cpu computes in f32 (dot products of hd terms, sums of at
// most S terms, Highway's exp within 2 ulp), the reference in double,
// rounded once. With sd-1 inputs and hd, S <= 37 each f32 sum carries at
// most ~37 u = 2.2e-6 of the magnitude of its terms (u = 2^-24), the
// softmax turns a score's absolute error into the same relative error of its
// probability, and the backward chains three such sums: within 2e-5 of the
// magnitudes (about 1 here; the largest gradient entries reach ~10), so
// abs 2e-5 and rel 2e-5. Edges go into one operand only (q, k or v): a
// product of two values beyond 1e19 overflows f32 on the cpu but not the
// reference's double, where the two backends are not meant to agree. q at
// 1e30 saturates its softmax: probabilities exactly 0 and 1 on both.
// The size of the terms behind each element of attention's backward (qkv
// [rows, 3*heads*hd], probs [batch, heads, seq, seq], dout [rows, heads*hd]
// -> [rows, 3*heads*hd]): the reference's sums (ops_reference.cc) over
// absolute values, with dS_ij's difference dP_ij - sum_j' P_ij' dP_ij' taken
// as |dP_ij| + sum_j' P_ij' |dP_ij'|. A sum of n f32 terms is within about
// n u of this size, however much it cancels; with the f32 edges in v (1e30)
// dQ and dK cancel to 1e-6 of their terms, far below any relative bound.
std::vector<double> AttentionBackwardTermSizes(const std::vector<float>& qkv,
                                               const std::vector<float>& probs,
                                               const std::vector<float>& dout, int64_t batch,
                                               int64_t seq, int64_t heads, int64_t kv_heads,
                                               int64_t hd, int64_t vd) {
  const int64_t S = seq, width = (heads + kv_heads) * hd + kv_heads * vd;
  const double scale = hd > 0 ? 1.0 / std::sqrt(static_cast<double>(hd)) : 0.0;
  std::vector<double> size(static_cast<size_t>(batch * S * width), 0.0);
  // Column of query head h's q (part 0), or of the k (1) or v (2) it reads.
  auto col = [&](int64_t part, int64_t h) {
    const int64_t g = h / (heads / kv_heads);
    return part == 0 ? h * hd : part == 1 ? (heads + g) * hd : (heads + kv_heads) * hd + g * vd;
  };
  auto x = [&](int64_t row, int64_t part, int64_t h, int64_t t) {
    return std::fabs(static_cast<double>(qkv[static_cast<size_t>(row * width + col(part, h) + t)]));
  };
  auto dO = [&](int64_t row, int64_t h, int64_t t) {
    return std::fabs(static_cast<double>(dout[static_cast<size_t>(row * heads * vd + h * vd + t)]));
  };
  std::vector<double> ds(static_cast<size_t>(S * S));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* P = probs.data() + (b * heads + h) * S * S;
      for (int64_t i = 0; i < S; ++i) {
        double pdp = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dp = 0;
          for (int64_t t = 0; t < vd; ++t) dp += dO(b * S + i, h, t) * x(b * S + j, 2, h, t);
          ds[static_cast<size_t>(i * S + j)] = dp;
          pdp += std::fabs(P[i * S + j]) * dp;
        }
        for (int64_t j = 0; j <= i; ++j) {
          double& d = ds[static_cast<size_t>(i * S + j)];
          d = std::fabs(P[i * S + j]) * (d + pdp) * scale;
        }
      }
      for (int64_t n = 0; n < S; ++n) {
        double* row = size.data() + (b * S + n) * width;
        for (int64_t t = 0; t < hd; ++t) {
          double q = 0, k = 0;
          for (int64_t j = 0; j <= n; ++j) q += ds[static_cast<size_t>(n * S + j)] * x(b * S + j, 1, h, t);
          for (int64_t i = n; i < S; ++i) {
            k += ds[static_cast<size_t>(i * S + n)] * x(b * S + i, 0, h, t);
          }
          row[col(0, h) + t] = q;
          row[col(1, h) + t] += k;  // a kv head's: the sum over its query heads
        }
        for (int64_t t = 0; t < vd; ++t) {
          double v = 0;
          for (int64_t i = n; i < S; ++i) v += std::fabs(P[i * S + n]) * dO(b * S + i, h, t);
          row[col(2, h) + t] += v;
        }
      }
    }
  }
  return size;
}

// The size of the terms of each attention output (qkv [rows, 3*heads*hd],
// probs [batch, heads, seq, seq] -> [rows, heads*hd]): sum_j P_ij |v_j|.
std::vector<double> AttentionOutputTermSizes(const std::vector<float>& qkv,
                                             const std::vector<float>& probs, int64_t batch,
                                             int64_t seq, int64_t heads, int64_t kv_heads,
                                             int64_t hd, int64_t vd) {
  const int64_t width = (heads + kv_heads) * hd + kv_heads * vd;
  std::vector<double> size(static_cast<size_t>(batch * seq * heads * vd), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* P = probs.data() + (b * heads + h) * seq * seq;
      for (int64_t i = 0; i < seq; ++i) {
        for (int64_t t = 0; t < vd; ++t) {
          double sum = 0;
          for (int64_t j = 0; j <= i; ++j) {
            const int64_t kv = h / (heads / kv_heads);
            const float v = qkv[static_cast<size_t>((b * seq + j) * width +
                                                    (heads + kv_heads) * hd + kv * vd + t)];
            sum += std::fabs(static_cast<double>(P[i * seq + j])) * std::fabs(v);
          }
          size[static_cast<size_t>((b * seq + i) * heads * vd + h * vd + t)] = sum;
        }
      }
    }
  }
  return size;
}

// Grouped-query shapes (kv heads 2 of 4, 2 of 6 with an odd seq and a
// head width with a scalar tail) and multi-query ones (1 of 3, 1 of 1 at
// a single position) beside multi-head ones (kv = heads).
void CheckAttention(std::mt19937& rng, bool edges) {
  for (auto [batch, seq, heads, kv, hd, vd] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>{2, 7, 3, 3, 4, 4},
        {1, 37, 2, 2, 12, 12},
        {1, 1, 1, 1, 8, 8},
        {0, 5, 2, 2, 4, 4},
        {1, 9, 1, 1, 0, 0},
        {2, 7, 4, 2, 4, 4},
        {1, 13, 6, 2, 20, 20},
        {1, 11, 3, 1, 8, 8},
        {0, 3, 4, 1, 4, 4},
        // MLA's value heads of their own width (v_head_dim), narrower or
        // wider than hd, with scalar tails, and none.
        {2, 9, 3, 3, 12, 5},
        {1, 13, 4, 2, 6, 19},
        {1, 7, 2, 2, 8, 0}}) {
    const int64_t rows = batch * seq, width = (heads + kv) * hd + kv * vd;
    for (int part = 0; part < (edges ? 3 : 1); ++part) {
      const std::string what = "attention " + Dims({batch, seq, heads, kv, hd, vd}) +
                               (edges ? " edges in " + std::string(1, "qkv"[part]) : "");
      std::vector<float> qkv = Values(rng, rows * width, false);
      // The edges into part `part` (q, k or v heads) of every row.
      const int64_t first = part == 0 ? 0 : (heads + (part - 1) * kv) * hd;
      const int64_t count = part == 0 ? heads * hd : part == 1 ? kv * hd : kv * vd;
      if (edges && count > 0) {
        const std::vector<float> e = Values(rng, rows * count, true);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(qkv.data() + r * width + first, e.data() + r * count,
                      static_cast<size_t>(count) * sizeof(float));
        }
      }
      const std::vector<float> dout = Values(rng, rows * heads * vd, false);
      const int64_t nprobs = batch * heads * seq * seq;
      std::vector<float> probs = Poisoned(nprobs), out = Poisoned(rows * heads * vd);
      ASSERT_TRUE(internal::AttentionForward(Ctx(BackendKind::kReference), qkv.data(), batch, seq,
                                             heads, kv, hd, probs.data(), out.data(), vd)
                      .ok());
      // The probabilities within 2e-5; each output within that of the size
      // of its terms sum_j P_ij |v_j| (the cpu's own P carries 2e-5), plus
      // (seq + 4) u of it for the f32 sum, which cancels where v holds 1e30.
      std::vector<double> out_abs =
          AttentionOutputTermSizes(qkv, probs, batch, seq, heads, kv, hd, vd);
      for (double& a : out_abs) {
        a = std::isfinite(a) ? 2e-5 + (2e-5 + static_cast<double>(seq + 4) * 0x1p-24) * a : a;
      }
      test::ForEachTarget([&] {
        std::vector<float> got_probs = Poisoned(nprobs), got_out = Poisoned(rows * heads * vd);
        ASSERT_TRUE(internal::AttentionForward(Ctx(BackendKind::kCpu), qkv.data(), batch, seq,
                                               heads, kv, hd, got_probs.data(), got_out.data(),
                                               vd)
                        .ok());
        ExpectClose(got_probs, probs, 2e-5, 2e-5, what + " forward probabilities");
        ExpectCloseWithin(got_out, out, out_abs, 2e-5, what + " forward output");
      });
      // Within 2e-5 relative, or (seq + max(hd, vd) + 4) u of the size of its terms
      // (a NaN or infinite size, from an infinite input, accepts any value:
      // the forward's check has held those rows).
      std::vector<double> abs =
          AttentionBackwardTermSizes(qkv, probs, dout, batch, seq, heads, kv, hd, vd);
      // dK and dV sum heads / kv heads' sums: that many more terms.
      const double terms_u =
          static_cast<double>(seq * (kv > 0 ? heads / kv : 1) + std::max(hd, vd) + 4) * 0x1p-24;
      for (double& a : abs) a = std::isfinite(a) ? 2e-5 + terms_u * a : a;
      std::vector<float> want = Poisoned(rows * width);
      ASSERT_TRUE(internal::AttentionBackward(Ctx(BackendKind::kReference), qkv.data(),
                                              probs.data(), dout.data(), batch, seq, heads, kv, hd,
                                              want.data(), vd)
                      .ok());
      test::ForEachTarget([&] {
        std::vector<float> got = Poisoned(rows * width);
        ASSERT_TRUE(internal::AttentionBackward(Ctx(BackendKind::kCpu), qkv.data(), probs.data(),
                                                dout.data(), batch, seq, heads, kv, hd, got.data(),
                                                vd)
                        .ok());
        ExpectCloseWithin(got, want, abs, 2e-5, what + " backward");
      });
    }
  }
}

// A softmax that saturates: one key's score 1e3 above the rest gives
// probability 1 and exactly 0 (exp underflows) on both backends.
void CheckAttentionSaturates() {
  const int64_t seq = 4, heads = 1, hd = 2, width = 3 * heads * hd;
  std::vector<float> qkv(static_cast<size_t>(seq * width), 0.0f);
  for (int64_t r = 0; r < seq; ++r) qkv[static_cast<size_t>(r * width)] = 1e3f;  // q
  qkv[static_cast<size_t>(1 * width + heads * hd)] = 5.0f;                       // k of key 1
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    std::vector<float> probs = Poisoned(seq * seq), out = Poisoned(seq * heads * hd);
    ASSERT_TRUE(internal::AttentionForward(Ctx(kind), qkv.data(), 1, seq, heads, heads, hd,
                                           probs.data(), out.data())
                    .ok());
    for (int64_t i = 1; i < seq; ++i) {
      for (int64_t j = 0; j < seq; ++j) {
        EXPECT_EQ(probs[static_cast<size_t>(i * seq + j)], j == 1 ? 1.0f : 0.0f)
            << BackendName(kind) << " row " << i << " key " << j;
      }
    }
  }
}

// The loss: the cpu sums exp in f32 per row (Highway's exp, V terms), the
// reference in double. The loss is a double mean of per-row values whose
// f32 error is at most ~V u |log-sum-exp| (V <= 300: 2e-5 relative); the
// bound 1e-5 + 1e-5 |loss| (the float64 twin's tests hold the cpu to 1e-6,
// model/layers_test.cc). dlogits = (p - onehot) / rows: p's error is the
// sum's relative error, within 2e-5 / rows of its scale 1 / rows.
void CheckCrossEntropy(std::mt19937& rng, bool edges) {
  for (auto [rows, v] : {std::pair<int64_t, int64_t>{9, 37}, {4, 256}, {1, 1}, {0, 5}, {3, 300}}) {
    const std::string what = "cross_entropy " + Dims({rows, v});
    const std::vector<float> logits = Values(rng, rows * v, edges, 4.0f);
    const std::vector<int32_t> tgt = Tokens(rng, rows, v);
    double want = 0;
    CompareBackends({Poisoned(rows * v)}, true, 2e-5 / std::max<int64_t>(rows, 1), 0, what,
                    [&](Context& ctx, Outputs& o) -> Status {
                      auto loss = internal::CrossEntropy(ctx, logits.data(), tgt.data(), rows, v,
                                                         o[0].data());
                      if (!loss.ok()) return loss.status();
                      if (ctx.backend() == BackendKind::kReference) {
                        want = *loss;
                      } else if (std::isfinite(want)) {
                        EXPECT_NEAR(*loss, want, 1e-5 + 1e-5 * std::fabs(want)) << what;
                      } else {
                        EXPECT_TRUE((std::isnan(want) && std::isnan(*loss)) || *loss == want)
                            << what << ": cpu " << *loss << ", reference " << want;
                      }
                      return OkStatus();
                    });
  }
  // Saturated: one logit 1e30 above the rest, as the target (loss 0,
  // gradient 0) and not (loss ~1e30, gradient -1/rows at the target and
  // 1/rows at the saturated logit).
  const std::vector<float> sat = {0.0f, 1e30f, -3.0f, 1e30f, 0.0f, 1.0f};
  const std::vector<int32_t> tgt = {1, 2};
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    std::vector<float> dl = Poisoned(6);
    auto loss = internal::CrossEntropy(Ctx(kind), sat.data(), tgt.data(), 2, 3, dl.data());
    ASSERT_TRUE(loss.ok());
    EXPECT_NEAR(*loss, 0.5e30, 1e24) << BackendName(kind);
    const std::vector<float> want = {0.0f, 0.0f, 0.0f, 0.5f, 0.0f, -0.5f};
    ExpectClose(dl, want, 1e-7, 0,
                std::string("saturated loss on ") + std::string(BackendName(kind)));
  }
}

// AdamW: the same f32 expressions per element on both: the same bits.
void CheckAdamW(std::mt19937& rng, bool edges) {
  for (int64_t n : {0, 1, 37, 1000}) {
    const std::vector<float> g = Values(rng, n, edges), p = Values(rng, n, false),
                             m = Values(rng, n, false, 0.1f);
    std::vector<float> v = Values(rng, n, false, 0.1f);
    for (float& x : v) x = x * x;  // a second moment is not negative
    internal::AdamWConstants k{0.9f, 0.999f, 1.5f, 1.25f, 1e-8f, 1e-2f, 0.75f, 0.1f};
    CompareBackends(
        {p, m, v}, false, 0, 0, "adamw " + std::to_string(n), [&](Context& ctx, Outputs& o) {
          return internal::AdamW(ctx, k, g.data(), o[0].data(), o[1].data(), o[2].data(), n);
        });
  }
}

// ---- The MoE layer: routing and row permutation ----------------------------------

// got and want bit for bit (a NaN matches a NaN): the routing ops' contracts
// fix their arithmetic (kernels/ops.h), so the backends agree exactly.
template <class T>
void ExpectSameBits(const std::vector<T>& got, const std::vector<T>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    const bool nan = std::isnan(static_cast<double>(got[i])) &&
                     std::isnan(static_cast<double>(want[i]));
    if (!nan && std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ++reported;
      ADD_FAILURE() << what << "[" << i << "]: cpu " << +got[i] << ", reference " << +want[i];
    }
  }
}

// Row buffers of F32 or BF16, as bytes (0xFF: NaN poison in both) and as f32
// values to compare.
std::vector<uint8_t> RowBytes(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> b(v.size() * DTypeSize(dtype) + 1);  // + 1: never a null data()
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(b.data() + i * 4, &v[i], 4);
    } else {
      const uint16_t h = F32ToBf16(v[i]);
      std::memcpy(b.data() + i * 2, &h, 2);
    }
  }
  return b;
}
std::vector<float> RowValues(const std::vector<uint8_t>& b, DType dtype) {
  std::vector<float> v((b.size() - 1) / DTypeSize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&v[i], b.data() + i * 4, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + i * 2, 2);
      v[i] = Bf16ToF32(h);
    }
  }
  return v;
}
std::vector<uint8_t> PoisonedRows(int64_t n, DType dtype) {
  return std::vector<uint8_t>(static_cast<size_t>(n) * DTypeSize(dtype) + 1, 0xFF);
}

// Logits [t, e] of every kind the router meets: random (sd 2), the f32
// edges, ties, rows scaled x200 (a saturating softmax), rows of +-1e30 and
// -inf; NaN only with `edges`.
std::vector<float> RouterLogits(std::mt19937& rng, int64_t t, int64_t e, bool edges) {
  std::vector<float> l = Values(rng, t * e, edges, 2.0f);
  for (int64_t i = 0; i < t && e > 0; ++i) {
    float* row = l.data() + i * e;
    switch (i % 5) {
      case 1: row[rng() % e] = row[rng() % e]; break;                // a tie
      case 2: for (int64_t x = 0; x < e; ++x) row[x] *= 200; break;  // saturates
      case 3: row[rng() % e] = (rng() % 2 ? 1e30f : -1e30f); break;
      case 4: row[rng() % e] = -kInf; break;
      default: break;
    }
  }
  return l;
}

// The route and the sort by expert of one shape, both backends, bit for bit.
struct Routed {
  std::vector<int32_t> expert;
  std::vector<float> weight;
  std::vector<double> softmax, probs;
};
Routed RouteOn(BackendKind kind, const std::vector<float>& l, int64_t t, int64_t e, int64_t k,
               const internal::RouteScoring& scoring) {
  Routed r{std::vector<int32_t>(static_cast<size_t>(t * k), -7), Poisoned(t * k),
           std::vector<double>(static_cast<size_t>(t * k), kNaN),
           std::vector<double>(static_cast<size_t>(t * e), kNaN)};
  const Status s = internal::RouteTopK(Ctx(kind), l.data(), t, e, k, scoring, r.expert.data(),
                                       r.weight.data(), r.softmax.data(), r.probs.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

// Every scoring of the router the shape allows (kernels/ops.h
// RouteScoring), named: softmax and sigmoid, each with and without
// norm_topk_prob and with a scaling; sigmoid with a choice bias (random,
// with the f32 edges if `edges`, or all 0: the ties of saturated scores)
// and with routing groups when E splits into groups of 2 or more. The
// biases live in *biases.
std::vector<std::pair<std::string, internal::RouteScoring>> Scorings(
    std::mt19937& rng, bool edges, int64_t e, int64_t k, std::vector<std::vector<float>>* biases) {
  using internal::RouteScoring;
  biases->clear();
  biases->push_back(Values(rng, e, edges, 0.5f));
  biases->push_back(std::vector<float>(static_cast<size_t>(e), 0.0f));
  const float* random_bias = (*biases)[0].data();
  const float* zero_bias = (*biases)[1].data();
  std::vector<std::pair<std::string, RouteScoring>> out = {
      {"", {}},
      {" norm", {.norm_topk_prob = true}},
      {" scaled", {.norm_topk_prob = true, .scaling = 2.5}},
      {" sigmoid", {.sigmoid = true}},
      {" sigmoid norm scaled", {.sigmoid = true, .norm_topk_prob = true, .scaling = 2.5}},
      {" sigmoid bias", {.sigmoid = true, .norm_topk_prob = true, .bias = random_bias}},
      {" sigmoid zero bias", {.sigmoid = true, .bias = zero_bias}}};
  for (int64_t g = 2; g <= e / 2; ++g) {
    if (e % g != 0) continue;
    const int64_t keep = (k + e / g - 1) / (e / g);  // the fewest that hold k
    out.push_back({" groups " + std::to_string(g) + " keep " + std::to_string(keep),
                   {.sigmoid = true, .norm_topk_prob = true, .scaling = 2.5, .groups = g,
                    .topk_groups = keep, .bias = random_bias}});
    if (keep < g) {
      out.push_back({" groups " + std::to_string(g) + " keep all but one",
                     {.sigmoid = true, .groups = g, .topk_groups = g - 1, .bias = zero_bias}});
    }
    break;  // one group count per shape
  }
  return out;
}

// Route: top-k and softmaxes of k = 1, k = E, empty token sets and
// saturating rows, in every scoring; the experts, the f32 weights and both
// double arrays the same bits on both backends (NaN logits included: what
// Route did before the seam, kernels/ops.h RouteTopK).
void CheckRoute(std::mt19937& rng, bool edges) {
  for (auto [t, e, k] : {std::tuple<int64_t, int64_t, int64_t>{13, 8, 2},
                         {0, 4, 2},
                         {11, 5, 5},
                         {9, 6, 1},
                         {1, 1, 1},
                         {40, 64, 8}}) {
    const std::vector<float> l = RouterLogits(rng, t, e, edges);
    std::vector<std::vector<float>> biases;
    for (const auto& [name, scoring] : Scorings(rng, edges, e, k, &biases)) {
      const std::string what = "route " + Dims({t, e, k}) + name;
      const Routed want = RouteOn(BackendKind::kReference, l, t, e, k, scoring);
      const Routed got = RouteOn(BackendKind::kCpu, l, t, e, k, scoring);
      EXPECT_EQ(got.expert, want.expert) << what;
      ExpectSameBits(got.weight, want.weight, what + " weight");
      ExpectSameBits(got.softmax, want.softmax, what + " softmax");
      ExpectSameBits(got.probs, want.probs, what + " probs");
    }
  }
}

// The sort, of every expert (one rank) and of a window (a ring's local
// experts; the others' pairs get -1), with expert ids outside the window
// on either side.
void CheckSortByExpert(std::mt19937& rng, bool edges) {
  (void)edges;  // integer data: no f32 edges
  for (auto [pairs, experts, first, count] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{26, 8, 0, 8},
        {0, 4, 0, 4},
        {37, 8, 2, 3},
        {19, 6, 5, 1},
        {12, 4, 1, 0}}) {
    const std::string what = "sort_by_expert " + Dims({pairs, experts, first, count});
    std::vector<int32_t> expert(static_cast<size_t>(pairs));
    for (int32_t& x : expert) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
    auto run = [&](BackendKind kind) {
      std::vector<int64_t> maps(static_cast<size_t>(2 * pairs + count + 1), -9);
      std::vector<int32_t> sizes(static_cast<size_t>(count) + 1, -9);
      auto rows = internal::SortByExpert(Ctx(kind), expert.data(), pairs, first, count,
                                         sizes.data(), maps.data(), maps.data() + pairs,
                                         maps.data() + 2 * pairs);
      EXPECT_TRUE(rows.ok()) << what;
      maps.resize(static_cast<size_t>(2 * pairs));  // the scratch is not compared
      return std::tuple{rows.ok() ? *rows : -1, sizes, maps};
    };
    const auto [want_rows, want_sizes, want_maps] = run(BackendKind::kReference);
    const auto [rows, sizes, maps] = run(BackendKind::kCpu);
    EXPECT_EQ(rows, want_rows) << what;
    EXPECT_EQ(sizes, want_sizes) << what;
    // pair_of_row past `rows` is not written: compare row_of_pair and the
    // valid part of pair_of_row.
    EXPECT_TRUE(std::equal(maps.begin(), maps.begin() + pairs + rows, want_maps.begin()))
        << what;
  }
}

// Random maps of `pairs` pairs onto buffer rows: about one pair in four has
// no row (-1: its expert runs on another rank), the others a distinct row
// in random order, `used` rows; the buffer has `tail` rows more, which no
// pair names. pair_of_row [used] names each used row's pair.
struct PairMaps {
  std::vector<int64_t> row_of_pair, pair_of_row;
  int64_t used = 0;
};
PairMaps RandomMaps(std::mt19937& rng, int64_t pairs, int64_t tail) {
  PairMaps m;
  m.row_of_pair.assign(static_cast<size_t>(pairs) + 1, -1);
  std::vector<int64_t> order;
  for (int64_t p = 0; p < pairs; ++p) {
    if (rng() % 4 != 0) order.push_back(p);
  }
  std::shuffle(order.begin(), order.end(), rng);
  m.used = static_cast<int64_t>(order.size());
  m.pair_of_row.assign(static_cast<size_t>(m.used) + 1, 0);
  for (int64_t r = 0; r < m.used; ++r) {
    m.row_of_pair[static_cast<size_t>(order[static_cast<size_t>(r)])] = r;
    m.pair_of_row[static_cast<size_t>(r)] = order[static_cast<size_t>(r)];
  }
  return m;
}

// Each (tokens, cols, k) shape of the permute and combine checks: odd,
// empty tokens, empty rows, one column, k = 1.
const std::vector<std::tuple<int64_t, int64_t, int64_t>>& RowShapes() {
  static const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {13, 17, 2}, {0, 5, 2}, {7, 0, 3}, {1, 1, 1}, {37, 33, 4}, {9, 8, 1}};
  return shapes;
}

// The permute: copies and one conversion per element (f32 -> bf16 rounds to
// nearest even, SIMD on the cpu on every target): the same bits. The
// buffer's tail rows stay poisoned on both.
void CheckPermuteRows(std::mt19937& rng, bool edges) {
  for (auto [t, cols, k] : RowShapes()) {
    const PairMaps m = RandomMaps(rng, t * k, 3);
    const int64_t rows = m.used, tail = 3;
    const std::vector<float> x = Values(rng, t * cols, edges);
    for (auto [from, to] : {std::pair{DType::kF32, DType::kF32}, {DType::kF32, DType::kBF16},
                            {DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF32}}) {
      const std::string what = "permute_rows " + Dims({t, cols, k}) + " " +
                               std::string(DTypeName(from)) + " to " + std::string(DTypeName(to));
      const std::vector<uint8_t> src = RowBytes(x, from);
      auto run = [&](BackendKind kind) {
        std::vector<uint8_t> out = PoisonedRows((rows + tail) * cols, to);
        EXPECT_TRUE(internal::PermuteRows(Ctx(kind), src.data(), from, t, cols, k,
                                          m.pair_of_row.data(), rows, out.data(), to)
                        .ok())
            << what;
        return RowValues(out, to);
      };
      const std::vector<float> want = run(BackendKind::kReference);
      test::ForEachTarget([&] { ExpectClose(run(BackendKind::kCpu), want, 0, 0, what); });
    }
  }
}

// The combine and its backward over maps with rows of -1: f32 products
// and sums in slot order from +0, dweight's dot in double in order, the
// conversions as the permute's: the same bits. The rows of no pair stay
// poisoned on both.
void CheckCombineRows(std::mt19937& rng, bool edges) {
  for (auto [t, cols, k] : RowShapes()) {
    const PairMaps m = RandomMaps(rng, t * k, 2);
    const int64_t rows = m.used + 2;
    const std::vector<float> buffer = Values(rng, rows * cols, edges),
                             weight = Values(rng, t * k, edges), dy = Values(rng, t * cols, edges);
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const std::string what =
          "combine_rows " + Dims({t, cols, k}) + " " + std::string(DTypeName(dtype));
      const std::vector<uint8_t> buf = RowBytes(buffer, dtype);
      auto run = [&](BackendKind kind) {
        Context& ctx = Ctx(kind);
        std::vector<float> y = Poisoned(t * cols), dweight = Poisoned(t * k);
        std::vector<uint8_t> dbuf = PoisonedRows(rows * cols, dtype);
        EXPECT_TRUE(internal::CombineRows(ctx, buf.data(), dtype, rows, cols,
                                          m.row_of_pair.data(), weight.data(), t, k, y.data())
                        .ok());
        EXPECT_TRUE(internal::CombineRowsBackward(ctx, dy.data(), buf.data(), dtype, rows, cols,
                                                  m.row_of_pair.data(), weight.data(), t, k,
                                                  dbuf.data(), dweight.data())
                        .ok());
        return Outputs{y, dweight, RowValues(dbuf, dtype)};
      };
      const Outputs want = run(BackendKind::kReference);
      test::ForEachTarget([&] {
        const Outputs got = run(BackendKind::kCpu);
        ExpectClose(got[0], want[0], 0, 0, what + " y");
        ExpectClose(got[1], want[1], 0, 0, what + " backward dweight");
        ExpectClose(got[2], want[2], 0, 0, what + " backward dbuffer");
      });
    }
  }
}

// The permute's backward: f32 adds in slot order onto dx or onto +0, the
// same bits; maps with rows of -1.
void CheckScatterAddRows(std::mt19937& rng, bool edges) {
  for (auto [t, cols, k] : RowShapes()) {
    const PairMaps m = RandomMaps(rng, t * k, 1);
    const int64_t rows = m.used + 1;
    const std::vector<float> dbuf = Values(rng, rows * cols, edges);
    const std::vector<float> dx = Values(rng, t * cols, edges);
    for (bool accumulate : {true, false}) {
      CompareBackends({accumulate ? dx : Poisoned(t * cols)}, false, 0, 0,
                      "scatter_add_rows " + Dims({t, cols, k}) + (accumulate ? " +=" : " ="),
                      [&](Context& ctx, Outputs& o) {
                        return internal::ScatterAddRows(ctx, dbuf.data(), rows, cols,
                                                        m.row_of_pair.data(), t, k, accumulate,
                                                        o[0].data());
                      });
    }
  }
}

// The router's backward from a route of saturating and edge logits: both
// compute the same double expressions in the same order, each row rounded
// once: the same bits.
void CheckRouterBackward(std::mt19937& rng, bool edges) {
  for (auto [t, e, k] : {std::tuple<int64_t, int64_t, int64_t>{13, 8, 2},
                         {0, 4, 2},
                         {11, 5, 5},
                         {9, 6, 1},
                         {40, 64, 8}}) {
    const std::vector<float> l = RouterLogits(rng, t, e, edges);
    const std::vector<float> dweight = Values(rng, t * k, edges);
    std::vector<double> fraction(static_cast<size_t>(e));
    for (double& f : fraction) f = static_cast<double>(rng() % 1000) / 1000.0;
    std::vector<std::vector<float>> biases;
    for (const auto& [name, scoring] : Scorings(rng, edges, e, k, &biases)) {
      const Routed r = RouteOn(BackendKind::kReference, l, t, e, k, scoring);
      CompareBackends({Poisoned(t * e)}, false, 0, 0,
                      "router_backward " + Dims({t, e, k}) + name,
                      [&](Context& ctx, Outputs& o) {
                        return internal::RouterBackward(
                            ctx, r.expert.data(), r.softmax.data(), r.probs.data(),
                            dweight.data(), fraction.data(), t, e, k, scoring, 0.01,
                            o[0].data());
                      });
    }
  }
}

// Route's contract on known rows, on both backends: ties to the lower
// index (k = E: the whole order), a softmax that saturates (x200, +-1e30,
// -inf beside a finite top) gives exactly 1 and 0, and the NaN rules.
void CheckRouteContract() {
  const int64_t e = 5;
  const std::vector<float> l = {
      1, 3, 3, 2, 3,                // ties: 1, 2, 4, 3, 0
      200 * 1.f, 200 * 3.f, 200 * 2.f, 200 * -1.f, 0,  // saturates: weight 1, then 0
      1e30f, -1e30f, 0, 0, -1e30f,  // 1e30 on top: 1 and 0
      2, -kInf, -kInf, 1, -kInf,    // -inf selected: weight 0
      kNaN, 1, 2, 3, 4,             // a NaN first: chosen first, weights NaN
      1, kNaN, 5, 3, 2};            // a NaN later: chosen last, probabilities NaN
  const std::vector<std::vector<int32_t>> order = {
      {1, 2, 4, 3, 0}, {1, 2, 0, 4, 3}, {0, 2, 3, 1, 4},
      {0, 3, 1, 2, 4}, {0, 4, 3, 2, 1}, {2, 3, 4, 0, 1}};
  const int64_t t = static_cast<int64_t>(order.size());
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    SCOPED_TRACE(BackendName(kind));
    for (int64_t k : {int64_t{1}, int64_t{2}, e}) {
      const Routed r = RouteOn(kind, l, t, e, k, {});
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          EXPECT_EQ(r.expert[static_cast<size_t>(i * k + j)],
                    order[static_cast<size_t>(i)][static_cast<size_t>(j)])
              << "token " << i << " slot " << j << " of k = " << k;
        }
      }
      auto w = [&](int64_t i, int64_t j) { return r.weight[static_cast<size_t>(i * k + j)]; };
      EXPECT_EQ(w(1, 0), 1.0f);
      EXPECT_EQ(w(2, 0), 1.0f);
      EXPECT_EQ(w(3, 0), k == 1 ? 1.0f : static_cast<float>(1 / (1 + std::exp(-1.0))));
      if (k > 1) {
        EXPECT_EQ(w(1, 1), 0.0f);
        EXPECT_EQ(w(2, 1), 0.0f);
      }
      if (k == e) {
        EXPECT_EQ(w(3, 4), 0.0f);
      }
      for (int64_t j = 0; j < k; ++j) EXPECT_TRUE(std::isnan(w(4, j)));
      EXPECT_EQ(std::isnan(w(5, 0)), k == e) << "the NaN is selected only with k = E";
      for (int64_t x = 0; x < e; ++x) {
        EXPECT_TRUE(std::isnan(r.probs[static_cast<size_t>(5 * e + x)]));
        EXPECT_EQ(r.probs[static_cast<size_t>(2 * e + x)], x == 0 ? 1.0 : 0.0);
      }
    }
  }
}

// The sigmoid scoring's contract on known rows, both backends: the bias
// and the groups choose, the weights are the unbiased scores (over their
// sum + 1e-20 with norm_topk_prob) times the scaling, and ties go to the
// lower expert and the lower group.
void CheckSigmoidRouteContract() {
  using internal::RouteScoring;
  const int64_t e = 4, k = 2;
  const std::vector<float> l = {0, 0, 1, -10,  // group 0 {0, 1} sums 1.0 > group 1's 0.73
                                0, 0, 0, 0};   // all tied: the bias decides
  const std::vector<float> bias = {0, 0, 0.1f, 0.2f}, zero(4, 0.0f);
  const double s1 = 1 / (1 + std::exp(-1.0)), s10 = std::exp(-10.0) / (1 + std::exp(-10.0));
  struct Case {
    RouteScoring scoring;
    std::vector<int32_t> expert;  // [2 tokens, k]
    std::vector<double> weight;
  };
  const std::vector<Case> cases = {
      {{.sigmoid = true, .bias = zero.data()}, {2, 0, 0, 1}, {s1, 0.5, 0.5, 0.5}},
      {{.sigmoid = true, .norm_topk_prob = true, .scaling = 2.5, .bias = zero.data()},
       {2, 0, 0, 1},
       {s1 / (s1 + 0.5 + 1e-20) * 2.5, 0.5 / (s1 + 0.5 + 1e-20) * 2.5, 1.25, 1.25}},
      // The bias moves expert 3 ahead of 0 and 1 only where it beats them.
      {{.sigmoid = true, .norm_topk_prob = true, .bias = bias.data()},
       {2, 0, 3, 2},
       {s1 / (s1 + 0.5 + 1e-20), 0.5 / (s1 + 0.5 + 1e-20), 0.5, 0.5}},
      // Token 0: group 0 {0, 1} wins on its sum 1.0 > 0.73 though expert 2
      // has the top score; token 1: the groups tie, the lower one is kept.
      {{.sigmoid = true, .groups = 2, .topk_groups = 1, .bias = zero.data()},
       {0, 1, 0, 1},
       {0.5, 0.5, 0.5, 0.5}},
      // With the bias group 1's sums are 1.03 and 1.3: it wins both.
      {{.sigmoid = true, .groups = 2, .topk_groups = 1, .bias = bias.data()},
       {2, 3, 3, 2},
       {s1, s10, 0.5, 0.5}}};
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    SCOPED_TRACE(BackendName(kind));
    for (size_t c = 0; c < cases.size(); ++c) {
      const Routed r = RouteOn(kind, l, 2, e, k, cases[c].scoring);
      EXPECT_EQ(r.expert, cases[c].expert) << "case " << c;
      for (size_t i = 0; i < 4; ++i) {
        EXPECT_EQ(r.weight[i], static_cast<float>(cases[c].weight[i])) << "case " << c << " " << i;
      }
    }
  }
  // Saturated scores: +inf and 1e30 give 1, -inf and -1e30 give 0 (the
  // small side exactly, as exp(l) / (1 + exp(l))), a NaN gives NaN.
  const std::vector<float> edge = {kInf, -kInf, 1e30f, -1e30f, kNaN, -100.0f};
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    const Routed r = RouteOn(kind, edge, 1, 6, 6, {.sigmoid = true});
    EXPECT_EQ(r.expert, (std::vector<int32_t>{0, 2, 5, 1, 3, 4})) << BackendName(kind);
    EXPECT_EQ(r.softmax[0], 1.0);
    EXPECT_EQ(r.softmax[1], 1.0);
    EXPECT_EQ(r.softmax[2], std::exp(-100.0) / (1 + std::exp(-100.0)));
    EXPECT_EQ(r.softmax[3], 0.0);
    EXPECT_TRUE(std::isnan(r.softmax[5]));
  }
}

// Scorings the route refuses before any work, the outputs untouched.
void CheckRouteRefusesBadScorings() {
  using internal::RouteScoring;
  const std::vector<float> l(12, 0.5f), bias(6, 0.0f);
  const std::vector<std::pair<RouteScoring, const char*>> bad = {
      {{.bias = bias.data()}, "sigmoid"},
      {{.groups = 3, .topk_groups = 1}, "sigmoid"},
      {{.sigmoid = true, .groups = 4, .topk_groups = 1}, "groups"},   // 4 does not divide 6
      {{.sigmoid = true, .groups = 6, .topk_groups = 3}, "groups"},   // groups of 1
      {{.sigmoid = true, .groups = 3, .topk_groups = 0}, "groups"},
      {{.sigmoid = true, .groups = 3, .topk_groups = 4}, "groups"},
      {{.sigmoid = true, .groups = 3, .topk_groups = 1}, "groups"},   // 2 experts < k = 3
      {{.scaling = std::numeric_limits<double>::infinity()}, "scaling"},
      {{.scaling = std::nan("")}, "scaling"}};
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    for (const auto& [scoring, word] : bad) {
      std::vector<int32_t> expert(6, -7);
      std::vector<float> weight = Poisoned(6);
      std::vector<double> softmax(6, 7.0), probs(12, 7.0);
      const Status st = internal::RouteTopK(Ctx(kind), l.data(), 2, 6, 3, scoring, expert.data(),
                                            weight.data(), softmax.data(), probs.data());
      ASSERT_FALSE(st.ok()) << word;
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find(word), std::string::npos) << st.message();
      EXPECT_EQ(expert, std::vector<int32_t>(6, -7));
      EXPECT_EQ(softmax, std::vector<double>(6, 7.0));
    }
  }
}

// ---- Quantization (quant/ is the cpu implementation's code) ---------------------
//
// Every quantization op is exact per element on both backends: an amax
// (a max), one f32 division or multiplication by a reciprocal, a saturating
// cast, a decode times a scale, an integer count. The cpu runs quant/'s
// SIMD spans and tables, the reference quant.h's scalars one element at a
// time; both must give the same bits (codes and bf16 byte for byte, f32
// values and scales exactly, a NaN matching a NaN) for every format and
// calibration, on every SIMD target where the cpu code is vectorized.

constexpr QuantDType kFormats[] = {QuantDType::kE4M3FN, QuantDType::kE4M3FNUZ, QuantDType::kE5M2,
                                   QuantDType::kE5M2FNUZ, QuantDType::kInt8};

// The calibrations the step uses (absmax, fixed; exact division) and the
// XLA reciprocal arithmetic of the Python path. fixed,-2,3: amax 3, so the
// sd-3 draws go past it and saturate.
std::vector<Calibration> Calibrations() {
  const Calibration absmax = Calibration::AbsMax(), fixed = Calibration::Fixed(-2.0f, 3.0f);
  return {absmax, fixed, absmax.With(ScaleArithmetic::kXlaReciprocal),
          fixed.With(ScaleArithmetic::kXlaReciprocal)};
}

// The one combination that also runs a buffer past quant/'s threshold for
// threads (2^18 elements): the threaded loops split rows, not arithmetic.
bool Threaded(QuantDType dt, const Calibration& calib) {
  return dt == QuantDType::kE4M3FN && calib.kind == Calibration::Kind::kAbsMax &&
         calib.arithmetic == ScaleArithmetic::kExactDivide;
}

std::string QuantWhat(const char* op, std::initializer_list<int64_t> dims, QuantDType dt) {
  return std::string(op) + " " + Dims(dims) + " " + std::string(QuantDTypeName(dt));
}
std::string QuantWhat(const char* op, std::initializer_list<int64_t> dims, QuantDType dt,
                      const Calibration& calib) {
  return QuantWhat(op, dims, dt) + " " + calib.ToString() + " " +
         std::string(ScaleArithmeticName(calib.arithmetic));
}

// x [rows, cols]: sd-3 draws; with `edges`, the f32 edges salted in and
// whole rows of the cases a scaling group must survive: row 0 all zeros,
// row 1 subnormals only (its codes flush to zero), row 2 the format's max
// and values past it, row 3 a +inf, row 4 a NaN, row 5 a -inf beside -1e30.
std::vector<float> QuantInput(std::mt19937& rng, int64_t rows, int64_t cols, bool edges,
                              QuantDType dt) {
  std::vector<float> x = Values(rng, rows * cols, edges, 3.0f);
  if (!edges || cols == 0) return x;
  const float max = QuantMax(dt), sub = std::numeric_limits<float>::denorm_min();
  auto row = [&](int64_t r) { return x.data() + r * cols; };
  for (int64_t r = 0; r < std::min<int64_t>(rows, 6); ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = Values(rng, 1, false, 3.0f)[0];
      switch (r) {
        case 0: row(r)[c] = 0.0f; break;
        case 1: row(r)[c] = (c % 2 ? -1.0f : 1.0f) * sub * static_cast<float>(1 + c % 7); break;
        case 2: row(r)[c] = c % 3 == 0 ? max : c % 3 == 1 ? -2.0f * max : v; break;
        default: row(r)[c] = v; break;
      }
    }
  }
  if (rows > 3) row(3)[cols / 2] = kInf;
  if (rows > 4) row(4)[cols - 1] = kNaN;
  if (rows > 5) row(5)[0] = -kInf, row(5)[cols - 1] = -1e30f;
  return x;
}

// Every output a quantization op writes; the unused ones stay empty.
struct QuantOut {
  std::vector<uint8_t> q;      // codes
  std::vector<float> f;        // scales or f32 values
  std::vector<float> f2;       // a second f32 output
  std::vector<uint16_t> bf16;  // bf16 bits
  internal::Fp8CodeCounts counts{-1, -1};
};

// Runs `run` on the reference backend, then on the cpu backend (on every
// SIMD target when `per_target`), each from a fresh copy of `start` (the
// poisoned outputs), and requires the same bits in every output.
void CompareQuant(const QuantOut& start, bool per_target, const std::string& what,
                  const std::function<Status(Context&, QuantOut&)>& run) {
  QuantOut want = start;
  const Status ref = run(Ctx(BackendKind::kReference), want);
  ASSERT_TRUE(ref.ok()) << what << ": " << ref.message();
  auto check = [&] {
    QuantOut got = start;
    const Status cpu = run(Ctx(BackendKind::kCpu), got);
    ASSERT_TRUE(cpu.ok()) << what << ": " << cpu.message();
    ExpectSameBits(got.q, want.q, what + " codes");
    ExpectClose(got.f, want.f, 0, 0, what + " f32");
    ExpectClose(got.f2, want.f2, 0, 0, what + " f32 (2)");
    ExpectSameBits(got.bf16, want.bf16, what + " bf16");
    EXPECT_EQ(got.counts.saturated, want.counts.saturated) << what << " saturated";
    EXPECT_EQ(got.counts.flushed, want.counts.flushed) << what << " flushed";
  };
  if (per_target) {
    test::ForEachTarget(check);
  } else {
    check();
  }
}

constexpr uint8_t kPoisonCode = 0xA5;  // a code no test expects where it lands
std::vector<uint8_t> PoisonedCodes(int64_t n) {
  return std::vector<uint8_t>(static_cast<size_t>(n), kPoisonCode);
}

// Every byte, in random order (NaN codes, both zeros, the max of each sign).
std::vector<uint8_t> AllCodes(std::mt19937& rng, int64_t n) {
  std::vector<uint8_t> q(static_cast<size_t>(n));
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>(i < 256 ? i : rng());
  std::shuffle(q.begin(), q.end(), rng);
  return q;
}

// Row quantization, with tail rows (valid < rows: code 0, scale 0), blocks
// that do not divide the row, zero-width and empty buffers, and one buffer
// past quant/'s threshold for threads (2^18 elements).
void CheckQuantizeRows(std::mt19937& rng, bool edges) {
  struct Case {
    int64_t rows, cols, valid, block;
  };
  for (QuantDType dt : kFormats) {
    for (const Calibration& calib : Calibrations()) {
      std::vector<Case> cases = {{9, 13, 7, 0}, {9, 13, 9, 4}, {7, 16, 6, 8}, {0, 5, 0, 0},
                                 {4, 0, 2, 0},  {4, 0, 2, 3},  {3, 1, 3, 0},  {5, 6, 0, 2}};
      if (Threaded(dt, calib)) cases.push_back({300, 1000, 290, 128});
      for (const Case& c : cases) {
        const std::string what = QuantWhat("quantize_rows", {c.rows, c.cols, c.valid, c.block},
                                           dt, calib);
        const std::vector<float> x = QuantInput(rng, c.valid, c.cols, edges, dt);
        const int64_t nb = NumBlocks(c.cols, c.block);
        QuantOut start;
        start.q = PoisonedCodes(c.rows * c.cols);
        start.f = Poisoned(c.rows * nb);
        CompareQuant(start, true, what, [&](Context& ctx, QuantOut& o) {
          return internal::QuantizeRows(ctx, x.data(), c.rows, c.cols, c.valid, c.block, dt,
                                        calib, o.q.data(), o.f.data());
        });
        QuantOut tail = start;  // the tail rows' promise, on the reference
        ASSERT_TRUE(internal::QuantizeRows(Ctx(BackendKind::kReference), x.data(), c.rows, c.cols,
                                           c.valid, c.block, dt, calib, tail.q.data(),
                                           tail.f.data())
                        .ok());
        for (int64_t i = c.valid * c.cols; i < c.rows * c.cols; ++i) {
          ASSERT_EQ(tail.q[i], 0) << what;
        }
        for (int64_t i = c.valid * nb; i < c.rows * nb; ++i) ASSERT_EQ(tail.f[i], 0.0f) << what;
      }
    }
  }
}

// Dequantization of every code with scales that include the f32 edges.
void CheckDequantizeRows(std::mt19937& rng, bool edges) {
  for (QuantDType dt : kFormats) {
    for (auto [rows, cols, block] : {std::tuple<int64_t, int64_t, int64_t>{17, 31, 0},
                                     {16, 32, 8},
                                     {9, 13, 4},
                                     {0, 4, 0},
                                     {3, 0, 0},
                                     {1, 1, 0},
                                     {300, 1000, 0}}) {
      const std::string what = QuantWhat("dequantize_rows", {rows, cols, block}, dt);
      const std::vector<uint8_t> q = AllCodes(rng, rows * cols);
      const int64_t nb = NumBlocks(cols, block);
      const std::vector<float> scales = Values(rng, rows * nb, edges, 0.5f);
      QuantOut start;
      start.f = Poisoned(rows * cols);
      CompareQuant(start, false, what, [&](Context& ctx, QuantOut& o) {
        return internal::DequantizeRows(ctx, q.data(), rows, cols, block, scales.data(), dt,
                                        o.f.data());
      });
    }
  }
}

// Per-channel weight quantization: amax down each column of k per expert.
void CheckQuantizeChannels(std::mt19937& rng, bool edges) {
  for (QuantDType dt : kFormats) {
    for (const Calibration& calib : Calibrations()) {
      std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
          {3, 7, 5}, {2, 33, 17}, {1, 1, 1}, {0, 4, 3}, {2, 0, 3}, {2, 5, 0}};
      if (Threaded(dt, calib)) shapes.push_back({1, 600, 500});
      for (auto [e, k, n] : shapes) {
        const std::string what = QuantWhat("quantize_channels", {e, k, n}, dt, calib);
        // Transposed: QuantInput's special rows become special channels.
        const std::vector<float> t = QuantInput(rng, e * n, k, edges, dt);
        std::vector<float> w(t.size());
        for (int64_t x = 0; x < e; ++x) {
          for (int64_t i = 0; i < k; ++i) {
            for (int64_t j = 0; j < n; ++j) w[(x * k + i) * n + j] = t[(x * n + j) * k + i];
          }
        }
        QuantOut start;
        start.q = PoisonedCodes(e * k * n);
        start.f = Poisoned(e * n);
        CompareQuant(start, true, what, [&](Context& ctx, QuantOut& o) {
          return internal::QuantizeChannels(ctx, w.data(), e, k, n, dt, calib, o.q.data(),
                                            o.f.data());
        });
      }
    }
  }
}

// The int8 scheme's dLHS weight copy, for every format's codes.
void CheckDequantizeChannelsToBf16(std::mt19937& rng, bool edges) {
  for (QuantDType dt : kFormats) {
    for (auto [e, k, n] : {std::tuple<int64_t, int64_t, int64_t>{3, 7, 5},
                           {2, 40, 33},
                           {0, 2, 2},
                           {2, 0, 2},
                           {1, 1, 1}}) {
      const std::string what = QuantWhat("dequantize_channels_to_bf16", {e, k, n}, dt);
      const std::vector<uint8_t> q = AllCodes(rng, e * k * n);
      const std::vector<float> scales = Values(rng, e * n, edges, 0.5f);
      QuantOut start;
      start.bf16.assign(static_cast<size_t>(e * k * n), uint16_t{0x7FC1});
      CompareQuant(start, false, what, [&](Context& ctx, QuantOut& o) {
        return internal::DequantizeChannelsToBf16(ctx, q.data(), e, k, n, scales.data(), dt,
                                                  o.bf16.data());
      });
    }
  }
}

// The recipe's cotangent scaling, per (group, column) and per row, from f32
// and from bf16, with an empty group and rows past the groups (not
// written: they stay poisoned on both).
void CheckScaleToF32(std::mt19937& rng, bool edges) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (auto [rows, cols, sizes] :
         {std::tuple<int64_t, int64_t, std::vector<int32_t>>{13, 9, {3, 0, 5, 2}},
          {6, 1, {6}},
          {4, 0, {1, 2}},
          {0, 3, {0, 0}},
          {5, 4, {}},
          {40, 33, {7, 11, 0, 20}}}) {
      const int64_t groups = static_cast<int64_t>(sizes.size());
      const std::vector<float> xf = Values(rng, rows * cols, edges);
      std::vector<uint16_t> xb(xf.size());
      for (size_t i = 0; i < xf.size(); ++i) xb[i] = F32ToBf16(xf[i]);
      const void* x = dtype == DType::kF32 ? static_cast<const void*>(xf.data()) : xb.data();
      const std::vector<float> row_scale = Values(rng, rows, edges, 0.1f),
                               col_scale = Values(rng, groups * cols, edges, 0.1f);
      const std::string what = "scale_to_f32 " + Dims({rows, cols, groups}) + " " +
                               std::string(DTypeName(dtype));
      QuantOut start;
      start.f = Poisoned(rows * cols);
      start.f2 = Poisoned(rows * cols);
      CompareQuant(start, false, what, [&](Context& ctx, QuantOut& o) {
        FP8MOE_RETURN_IF_ERROR(internal::ScaleToF32(ctx, x, dtype, rows, cols, sizes.data(),
                                                    groups, internal::ScaleBy::kGroupColumn,
                                                    col_scale.data(), o.f.data()));
        return internal::ScaleToF32(ctx, x, dtype, rows, cols, sizes.data(), groups,
                                    internal::ScaleBy::kRow, row_scale.data(), o.f2.data());
      });
    }
  }
}

// Health counts of codes quantized from the quantizers' inputs (fixed
// calibration: values past amax saturate; subnormals flush), and of random
// codes against values that are zero or not.
void CheckFp8HealthCount(std::mt19937& rng, bool edges) {
  for (QuantDType dt : kFormats) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{9, 13}, {0, 4}, {1, 1}, {40, 700}}) {
      const std::string what = QuantWhat("fp8_health_count", {rows, cols}, dt);
      std::vector<float> x = QuantInput(rng, rows, cols, edges, dt);
      std::vector<uint8_t> q(x.size());
      std::vector<float> scales(static_cast<size_t>(rows));
      ASSERT_TRUE(internal::QuantizeRows(Ctx(BackendKind::kReference), x.data(), rows, cols, rows,
                                         0, dt, Calibration::Fixed(-2.0f, 3.0f), q.data(),
                                         scales.data())
                      .ok());
      for (const std::vector<uint8_t>& codes : {q, AllCodes(rng, rows * cols)}) {
        CompareQuant({}, false, what, [&](Context& ctx, QuantOut& o) -> Status {
          FP8MOE_ASSIGN_OR_RETURN(o.counts, internal::Fp8HealthCount(ctx, codes.data(), x.data(),
                                                                     rows * cols, dt));
          return OkStatus();
        });
      }
    }
  }
}

// The health counts' promise on hand-made values, on both backends: with a
// fixed amax of 448 (e4m3fn: scale 1) 448 and -896 land on the largest
// magnitude (saturated), 1e-30 and the subnormal 1e-40 on code zero
// (flushed), +-0 on code zero without being flushed; with absmax the row's
// largest value alone saturates.
TEST(QuantOps, SaturatedAndFlushedValuesAreCountedOnBothBackends) {
  const std::vector<float> x = {448.0f, -896.0f, 1e-30f, 0.0f, 1.0f, -0.0f, 2.0f, 1e-40f};
  const int64_t n = static_cast<int64_t>(x.size());
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    SCOPED_TRACE(std::string(BackendName(kind)));
    for (auto [calib, scale, saturated, flushed] :
         {std::tuple<Calibration, float, int64_t, int64_t>{Calibration::Fixed(-448.0f, 448.0f),
                                                            1.0f, 2, 2},
          {Calibration::AbsMax(), 2.0f, 1, 2}}) {
      std::vector<uint8_t> q = PoisonedCodes(n);
      std::vector<float> s = Poisoned(1);
      ASSERT_TRUE(internal::QuantizeRows(Ctx(kind), x.data(), 1, n, 1, 0, QuantDType::kE4M3FN,
                                         calib, q.data(), s.data())
                      .ok());
      EXPECT_EQ(s[0], scale);
      auto counts = internal::Fp8HealthCount(Ctx(kind), q.data(), x.data(), n, QuantDType::kE4M3FN);
      ASSERT_TRUE(counts.ok());
      EXPECT_EQ(counts->saturated, saturated) << calib.ToString();
      EXPECT_EQ(counts->flushed, flushed) << calib.ToString();
    }
  }
}

// Bad arguments are refused with the op's name and what is wrong, before
// anything is written.
TEST(QuantOps, BadArgumentsAreRefusedByNameBeforeAnyWork) {
  Context& ctx = Ctx(BackendKind::kCpu);
  const QuantDType dt = QuantDType::kE4M3FN;
  const Calibration absmax = Calibration::AbsMax();
  std::vector<float> x(12, 1.0f), s = Poisoned(3), out = Poisoned(12);
  std::vector<uint8_t> q = PoisonedCodes(12);
  const std::vector<int32_t> sizes = {2}, too_many = {4};
  auto refused = [](const Status& st, const std::string& needle) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  refused(internal::QuantizeRows(ctx, x.data(), 3, 4, 4, 0, dt, absmax, q.data(), s.data()),
          "quantize_rows: valid_rows = 4 exceeds rows = 3");
  refused(internal::QuantizeRows(ctx, x.data(), 3, 4, 3, -1, dt, absmax, q.data(), s.data()),
          "quantize_rows: block_size = -1 is negative");
  refused(internal::QuantizeRows(ctx, nullptr, 3, 4, 3, 0, dt, absmax, q.data(), s.data()),
          "quantize_rows: x [3, 4] has no data");
  refused(internal::QuantizeRows(ctx, x.data(), 3, 4, 3, 0, static_cast<QuantDType>(9), absmax,
                                 q.data(), s.data()),
          "quantize_rows: quant dtype 9 is none of");
  refused(internal::DequantizeRows(ctx, q.data(), 3, 4, 0, s.data(), dt,
                                   reinterpret_cast<float*>(q.data())),
          "dequantize_rows: x overlaps q");
  refused(internal::QuantizeChannels(ctx, x.data(), 1, 3, -4, dt, absmax, q.data(), s.data()),
          "quantize_channels: w");
  refused(internal::DequantizeChannelsToBf16(ctx, q.data(), 1, 3, 4, nullptr, dt,
                                             reinterpret_cast<uint16_t*>(out.data())),
          "dequantize_channels_to_bf16: scales [1, 4] has no data");
  using internal::ScaleBy;
  refused(internal::ScaleToF32(ctx, x.data(), DType::kF32, 3, 4, sizes.data(), 1,
                               ScaleBy::kGroupColumn, nullptr, out.data()),
          "scale_to_f32: scale [1, 4] has no data");
  refused(internal::ScaleToF32(ctx, x.data(), DType::kI32, 3, 4, sizes.data(), 1, ScaleBy::kRow,
                               s.data(), out.data()),
          "scale_to_f32: x is int32; it must be f32 or bf16");
  refused(internal::ScaleToF32(ctx, x.data(), DType::kF32, 3, 4, too_many.data(), 1,
                               ScaleBy::kRow, s.data(), out.data()),
          "scale_to_f32: ");
  refused(internal::ScaleToF32(ctx, x.data(), DType::kF32, 3, 4, sizes.data(), 1, ScaleBy::kRow,
                               s.data(), x.data()),
          "scale_to_f32: out overlaps x");
  refused(internal::Fp8HealthCount(ctx, q.data(), nullptr, 12, dt).status(),
          "fp8_health_count: x [12] has no data");
  for (uint8_t c : q) EXPECT_EQ(c, kPoisonCode);
  for (float v : s) EXPECT_TRUE(std::isnan(v));
  for (float v : out) EXPECT_TRUE(std::isnan(v));
}

// ---- Every op of the registry has its check --------------------------------------

struct OpCheck {
  Op op;
  void (*check)(std::mt19937& rng, bool edges);  // null: kGmmTests
};

// The GMMs' tests against the float64 oracle, every mode on every backend.
constexpr const char* kGmmTests =
    "kernels/gmm_test.cc: Gmm.EveryModeMatchesTheOracleOnEveryBackend, "
    "GmmDlhs.EveryModeMatchesTheOracleOnEveryBackend, "
    "Tgmm.EveryModeMatchesTheOracleOnEveryBackend";

const std::vector<OpCheck>& Checks() {
  static const std::vector<OpCheck> checks = {
      {Op::kGmm, nullptr},
      {Op::kGmmDlhs, nullptr},
      {Op::kTgmm, nullptr},
      {Op::kEmbeddingGather, CheckEmbedding},
      {Op::kEmbeddingScatterAdd, CheckEmbedding},
      {Op::kAdd, CheckAdd},
      {Op::kRmsNormForward, CheckRmsNorm},
      {Op::kRmsNormBackward, CheckRmsNorm},
      {Op::kRope, CheckRope},
      {Op::kAttentionForward, CheckAttention},
      {Op::kAttentionBackward, CheckAttention},
      {Op::kCopyColumns, CheckCopyColumns},
      {Op::kCrossEntropy, CheckCrossEntropy},
      {Op::kAdamW, CheckAdamW},
      // The MoE layer: routing and row permutation
      {Op::kRoute, CheckRoute},
      {Op::kSortByExpert, CheckSortByExpert},
      {Op::kPermuteRows, CheckPermuteRows},
      {Op::kCombineRows, CheckCombineRows},
      {Op::kCombineRowsBackward, CheckCombineRows},
      {Op::kScatterAddRows, CheckScatterAddRows},
      {Op::kRouterBackward, CheckRouterBackward},
      // Quantization (quant/ is the cpu implementation's code)
      {Op::kQuantizeRows, CheckQuantizeRows},
      {Op::kDequantizeRows, CheckDequantizeRows},
      {Op::kQuantizeChannels, CheckQuantizeChannels},
      {Op::kDequantizeChannelsToBf16, CheckDequantizeChannelsToBf16},
      {Op::kScaleToF32, CheckScaleToF32},
      {Op::kFp8HealthCount, CheckFp8HealthCount},
  };
  return checks;
}

// Every check once (one check covers an op's forward and backward).
void RunChecks(uint64_t seed, bool edges) {
  std::set<void (*)(std::mt19937&, bool)> ran;
  for (const OpCheck& c : Checks()) {
    if (c.check == nullptr || !ran.insert(c.check).second) continue;
    SCOPED_TRACE(std::string(internal::OpName(c.op)));
    std::mt19937 rng(static_cast<unsigned>(seed));
    c.check(rng, edges);
  }
}

TEST(BackendOps, EveryOpOfTheRegistryHasACheck) {
  std::set<Op> covered;
  for (const OpCheck& c : Checks()) covered.insert(c.op);
  for (int i = 0; i < static_cast<int>(Op::kCount); ++i) {
    EXPECT_EQ(covered.count(static_cast<Op>(i)), 1u)
        << "op " << internal::OpName(static_cast<Op>(i))
        << " has no check in backend_ops_test.cc: add one beside the others";
  }
  std::printf("GMMs: %s\n", kGmmTests);
}

TEST(BackendOps, CpuMatchesTheReferenceOnRandomInputs) {
  FP8MOE_RANDOM_SEED(seed);
  RunChecks(seed, /*edges=*/false);
}

TEST(BackendOps, CpuMatchesTheReferenceAtTheEdgesOfTheF32Range) {
  FP8MOE_RANDOM_SEED(seed);
  RunChecks(seed, /*edges=*/true);
}

TEST(BackendOps, SaturatedAttentionSoftmaxGivesZeroAndOne) { CheckAttentionSaturates(); }

// Blocks past a row's end, overlapping dst blocks, blocks that would
// overwrite each other, overlapping buffers, an odd or too wide rope_dim:
// refused by name before anything is written.
TEST(BackendOps, CopyColumnsAndPartialRopeRefuseBadLayouts) {
  std::vector<float> src(24, 1.0f), dst = Poisoned(24);
  struct Bad {
    int64_t src_cols, src_offset, src_step, blocks, width, dst_cols, dst_offset, dst_step;
    bool accumulate;
    const char* why;
  };
  for (const Bad& k : {Bad{6, 4, 0, 1, 3, 6, 0, 0, false, "src block ends past its row"},
                       Bad{6, 0, 1, 3, 2, 6, 1, 2, false, "dst block ends past its row"},
                       Bad{6, 0, 1, 2, 3, 6, 0, 2, false, "dst blocks overlap"},
                       Bad{6, 0, 1, 2, 2, 6, 0, 0, false, "accumulate them"},
                       Bad{6, -1, 1, 1, 2, 6, 0, 0, false, "negative"}}) {
    for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
      const Status s = internal::CopyColumns(Ctx(kind), src.data(), 4, k.src_cols, k.src_offset,
                                             k.src_step, k.blocks, k.width, dst.data(),
                                             k.dst_cols, k.dst_offset, k.dst_step, k.accumulate);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << k.why;
      EXPECT_NE(s.message().find(k.why), std::string::npos) << s.message();
    }
  }
  for (float v : dst) EXPECT_TRUE(std::isnan(v));
  const Status overlap = internal::CopyColumns(Ctx(BackendKind::kCpu), src.data(), 2, 6, 0, 0, 1,
                                               3, src.data() + 6, 6, 0, 0, false);
  EXPECT_NE(overlap.message().find("dst overlaps src"), std::string::npos) << overlap.message();
  std::vector<float> qkv(3 * 8, 1.0f), cos(8, 1.0f), sin(8, 0.0f);
  for (int64_t rope_dim : {int64_t{3}, int64_t{10}}) {
    const Status s = internal::RopeApply(Ctx(BackendKind::kCpu), qkv.data(), 1, 1, 1, 1, 8,
                                         cos.data(), sin.data(), false, rope_dim, true);
    EXPECT_NE(s.message().find("rope_dim " + std::to_string(rope_dim) + " must be even"),
              std::string::npos)
        << s.message();
  }
  // Only -1 means the whole head; another negative rope_dim is refused, and
  // an odd head is refused only when the whole of it rotates.
  const std::vector<float> before = qkv;
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    const Status neg = internal::RopeApply(Ctx(kind), qkv.data(), 1, 1, 1, 1, 8, cos.data(),
                                           sin.data(), false, -2, true);
    EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(neg.message().find("rope_dim -2 is negative"), std::string::npos) << neg.message();
    const Status odd = internal::RopeApply(Ctx(kind), qkv.data(), 1, 1, 1, 1, 7, cos.data(),
                                           sin.data(), false);
    EXPECT_NE(odd.message().find("head dimension 7 is odd"), std::string::npos) << odd.message();
  }
  EXPECT_EQ(qkv, before);
}

// hd 0 with value heads: the scores' scale 1/sqrt(0) would be NaN; both
// attention ops refuse it by name before writing anything.
TEST(BackendOps, AttentionRefusesAZeroHeadDimensionWithValues) {
  const int64_t seq = 3, heads = 2, vd = 4;
  const std::vector<float> qkv(seq * heads * vd, 1.0f), dout(seq * heads * vd, 1.0f);
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    std::vector<float> probs = Poisoned(heads * seq * seq), out = Poisoned(seq * heads * vd),
                       dqkv = Poisoned(seq * heads * vd);
    const Status st[] = {
        internal::AttentionForward(Ctx(kind), qkv.data(), 1, seq, heads, heads, 0, probs.data(),
                                   out.data(), vd),
        internal::AttentionBackward(Ctx(kind), qkv.data(), probs.data(), dout.data(), 1, seq,
                                    heads, heads, 0, dqkv.data(), vd)};
    for (const Status& s : st) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
      EXPECT_NE(s.message().find("head dimension 0 with value width 4"), std::string::npos)
          << s.message();
    }
    for (float v : probs) EXPECT_TRUE(std::isnan(v));
    for (float v : out) EXPECT_TRUE(std::isnan(v));
    for (float v : dqkv) EXPECT_TRUE(std::isnan(v));
  }
}

// kv heads that do not split the query heads into equal groups (or none):
// each attention op refuses them by name before writing anything.
TEST(BackendOps, AttentionRefusesKvHeadsThatDoNotDivideTheQueryHeads) {
  const int64_t seq = 3, heads = 3, hd = 4;
  for (int64_t kv : {int64_t{0}, int64_t{2}, int64_t{-1}, int64_t{6}}) {
    const int64_t width = (heads + 2 * std::max<int64_t>(kv, 0)) * hd;
    std::vector<float> qkv(static_cast<size_t>(seq * width), 1.0f), cos(seq * hd / 2, 1.0f),
        sin(seq * hd / 2, 0.0f), dout(seq * heads * hd, 1.0f);
    for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
      std::vector<float> probs = Poisoned(heads * seq * seq), out = Poisoned(seq * heads * hd),
                         dqkv = Poisoned(seq * width), rotated = qkv;
      const Status st[] = {
          internal::RopeApply(Ctx(kind), rotated.data(), 1, seq, heads, kv, hd, cos.data(),
                              sin.data(), false),
          internal::AttentionForward(Ctx(kind), qkv.data(), 1, seq, heads, kv, hd, probs.data(),
                                     out.data()),
          internal::AttentionBackward(Ctx(kind), qkv.data(), probs.data(), dout.data(), 1, seq,
                                      heads, kv, hd, dqkv.data())};
      for (const Status& s : st) {
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << kv << ": " << s.message();
        EXPECT_NE(s.message().find("3 query heads do not split into groups of " +
                                   std::to_string(kv) + " kv heads"),
                  std::string::npos)
            << s.message();
      }
      EXPECT_EQ(rotated, qkv);
      for (float v : probs) EXPECT_TRUE(std::isnan(v));
      for (float v : out) EXPECT_TRUE(std::isnan(v));
      for (float v : dqkv) EXPECT_TRUE(std::isnan(v));
    }
  }
}

TEST(BackendOps, SigmoidRoutingChoosesByBiasAndGroupsAndWeighsTheUnbiasedScores) {
  CheckSigmoidRouteContract();
}

TEST(BackendOps, RouteRefusesScoringsOutsideItsContract) { CheckRouteRefusesBadScorings(); }

TEST(BackendOps, RouteBreaksTiesToTheLowerExpertAndSaturatesToZeroAndOne) {
  CheckRouteContract();
}

// ---- A backend that runs some ops only ------------------------------------------

// Runs add and the forward GMM, on the reference backend's code, and
// nothing else: what a device backend looks like while its ops are written
// one by one.
class PartialBackend final : public internal::Backend {
 public:
  BackendKind kind() const override { return BackendKind::kReference; }
  bool Supports(const internal::OpArgs& args) const override {
    return args.op == Op::kAdd || args.op == Op::kGmm;
  }
  Status Gmm(Context& ctx, const internal::GmmProblem& p, const GmmOptions& o,
             const ConstTensorView& lhs, const ConstTensorView& rhs,
             const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
             const TensorView& out, const TensorView* h_out) override {
    return internal::ReferenceBackend().Gmm(ctx, p, o, lhs, rhs, rhs_scale, group_sizes, out,
                                            h_out);
  }
  Status Dlhs(Context&, const internal::GmmProblem&, const GmmOptions&, const ConstTensorView&,
              const ConstTensorView&, const ConstTensorView*, const ConstTensorView&,
              const TensorView&, const ConstTensorView*) override {
    return Called("gmm_dlhs");
  }
  Status Tgmm(Context&, const internal::GmmProblem&, const GmmOptions&, const TgmmQuant&,
              const ConstTensorView&, const ConstTensorView&, const ConstTensorView&,
              const TensorView&) override {
    return Called("tgmm");
  }
  Status Add(Context& ctx, const internal::AddArgs& a) override {
    return internal::ReferenceBackend().Add(ctx, a);
  }
  Status EmbeddingGather(Context&, const internal::EmbeddingGatherArgs&) override {
    return Called("embedding_gather");
  }
  Status EmbeddingScatterAdd(Context&, const internal::EmbeddingScatterAddArgs&) override {
    return Called("embedding_scatter_add");
  }
  Status RmsNormForward(Context&, const internal::RmsNormForwardArgs&) override {
    return Called("rms_norm_forward");
  }
  Status RmsNormBackward(Context&, const internal::RmsNormBackwardArgs&) override {
    return Called("rms_norm_backward");
  }
  Status Rope(Context&, const internal::RopeArgs&) override { return Called("rope"); }
  Status AttentionForward(Context&, const internal::AttentionForwardArgs&) override {
    return Called("attention_forward");
  }
  Status AttentionBackward(Context&, const internal::AttentionBackwardArgs&) override {
    return Called("attention_backward");
  }
  Status CopyColumns(Context&, const internal::CopyColumnsArgs&) override {
    return Called("copy_columns");
  }
  Status CrossEntropy(Context&, const internal::CrossEntropyArgs&) override {
    return Called("cross_entropy");
  }
  Status AdamW(Context&, const internal::AdamWArgs&) override { return Called("adamw"); }
  // The MoE layer: routing and row permutation
  Status Route(Context&, const internal::RouteArgs&) override { return Called("route"); }
  Status SortByExpert(Context&, const internal::SortByExpertArgs&) override {
    return Called("sort_by_expert");
  }
  Status PermuteRows(Context&, const internal::PermuteRowsArgs&) override {
    return Called("permute_rows");
  }
  Status CombineRows(Context&, const internal::CombineRowsArgs&) override {
    return Called("combine_rows");
  }
  Status CombineRowsBackward(Context&, const internal::CombineRowsBackwardArgs&) override {
    return Called("combine_rows_backward");
  }
  Status ScatterAddRows(Context&, const internal::ScatterAddRowsArgs&) override {
    return Called("scatter_add_rows");
  }
  Status RouterBackward(Context&, const internal::RouterBackwardArgs&) override {
    return Called("router_backward");
  }

  // Quantization (quant/ is the cpu implementation's code)
  Status QuantizeRows(Context&, const internal::QuantizeRowsArgs&) override {
    return Called("quantize_rows");
  }
  Status DequantizeRows(Context&, const internal::DequantizeRowsArgs&) override {
    return Called("dequantize_rows");
  }
  Status QuantizeChannels(Context&, const internal::QuantizeChannelsArgs&) override {
    return Called("quantize_channels");
  }
  Status DequantizeChannelsToBf16(Context&,
                                  const internal::DequantizeChannelsToBf16Args&) override {
    return Called("dequantize_channels_to_bf16");
  }
  Status ScaleToF32(Context&, const internal::ScaleToF32Args&) override {
    return Called("scale_to_f32");
  }
  Status Fp8HealthCount(Context&, const internal::Fp8HealthCountArgs&) override {
    return Called("fp8_health_count");
  }

 private:
  // The entry points ask Supports first: reaching here is the seam's bug.
  static Status Called(const char* op) {
    ADD_FAILURE() << "the entry point called the unsupported op " << op;
    return Internal(std::string("unsupported op ") + op + " called");
  }
};

// Stands the partial backend in for the reference kind while in scope.
class StandIn {
 public:
  explicit StandIn(internal::Backend* b)
      : old_(internal::SetBackendForTesting(BackendKind::kReference, b)) {}
  ~StandIn() { internal::SetBackendForTesting(BackendKind::kReference, old_); }
  StandIn(const StandIn&) = delete;
  StandIn& operator=(const StandIn&) = delete;

 private:
  internal::Backend* old_;
};

TEST(BackendOps, AnOpTheBackendDoesNotRunIsRefusedByNameAndNothingIsWritten) {
  PartialBackend partial;
  StandIn stand_in(&partial);
  Context& ctx = Ctx(BackendKind::kReference);
  const int64_t rows = 3, d = 4;
  std::vector<float> x(rows * d, 1.0f), g(d, 1.0f), y = Poisoned(rows * d), inv = Poisoned(rows);
  // Supported: runs.
  ASSERT_TRUE(internal::Add(ctx, x.data(), x.data(), rows * d, y.data()).ok());
  EXPECT_EQ(y[0], 2.0f);
  // Not supported: refused by name, the outputs untouched.
  y = Poisoned(rows * d);
  const Status s =
      internal::RmsNormForward(ctx, x.data(), g.data(), rows, d, 1e-6f, y.data(), inv.data());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.message();
  EXPECT_NE(s.message().find("rms_norm_forward"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("reference backend"), std::string::npos) << s.message();
  for (float v : y) EXPECT_TRUE(std::isnan(v));
  for (float v : inv) EXPECT_TRUE(std::isnan(v));
  auto loss = internal::CrossEntropy(ctx, x.data(), std::vector<int32_t>(rows, 0).data(), rows, d,
                                     y.data());
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("cross_entropy"), std::string::npos);
  // The MoE layer's ops too: the route is refused, its outputs untouched.
  std::vector<int32_t> expert(rows * 2, -1);
  std::vector<double> softmax(rows * 2, 7.0), probs(rows * d, 7.0);
  y = Poisoned(rows * 2);
  const Status route = internal::RouteTopK(ctx, x.data(), rows, d, 2, {}, expert.data(),
                                           y.data(), softmax.data(), probs.data());
  ASSERT_FALSE(route.ok());
  EXPECT_EQ(route.code(), StatusCode::kFailedPrecondition) << route.message();
  EXPECT_NE(route.message().find("op route "), std::string::npos) << route.message();
  for (int32_t e : expert) EXPECT_EQ(e, -1);
  for (double v : softmax) EXPECT_EQ(v, 7.0);

  // The GMM entry points too: the forward runs, its dLHS is refused by name.
  Tensor lhs = *Tensor::Zeros(DType::kF32, {2, 3}), rhs = *Tensor::Zeros(DType::kF32, {1, 3, 5}),
         gs = *Tensor::Zeros(DType::kI32, {1}), out = *Tensor::Zeros(DType::kF32, {2, 5}),
         da = *Tensor::Zeros(DType::kF32, {2, 3});
  gs.data_as<int32_t>()[0] = 2;
  GmmOptions o;
  o.mode = GmmMode::kF32;
  EXPECT_TRUE(Gmm(ctx, o, lhs.view(), rhs.view(), nullptr, gs.view(), out.view()).ok());
  const Status dl = GmmDlhs(ctx, o, out.view(), rhs.view(), nullptr, gs.view(), da.view());
  ASSERT_FALSE(dl.ok());
  EXPECT_EQ(dl.code(), StatusCode::kFailedPrecondition) << dl.message();
  EXPECT_NE(dl.message().find("gmm_dlhs"), std::string::npos) << dl.message();
}

}  // namespace
}  // namespace fp8moe
