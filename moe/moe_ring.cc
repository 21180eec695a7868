// The ring of experts' dispatch and combine (moe/moe_ring.h). Each rank of
// an expert ring runs E / P experts on the tokens of the whole ring: the
// tokens and their routing are all-gathered, the partial outputs
// reduce-scattered. The arithmetic of each token's combine is that of
// CombineRows / CombineBackward / ScatterAddRows (moe/routing.cc) restricted
// to the local slots; the ring's f32 sum then adds the ranks' partials.
#include "moe/moe_ring.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"
#include "fp8moe/quant.h"
#include "fp8moe/numerics.h"
#include "kernels/ops.h"
#include "moe/moe_workspace.h"
#include "moe/routing.h"

namespace fp8moe::internal {

using State = MoeWorkspace::State;

namespace {

size_t U(int64_t i) { return static_cast<size_t>(i); }

}  // namespace

Status RingDispatch(Context& ctx, const MoeConfig& cfg, const TensorView& x,
                    const MoeOptions& options, State& s) {
  (void)options;
  Communicator& ring = *s.ring;
  const int64_t T = s.T, D = s.D, k = s.k, P = s.P, TT = P * T;
  s.E_local = s.E / P;
  s.e0 = s.ring_index * s.E_local;
  // Tokens: this rank's block rounded to the activation dtype (the bits the
  // single-rank permute stores), then gathered in place.
  FP8MOE_ASSIGN_OR_RETURN(TensorView xr, Grow(&s.x_ring, s.act, {TT, D}));
  const int64_t own = s.ring_index * T * D;
  if (s.quantized_tokens) {
    // e4m3fn codes + f32 scale per token (D + 4 bytes against 2 D in bf16),
    // dequantized once into the activation dtype.
    FP8MOE_ASSIGN_OR_RETURN(TensorView q, Grow(&s.x_codes, DType::kU8, {TT, D}));
    FP8MOE_ASSIGN_OR_RETURN(TensorView sc, Grow(&s.x_scales, DType::kF32, {TT}));
    FP8MOE_ASSIGN_OR_RETURN(TensorView deq, Grow(&s.x_deq, DType::kF32, {TT, D}));
    FP8MOE_RETURN_IF_ERROR(GatherQuantizedTokens(ring, x.as<float>(), T, D, QuantDType::kE4M3FN,
                                                 cfg.act_quantization_calibration_method,
                                                 q.as<uint8_t>(), sc.as<float>()));
    FP8MOE_RETURN_IF_ERROR(DequantizeRows(ctx, q.as<uint8_t>(), TT, D, 0, sc.as<float>(),
                                          QuantDType::kE4M3FN, deq.as<float>()));
    if (s.act == DType::kF32) {
      if (TT * D > 0) std::memcpy(xr.data, deq.data, U(TT * D) * sizeof(float));
    } else {
      F32ToBf16Span(deq.as<float>(), xr.as<uint16_t>(), U(TT * D));
    }
  } else if (s.act == DType::kF32) {
    if (T * D > 0) std::memcpy(xr.as<float>() + own, x.data, U(T * D) * sizeof(float));
  } else {
    F32ToBf16Span(x.as<float>(), xr.as<uint16_t>() + own, U(T * D));
  }
  if (!s.quantized_tokens) {
    FP8MOE_RETURN_IF_ERROR(ring.AllGather(static_cast<const char*>(xr.data) +
                                              own * DTypeSize(s.act),
                                          xr.data, T * D, s.act));
  }
  // Routing: expert ids and weights of every ring token.
  s.ring_expert.resize(U(TT * k));
  s.ring_weight.resize(U(TT * k));
  FP8MOE_RETURN_IF_ERROR(
      ring.AllGather(s.routing.expert.data(), s.ring_expert.data(), T * k, DType::kI32));
  FP8MOE_RETURN_IF_ERROR(
      ring.AllGather(s.routing.weight.data(), s.ring_weight.data(), T * k, DType::kF32));
  // The local pairs, stably sorted by expert (a counting sort).
  s.ring_sizes.assign(U(s.E_local), 0);
  for (int32_t e : s.ring_expert) {
    if (e >= s.e0 && e < s.e0 + s.E_local) ++s.ring_sizes[U(e - s.e0)];
  }
  std::vector<int64_t>& next = s.routing.next_row;  // scratch, free after Route
  next.assign(U(s.E_local), 0);
  for (int64_t e = 1; e < s.E_local; ++e) next[U(e)] = next[U(e - 1)] + s.ring_sizes[U(e - 1)];
  s.valid = 0;
  for (int32_t n : s.ring_sizes) s.valid += n;
  s.ring_row_of_pair.assign(U(TT * k), -1);
  s.ring_pair_of_row.resize(U(s.valid));
  for (int64_t p = 0; p < TT * k; ++p) {
    const int32_t e = s.ring_expert[U(p)];
    if (e < s.e0 || e >= s.e0 + s.E_local) continue;
    const int64_t row = next[U(e - s.e0)]++;
    s.ring_row_of_pair[U(p)] = row;
    s.ring_pair_of_row[U(row)] = p;
  }
  s.local_sizes = s.ring_sizes.data();
  return OkStatus();
}

Result<int64_t> RingMaxValid(State& s) {
  int64_t v = s.valid;
  FP8MOE_RETURN_IF_ERROR(s.ring->AllReduce(&v, &v, 1, DType::kI64, ReduceOp::kMax));
  return v;
}

void RingGatherRows(const State& s, void* buffer, DType act) {
  const int64_t TT = s.P * s.T, D = s.D;
  const size_t row_bytes = U(D) * DTypeSize(act);
  const char* src = static_cast<const char*>(s.x_ring.data());
  char* dst = static_cast<char*>(buffer);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < s.valid; ++i) {
    const int64_t t = Clamp(s.ring_pair_of_row[U(i)] / s.k, TT);
    if (row_bytes > 0) std::memcpy(dst + U(i) * row_bytes, src + U(t) * row_bytes, row_bytes);
  }
}

Status RingCombine(State& s, const TensorView& y) {
  const int64_t TT = s.P * s.T, D = s.D, k = s.k, rows = std::max<int64_t>(s.valid, 1);
  FP8MOE_ASSIGN_OR_RETURN(TensorView yr, Grow(&s.y_ring, DType::kF32, {TT, D}));
  float* yp = yr.as<float>();
#pragma omp parallel
  {
    std::vector<float> row(U(D));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < TT; ++t) {
      float* yt = yp + t * D;
      std::fill(yt, yt + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = s.ring_row_of_pair[U(t * k + j)];
        if (r < 0) continue;
        RowToF32(s.ysv.data, s.act, Clamp(r, rows), D, row.data());
        const float w = s.ring_weight[U(t * k + j)];
        for (int64_t c = 0; c < D; ++c) yt[c] += w * row[U(c)];
      }
    }
  }
  return s.ring->ReduceScatter(yp, y.data, s.T * D, DType::kF32, ReduceOp::kSum);
}

Status RingCombineBackward(const TensorView& dy, State& s) {
  const int64_t T = s.T, TT = s.P * T, D = s.D, k = s.k, rows = std::max<int64_t>(s.valid, 1);
  FP8MOE_ASSIGN_OR_RETURN(TensorView dyr, Grow(&s.dy_ring, DType::kF32, {TT, D}));
  FP8MOE_RETURN_IF_ERROR(s.ring->AllGather(dy.data, dyr.data, T * D, DType::kF32));
  FP8MOE_ASSIGN_OR_RETURN(TensorView dwr, Grow(&s.dw_ring, DType::kF32, {TT * k}));
  float* dw = dwr.as<float>();
  std::fill(dw, dw + TT * k, 0.0f);
  const float* dyp = dyr.as<float>();
#pragma omp parallel
  {
    std::vector<float> row(U(D)), g(U(D));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < s.valid; ++i) {
      const int64_t p = Clamp(s.ring_pair_of_row[U(i)], TT * k);
      const float* dyt = dyp + (p / k) * D;
      const float w = s.ring_weight[U(p)];
      for (int64_t c = 0; c < D; ++c) g[U(c)] = w * dyt[c];
      StoreRow(g.data(), D, s.dys.data, s.act, Clamp(i, rows));
      RowToF32(s.ysv.data, s.act, Clamp(i, rows), D, row.data());
      double d = 0.0;
      for (int64_t c = 0; c < D; ++c) d += static_cast<double>(dyt[c]) * row[U(c)];
      dw[p] = static_cast<float>(d);
    }
  }
  // One rank holds each pair's value, the others zero: the sum is exact.
  return s.ring->ReduceScatter(dw, s.dwv.data, T * k, DType::kF32, ReduceOp::kSum);
}

Status RingDispatchBackward(State& s, const TensorView& dx) {
  const int64_t T = s.T, TT = s.P * T, D = s.D, k = s.k, rows = std::max<int64_t>(s.valid, 1);
  FP8MOE_ASSIGN_OR_RETURN(TensorView dxr, Grow(&s.dx_ring, DType::kF32, {TT, D}));
  float* dp = dxr.as<float>();
  const float* dxs = s.dxs.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < TT; ++t) {
    float* d = dp + t * D;
    std::fill(d, d + D, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = s.ring_row_of_pair[U(t * k + j)];
      if (r < 0) continue;
      const float* g = dxs + Clamp(r, rows) * D;
      for (int64_t c = 0; c < D; ++c) d[c] += g[c];
    }
  }
  FP8MOE_ASSIGN_OR_RETURN(TensorView part, Grow(&s.ring_tmp, DType::kF32, {T, D}));
  FP8MOE_RETURN_IF_ERROR(
      s.ring->ReduceScatter(dp, part.data, T * D, DType::kF32, ReduceOp::kSum));
  float* out = dx.as<float>();
  const float* pp = part.as<float>();
  for (int64_t i = 0; i < T * D; ++i) out[i] += pp[i];
  return OkStatus();
}

}  // namespace fp8moe::internal
