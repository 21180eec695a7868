// The MoE layer's forward and backward on the grouped matmul kernels, in
// every QAT mode (include/fp8moe/moe.h has the semantics; the plain-loop twin
// is moe/reference/moe_reference.cc). Weights arrive prepared once per step
// (moe/moe_prepare.cc); every intermediate buffer lives in the caller's
// MoeWorkspace, so a steady-state step allocates nothing.
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "base/default_context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/moe.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "moe/gmm_ctx.h"
#include "moe/moe_workspace.h"
#include "moe/routing.h"

namespace fp8moe {

using internal::CtxGmm;
using internal::CtxGmmDlhs;
using internal::CtxTgmm;
using internal::Grow;
using internal::Routing;
using State = MoeWorkspace::State;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Status Need(bool ok, const std::string& what) {
  return ok ? OkStatus() : InvalidArgument(what);
}

// Shapes: x [T, D], router [D, E], wi [E, D, 2F], wo [E, F, D], all F32.
Status CheckShapes(const MoeConfig& cfg, const TensorView& x, const MoeWeights& w) {
  auto f32 = [](const TensorView& t) { return t.dtype == DType::kF32; };
  FP8MOE_RETURN_IF_ERROR(Need(x.rank() == 2 && f32(x), "x must be F32 [T, D]; got " +
                                                           std::string(DTypeName(x.dtype)) + " " +
                                                           ShapeToString(x.shape)));
  const int64_t D = x.shape[1];
  FP8MOE_RETURN_IF_ERROR(Need(w.router.rank() == 2 && f32(w.router) && w.router.shape[0] == D,
                              "router must be F32 [D, E] with D = " + std::to_string(D) +
                                  "; got " + ShapeToString(w.router.shape)));
  const int64_t E = w.router.shape[1];
  FP8MOE_RETURN_IF_ERROR(Need(E == cfg.num_experts,
                              "router has " + std::to_string(E) + " experts but num_experts = " +
                                  std::to_string(cfg.num_experts)));
  FP8MOE_RETURN_IF_ERROR(Need(cfg.num_experts_per_tok >= 1 && cfg.num_experts_per_tok <= E,
                              "num_experts_per_tok must be in [1, num_experts]"));
  FP8MOE_RETURN_IF_ERROR(Need(w.wi.rank() == 3 && f32(w.wi) && w.wi.shape[0] == E &&
                                  w.wi.shape[1] == D && w.wi.shape[2] % 2 == 0 && w.wi.shape[2] > 0,
                              "wi must be F32 [E, D, 2F] = [" + std::to_string(E) + ", " +
                                  std::to_string(D) + ", 2F]; got " + ShapeToString(w.wi.shape)));
  const int64_t F = w.wi.shape[2] / 2;
  FP8MOE_RETURN_IF_ERROR(Need(w.wo.rank() == 3 && f32(w.wo) && w.wo.shape == Shape{E, F, D},
                              "wo must be F32 [E, F, D] = " + ShapeToString({E, F, D}) +
                                  "; got " + ShapeToString(w.wo.shape)));
  return OkStatus();
}

// The prepared weights must be those of this config and these masters.
Status CheckPrepared(const MoeConfig& cfg, const MoeWeights& w, const PreparedMoeWeights& p) {
  if (!(p.plan == PlanMoeQuantization(cfg))) {
    return InvalidArgument("the prepared expert weights were made for QAT mode " +
                           std::string(MoeQatModeName(p.plan.mode)) + " but the config runs " +
                           std::string(MoeQatModeName(PlanMoeQuantization(cfg).mode)) +
                           "; call PrepareMoeWeights with this config");
  }
  if (p.wi_shape != w.wi.shape || p.wo_shape != w.wo.shape) {
    return InvalidArgument("the prepared expert weights have shapes " +
                           ShapeToString(p.wi_shape) + " and " + ShapeToString(p.wo_shape) +
                           " but the masters " + ShapeToString(w.wi.shape) + " and " +
                           ShapeToString(w.wo.shape) + "; call PrepareMoeWeights on these masters");
  }
  return OkStatus();
}

Status CheckF32(const TensorView& t, const Shape& shape, const char* name) {
  if (t.dtype == DType::kF32 && t.shape == shape && (t.data != nullptr || t.num_elements() == 0)) {
    return OkStatus();
  }
  return InvalidArgument(std::string(name) + " must be F32 " + ShapeToString(shape) + "; got " +
                         std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape));
}

int64_t BufferRows(const MoeConfig& cfg, int64_t valid, MoeStats* stats) {
  *stats = {};
  stats->valid_rows = valid;
  int64_t rows = valid;
  if (cfg.ragged_buffer_factor > 0) {
    rows = static_cast<int64_t>(std::ceil(cfg.ragged_buffer_factor * static_cast<double>(valid)));
    // The routing is known before any GMM runs, so an overflow is caught
    // here and the step runs on the dropless buffer instead.
    if (valid > rows) {
      rows = valid;
      stats->dropless_reruns = 1;
    }
  }
  stats->buffer_rows = rows;
  return rows;
}

void PoisonTail(const TensorView& t, int64_t valid_rows) {
  const int64_t cols = t.shape[1];
  const size_t from = static_cast<size_t>(valid_rows * cols);
  if (t.dtype == DType::kF32) {
    std::fill(t.as<float>() + from, t.as<float>() + t.num_elements(), kNaN);
  } else {
    std::fill(t.as<uint16_t>() + from, t.as<uint16_t>() + t.num_elements(), uint16_t{0x7FC0});
  }
}

// A ragged buffer [rows, cols] from the workspace (poisoned for tests).
Result<TensorView> Buffer(Tensor* t, DType d, int64_t rows, int64_t cols, const MoeOptions& o,
                          int64_t valid) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView v, Grow(t, d, {rows, cols}));
  if (o.poison_tail_rows) PoisonTail(v, valid);
  return v;
}

// The forward GMM options of the mode (DESIGN 3.4).
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
Result<TensorView> OneGroup(State& s) {
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, Grow(&s.one, DType::kI32, {1}));
  one.as<int32_t>()[0] = static_cast<int32_t>(s.T);
  return one;
}

}  // namespace

Status MoeForward(Context& ctx, const MoeConfig& cfg, const TensorView& x,
                  const MoeWeights& w, const PreparedMoeWeights& prepared,
                  MoeWorkspace* workspace, const TensorView& y, MoeStepInfo* info,
                  const MoeOptions& options) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  FP8MOE_RETURN_IF_ERROR(CheckPrepared(cfg, w, prepared));
  FP8MOE_RETURN_IF_ERROR(CheckF32(y, x.shape, "y"));
  State& s = workspace->state();
  s.forward_done = false;
  s.T = x.shape[0];
  s.D = x.shape[1];
  s.E = cfg.num_experts;
  s.k = cfg.num_experts_per_tok;
  s.F = w.wi.shape[2] / 2;
  s.plan = prepared.plan;
  s.act = prepared.act;
  MoeStepInfo out;

  // 1-3. Router logits (an f32 GMM with one group), top-k, expert order.
  FP8MOE_ASSIGN_OR_RETURN(TensorView logits, Grow(&s.logits, DType::kF32, {s.T, s.E}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, OneGroup(s));
  {
    GmmOptions o;
    o.mode = GmmMode::kF32;
    TensorView r3{w.router.data, DType::kF32, {1, s.D, s.E}};
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, x, r3, nullptr, one, logits));
  }
  internal::Route(logits.as<float>(), s.T, s.E, s.k, cfg.norm_topk_prob, &s.routing);
  FP8MOE_ASSIGN_OR_RETURN(s.group_sizes_view, Grow(&s.group_sizes, DType::kI32, {s.E}));
  std::memcpy(s.group_sizes_view.data, s.routing.group_sizes.data(),
              static_cast<size_t>(s.E) * sizeof(int32_t));
  // The load-balancing fractions: of this batch, or of the whole batch it
  // is a part of (FSDP ranks).
  if (options.sum_batch_counts) {
    s.lb_counts.assign(static_cast<size_t>(s.E + 1), 0);
    for (int64_t e = 0; e < s.E; ++e) s.lb_counts[static_cast<size_t>(e)] = s.routing.group_sizes[static_cast<size_t>(e)];
    s.lb_counts[static_cast<size_t>(s.E)] = s.T;
    FP8MOE_RETURN_IF_ERROR(options.sum_batch_counts(s.lb_counts.data(), s.E + 1));
    internal::LoadFractions(s.routing, s.lb_counts.data(), &s.lb_fraction);
  } else {
    internal::LoadFractions(s.routing, nullptr, &s.lb_fraction);
  }
  out.aux_loss = static_cast<float>(
      internal::LoadBalanceLoss(s.routing, s.lb_fraction, cfg.load_balance_loss_weight));

  // 4. The ragged buffer.
  const int64_t valid = s.T * s.k;
  s.rows = BufferRows(cfg, valid, &out.stats);
  FP8MOE_ASSIGN_OR_RETURN(s.xs, Buffer(&s.x_sorted, s.act, s.rows, s.D, options, valid));
  internal::GatherRows(s.routing, x.as<float>(), s.D, s.xs.data, s.act);

  // 5. wi GMM with the SwiGLU epilogue, wo GMM.
  const PreparedExpertWeight& wi = prepared.wi;
  const PreparedExpertWeight& wo = prepared.wo;
  FP8MOE_ASSIGN_OR_RETURN(s.hv, Buffer(&s.h, s.act, s.rows, 2 * s.F, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(s.av, Buffer(&s.a, s.act, s.rows, s.F, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(s.ysv, Buffer(&s.y_sorted, s.act, s.rows, s.D, options, valid));
  const auto lhs_q = s.plan.fwd.lhs;
  const auto rhs_q = s.plan.fwd.rhs;
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wi_tiles.fwd);
    o.epilogue = GmmEpilogue::kSwiGlu;
    TensorView scale = wi.codes ? wi.scale.view() : TensorView{};
    Report(options, "wi_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, s.xs, wi.view, wi.codes ? &scale : nullptr,
                                  s.group_sizes_view, s.av, &s.hv));
  }
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wo_tiles.fwd);
    TensorView scale = wo.codes ? wo.scale.view() : TensorView{};
    Report(options, "wo_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, s.av, wo.view, wo.codes ? &scale : nullptr,
                                  s.group_sizes_view, s.ysv));
  }

  // 6. Weighted combine in f32.
  internal::CombineRows(s.routing, s.ysv.data, s.act, s.D, y.as<float>());
  s.forward_done = true;
  if (MetricsSink* sink = ctx.metrics()) {
    sink->Record("moe/aux_loss", out.aux_loss);
    sink->Record("moe/dropless_reruns", static_cast<double>(out.stats.dropless_reruns));
  }
  if (info != nullptr) *info = out;
  return OkStatus();
}

namespace {

// The backward of one expert GMM (wi or wo).
//   a_in  [rows, K]  the forward's lhs (x_sorted or a), act dtype
//   g     [rows, N]  the cotangent of its output (act dtype)
//   dlhs  [rows, K]  (or dh [rows, 2F] with dSwiGLU), dw [E, K, N] f32
struct GmmBackwardArgs {
  const char* name;  // "wi" or "wo"
  const TensorView* master;
  const PreparedExpertWeight* weight;
  TensorView a_in, g, dlhs;
  const TensorView* h = nullptr;  // dSwiGLU
  MoeGmmTiles tiles;
};

// deq(q_bwd(g * s, per row)) [rows, N] f32 for fp8_full's dLHS, where s scales
// each column by the weight's per-channel scale of the row's expert.
Result<TensorView> RecipeDlhsOperand(Context& ctx, const MoeConfig& cfg, State& s,
                                     const TensorView& g, const Tensor& scale) {
  const int64_t rows = g.shape[0], n = g.shape[1], valid = s.T * s.k;
  FP8MOE_ASSIGN_OR_RETURN(TensorView gs, Grow(&s.recipe_g, DType::kF32, {rows, n}));
  const int32_t* sizes = s.routing.group_sizes.data();
  int64_t row = 0;
  for (int64_t e = 0; e < s.E; ++e) {
    const float* se = scale.data_as<float>() + e * n;
    const int64_t end = row + sizes[e];
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
    for (int64_t i = row; i < end; ++i) {
      float* dst = gs.as<float>() + i * n;
      if (g.dtype == DType::kF32) {
        std::memcpy(dst, g.as<float>() + i * n, static_cast<size_t>(n) * 4);
      } else {
        Bf16ToF32Span(g.as<uint16_t>() + i * n, dst, static_cast<size_t>(n));
      }
      for (int64_t j = 0; j < n; ++j) dst[j] *= se[j];
    }
    row = end;
  }
  FP8MOE_ASSIGN_OR_RETURN(TensorView q,
                          Grow(&s.recipe_q, QuantStorageDType(*s.plan.bwd_dtype), {rows, n}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView sc, Grow(&s.recipe_sc, DType::kF32, {rows}));
  FP8MOE_RETURN_IF_ERROR(QuantizeRows(gs.as<float>(), rows, n, valid, 0, *s.plan.bwd_dtype,
                                      cfg.bwd_quantization_calibration_method, q.as<uint8_t>(),
                                      sc.as<float>()));
  DequantizeRows(q.as<uint8_t>(), rows, n, 0, sc.as<float>(), *s.plan.bwd_dtype, gs.as<float>());
  return gs;
}

Status GmmBackward(Context& ctx, const MoeConfig& cfg, State& s, const GmmBackwardArgs& b,
                   const MoeOptions& options, const TensorView& dw) {
  const PreparedExpertWeight& wt = *b.weight;
  const std::string name = b.name;
  const int64_t valid = s.T * s.k;
  GmmOptions od;
  od.tiles = b.tiles.dlhs;
  od.epilogue = b.h != nullptr ? GmmEpilogue::kDSwiGlu : GmmEpilogue::kNone;
  TensorView scale = wt.codes ? wt.scale.view() : TensorView{};
  const MoeQatMode mode = s.plan.mode;
  // ---- dLHS ----
  if (mode == MoeQatMode::kRecipeFp8Full) {
    FP8MOE_ASSIGN_OR_RETURN(TensorView lhs, RecipeDlhsOperand(ctx, cfg, s, b.g, wt.scale));
    TensorView ov = wt.unit_scale.view();
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
    FP8MOE_RETURN_IF_ERROR(QuantizeRows(a32.as<float>(), rows, kdim, valid, 0,
                                        QuantDType::kE4M3FN,
                                        cfg.act_quantization_calibration_method,
                                        qa.as<uint8_t>(), sa.as<float>()));
    FP8MOE_ASSIGN_OR_RETURN(TensorView gs, Grow(&s.recipe_g, DType::kF32, {rows, n}));
    const float* sap = sa.as<float>();
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
    for (int64_t i = 0; i < valid; ++i) {
      float* dst = gs.as<float>() + i * n;
      Bf16ToF32Span(b.g.as<uint16_t>() + i * n, dst, static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) dst[j] *= sap[i];
    }
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

Status MoeBackward(Context& ctx, const MoeConfig& cfg, const TensorView& x,
                   const MoeWeights& w, const PreparedMoeWeights& prepared,
                   MoeWorkspace* workspace, const TensorView& dy,
                   const MoeGradientViews& grads, const MoeOptions& options) {
  State& s = workspace->state();
  if (!s.forward_done) {
    return FailedPrecondition("MoeBackward needs a MoeForward on the same workspace first");
  }
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  FP8MOE_RETURN_IF_ERROR(CheckPrepared(cfg, w, prepared));
  if (x.shape != Shape{s.T, s.D}) {
    return InvalidArgument("x has shape " + ShapeToString(x.shape) +
                           " but the forward ran on " + ShapeToString({s.T, s.D}));
  }
  if (dy.dtype != DType::kF32 || dy.shape != Shape{s.T, s.D}) {
    return InvalidArgument("dy must be F32 " + ShapeToString({s.T, s.D}) + "; got " +
                           std::string(DTypeName(dy.dtype)) + " " + ShapeToString(dy.shape));
  }
  FP8MOE_RETURN_IF_ERROR(CheckF32(grads.dx, x.shape, "dx"));
  FP8MOE_RETURN_IF_ERROR(CheckF32(grads.drouter, w.router.shape, "drouter"));
  FP8MOE_RETURN_IF_ERROR(CheckF32(grads.dwi, w.wi.shape, "dwi"));
  FP8MOE_RETURN_IF_ERROR(CheckF32(grads.dwo, w.wo.shape, "dwo"));
  const int64_t valid = s.T * s.k;

  // Combine: dy_sorted and the routing weights' gradient.
  FP8MOE_ASSIGN_OR_RETURN(TensorView dy_sorted,
                          Buffer(&s.dy_sorted, s.act, s.rows, s.D, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(TensorView dweight, Grow(&s.dweight, DType::kF32, {valid}));
  internal::CombineBackward(s.routing, dy.as<float>(), s.ysv.data, s.act, s.D, dy_sorted.data,
                            dweight.as<float>());

  // wo: dh = dSwiGLU(dy_sorted @ wo'^T, h); dwo = a^T dy_sorted.
  FP8MOE_ASSIGN_OR_RETURN(TensorView dh, Buffer(&s.dh, s.act, s.rows, 2 * s.F, options, valid));
  GmmBackwardArgs bo{"wo", &w.wo, &prepared.wo, s.av, dy_sorted, dh, &s.hv, cfg.wo_tiles};
  FP8MOE_RETURN_IF_ERROR(GmmBackward(ctx, cfg, s, bo, options, grads.dwo));

  // wi: dx_sorted = dh @ wi'^T; dwi = x_sorted^T dh. With remat_policy=full
  // x_sorted is gathered again (here into the same buffer; a memory-bound
  // trainer would drop it between the passes).
  if (cfg.remat_policy == MoeRematPolicy::kFull) {
    if (options.poison_tail_rows) PoisonTail(s.xs, valid);
    internal::GatherRows(s.routing, x.as<float>(), s.D, s.xs.data, s.act);
  }
  FP8MOE_ASSIGN_OR_RETURN(TensorView dx_sorted,
                          Buffer(&s.dx_sorted, DType::kF32, s.rows, s.D, options, valid));
  GmmBackwardArgs bi{"wi", &w.wi, &prepared.wi, s.xs, dh, dx_sorted, nullptr, cfg.wi_tiles};
  FP8MOE_RETURN_IF_ERROR(GmmBackward(ctx, cfg, s, bi, options, grads.dwi));

  // Router: dlogits from the routing weights and the load-balancing loss;
  // drouter = x^T dlogits, dx = unpermuted dx_sorted + dlogits Wr^T.
  FP8MOE_ASSIGN_OR_RETURN(TensorView dlogits, Grow(&s.dlogits, DType::kF32, {s.T, s.E}));
  internal::RouterBackward(s.routing, s.lb_fraction, dweight.as<float>(), cfg.norm_topk_prob,
                           cfg.load_balance_loss_weight, dlogits.as<float>());
  FP8MOE_ASSIGN_OR_RETURN(TensorView one, OneGroup(s));
  GmmOptions o32;
  o32.mode = GmmMode::kF32;
  TensorView dr3{grads.drouter.data, DType::kF32, {1, s.D, s.E}};
  FP8MOE_RETURN_IF_ERROR(CtxTgmm(ctx, o32, {}, x, dlogits, one, dr3));
  TensorView r3{w.router.data, DType::kF32, {1, s.D, s.E}};
  FP8MOE_RETURN_IF_ERROR(CtxGmmDlhs(ctx, o32, dlogits, r3, nullptr, one, grads.dx));
  internal::ScatterAddRows(s.routing, dx_sorted.as<float>(), s.D, grads.dx.as<float>());
  return OkStatus();
}

// ---- The one-call API ----

struct MoeSaved {
  PreparedMoeWeights prepared;
  MoeWorkspace workspace;
};

Result<MoeForwardResult> MoeForward(const MoeConfig& cfg, const TensorView& x,
                                    const MoeWeights& w, const MoeOptions& options) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  Context& ctx = DefaultContext();
  auto saved = std::make_shared<MoeSaved>();
  FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, w.wi, w.wo, &saved->prepared));
  MoeForwardResult out;
  FP8MOE_ASSIGN_OR_RETURN(out.y, Tensor::Create(DType::kF32, x.shape));
  MoeStepInfo info;
  FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, cfg, x, w, saved->prepared, &saved->workspace,
                                    out.y.view(), &info, options));
  const TensorView gs = saved->workspace.group_sizes();
  FP8MOE_ASSIGN_OR_RETURN(out.group_sizes, Tensor::Create(DType::kI32, gs.shape));
  std::memcpy(out.group_sizes.data(), gs.data, gs.num_bytes());
  out.aux_loss = info.aux_loss;
  out.stats = info.stats;
  out.saved = std::move(saved);
  return out;
}

Result<MoeGradients> MoeBackward(const MoeConfig& cfg, const TensorView& x,
                                 const MoeWeights& w, const MoeForwardResult& fwd,
                                 const TensorView& dy, const MoeOptions& options) {
  if (fwd.saved == nullptr) return InvalidArgument("MoeBackward needs the result of MoeForward");
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  MoeGradients g;
  FP8MOE_ASSIGN_OR_RETURN(g.dx, Tensor::Create(DType::kF32, x.shape));
  FP8MOE_ASSIGN_OR_RETURN(g.drouter, Tensor::Create(DType::kF32, w.router.shape));
  FP8MOE_ASSIGN_OR_RETURN(g.dwi, Tensor::Create(DType::kF32, w.wi.shape));
  FP8MOE_ASSIGN_OR_RETURN(g.dwo, Tensor::Create(DType::kF32, w.wo.shape));
  MoeGradientViews views{g.dx.view(), g.drouter.view(), g.dwi.view(), g.dwo.view()};
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  FP8MOE_RETURN_IF_ERROR(MoeBackward(DefaultContext(), cfg, x, w, fwd.saved->prepared,
                                     &fwd.saved->workspace, dy, views, options));
  return g;
}

}  // namespace fp8moe
