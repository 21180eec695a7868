// The dense per-token twin of the MoE layer (include/fp8moe/moe.h): router,
// top-k, the routed rows in expert order, wi GMM + SwiGLU, wo GMM, weighted
// combine and the load-balancing loss; then the backward of
// L = sum(y * dy) + aux. Plain loops and double sums, one step of moe.h's
// semantics at a time; slow on purpose, it is the yardstick for the fast
// layer. The QAT modes' weights and GMMs live in moe_reference_quant.cc.
//
// Precision: a bf16 layer (dtype = bfloat16 or any QAT mode) rounds exactly
// where moe.h says: GMM outputs to f32, act() to bf16. An f32 layer keeps
// every intermediate in double (the fast layer's f32 rounding is within the
// comparison tolerance), so the returned `loss` is a smooth function of the
// inputs and finite differences can check the gradients. Router logits and
// routing weights are double in both.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fp8moe/moe.h"
#include "kernels/gmm_problem.h"
#include "moe/reference/moe_reference_quant.h"
#include "moe/reference/routing_reference.h"

namespace fp8moe::reference {
namespace {

using moe_internal::Acc;
using moe_internal::Act;
using moe_internal::LayerNumerics;
using moe_internal::QuantizedRows;
using moe_internal::SortedRows;
using moe_internal::WeightOperand;

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

struct Dims {
  int64_t t = 0, d = 0, f = 0, e = 0, k = 0;
};

// Checks one tensor's dtype (F32) and shape; `what` names it in the error.
Status CheckF32(const std::string& what, const ConstTensorView& v, const Shape& want) {
  if (v.dtype != DType::kF32) {
    return InvalidArgument(what + " must be f32, got " +
                           std::string(DTypeName(v.dtype)));
  }
  if (v.shape != want) {
    return InvalidArgument(what + " must have shape " + ShapeToString(want) +
                           ", got " + ShapeToString(v.shape));
  }
  if (v.data == nullptr && v.num_elements() > 0) {
    return InvalidArgument(what + " has no data");
  }
  return OkStatus();
}

// x [T, D], router [D, E], wi [E, D, 2F], wo [E, F, D], dy [T, D].
Result<Dims> CheckShapes(const MoeConfig& config, const ConstTensorView& x, const MoeWeights& w,
                         const ConstTensorView* dy) {
  if (x.rank() != 2) {
    return InvalidArgument("x must be [T, D], got " + ShapeToString(x.shape));
  }
  if (w.wo.rank() != 3) {
    return InvalidArgument("wo must be [E, F, D], got " +
                           ShapeToString(w.wo.shape));
  }
  Dims dims;
  dims.t = x.shape[0];
  dims.d = x.shape[1];
  dims.e = config.num_experts;
  dims.f = w.wo.shape[1];
  dims.k = config.num_experts_per_tok;
  FP8MOE_RETURN_IF_ERROR(CheckF32("x", x, {dims.t, dims.d}));
  FP8MOE_RETURN_IF_ERROR(
      CheckF32("router (num_experts=" + std::to_string(dims.e) + ")", w.router,
               {dims.d, dims.e}));
  FP8MOE_RETURN_IF_ERROR(CheckF32("wi", w.wi, {dims.e, dims.d, 2 * dims.f}));
  FP8MOE_RETURN_IF_ERROR(CheckF32("wo", w.wo, {dims.e, dims.f, dims.d}));
  if (w.route_bias.data != nullptr) {
    FP8MOE_RETURN_IF_ERROR(CheckF32("route_bias", w.route_bias, {dims.e}));
  }
  if (dy != nullptr) {
    FP8MOE_RETURN_IF_ERROR(CheckF32("dy", *dy, {dims.t, dims.d}));
  }
  return dims;
}

// Steps 1-3 of moe.h for all tokens.
struct Routing {
  std::vector<double> probs;     // [T, E] softmax over all E logits (aux)
  std::vector<int64_t> expert;   // [T*k] expert of pair p = t*k + j
  std::vector<double> logits;    // [T, E]
  std::vector<double> softmax;   // [T*k] softmax over the k selected (sigmoid: their scores)
  std::vector<double> weight;    // [T*k] w[t, j] (norm_topk_prob applied)
  std::vector<int64_t> pair_of;  // [T*k] sorted row i -> its pair
  SortedRows rows;               // expert of each sorted row, group sizes
};

// x [T, D], router [D, E] -> the routing of every token.
// bias [E] (MoeWeights::route_bias) or null.
Routing Route(const MoeConfig& config, const Dims& dims, const float* x,
              const float* router, const float* bias) {
  const int64_t t_n = dims.t, e_n = dims.e, k = dims.k;
  Routing r;
  r.probs.resize(Idx(t_n * e_n));
  r.logits.resize(Idx(t_n * e_n));
  r.expert.resize(Idx(t_n * k));
  r.softmax.resize(Idx(t_n * k));
  r.weight.resize(Idx(t_n * k));
  std::vector<double> logits(Idx(e_n));
  for (int64_t t = 0; t < t_n; ++t) {
    for (int64_t e = 0; e < e_n; ++e) {
      double acc = 0.0;
      for (int64_t d = 0; d < dims.d; ++d) {
        acc += static_cast<double>(x[t * dims.d + d]) * router[d * e_n + e];
      }
      logits[Idx(e)] = acc;
    }
    // Softmax over all E (only the aux loss reads it).
    double lmax = logits[0], sum = 0.0;
    for (double l : logits) lmax = std::fmax(lmax, l);
    for (int64_t e = 0; e < e_n; ++e) {
      r.probs[Idx(t * e_n + e)] = std::exp(logits[Idx(e)] - lmax);
      sum += r.probs[Idx(t * e_n + e)];
    }
    for (int64_t e = 0; e < e_n; ++e) r.probs[Idx(t * e_n + e)] /= sum;
    // The choice and the weights: routing_reference.h.
    const TokenRoute route = RouteToken(config, logits.data(), bias, e_n);
    for (int64_t j = 0; j < k; ++j) {
      r.expert[Idx(t * k + j)] = route.expert[Idx(j)];
      r.softmax[Idx(t * k + j)] = route.score[Idx(j)];
      r.weight[Idx(t * k + j)] = route.weight[Idx(j)];
    }
    std::copy(logits.begin(), logits.end(), r.logits.begin() + t * e_n);
  }
  // Pairs sorted stably by expert: expert by expert, pairs in index order.
  r.rows.m = t_n * k;
  r.rows.group_sizes.assign(Idx(e_n), 0);
  for (int64_t e = 0; e < e_n; ++e) {
    for (int64_t p = 0; p < t_n * k; ++p) {
      if (r.expert[Idx(p)] != e) continue;
      r.pair_of.push_back(p);
      r.rows.expert.push_back(e);
      ++r.rows.group_sizes[Idx(e)];
    }
  }
  return r;
}

// f_e = group_sizes[e] / (T*k): the routed fraction of expert e [E].
std::vector<double> RoutedFractions(const Dims& dims, const Routing& r) {
  std::vector<double> frac(Idx(dims.e), 0.0);
  if (dims.t == 0) return frac;  // no tokens: no fraction, aux = 0
  for (int64_t e = 0; e < dims.e; ++e) {
    frac[Idx(e)] = static_cast<double>(r.rows.group_sizes[Idx(e)]) /
                   static_cast<double>(dims.t * dims.k);
  }
  return frac;
}

// The f32 tensor [shape] of doubles v (rounded once).
Result<Tensor> F32Tensor(const std::vector<double>& v, Shape shape) {
  FP8MOE_ASSIGN_OR_RETURN(Tensor out, Tensor::Create(DType::kF32, shape));
  float* o = out.data_as<float>();
  for (size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(v[i]);
  return out;
}

// The router's gradient dlogits [T, E] of L: the selected-softmax backward of
// dw [T*k] (dL/dw[t, j]) plus the aux loss's part.
std::vector<double> LogitGradients(const MoeConfig& config, const Dims& dims,
                                   const Routing& r,
                                   const std::vector<double>& dw) {
  const int64_t e_n = dims.e, k = dims.k;
  std::vector<double> dlogits(Idx(dims.t * e_n), 0.0);
  const std::vector<double> frac = RoutedFractions(dims, r);
  for (int64_t t = 0; t < dims.t; ++t) {
    TokenRoute route;
    for (int64_t j = 0; j < k; ++j) {
      route.expert.push_back(r.expert[Idx(t * k + j)]);
      route.score.push_back(r.softmax[Idx(t * k + j)]);
      route.weight.push_back(r.weight[Idx(t * k + j)]);
    }
    RouteTokenBackward(config, &r.logits[Idx(t * e_n)], route, &dw[Idx(t * k)],
                       &dlogits[Idx(t * e_n)]);
    // aux = lbw * E * sum_e f_e * mean_t P[t, e] with f constant:
    // daux/dlogits[t, e] = lbw * E / T * P[t, e] (f_e - sum_e' f_e' P[t, e']).
    const double* p = &r.probs[Idx(t * e_n)];
    double fp = 0.0;
    for (int64_t e = 0; e < e_n; ++e) fp += frac[Idx(e)] * p[e];
    const double c = config.load_balance_loss_weight *
                     static_cast<double>(e_n) / static_cast<double>(dims.t);
    for (int64_t e = 0; e < e_n; ++e) {
      dlogits[Idx(t * e_n + e)] += c * p[e] * (frac[Idx(e)] - fp);
    }
  }
  return dlogits;
}

}  // namespace

// x [T, D] f32, router [D, E], wi [E, D, 2F], wo [E, F, D], dy [T, D] or null.
Result<MoeReferenceResult> MoeLayer(const MoeConfig& config, const ConstTensorView& x,
                                    const MoeWeights& w, const ConstTensorView* dy) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(config));
  FP8MOE_ASSIGN_OR_RETURN(const Dims dims, CheckShapes(config, x, w, dy));
  const int64_t t_n = dims.t, d_n = dims.d, f_n = dims.f, e_n = dims.e,
                k = dims.k, f2 = 2 * f_n;
  const LayerNumerics num = moe_internal::NumericsOf(config);
  const float* xv = x.as<float>();
  const float* router = w.router.as<float>();

  // ---- Forward ----
  const Routing r = Route(config, dims, xv, router,
                          w.route_bias.data != nullptr ? w.route_bias.as<float>() : nullptr);
  const SortedRows& rows = r.rows;
  const int64_t m = rows.m;
  FP8MOE_ASSIGN_OR_RETURN(
      const WeightOperand wi,
      moe_internal::PresentWeight(num, w.wi.as<float>(), e_n, d_n, f2));
  FP8MOE_ASSIGN_OR_RETURN(
      const WeightOperand wo,
      moe_internal::PresentWeight(num, w.wo.as<float>(), e_n, f_n, d_n));

  // xs [M, D] = act(x[t(i)]).
  std::vector<double> xs(Idx(m * d_n));
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = r.pair_of[Idx(i)] / k;
    for (int64_t d = 0; d < d_n; ++d) {
      xs[Idx(i * d_n + d)] = Act(num, xv[t * d_n + d]);
    }
  }
  // h [M, 2F] (gate | up); a [M, F] = act(silu(gate) * up) from the
  // unrounded h; hs [M, 2F] = act(h), what the backward reads.
  QuantizedRows xq, aq;
  FP8MOE_ASSIGN_OR_RETURN(const std::vector<double> h,
                          moe_internal::ForwardGmm(num, wi, rows, xs, &xq));
  std::vector<double> a(Idx(m * f_n)), hs(Idx(m * f2));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < f_n; ++j) {
      const double gate = h[Idx(i * f2 + j)], up = h[Idx(i * f2 + f_n + j)];
      a[Idx(i * f_n + j)] = Act(num, Acc(num, internal::SiluRef(gate) * up));
    }
    for (int64_t j = 0; j < f2; ++j) {
      hs[Idx(i * f2 + j)] = Act(num, h[Idx(i * f2 + j)]);
    }
  }
  // ys [M, D] = act(a @ wo').
  FP8MOE_ASSIGN_OR_RETURN(std::vector<double> ys,
                          moe_internal::ForwardGmm(num, wo, rows, a, &aq));
  for (double& v : ys) v = Act(num, v);
  // y [T, D] = sum_j w[t, j] * ys[row of (t, j)].
  std::vector<double> y(Idx(t_n * d_n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p = r.pair_of[Idx(i)], t = p / k;
    for (int64_t d = 0; d < d_n; ++d) {
      y[Idx(t * d_n + d)] += r.weight[Idx(p)] * ys[Idx(i * d_n + d)];
    }
  }
  // aux = lbw * E * sum_e f_e * p_e, p_e = mean over tokens of P[t, e].
  const std::vector<double> frac = RoutedFractions(dims, r);
  double aux = 0.0;
  for (int64_t e = 0; e < e_n; ++e) {
    double pe = 0.0;
    for (int64_t t = 0; t < t_n; ++t) pe += r.probs[Idx(t * e_n + e)];
    if (t_n > 0) aux += frac[Idx(e)] * pe / static_cast<double>(t_n);
  }
  aux *= config.load_balance_loss_weight * static_cast<double>(e_n);

  MoeReferenceResult out;
  FP8MOE_ASSIGN_OR_RETURN(out.y, F32Tensor(y, {t_n, d_n}));
  FP8MOE_ASSIGN_OR_RETURN(out.group_sizes, Tensor::Create(DType::kI32, {e_n}));
  for (int64_t e = 0; e < e_n; ++e) {
    out.group_sizes.data_as<int32_t>()[e] = rows.group_sizes[Idx(e)];
  }
  out.aux_loss = aux;
  out.loss = aux;
  if (dy == nullptr) return out;

  // ---- Backward of L = sum(y * dy) + aux ----
  const float* dyv = dy->as<float>();
  for (int64_t i = 0; i < t_n * d_n; ++i) out.loss += y[Idx(i)] * dyv[i];
  // dys [M, D] = act(w[t, j] * dy[t]); dw [T*k] = dy[t] . ys[row of (t, j)].
  std::vector<double> dys(Idx(m * d_n)), dw(Idx(t_n * k), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t p = r.pair_of[Idx(i)], t = p / k;
    for (int64_t d = 0; d < d_n; ++d) {
      const double g = dyv[t * d_n + d];
      dys[Idx(i * d_n + d)] = Act(num, Acc(num, r.weight[Idx(p)] * g));
      dw[Idx(p)] += g * ys[Idx(i * d_n + d)];
    }
  }
  // wo: da [M, F] = dys @ wo'^T; dwo [E, F, D] = a^T dys per group.
  FP8MOE_ASSIGN_OR_RETURN(const std::vector<double> da,
                          moe_internal::DlhsGmm(num, wo, rows, dys));
  FP8MOE_ASSIGN_OR_RETURN(
      const std::vector<double> dwo,
      moe_internal::DrhsGmm(num, wo, rows, a, aq, dys, num.wo_quant_tile));
  // dSwiGLU from the saved hs: dgate = da * up * silu'(gate),
  // dup = da * silu(gate), each act-rounded. dh [M, 2F].
  std::vector<double> dh(Idx(m * f2));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < f_n; ++j) {
      const double g = da[Idx(i * f_n + j)];
      const double gate = hs[Idx(i * f2 + j)], up = hs[Idx(i * f2 + f_n + j)];
      dh[Idx(i * f2 + j)] =
          Act(num, Acc(num, g * up * internal::SiluGradRef(gate)));
      dh[Idx(i * f2 + f_n + j)] =
          Act(num, Acc(num, g * internal::SiluRef(gate)));
    }
  }
  // wi: dxs [M, D] = dh @ wi'^T; dwi [E, D, 2F] = xs^T dh per group.
  FP8MOE_ASSIGN_OR_RETURN(const std::vector<double> dxs,
                          moe_internal::DlhsGmm(num, wi, rows, dh));
  FP8MOE_ASSIGN_OR_RETURN(
      const std::vector<double> dwi,
      moe_internal::DrhsGmm(num, wi, rows, xs, xq, dh, num.wi_quant_tile));
  // dx [T, D] = sum over a token's rows of dxs + dlogits @ Wr^T;
  // drouter [D, E] = x^T dlogits.
  std::vector<double> dx(Idx(t_n * d_n), 0.0), drouter(Idx(d_n * e_n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = r.pair_of[Idx(i)] / k;
    for (int64_t d = 0; d < d_n; ++d) {
      dx[Idx(t * d_n + d)] += dxs[Idx(i * d_n + d)];
    }
  }
  const std::vector<double> dlogits = LogitGradients(config, dims, r, dw);
  for (int64_t t = 0; t < t_n; ++t) {
    for (int64_t d = 0; d < d_n; ++d) {
      for (int64_t e = 0; e < e_n; ++e) {
        const double g = dlogits[Idx(t * e_n + e)];
        dx[Idx(t * d_n + d)] += g * router[d * e_n + e];
        drouter[Idx(d * e_n + e)] += static_cast<double>(xv[t * d_n + d]) * g;
      }
    }
  }
  FP8MOE_ASSIGN_OR_RETURN(out.dx, F32Tensor(dx, {t_n, d_n}));
  FP8MOE_ASSIGN_OR_RETURN(out.drouter, F32Tensor(drouter, {d_n, e_n}));
  FP8MOE_ASSIGN_OR_RETURN(out.dwi, F32Tensor(dwi, {e_n, d_n, f2}));
  FP8MOE_ASSIGN_OR_RETURN(out.dwo, F32Tensor(dwo, {e_n, f_n, d_n}));
  return out;
}

}  // namespace fp8moe::reference
