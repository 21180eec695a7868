// The ring of experts' dispatch and combine (moe/moe_ring.h). Each rank of
// an expert ring runs E / P experts on the tokens of the whole ring: the
// tokens and their routing are all-gathered, the partial outputs
// reduce-scattered. Between the collectives the ops of the single-rank
// layer run (kernels/ops.h PermuteRows, CombineRows, CombineRowsBackward,
// ScatterAddRows) over the ring's maps, whose pairs of other ranks' experts
// have no row (-1): each token's combine is the single-rank one restricted
// to the local slots, and the ring's f32 sum adds the ranks' partials.
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

Status RingDispatch(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
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
  // The local pairs, stably sorted by expert.
  s.ring_sizes.resize(U(s.E_local));
  std::vector<int64_t>& next = s.routing.next_row;  // scratch, free after Route
  next.resize(U(s.E_local));
  s.ring_row_of_pair.resize(U(TT * k));
  s.ring_pair_of_row.resize(U(TT * k));
  FP8MOE_ASSIGN_OR_RETURN(s.valid, SortByExpert(ctx, s.ring_expert.data(), TT * k, s.e0,
                                                s.E_local, s.ring_sizes.data(),
                                                s.ring_row_of_pair.data(),
                                                s.ring_pair_of_row.data(), next.data()));
  s.local_sizes = s.ring_sizes.data();
  return OkStatus();
}

Result<int64_t> RingMaxValid(State& s) {
  int64_t v = s.valid;
  FP8MOE_RETURN_IF_ERROR(s.ring->AllReduce(&v, &v, 1, DType::kI64, ReduceOp::kMax));
  return v;
}

Status RingGatherRows(Context& ctx, const State& s, void* buffer, DType act) {
  return PermuteRows(ctx, s.x_ring.data(), act, s.P * s.T, s.D, s.k, s.ring_pair_of_row.data(),
                     s.valid, buffer, act);
}

Status RingCombine(Context& ctx, State& s, const TensorView& y) {
  const int64_t TT = s.P * s.T, D = s.D;
  FP8MOE_ASSIGN_OR_RETURN(TensorView yr, Grow(&s.y_ring, DType::kF32, {TT, D}));
  FP8MOE_RETURN_IF_ERROR(CombineRows(ctx, s.ysv.data, s.act, s.valid, D,
                                     s.ring_row_of_pair.data(), s.ring_weight.data(), TT, s.k,
                                     yr.as<float>()));
  return s.ring->ReduceScatter(yr.data, y.data, s.T * D, DType::kF32, ReduceOp::kSum);
}

Status RingCombineBackward(Context& ctx, const ConstTensorView& dy, State& s) {
  const int64_t T = s.T, TT = s.P * T, D = s.D, k = s.k;
  FP8MOE_ASSIGN_OR_RETURN(TensorView dyr, Grow(&s.dy_ring, DType::kF32, {TT, D}));
  FP8MOE_RETURN_IF_ERROR(s.ring->AllGather(dy.data, dyr.data, T * D, DType::kF32));
  FP8MOE_ASSIGN_OR_RETURN(TensorView dwr, Grow(&s.dw_ring, DType::kF32, {TT * k}));
  // dweight is 0 for the pairs another rank runs: one rank holds each
  // pair's value, the others zero, and the ring's sum is exact.
  FP8MOE_RETURN_IF_ERROR(CombineRowsBackward(ctx, dyr.as<float>(), s.ysv.data, s.act, s.valid, D,
                                             s.ring_row_of_pair.data(), s.ring_weight.data(), TT,
                                             k, s.dys.data, dwr.as<float>()));
  return s.ring->ReduceScatter(dwr.data, s.dwv.data, T * k, DType::kF32, ReduceOp::kSum);
}

Status RingDispatchBackward(Context& ctx, State& s, const TensorView& dx) {
  const int64_t T = s.T, TT = s.P * T, D = s.D;
  FP8MOE_ASSIGN_OR_RETURN(TensorView dxr, Grow(&s.dx_ring, DType::kF32, {TT, D}));
  FP8MOE_RETURN_IF_ERROR(ScatterAddRows(ctx, s.dxs.as<float>(), s.valid, D,
                                        s.ring_row_of_pair.data(), TT, s.k,
                                        /*accumulate=*/false, dxr.as<float>()));
  FP8MOE_ASSIGN_OR_RETURN(TensorView part, Grow(&s.ring_tmp, DType::kF32, {T, D}));
  FP8MOE_RETURN_IF_ERROR(
      s.ring->ReduceScatter(dxr.data, part.data, T * D, DType::kF32, ReduceOp::kSum));
  return Add(ctx, dx.as<float>(), part.as<float>(), T * D, dx.as<float>());
}

}  // namespace fp8moe::internal
