// The cpu backend's routing and row permutation of the MoE layer
// (kernels/cpu/cpu_ops.h): the loops moe/routing.cc and moe/moe_ring.cc ran
// before the seam, moved. Each output row (or token) is one thread's, with a
// fixed order of its sums, so the bits do not depend on the thread count;
// the sort is one pass on one thread. Every index is also clamped into its
// buffer (the entry points have checked them already): a corrupt index can
// never read or write out of bounds.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fp8moe/numerics.h"
#include "kernels/cpu/cpu_ops.h"

namespace fp8moe::internal {

namespace {

int64_t Clamp(int64_t i, int64_t n) { return std::min(std::max<int64_t>(i, 0), n - 1); }

// Row `row` of a [rows, cols] buffer of dtype F32 or BF16, as f32 into out;
// and v stored into that row. Both return at once for a zero-width row: the
// row buffers of a D = 0 layer are empty vectors whose data() may be null,
// and memcpy must not be handed a null pointer even for zero bytes.
void RowToF32(const void* buffer, DType dtype, int64_t row, int64_t cols, float* out) {
  if (cols <= 0) return;
  if (dtype == DType::kF32) {
    std::memcpy(out, static_cast<const float*>(buffer) + row * cols,
                static_cast<size_t>(cols) * sizeof(float));
  } else {
    Bf16ToF32Span(static_cast<const uint16_t*>(buffer) + row * cols, out,
                  static_cast<size_t>(cols));
  }
}

void StoreRow(const float* v, int64_t cols, void* buffer, DType dtype, int64_t row) {
  if (cols <= 0) return;
  if (dtype == DType::kF32) {
    std::memcpy(static_cast<float*>(buffer) + row * cols, v,
                static_cast<size_t>(cols) * sizeof(float));
  } else {
    F32ToBf16Span(v, static_cast<uint16_t*>(buffer) + row * cols, static_cast<size_t>(cols));
  }
}

// sigmoid(l) in double; below 0 as exp(l) / (1 + exp(l)), so a small score
// keeps its digits (1 - 1/(1 + e^-l) would not).
double Sigmoid(double l) { return l >= 0 ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l) / (1.0 + std::exp(l)); }

// The index in [0, n) of the largest v(i) that keep(i) allows, by a scan in
// index order that moves only to a strictly larger value: ties go to the
// lower index, a NaN is chosen only where the scan starts on it. -1: none.
template <class Value, class Keep>
int64_t Largest(int64_t n, const Value& v, const Keep& keep) {
  int64_t best = -1;
  for (int64_t x = 0; x < n; ++x) {
    if (keep(x) && (best < 0 || v(x) > v(best))) best = x;
  }
  return best;
}

// Token t's top-k by its choice scores c [E]: e[0..k) in slot order.
// group [2 * groups] is scratch: the group scores, then the kept marks.
void ChooseExperts(const RouteArgs& a, const double* c, double* group, int32_t* e) {
  const int64_t E = a.experts, k = a.k, G = a.scoring.groups;
  const int64_t per = G > 0 ? E / G : E;
  // Group g's score: the sum of its two largest choice scores.
  for (int64_t g = 0; g < G; ++g) {
    const double* cg = c + g * per;
    const int64_t i0 = Largest(per, [&](int64_t x) { return cg[x]; }, [](int64_t) { return true; });
    const int64_t i1 = Largest(per, [&](int64_t x) { return cg[x]; },
                               [&](int64_t x) { return x != i0; });
    group[g] = cg[i0] + cg[i1];
  }
  // Keep the topk_groups best groups: group[G + g] marks group g kept (1)
  // or not (0).
  for (int64_t g = 0; g < G; ++g) group[G + g] = 0.0;
  for (int64_t j = 0; j < a.scoring.topk_groups; ++j) {
    const int64_t b = Largest(G, [&](int64_t g) { return group[g]; },
                              [&](int64_t g) { return group[G + g] == 0.0; });
    group[G + b] = 1.0;
  }
  auto open = [&](int64_t x) { return G == 0 || group[G + x / per] != 0.0; };
  for (int64_t j = 0; j < k; ++j) {
    const int64_t best = Largest(E, [&](int64_t x) { return c[x]; }, [&](int64_t x) {
      if (!open(x)) return false;
      for (int64_t i = 0; i < j; ++i) {
        if (e[i] == x) return false;
      }
      return true;
    });
    e[j] = static_cast<int32_t>(best);
  }
}

// Token t of Route: its top-k, the softmax over the selected logits (or
// their sigmoid scores) and the softmax over all of them. scratch: [E + 2G].
void RouteToken(const RouteArgs& a, int64_t t, double* scratch) {
  const int64_t experts = a.experts, k = a.k;
  const RouteScoring& sc = a.scoring;
  const float* l = a.logits + t * experts;
  float* w = a.weight + t * k;
  int32_t* e = a.expert + t * k;
  double* s = a.softmax + t * k;
  double* c = scratch;
  for (int64_t x = 0; x < experts; ++x) {
    c[x] = sc.sigmoid ? Sigmoid(l[x]) + (sc.bias != nullptr ? sc.bias[x] : 0.0f) : l[x];
  }
  ChooseExperts(a, c, scratch + experts, e);
  if (sc.sigmoid) {
    // The selected unbiased scores; norm_topk_prob divides by their sum
    // + 1e-20 (DeepSeek-V3's guard against a zero sum).
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += (s[j] = Sigmoid(l[e[j]]));
    const double d = sc.norm_topk_prob ? sum + 1e-20 : 1.0;
    for (int64_t j = 0; j < k; ++j) w[j] = static_cast<float>(s[j] / d * sc.scaling);
  } else {
    // Softmax over the k selected logits (e[0] holds the largest), in
    // double; the weights are it rounded once to f32 (after norm_topk_prob's
    // division by the sum, ~1, and the scaling, 1 unless set).
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      s[j] = std::exp(static_cast<double>(l[e[j]]) - static_cast<double>(l[e[0]]));
      sum += s[j];
    }
    double norm = 0.0;
    for (int64_t j = 0; j < k; ++j) norm += (s[j] /= sum);
    for (int64_t j = 0; j < k; ++j) {
      w[j] = static_cast<float>((sc.norm_topk_prob ? s[j] / norm : s[j]) * sc.scaling);
    }
  }
  // Softmax over all experts, for the load-balancing loss, in double.
  double mx = l[0];
  for (int64_t x = 1; x < experts; ++x) mx = std::max(mx, static_cast<double>(l[x]));
  double* p = a.probs + t * experts;
  double all = 0.0;
  for (int64_t x = 0; x < experts; ++x) {
    p[x] = std::exp(static_cast<double>(l[x]) - mx);
    all += p[x];
  }
  for (int64_t x = 0; x < experts; ++x) p[x] /= all;
}

// Token t's row of dlogits; row [E] is the thread's scratch.
void RouterBackwardToken(const RouterBackwardArgs& a, double lb, int64_t t, double* row) {
  const int64_t E = a.experts, k = a.k;
  const double* f = a.fraction;
  // Load-balancing loss through p_e = mean softmax: dP/dl = P (1 - P).
  // In double: 1 - P of a saturated softmax is not lost to rounding.
  const double* p = a.probs + t * E;
  double pf = 0.0;
  for (int64_t e = 0; e < E; ++e) pf += p[e] * f[e];
  for (int64_t e = 0; e < E; ++e) row[e] = lb * p[e] * (f[e] - pf);
  // Routing weights: the softmax s over the selected logits, whose backward
  // s_j (g_j - sum_i s_i g_i) is written s_j sum_i s_i (g_j - g_i)
  // (sum_i s_i = 1). Where s saturates (s_0 ~ 1) the first form subtracts
  // two numbers of the size of g to leave s_1 (g_0 - g_1): from the f32
  // weights (s_0 rounded to 1, or within 3e-8 of 1 - s_1) that was all
  // rounding (issue 35). The second has no such difference.
  // norm_topk_prob, w = s / S with S = sum s, only shifts g by a constant,
  // which the differences drop, and divides it by S. The scaling c
  // multiplies it all.
  // Sigmoid scores: w_j = c s_j / D (D = sum s + 1e-20, or 1), so dw/ds
  // gives c (g_j - sum_i s_i g_i / D) / D, written as
  // c (g_j 1e-20 / D + sum_i s_i (g_j - g_i) / D) / D for the same reason,
  // times ds/dl = s (1 - s).
  const double* s = a.softmax + t * k;
  const float* g = a.dweight + t * k;
  const double c = a.scoring.scaling;
  const bool norm = a.scoring.norm_topk_prob;
  const int32_t* ex = a.expert + t * k;
  if (a.scoring.sigmoid) {
    double D = 1.0;
    if (norm) {
      D = 1e-20;
      for (int64_t j = 0; j < k; ++j) D += s[j];
    }
    for (int64_t j = 0; j < k; ++j) {
      double ds = static_cast<double>(g[j]);
      if (norm) {
        double d = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          d += s[i] * (static_cast<double>(g[j]) - static_cast<double>(g[i]));
        }
        ds = (static_cast<double>(g[j]) * 1e-20 / D + d / D) / D;
      }
      row[ex[j]] += s[j] * (1.0 - s[j]) * c * ds;
    }
  } else {
    double S = 1.0;
    if (norm) {
      S = 0.0;
      for (int64_t j = 0; j < k; ++j) S += s[j];
    }
    for (int64_t j = 0; j < k; ++j) {
      double d = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        d += s[i] * (static_cast<double>(g[j]) - static_cast<double>(g[i]));
      }
      row[ex[j]] += s[j] * d / S * c;
    }
  }
  float* dl = a.dlogits + t * E;
  for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(row[e]);
}

}  // namespace

void CpuOps::Route(Context& ctx, const RouteArgs& a) {
#pragma omp parallel num_threads(ctx.threads())
  {
    std::vector<double> scratch(static_cast<size_t>(a.experts + 2 * a.scoring.groups));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) RouteToken(a, t, scratch.data());
  }
}

void CpuOps::SortByExpert(Context& ctx, const SortByExpertArgs& a) {
  (void)ctx;
  // A stable counting sort of the pairs by expert.
  const int64_t first = a.first, count = a.count;
  auto ours = [&](int32_t e) { return e >= first && e < first + count; };
  std::fill(a.group_sizes, a.group_sizes + count, 0);
  for (int64_t p = 0; p < a.pairs; ++p) {
    if (ours(a.expert[p])) ++a.group_sizes[a.expert[p] - first];
  }
  int64_t* next = a.next_row;
  if (count > 0) next[0] = 0;
  for (int64_t x = 1; x < count; ++x) next[x] = next[x - 1] + a.group_sizes[x - 1];
  int64_t rows = 0;
  for (int64_t x = 0; x < count; ++x) rows += a.group_sizes[x];
  for (int64_t p = 0; p < a.pairs; ++p) {
    const int32_t e = a.expert[p];
    if (!ours(e)) {
      a.row_of_pair[p] = -1;
      continue;
    }
    const int64_t row = next[e - first]++;
    a.row_of_pair[p] = row;
    a.pair_of_row[row] = p;
  }
  *a.rows = rows;
}

void CpuOps::PermuteRows(Context& ctx, const PermuteRowsArgs& a) {
  const int64_t cols = a.cols;
  const size_t in_row = static_cast<size_t>(cols) * DTypeSize(a.src_dtype);
  const size_t out_row = static_cast<size_t>(cols) * DTypeSize(a.out_dtype);
  const char* src = static_cast<const char*>(a.src);
  char* out = static_cast<char*>(a.out);
  const bool copy = a.src_dtype == a.out_dtype;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t i = 0; i < a.rows; ++i) {
    if (cols <= 0) continue;  // empty rows: src and out may be null
    const int64_t t = Clamp(a.pair_of_row[i] / a.k, a.tokens);
    const char* from = src + static_cast<size_t>(t) * in_row;
    char* to = out + static_cast<size_t>(i) * out_row;
    if (copy) {
      std::memcpy(to, from, out_row);
    } else if (a.src_dtype == DType::kF32) {
      F32ToBf16Span(reinterpret_cast<const float*>(from), reinterpret_cast<uint16_t*>(to),
                    static_cast<size_t>(cols));
    } else {
      Bf16ToF32Span(reinterpret_cast<const uint16_t*>(from), reinterpret_cast<float*>(to),
                    static_cast<size_t>(cols));
    }
  }
}

void CpuOps::CombineRows(Context& ctx, const CombineRowsArgs& a) {
  const int64_t cols = a.cols, k = a.k;
#pragma omp parallel num_threads(ctx.threads())
  {
    std::vector<float> row(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) {
      float* yt = a.y + t * cols;
      std::fill(yt, yt + cols, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = a.row_of_pair[t * k + j];
        if (r < 0) continue;
        RowToF32(a.buffer, a.dtype, Clamp(r, a.rows), cols, row.data());
        const float w = a.weight[t * k + j];
        for (int64_t c = 0; c < cols; ++c) yt[c] += w * row[static_cast<size_t>(c)];
      }
    }
  }
}

void CpuOps::CombineRowsBackward(Context& ctx, const CombineRowsBackwardArgs& a) {
  const int64_t cols = a.cols, k = a.k;
#pragma omp parallel num_threads(ctx.threads())
  {
    std::vector<float> row(static_cast<size_t>(cols)), g(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) {
      const float* dyt = a.dy + t * cols;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = t * k + j;
        if (a.row_of_pair[p] < 0) {
          a.dweight[p] = 0.0f;
          continue;
        }
        const int64_t i = Clamp(a.row_of_pair[p], a.rows);
        const float w = a.weight[p];
        for (int64_t c = 0; c < cols; ++c) g[static_cast<size_t>(c)] = w * dyt[c];
        StoreRow(g.data(), cols, a.dbuffer, a.dtype, i);
        RowToF32(a.buffer, a.dtype, i, cols, row.data());
        double d = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          d += static_cast<double>(dyt[c]) * row[static_cast<size_t>(c)];
        }
        a.dweight[p] = static_cast<float>(d);
      }
    }
  }
}

void CpuOps::ScatterAddRows(Context& ctx, const ScatterAddRowsArgs& a) {
  const int64_t cols = a.cols, k = a.k;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t t = 0; t < a.tokens; ++t) {
    float* d = a.dx + t * cols;
    if (!a.accumulate) std::fill(d, d + cols, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = a.row_of_pair[t * k + j];
      if (r < 0) continue;
      const float* g = a.dbuffer + Clamp(r, a.rows) * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] += g[c];
    }
  }
}

void CpuOps::RouterBackward(Context& ctx, const RouterBackwardArgs& a) {
  const double lb = a.tokens > 0 ? a.lb_weight * static_cast<double>(a.experts) /
                                       static_cast<double>(a.tokens)
                                 : 0.0;
#pragma omp parallel num_threads(ctx.threads())
  {
    std::vector<double> row(static_cast<size_t>(a.experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) RouterBackwardToken(a, lb, t, row.data());
  }
}

}  // namespace fp8moe::internal
