// Shared helpers of the MoE ring and chunk tests: the layer on P thread
// ranks of an expert ring (P = 1: one rank) against the single-rank layer,
// and a comparison of two outputs.
#ifndef FP8MOE_MOE_MOE_RING_TEST_UTIL_H_
#define FP8MOE_MOE_MOE_RING_TEST_UTIL_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"
#include "fp8moe/moe.h"
#include "moe/moe_test_util.h"

namespace fp8moe::test {

inline Tensor F32(const Shape& s) { return std::move(Tensor::Create(DType::kF32, s)).value(); }

// Outputs of the whole batch: y, dx [P*T, D], drouter [D, E], dwi, dwo whole.
struct Out {
  Tensor y, dx, dr, dwi, dwo;
  double aux = 0;
  std::vector<MoeStats> stats;  // per rank
  explicit Out(const LayerInputs& in)
      : y(F32(in.x.shape())), dx(F32(in.x.shape())), dr(F32(in.router.shape())),
        dwi(F32(in.wi.shape())), dwo(F32(in.wo.shape())) {}
};

// Rows [first, first + n) of an f32 tensor: a read-only view of a const
// tensor (an input), a writable one of a mutable tensor (an output).
template <class T>
auto Rows(T& t, int64_t first, int64_t n) {
  auto v = t.view();
  const int64_t row = static_cast<int64_t>(t.num_elements()) / v.shape[0];
  v.data = t.template data_as<float>() + first * row;
  v.shape[0] = n;
  return v;
}

inline Status RunWhole(const MoeConfig& cfg, const LayerInputs& in, Out* out) {
  Context ctx;
  PreparedMoeWeights p;
  MoeWorkspace ws;
  MoeStepInfo info;
  FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), &p));
  FP8MOE_RETURN_IF_ERROR(
      MoeForward(ctx, cfg, in.x.view(), in.weights(), p, &ws, out->y.view(), &info));
  out->aux = info.aux_loss;
  out->stats = {info.stats};
  return MoeBackward(ctx, cfg, in.x.view(), in.weights(), p, &ws, in.dy.view(),
                     {out->dx.view(), out->dr.view(), out->dwi.view(), out->dwo.view()});
}

// P ranks: rank r takes tokens [r T, (r+1) T) and experts [r E/P, (r+1) E/P).
// drouter: the ranks' shares added in rank order; aux: their sum. Each rank's
// aux loss is of its own tokens' mean probabilities (with the whole batch's
// fractions), so the ranks' sum is the single-rank aux loss when each runs
// with load_balance_loss_weight / P (the trainer's 1 / N on every gradient
// does the same).
inline Status RunRing(int P, const MoeConfig& cfg, const LayerInputs& in, Out* out,
               bool poison = false) {
  const int64_t T = in.x.shape()[0] / P, E = cfg.num_experts, El = E / P;
  std::vector<Tensor> dr(static_cast<size_t>(P));
  std::vector<double> aux(static_cast<size_t>(P));
  out->stats.assign(static_cast<size_t>(P), {});
  FP8MOE_RETURN_IF_ERROR(RunThreadRanks(P, [&](Communicator& comm) -> Status {
    const int r = comm.rank();
    Context ctx;
    MoeOptions o;
    o.ranks.expert_ring = &comm;
    o.poison_tail_rows = poison;
    o.ranks.batch = &comm;
    const int64_t e_first = El <= 0 ? 0 : r * El;
    const ConstTensorView wi = Rows(in.wi, e_first, El), wo = Rows(in.wo, e_first, El);
    MoeWeights w = in.weights();
    w.wi = wi;
    w.wo = wo;
    PreparedMoeWeights p;
    MoeWorkspace ws;
    MoeStepInfo info;
    FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, wi, wo, &p));
    const ConstTensorView x = Rows(in.x, r * T, T);
    FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, cfg, x, w, p, &ws, Rows(out->y, r * T, T), &info, o));
    aux[static_cast<size_t>(r)] = info.aux_loss;
    out->stats[static_cast<size_t>(r)] = info.stats;
    dr[static_cast<size_t>(r)] = F32(in.router.shape());
    return MoeBackward(ctx, cfg, x, w, p, &ws, Rows(in.dy, r * T, T),
                       {Rows(out->dx, r * T, T), dr[static_cast<size_t>(r)].view(),
                        Rows(out->dwi, e_first, El), Rows(out->dwo, e_first, El)},
                       o);
  }));
  float* d = out->dr.data_as<float>();
  std::memcpy(d, dr[0].data(), dr[0].num_bytes());
  for (int r = 1; r < P; ++r) {
    for (size_t i = 0; i < out->dr.num_elements(); ++i) d[i] += dr[static_cast<size_t>(r)].data_as<float>()[i];
  }
  out->aux = 0;
  for (double a : aux) out->aux += a;
  return OkStatus();
}

// max |a - b| / max |b|, and the fraction of elements whose bits differ.
struct Diff {
  double rel = 0, differ = 0;
};
inline Diff Compare(const Tensor& a, const Tensor& b) {
  double m = 0, d = 0;
  size_t n = 0;
  const float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  for (size_t i = 0; i < a.num_elements(); ++i) {
    m = std::max(m, static_cast<double>(std::fabs(y[i])));
    d = std::max(d, std::fabs(static_cast<double>(x[i]) - y[i]));
    n += std::memcmp(x + i, y + i, 4) != 0;
  }
  return {m > 0 ? d / m : d, static_cast<double>(n) / std::max<size_t>(a.num_elements(), 1)};
}


// Diffs of y, dx, drouter, dwi, dwo (kOutNames) of a against b; *line
// gets "NAME REL (PCT% differ)" for each.
inline constexpr const char* kOutNames[] = {"y", "dx", "drouter", "dwi", "dwo"};
inline std::array<Diff, 5> CompareOuts(const Out& a, const Out& b, std::string* line) {
  const Tensor* x[] = {&a.y, &a.dx, &a.dr, &a.dwi, &a.dwo};
  const Tensor* y[] = {&b.y, &b.dx, &b.dr, &b.dwi, &b.dwo};
  std::array<Diff, 5> d;
  for (int i = 0; i < 5; ++i) {
    d[i] = Compare(*x[i], *y[i]);
    char buf[96];
    std::snprintf(buf, sizeof(buf), " %s %.1e (%.0f%% differ)", kOutNames[i], d[i].rel,
                  100 * d[i].differ);
    *line += buf;
  }
  return d;
}

}  // namespace fp8moe::test

#endif  // FP8MOE_MOE_MOE_RING_TEST_UTIL_H_
