// The stages of the MoE layer (moe/moe_stages.h): route, dispatch, expert
// GMMs, combine and their backward, on one rank or on an expert ring
// (moe/moe_ring.cc has the ring's dispatch and combine).
#include "moe/moe_stages.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/ops.h"
#include "moe/gmm_ctx.h"
#include "moe/moe_ring.h"
#include "moe/routing.h"

namespace fp8moe::internal {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The forward GMM options of the mode (docs/design.md §4).
GmmOptions ForwardOptions(const MoeConfig& cfg, const MoeQuantPlan& plan, DType act,
                          const GmmTiles& tiles) {
  GmmOptions o;
  o.tiles = tiles;
  switch (plan.mode) {
    case MoeQatMode::kNone:
      o.mode = act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
      break;
    case MoeQatMode::kFakeQat:
      o.mode = GmmMode::kFakeQat;
      break;
    default:
      if (plan.fwd.lhs == QuantDType::kInt8) {
        o.mode = GmmMode::kInt8;
      } else {
        o.mode = GmmMode::kNativeFp8;
        o.fp8_dtype = *plan.fwd.lhs;
        if (plan.mode == MoeQatMode::kNativeFwd || plan.mode == MoeQatMode::kNativeFwdDlhs) {
          o.lhs_quant_block_size = cfg.moe_lhs_quant_block_size;
        }
      }
      o.lhs_calibration = cfg.act_quantization_calibration_method;
      break;
  }
  return o;
}

void Report(const MoeOptions& o, const std::string& name, GmmMode mode,
            std::optional<QuantDType> lhs, std::optional<QuantDType> rhs) {
  if (o.on_gmm) o.on_gmm(MoeGmmCall{name, mode, lhs, rhs});
}


// The router's single group of T rows.
Result<TensorView> OneGroup(MoeState& s) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, Grow(&s.one, DType::kI32, {1}));
  one.as<int32_t>()[0] = static_cast<int32_t>(s.T);
  return one;
}

// Rows of the ragged buffer for `valid` local pairs out of `all` (the pairs
// of the ring), and whether the static buffer overflowed. The static size is
// ragged_buffer_factor x the balanced share all / P. The routing is known
// before any GMM runs, so an overflow is caught here and the step runs on the
// dropless buffer instead. On a ring the decision is collective: every rank
// takes the largest valid count of the ring, so all ranks rerun together
// with buffers of one size.
Result<int64_t> BufferRows(const MoeConfig& cfg, MoeState& s, int64_t all, MoeStats* stats) {
  *stats = {};
  stats->valid_rows = s.valid;
  int64_t need = s.valid;
  if (s.P > 1) {
    FP8MOE_ASSIGN_OR_RETURN(need, RingMaxValid(s));
  }
  int64_t rows = s.valid;
  if (cfg.ragged_buffer_factor > 0) {
    const double share = static_cast<double>(all) / static_cast<double>(s.P);
    rows = static_cast<int64_t>(std::ceil(cfg.ragged_buffer_factor * share));
    if (need > rows) {
      rows = need;
      stats->dropless_reruns = 1;
    }
  }
  stats->buffer_rows = rows;
  return rows;
}

// x_sorted's valid rows from the tokens (one rank: x, or its quantization
// round trip; ring: the gathered x).
Status GatherSorted(Context& ctx, const MoeState& s, const ConstTensorView& x) {
  if (s.P > 1) return RingGatherRows(ctx, s, s.xs.data, s.act);
  const float* src = s.quantized_tokens ? s.x_deq.data_as<float>() : x.as<float>();
  return PermuteRows(ctx, src, DType::kF32, s.T, s.D, s.k, s.routing.pair_of_row.data(), s.valid,
                     s.xs.data, s.act);
}

// moe_quantize_token_all_gather on one rank: x_deq [T, D] = deq(q(x)), the
// values the ring's gathered codes carry.
Status QuantizeTokensRoundTrip(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                               MoeState& s) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView q, Grow(&s.x_codes, DType::kU8, {s.T, s.D}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView sc, Grow(&s.x_scales, DType::kF32, {s.T}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView deq, Grow(&s.x_deq, DType::kF32, {s.T, s.D}));
  FP8MOE_RETURN_IF_ERROR(QuantizeRows(ctx, x.as<float>(), s.T, s.D, s.T, 0, QuantDType::kE4M3FN,
                                      cfg.act_quantization_calibration_method,
                                      q.as<uint8_t>(), sc.as<float>()));
  return DequantizeRows(ctx, q.as<uint8_t>(), s.T, s.D, 0, sc.as<float>(), QuantDType::kE4M3FN,
                        deq.as<float>());
}

// The backward of one expert GMM (wi or wo).
//   a_in  [rows, K]  the forward's lhs (x_sorted or a), act dtype
//   g     [rows, N]  the cotangent of its output (act dtype)
//   dlhs  [rows, K]  (or dh [rows, 2F] with dSwiGLU), dw [E, K, N] f32
struct GmmBackwardArgs {
  const char* name;  // "wi" or "wo"
  const ConstTensorView* master;
  const PreparedExpertWeight* weight;
  ConstTensorView a_in, g;
  TensorView dlhs;
  const ConstTensorView* h = nullptr;  // dSwiGLU
  MoeGmmTiles tiles;
};

// deq(q_bwd(g * s, per row)) [rows, N] f32 for fp8_full's dLHS, where s scales
// each column by the weight's per-channel scale of the row's expert.
Result<TensorView> RecipeDlhsOperand(Context& ctx, const MoeConfig& cfg, MoeState& s,
                                     const ConstTensorView& g, const Tensor& scale) {
  const int64_t rows = g.shape[0], n = g.shape[1], valid = s.valid;
  FP8MOE_ASSIGN_OR_RETURN(TensorView gs, Grow(&s.recipe_g, DType::kF32, {rows, n}));
  FP8MOE_RETURN_IF_ERROR(ScaleToF32(ctx, g.data, g.dtype, rows, n, s.local_sizes, s.E_local,
                                    ScaleBy::kGroupColumn, scale.data_as<float>(),
                                    gs.as<float>()));
  FP8MOE_ASSIGN_OR_RETURN(TensorView q,
                          Grow(&s.recipe_q, QuantStorageDType(*s.plan.bwd_dtype), {rows, n}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView sc, Grow(&s.recipe_sc, DType::kF32, {rows}));
  FP8MOE_RETURN_IF_ERROR(QuantizeRows(ctx, gs.as<float>(), rows, n, valid, 0, *s.plan.bwd_dtype,
                                      cfg.bwd_quantization_calibration_method, q.as<uint8_t>(),
                                      sc.as<float>()));
  FP8MOE_RETURN_IF_ERROR(DequantizeRows(ctx, q.as<uint8_t>(), rows, n, 0, sc.as<float>(),
                                        *s.plan.bwd_dtype, gs.as<float>()));
  return gs;
}

Status GmmBackward(Context& ctx, const MoeConfig& cfg, MoeState& s, const GmmBackwardArgs& b,
                   const MoeOptions& options, const TensorView& dw) {
  const PreparedExpertWeight& wt = *b.weight;
  const std::string name = b.name;
  const int64_t valid = s.valid;
  GmmOptions od;
  od.tiles = b.tiles.dlhs;
  od.epilogue = b.h != nullptr ? GmmEpilogue::kDSwiGlu : GmmEpilogue::kNone;
  ConstTensorView scale = wt.codes ? wt.scale.view() : ConstTensorView{};
  const MoeQatMode mode = s.plan.mode;
  // ---- dLHS ----
  if (mode == MoeQatMode::kRecipeFp8Full) {
    FP8MOE_ASSIGN_OR_RETURN(TensorView lhs, RecipeDlhsOperand(ctx, cfg, s, b.g, wt.scale));
    ConstTensorView ov = wt.unit_scale.view();
    od.mode = GmmMode::kF32;
    Report(options, name + "_dlhs", od.mode, s.plan.bwd_dtype, wt.quant);
    FP8MOE_RETURN_IF_ERROR(
        CtxGmmDlhs(ctx, od, lhs, wt.view, &ov, s.group_sizes_view, b.dlhs, b.h));
  } else if (!wt.codes) {
    od.mode = s.act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
    Report(options, name + "_dlhs", od.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(
        CtxGmmDlhs(ctx, od, b.g, wt.view, nullptr, s.group_sizes_view, b.dlhs, b.h));
  } else if (wt.quant == QuantDType::kInt8) {
    // int8 weights: their dequantized values as a bf16 copy (prepared once).
    od.mode = GmmMode::kBf16;
    Report(options, name + "_dlhs", od.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(CtxGmmDlhs(ctx, od, b.g, wt.dlhs_copy.view(), nullptr,
                                      s.group_sizes_view, b.dlhs, b.h));
  } else {
    // fp8 codes: the BF16 copy (fake QAT), or tile by tile from the codes
    // (native dLHS); the two are bit-identical.
    od.mode = mode == MoeQatMode::kNativeFwdDlhs ? GmmMode::kBf16 : GmmMode::kFakeQat;
    Report(options, name + "_dlhs", od.mode, std::nullopt, wt.quant);
    FP8MOE_RETURN_IF_ERROR(
        CtxGmmDlhs(ctx, od, b.g, wt.view, &scale, s.group_sizes_view, b.dlhs, b.h));
  }
  // ---- dW ----
  GmmOptions ow;
  ow.tiles = b.tiles.drhs;
  if (mode == MoeQatMode::kRecipeFp8Full) {
    // f32(q_a)^T @ deq(q_bwd(g * s_a)): q_a, s_a as the forward quantized a_in.
    const int64_t rows = b.a_in.shape[0], kdim = b.a_in.shape[1], n = b.g.shape[1];
    FP8MOE_ASSIGN_OR_RETURN(TensorView a32, Grow(&s.recipe_a32, DType::kF32, {rows, kdim}));
    Bf16ToF32Span(b.a_in.as<uint16_t>(), a32.as<float>(), static_cast<size_t>(valid * kdim));
    FP8MOE_ASSIGN_OR_RETURN(TensorView qa, Grow(&s.recipe_qa, DType::kE4M3FN, {rows, kdim}));
    FP8MOE_ASSIGN_OR_RETURN(TensorView sa, Grow(&s.recipe_sa, DType::kF32, {rows}));
    std::fill(sa.as<float>(), sa.as<float>() + rows, 0.0f);
    FP8MOE_RETURN_IF_ERROR(QuantizeRows(ctx, a32.as<float>(), rows, kdim, valid, 0,
                                        QuantDType::kE4M3FN,
                                        cfg.act_quantization_calibration_method,
                                        qa.as<uint8_t>(), sa.as<float>()));
    FP8MOE_ASSIGN_OR_RETURN(TensorView gs, Grow(&s.recipe_g, DType::kF32, {rows, n}));
    FP8MOE_RETURN_IF_ERROR(ScaleToF32(ctx, b.g.data, b.g.dtype, rows, n, s.local_sizes,
                                      s.E_local, ScaleBy::kRow, sa.as<float>(), gs.as<float>()));
    TgmmQuant q;
    q.dout_dtype = s.plan.bwd_dtype;
    q.per_group = !s.plan.inkernel_bwd;
    q.calibration = cfg.bwd_quantization_calibration_method;
    ow.mode = GmmMode::kF32;
    Report(options, name + "_drhs", ow.mode, QuantDType::kE4M3FN, s.plan.bwd_dtype);
    FP8MOE_RETURN_IF_ERROR(CtxTgmm(ctx, ow, q, qa, gs, s.group_sizes_view, dw));
  } else {
    ow.mode = s.act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
    Report(options, name + "_drhs", ow.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(CtxTgmm(ctx, ow, {}, b.a_in, b.g, s.group_sizes_view, dw));
  }
  // Straight-through to the master; fixed calibration masks what it clips.
  const Calibration& wc = cfg.weight_quantization_calibration_method;
  if (mode != MoeQatMode::kNone && wc.kind == Calibration::Kind::kFixed) {
    const float clip = wc.FixedAmax();
    const float* m = b.master->as<float>();
    float* d = dw.as<float>();
    const size_t n = dw.num_elements();
    for (size_t i = 0; i < n; ++i) {
      if (std::fabs(m[i]) > clip) d[i] = 0.0f;
    }
  }
  return OkStatus();
}

}  // namespace

void PoisonTail(const TensorView& t, int64_t valid_rows) {
  const int64_t cols = t.shape[1];
  const size_t from = static_cast<size_t>(valid_rows * cols);
  if (t.dtype == DType::kF32) {
    std::fill(t.as<float>() + from, t.as<float>() + t.num_elements(), kNaN);
  } else {
    std::fill(t.as<uint16_t>() + from, t.as<uint16_t>() + t.num_elements(), uint16_t{0x7FC0});
  }
}

Result<TensorView> RaggedBuffer(Tensor* t, DType d, int64_t rows, int64_t cols,
                                const MoeOptions& o, int64_t valid) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView v, Grow(t, d, {rows, cols}));
  if (o.poison_tail_rows) PoisonTail(v, valid);
  return v;
}

Status RouteForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                    const ConstTensorView& router, const MoeOptions& options, MoeState& s,
                    float* aux_loss) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView logits, Grow(&s.logits, DType::kF32, {s.T, s.E}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, OneGroup(s));
  {
    GmmOptions o;
    o.mode = GmmMode::kF32;
    ConstTensorView r3{router.data, DType::kF32, {1, s.D, s.E}};
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, x, r3, nullptr, one, logits));
  }
  FP8MOE_RETURN_IF_ERROR(
      Route(ctx, logits.as<float>(), s.T, s.E, s.k, ScoringOf(cfg, s.route_bias), &s.routing));
  // The load-balancing fractions: of this batch, or of the whole batch it
  // is a part of (FSDP and expert-ring ranks).
  Communicator* batch = options.ranks.batch;
  if (batch != nullptr && batch->size() > 1) {
    s.lb_counts.assign(static_cast<size_t>(s.E + 1), 0);
    for (int64_t e = 0; e < s.E; ++e) {
      s.lb_counts[static_cast<size_t>(e)] = s.routing.group_sizes[static_cast<size_t>(e)];
    }
    s.lb_counts[static_cast<size_t>(s.E)] = s.T;
    FP8MOE_RETURN_IF_ERROR(
        batch->AllReduce(s.lb_counts.data(), s.lb_counts.data(), s.E + 1, DType::kI64, ReduceOp::kSum));
    LoadFractions(s.routing, s.lb_counts.data(), &s.lb_fraction);
  } else {
    LoadFractions(s.routing, nullptr, &s.lb_fraction);
  }
  *aux_loss = static_cast<float>(
      LoadBalanceLoss(s.routing, s.lb_fraction, cfg.load_balance_loss_weight));
  return OkStatus();
}

Status DispatchForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeOptions& options, MoeState& s, MoeStats* stats) {
  s.quantized_tokens = cfg.moe_quantize_token_all_gather;
  if (s.P > 1) {
    FP8MOE_RETURN_IF_ERROR(RingDispatch(ctx, cfg, x, options, s));
  } else {
    if (s.quantized_tokens) FP8MOE_RETURN_IF_ERROR(QuantizeTokensRoundTrip(ctx, cfg, x, s));
    s.valid = s.T * s.k;
    s.E_local = s.E;
    s.local_sizes = s.routing.group_sizes.data();
  }
  FP8MOE_ASSIGN_OR_RETURN(s.group_sizes_view, Grow(&s.group_sizes, DType::kI32, {s.E_local}));
  std::memcpy(s.group_sizes_view.data, s.local_sizes,
              static_cast<size_t>(s.E_local) * sizeof(int32_t));
  FP8MOE_ASSIGN_OR_RETURN(s.rows, BufferRows(cfg, s, s.P * s.T * s.k, stats));
  FP8MOE_ASSIGN_OR_RETURN(s.xs, RaggedBuffer(&s.x_sorted, s.act, s.rows, s.D, options, s.valid));
  return GatherSorted(ctx, s, x);
}

Status ExpertsForward(Context& ctx, const MoeConfig& cfg, const PreparedMoeWeights& prepared,
                      const MoeOptions& options, MoeState& s) {
  const PreparedExpertWeight& wi = prepared.wi;
  const PreparedExpertWeight& wo = prepared.wo;
  FP8MOE_ASSIGN_OR_RETURN(s.hv, RaggedBuffer(&s.h, s.act, s.rows, 2 * s.F, options, s.valid));
  FP8MOE_ASSIGN_OR_RETURN(s.av, RaggedBuffer(&s.a, s.act, s.rows, s.F, options, s.valid));
  FP8MOE_ASSIGN_OR_RETURN(s.ysv, RaggedBuffer(&s.y_sorted, s.act, s.rows, s.D, options, s.valid));
  const auto lhs_q = s.plan.fwd.lhs;
  const auto rhs_q = s.plan.fwd.rhs;
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wi_tiles.fwd);
    o.epilogue = GmmEpilogue::kSwiGlu;
    ConstTensorView scale = wi.codes ? wi.scale.view() : ConstTensorView{};
    Report(options, "wi_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, s.xs, wi.view, wi.codes ? &scale : nullptr,
                                  s.group_sizes_view, s.av, &s.hv));
  }
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wo_tiles.fwd);
    ConstTensorView scale = wo.codes ? wo.scale.view() : ConstTensorView{};
    Report(options, "wo_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, s.av, wo.view, wo.codes ? &scale : nullptr,
                                  s.group_sizes_view, s.ysv));
  }
  return OkStatus();
}

Status CombineForward(Context& ctx, MoeState& s, const TensorView& y) {
  if (s.P > 1) return RingCombine(ctx, s, y);
  return CombineRows(ctx, s.ysv.data, s.act, s.valid, s.D, s.routing.row_of_pair.data(),
                     s.routing.weight.data(), s.T, s.k, y.as<float>());
}

Status CombineBackwardStage(Context& ctx, const MoeOptions& options, MoeState& s,
                            const ConstTensorView& dy) {
  FP8MOE_ASSIGN_OR_RETURN(s.dys, RaggedBuffer(&s.dy_sorted, s.act, s.rows, s.D, options, s.valid));
  FP8MOE_ASSIGN_OR_RETURN(s.dwv, Grow(&s.dweight, DType::kF32, {s.T * s.k}));
  if (s.P > 1) return RingCombineBackward(ctx, dy, s);
  return CombineRowsBackward(ctx, dy.as<float>(), s.ysv.data, s.act, s.valid, s.D,
                             s.routing.row_of_pair.data(), s.routing.weight.data(), s.T, s.k,
                             s.dys.data, s.dwv.as<float>());
}

Status ExpertsBackward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeWeights& w, const PreparedMoeWeights& prepared,
                       const MoeOptions& options, MoeState& s, const TensorView& dwi,
                       const TensorView& dwo) {
  // wo: dh = dSwiGLU(dy_sorted @ wo'^T, h); dwo = a^T dy_sorted.
  FP8MOE_ASSIGN_OR_RETURN(s.dhv, RaggedBuffer(&s.dh, s.act, s.rows, 2 * s.F, options, s.valid));
  const ConstTensorView h = s.hv;  // the forward's pre-activation, read by dSwiGLU
  GmmBackwardArgs bo{"wo", &w.wo, &prepared.wo, s.av, s.dys, s.dhv, &h, cfg.wo_tiles};
  FP8MOE_RETURN_IF_ERROR(GmmBackward(ctx, cfg, s, bo, options, dwo));
  // wi: dx_sorted = dh @ wi'^T; dwi = x_sorted^T dh. With remat_policy=full
  // x_sorted is gathered again (here into the same buffer; a memory-bound
  // trainer would drop it between the passes).
  if (cfg.remat_policy == MoeRematPolicy::kFull) {
    if (options.poison_tail_rows) PoisonTail(s.xs, s.valid);
    FP8MOE_RETURN_IF_ERROR(GatherSorted(ctx, s, x));
  }
  FP8MOE_ASSIGN_OR_RETURN(s.dxs,
                          RaggedBuffer(&s.dx_sorted, DType::kF32, s.rows, s.D, options, s.valid));
  GmmBackwardArgs bi{"wi", &w.wi, &prepared.wi, s.xs, s.dhv, s.dxs, nullptr, cfg.wi_tiles};
  return GmmBackward(ctx, cfg, s, bi, options, dwi);
}

Status RouteBackwardStage(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                          const ConstTensorView& router, MoeState& s, const TensorView& drouter,
                          const TensorView& dx) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView dlogits, Grow(&s.dlogits, DType::kF32, {s.T, s.E}));
  const Routing& r = s.routing;
  FP8MOE_RETURN_IF_ERROR(RouterBackward(ctx, r.expert.data(), r.softmax.data(), r.probs.data(),
                                        s.dwv.as<float>(), s.lb_fraction.data(), s.T, s.E, s.k,
                                        ScoringOf(cfg), cfg.load_balance_loss_weight,
                                        dlogits.as<float>()));
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, OneGroup(s));
  GmmOptions o32;
  o32.mode = GmmMode::kF32;
  TensorView dr3{drouter.data, DType::kF32, {1, s.D, s.E}};
  FP8MOE_RETURN_IF_ERROR(CtxTgmm(ctx, o32, {}, x, dlogits, one, dr3));
  ConstTensorView r3{router.data, DType::kF32, {1, s.D, s.E}};
  return CtxGmmDlhs(ctx, o32, dlogits, r3, nullptr, one, dx);
}

Status DispatchBackward(Context& ctx, MoeState& s, const TensorView& dx) {
  if (s.P > 1) return RingDispatchBackward(ctx, s, dx);
  return ScatterAddRows(ctx, s.dxs.as<float>(), s.valid, s.D, s.routing.row_of_pair.data(), s.T,
                        s.k, /*accumulate=*/true, dx.as<float>());
}

}  // namespace fp8moe::internal
