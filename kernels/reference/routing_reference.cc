// The reference backend's routing and row permutation of the MoE layer
// (kernels/reference/ops_reference.h): plain loops on one thread, element by
// element, written from the contracts of kernels/ops.h. The contracts fix
// each op's arithmetic (the softmaxes and the router's backward in double
// in a stated order, the combines' f32 sums in slot order from +0), so the
// reference and the cpu backend agree bit for bit.
#include <cmath>
#include <cstring>
#include <vector>

#include "fp8moe/numerics.h"
#include "kernels/reference/ops_reference.h"

namespace fp8moe::internal {

namespace {

// Element i of a buffer of F32 or BF16, as f32.
float Load(const void* buffer, DType dtype, int64_t i) {
  return dtype == DType::kF32 ? static_cast<const float*>(buffer)[i]
                              : Bf16ToF32(static_cast<const uint16_t*>(buffer)[i]);
}

// v into element i of a buffer of F32 or BF16 (bf16: round to nearest even).
void Store(float v, void* buffer, DType dtype, int64_t i) {
  if (dtype == DType::kF32) {
    static_cast<float*>(buffer)[i] = v;
  } else {
    static_cast<uint16_t*>(buffer)[i] = F32ToBf16(v);
  }
}

// exp(v[i] - top) / sum_i exp(v[i] - top) of n values read through value(i),
// in double, summed in index order.
template <class Value>
void Softmax(int64_t n, double top, const Value& value, double* out) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(value(i) - top);
  for (int64_t i = 0; i < n; ++i) out[i] = std::exp(value(i) - top) / sum;
}

}  // namespace

void ReferenceOps::Route(Context&, const RouteArgs& a) {
  const int64_t E = a.experts, k = a.k, G = a.scoring.groups;
  const RouteScoring& sc = a.scoring;
  std::vector<bool> taken(static_cast<size_t>(E)), kept(static_cast<size_t>(G));
  std::vector<double> c(static_cast<size_t>(E)), group(static_cast<size_t>(G));
  // The sigmoid in double, exp(l) / (1 + exp(l)) below 0.
  auto sigmoid = [](double l) {
    return l >= 0 ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l) / (1.0 + std::exp(l));
  };
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* l = a.logits + t * E;
    int32_t* ex = a.expert + t * k;
    for (int64_t x = 0; x < E; ++x) {
      const double bias = sc.bias != nullptr ? sc.bias[x] : 0.0;
      c[static_cast<size_t>(x)] = sc.sigmoid ? sigmoid(l[x]) + bias : l[x];
    }
    // Each scan below runs in index order and moves on only to a strictly
    // larger value among those still open.
    const int64_t per = G > 0 ? E / G : E;
    for (int64_t g = 0; g < G; ++g) {
      int64_t i0 = -1, i1 = -1;
      for (int64_t x = g * per; x < (g + 1) * per; ++x) {
        if (i0 == -1 || c[static_cast<size_t>(x)] > c[static_cast<size_t>(i0)]) i0 = x;
      }
      for (int64_t x = g * per; x < (g + 1) * per; ++x) {
        if (x != i0 && (i1 == -1 || c[static_cast<size_t>(x)] > c[static_cast<size_t>(i1)])) i1 = x;
      }
      group[static_cast<size_t>(g)] = c[static_cast<size_t>(i0)] + c[static_cast<size_t>(i1)];
    }
    kept.assign(static_cast<size_t>(G), false);
    for (int64_t j = 0; j < sc.topk_groups; ++j) {
      int64_t best = -1;
      for (int64_t g = 0; g < G; ++g) {
        if (!kept[static_cast<size_t>(g)] &&
            (best == -1 || group[static_cast<size_t>(g)] > group[static_cast<size_t>(best)])) {
          best = g;
        }
      }
      kept[static_cast<size_t>(best)] = true;
    }
    // Slot j: the scan over the open experts not taken yet.
    taken.assign(static_cast<size_t>(E), false);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t x = 0; x < E; ++x) {
        const bool open = G == 0 || kept[static_cast<size_t>(x / per)];
        if (open && !taken[static_cast<size_t>(x)] &&
            (best == -1 || c[static_cast<size_t>(x)] > c[static_cast<size_t>(best)])) {
          best = x;
        }
      }
      taken[static_cast<size_t>(best)] = true;
      ex[j] = static_cast<int32_t>(best);
    }
    double* s = a.softmax + t * k;
    double sum = 0;
    if (sc.sigmoid) {
      for (int64_t j = 0; j < k; ++j) {
        s[j] = sigmoid(l[ex[j]]);
        sum += s[j];
      }
      for (int64_t j = 0; j < k; ++j) {
        const double w = sc.norm_topk_prob ? s[j] / (sum + 1e-20) : s[j];
        a.weight[t * k + j] = static_cast<float>(w * sc.scaling);
      }
    } else {
      Softmax(k, l[ex[0]], [&](int64_t j) { return static_cast<double>(l[ex[j]]); }, s);
      for (int64_t j = 0; j < k; ++j) sum += s[j];
      for (int64_t j = 0; j < k; ++j) {
        const double w = (sc.norm_topk_prob ? s[j] / sum : s[j]);
        a.weight[t * k + j] = static_cast<float>(w * sc.scaling);
      }
    }
    double top = l[0];
    for (int64_t x = 1; x < E; ++x) {
      if (l[x] > top) top = l[x];
    }
    Softmax(E, top, [&](int64_t x) { return static_cast<double>(l[x]); }, a.probs + t * E);
  }
}

void ReferenceOps::SortByExpert(Context&, const SortByExpertArgs& a) {
  for (int64_t p = 0; p < a.pairs; ++p) a.row_of_pair[p] = -1;
  int64_t row = 0;
  for (int64_t x = 0; x < a.count; ++x) {  // expert by expert, pairs in order
    a.group_sizes[x] = 0;
    for (int64_t p = 0; p < a.pairs; ++p) {
      if (a.expert[p] != a.first + x) continue;
      a.row_of_pair[p] = row;
      a.pair_of_row[row] = p;
      ++row;
      ++a.group_sizes[x];
    }
  }
  *a.rows = row;
}

void ReferenceOps::PermuteRows(Context&, const PermuteRowsArgs& a) {
  const size_t elem = DTypeSize(a.src_dtype);
  for (int64_t i = 0; i < a.rows; ++i) {
    const int64_t t = a.pair_of_row[i] / a.k;
    for (int64_t c = 0; c < a.cols; ++c) {
      const int64_t from = t * a.cols + c, to = i * a.cols + c;
      if (a.src_dtype == a.out_dtype) {  // the bits, NaN payloads included
        std::memcpy(static_cast<char*>(a.out) + static_cast<size_t>(to) * elem,
                    static_cast<const char*>(a.src) + static_cast<size_t>(from) * elem, elem);
      } else {
        Store(Load(a.src, a.src_dtype, from), a.out, a.out_dtype, to);
      }
    }
  }
}

void ReferenceOps::CombineRows(Context&, const CombineRowsArgs& a) {
  for (int64_t t = 0; t < a.tokens; ++t) {
    for (int64_t c = 0; c < a.cols; ++c) {
      float y = 0.0f;
      for (int64_t j = 0; j < a.k; ++j) {
        const int64_t r = a.row_of_pair[t * a.k + j];
        if (r >= 0) y += a.weight[t * a.k + j] * Load(a.buffer, a.dtype, r * a.cols + c);
      }
      a.y[t * a.cols + c] = y;
    }
  }
}

void ReferenceOps::CombineRowsBackward(Context&, const CombineRowsBackwardArgs& a) {
  for (int64_t p = 0; p < a.tokens * a.k; ++p) {
    const int64_t r = a.row_of_pair[p], t = p / a.k;
    double d = 0;
    for (int64_t c = 0; r >= 0 && c < a.cols; ++c) {
      const float dy = a.dy[t * a.cols + c];
      Store(a.weight[p] * dy, a.dbuffer, a.dtype, r * a.cols + c);
      d += static_cast<double>(dy) * Load(a.buffer, a.dtype, r * a.cols + c);
    }
    a.dweight[p] = static_cast<float>(d);
  }
}

void ReferenceOps::ScatterAddRows(Context&, const ScatterAddRowsArgs& a) {
  for (int64_t t = 0; t < a.tokens; ++t) {
    for (int64_t c = 0; c < a.cols; ++c) {
      float v = a.accumulate ? a.dx[t * a.cols + c] : 0.0f;
      for (int64_t j = 0; j < a.k; ++j) {
        const int64_t r = a.row_of_pair[t * a.k + j];
        if (r >= 0) v += a.dbuffer[r * a.cols + c];
      }
      a.dx[t * a.cols + c] = v;
    }
  }
}

void ReferenceOps::RouterBackward(Context&, const RouterBackwardArgs& a) {
  // dl_e = lb p_e (f_e - sum_x p_x f_x) (the load-balancing loss, lb =
  // weight E / T) + sum over the slots j with expert e of
  // s_j sum_i s_i (g_j - g_i) / S c (softmax scoring; sigmoid: kernels/ops.h).
  const int64_t E = a.experts, k = a.k;
  const double lb =
      a.tokens > 0 ? a.lb_weight * static_cast<double>(E) / static_cast<double>(a.tokens) : 0.0;
  std::vector<double> dl(static_cast<size_t>(E));
  for (int64_t t = 0; t < a.tokens; ++t) {
    const double* p = a.probs + t * E;
    const double* s = a.softmax + t * k;
    const float* g = a.dweight + t * k;
    double pf = 0;
    for (int64_t x = 0; x < E; ++x) pf += p[x] * a.fraction[x];
    for (int64_t x = 0; x < E; ++x) dl[static_cast<size_t>(x)] = lb * p[x] * (a.fraction[x] - pf);
    const double c = a.scoring.scaling;
    if (a.scoring.sigmoid) {
      // w_j = c s_j / D (D = sum s + 1e-20 with norm_topk_prob, else 1);
      // dl_j = s_j (1 - s_j) dL/ds_j.
      double D = 1;
      if (a.scoring.norm_topk_prob) {
        D = 1e-20;
        for (int64_t j = 0; j < k; ++j) D += s[j];
      }
      for (int64_t j = 0; j < k; ++j) {
        double ds = g[j];
        if (a.scoring.norm_topk_prob) {
          double d = 0;
          for (int64_t i = 0; i < k; ++i) d += s[i] * (static_cast<double>(g[j]) - g[i]);
          ds = (static_cast<double>(g[j]) * 1e-20 / D + d / D) / D;
        }
        dl[static_cast<size_t>(a.expert[t * k + j])] += s[j] * (1.0 - s[j]) * c * ds;
      }
    } else {
      double S = 1;
      if (a.scoring.norm_topk_prob) {
        S = 0;
        for (int64_t j = 0; j < k; ++j) S += s[j];
      }
      for (int64_t j = 0; j < k; ++j) {
        double d = 0;
        for (int64_t i = 0; i < k; ++i) d += s[i] * (static_cast<double>(g[j]) - g[i]);
        dl[static_cast<size_t>(a.expert[t * k + j])] += s[j] * d / S * c;
      }
    }
    for (int64_t x = 0; x < E; ++x) {
      a.dlogits[t * E + x] = static_cast<float>(dl[static_cast<size_t>(x)]);
    }
  }
}

}  // namespace fp8moe::internal
