#include "moe/routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp8moe/numerics.h"

namespace fp8moe::internal {

int64_t Clamp(int64_t i, int64_t n) { return std::min(std::max<int64_t>(i, 0), n - 1); }

// Both helpers return at once for a zero-width row: the row buffers of a
// D = 0 layer are empty vectors whose data() may be null, and memcpy must
// not be handed a null pointer even for zero bytes.
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

void Route(const float* logits, int64_t tokens, int64_t experts, int64_t k,
           bool norm_topk_prob, Routing* out) {
  Routing& r = *out;
  r.tokens = tokens;
  r.experts = experts;
  r.k = k;
  r.expert.resize(static_cast<size_t>(tokens * k));
  r.weight.resize(static_cast<size_t>(tokens * k));
  r.softmax.resize(static_cast<size_t>(tokens * k));
  r.probs.resize(static_cast<size_t>(tokens * experts));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    // Top-k by repeated selection: k is small; ties go to the lower expert.
    float* w = r.weight.data() + t * k;
    int32_t* e = r.expert.data() + t * k;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t x = 0; x < experts; ++x) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= e[i] == x;
        if (taken) continue;
        if (best < 0 || l[x] > l[best]) best = x;
      }
      e[j] = static_cast<int32_t>(best);
    }
    // Softmax over the k selected logits (e[0] holds the largest), in
    // double; the weights are it rounded once to f32 (after norm_topk_prob's
    // division by the sum, ~1).
    double* s = r.softmax.data() + t * k;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      s[j] = std::exp(static_cast<double>(l[e[j]]) - static_cast<double>(l[e[0]]));
      sum += s[j];
    }
    double norm = 0.0;
    for (int64_t j = 0; j < k; ++j) norm += (s[j] /= sum);
    for (int64_t j = 0; j < k; ++j) w[j] = static_cast<float>(norm_topk_prob ? s[j] / norm : s[j]);
    // Softmax over all experts, for the load-balancing loss, in double.
    double mx = l[0];
    for (int64_t x = 1; x < experts; ++x) mx = std::max(mx, static_cast<double>(l[x]));
    double* p = r.probs.data() + t * experts;
    double all = 0.0;
    for (int64_t x = 0; x < experts; ++x) {
      p[x] = std::exp(static_cast<double>(l[x]) - mx);
      all += p[x];
    }
    for (int64_t x = 0; x < experts; ++x) p[x] /= all;
  }
  // Stable counting sort of the pairs by expert.
  r.group_sizes.assign(static_cast<size_t>(experts), 0);
  for (int32_t e : r.expert) ++r.group_sizes[static_cast<size_t>(e)];
  std::vector<int64_t>& next = r.next_row;
  next.assign(static_cast<size_t>(experts), 0);
  for (int64_t x = 1; x < experts; ++x) {
    next[static_cast<size_t>(x)] = next[static_cast<size_t>(x - 1)] + r.group_sizes[static_cast<size_t>(x - 1)];
  }
  const int64_t pairs = tokens * k;
  r.row_of_pair.resize(static_cast<size_t>(pairs));
  r.pair_of_row.resize(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = next[static_cast<size_t>(r.expert[static_cast<size_t>(p)])]++;
    r.row_of_pair[static_cast<size_t>(p)] = row;
    r.pair_of_row[static_cast<size_t>(row)] = p;
  }
}

void LoadFractions(const Routing& r, const int64_t* batch, std::vector<double>* f) {
  const int64_t E = r.experts;
  f->resize(static_cast<size_t>(E));
  const int64_t tokens = batch != nullptr ? batch[E] : r.tokens;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t pairs = batch != nullptr ? batch[e] : r.group_sizes[static_cast<size_t>(e)];
    (*f)[static_cast<size_t>(e)] =
        static_cast<double>(pairs) / static_cast<double>(std::max<int64_t>(tokens * r.k, 1));
  }
}

double LoadBalanceLoss(const Routing& r, const std::vector<double>& f, double weight) {
  if (weight == 0.0 || r.tokens == 0) return 0.0;
  double loss = 0.0;
  for (int64_t e = 0; e < r.experts; ++e) {
    double p = 0.0;
    for (int64_t t = 0; t < r.tokens; ++t) p += r.probs[static_cast<size_t>(t * r.experts + e)];
    loss += f[static_cast<size_t>(e)] * (p / static_cast<double>(r.tokens));
  }
  return weight * static_cast<double>(r.experts) * loss;
}

void RouterBackward(const Routing& r, const std::vector<double>& f, const float* dweight,
                    bool norm_topk_prob, double lb_weight, float* dlogits) {
  const int64_t E = r.experts, k = r.k;
  const double lb = r.tokens > 0 ? lb_weight * static_cast<double>(E) / static_cast<double>(r.tokens) : 0.0;
#pragma omp parallel
  {
    std::vector<double> row(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < r.tokens; ++t) {
      // Load-balancing loss through p_e = mean softmax: dP/dl = P (1 - P).
      // In double: 1 - P of a saturated softmax is not lost to rounding.
      const double* p = r.probs.data() + t * E;
      double pf = 0.0;
      for (int64_t e = 0; e < E; ++e) pf += p[e] * f[static_cast<size_t>(e)];
      for (int64_t e = 0; e < E; ++e) {
        row[static_cast<size_t>(e)] = lb * p[e] * (f[static_cast<size_t>(e)] - pf);
      }
      // Routing weights: the softmax s over the selected logits, whose
      // backward s_j (g_j - sum_i s_i g_i) is written s_j sum_i s_i (g_j - g_i)
      // (sum_i s_i = 1). Where s saturates (s_0 ~ 1) the first form subtracts
      // two numbers of the size of g to leave s_1 (g_0 - g_1): from the f32
      // weights (s_0 rounded to 1, or within 3e-8 of 1 - s_1) that was all
      // rounding (issue 35). The second has no such difference.
      // norm_topk_prob, w = s / S with S = sum s, only shifts g by a
      // constant, which the differences drop, and divides it by S.
      const double* s = r.softmax.data() + t * k;
      const float* g = dweight + t * k;
      double S = 1.0;
      if (norm_topk_prob) {
        S = 0.0;
        for (int64_t j = 0; j < k; ++j) S += s[j];
      }
      const int32_t* ex = r.expert.data() + t * k;
      for (int64_t j = 0; j < k; ++j) {
        double d = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          d += s[i] * (static_cast<double>(g[j]) - static_cast<double>(g[i]));
        }
        row[static_cast<size_t>(ex[j])] += s[j] * d / S;
      }
      float* dl = dlogits + t * E;
      for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(row[static_cast<size_t>(e)]);
    }
  }
}

void GatherRows(const Routing& r, const float* x, int64_t cols, void* buffer,
                DType dtype) {
  const int64_t rows = r.tokens * r.k;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = Clamp(r.pair_of_row[static_cast<size_t>(i)] / r.k, r.tokens);
    StoreRow(x + t * cols, cols, buffer, dtype, i);
  }
}

void CombineRows(const Routing& r, const void* buffer, DType dtype, int64_t cols, float* y) {
  const int64_t rows = r.tokens * r.k;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < r.tokens; ++t) {
      float* yt = y + t * cols;
      std::fill(yt, yt + cols, 0.0f);
      for (int64_t j = 0; j < r.k; ++j) {
        const int64_t i = Clamp(r.row_of_pair[static_cast<size_t>(t * r.k + j)], rows);
        RowToF32(buffer, dtype, i, cols, row.data());
        const float w = r.weight[static_cast<size_t>(t * r.k + j)];
        for (int64_t c = 0; c < cols; ++c) yt[c] += w * row[static_cast<size_t>(c)];
      }
    }
  }
}

void CombineBackward(const Routing& r, const float* dy, const void* buffer,
                     DType dtype, int64_t cols, void* dbuffer, float* dweight) {
  const int64_t rows = r.tokens * r.k;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(cols)), g(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < r.tokens; ++t) {
      const float* dyt = dy + t * cols;
      for (int64_t j = 0; j < r.k; ++j) {
        const int64_t p = t * r.k + j;
        const int64_t i = Clamp(r.row_of_pair[static_cast<size_t>(p)], rows);
        const float w = r.weight[static_cast<size_t>(p)];
        for (int64_t c = 0; c < cols; ++c) g[static_cast<size_t>(c)] = w * dyt[c];
        StoreRow(g.data(), cols, dbuffer, dtype, i);
        RowToF32(buffer, dtype, i, cols, row.data());
        double d = 0.0;
        for (int64_t c = 0; c < cols; ++c) d += static_cast<double>(dyt[c]) * row[static_cast<size_t>(c)];
        dweight[p] = static_cast<float>(d);
      }
    }
  }
}

void ScatterAddRows(const Routing& r, const float* dbuffer, int64_t cols, float* dx) {
  const int64_t rows = r.tokens * r.k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < r.tokens; ++t) {
    float* d = dx + t * cols;
    for (int64_t j = 0; j < r.k; ++j) {
      const int64_t i = Clamp(r.row_of_pair[static_cast<size_t>(t * r.k + j)], rows);
      const float* g = dbuffer + i * cols;
      for (int64_t c = 0; c < cols; ++c) d[c] += g[c];
    }
  }
}

}  // namespace fp8moe::internal
