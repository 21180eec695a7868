// The MoE layer's forward and backward on the grouped matmul kernels, in
// every QAT mode (include/fp8moe/moe.h has the semantics; the plain-loop twin
// is moe/reference/moe_reference.cc).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fp8moe/gmm.h"
#include "fp8moe/moe.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "moe/routing.h"

namespace fp8moe {

// A weight as the QAT mode presents it to the GMMs.
struct PreparedWeight {
  TensorView view;  // f32 master, bf16 copy, or codes
  Tensor owned;     // the bf16 copy or the codes, when not the master
  Tensor scale;     // [E, N] per-channel scale of codes
  bool codes = false;
  QuantDType quant = QuantDType::kE4M3FN;
};

struct MoeSaved {
  internal::Routing routing;
  MoeQuantPlan plan;
  DType act = DType::kBF16;  // activation dtype of the buffers
  int64_t T = 0, D = 0, F = 0, E = 0, k = 0, rows = 0;
  Tensor group_sizes;        // [E] i32
  Tensor x_sorted;           // [rows, D], kept with remat_policy=moe_x_sorted
  Tensor h, a, y_sorted;     // [rows, 2F], [rows, F], [rows, D]
  PreparedWeight wi, wo;
};

namespace {

using internal::Routing;

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

// Activations are bf16 in every quantized mode (their GMMs take bf16).
DType ActDType(const MoeConfig& cfg, const MoeQuantPlan& plan) {
  return plan.mode == MoeQatMode::kNone ? cfg.dtype : DType::kBF16;
}

int64_t BufferRows(const MoeConfig& cfg, int64_t valid, MoeStats* stats) {
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

void PoisonTail(Tensor* t, int64_t valid_rows) {
  const int64_t cols = t->dim(1);
  const size_t from = static_cast<size_t>(valid_rows * cols);
  if (t->dtype() == DType::kF32) {
    std::fill(t->data_as<float>() + from, t->data_as<float>() + t->num_elements(), kNaN);
  } else {
    std::fill(t->data_as<uint16_t>() + from, t->data_as<uint16_t>() + t->num_elements(),
              uint16_t{0x7FC0});
  }
}

Result<Tensor> Buffer(DType d, int64_t rows, int64_t cols, const MoeOptions& o, int64_t valid) {
  FP8MOE_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(d, {rows, cols}));
  if (o.poison_tail_rows) PoisonTail(&t, valid);
  return t;
}

Result<PreparedWeight> Prepare(const MoeConfig& cfg, const MoeQuantPlan& plan, DType act,
                               const TensorView& master) {
  PreparedWeight p;
  const int64_t E = master.shape[0], K = master.shape[1], N = master.shape[2];
  if (plan.mode == MoeQatMode::kNone) {
    if (act == DType::kF32) {
      p.view = master;
    } else {
      FP8MOE_ASSIGN_OR_RETURN(p.owned, Tensor::Create(DType::kBF16, master.shape));
      F32ToBf16Span(master.as<float>(), p.owned.data_as<uint16_t>(), master.num_elements());
      p.view = p.owned.view();
    }
    return p;
  }
  p.codes = true;
  p.quant = *plan.fwd.rhs;
  FP8MOE_ASSIGN_OR_RETURN(p.owned, Tensor::Create(QuantStorageDType(p.quant), master.shape));
  FP8MOE_ASSIGN_OR_RETURN(p.scale, Tensor::Create(DType::kF32, {E, N}));
  FP8MOE_RETURN_IF_ERROR(QuantizeChannels(master.as<float>(), E, K, N, p.quant,
                                          cfg.weight_quantization_calibration_method,
                                          p.owned.data_as<uint8_t>(), p.scale.data_as<float>()));
  p.view = p.owned.view();
  return p;
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

Tensor GroupSizes(const Routing& r) {
  Tensor gs = std::move(Tensor::Create(DType::kI32, {r.experts})).value();
  std::memcpy(gs.data(), r.group_sizes.data(), r.group_sizes.size() * sizeof(int32_t));
  return gs;
}

}  // namespace

Result<MoeForwardResult> MoeForward(const MoeConfig& cfg, const TensorView& x,
                                    const MoeWeights& w, const MoeOptions& options) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  auto saved = std::make_shared<MoeSaved>();
  MoeSaved& s = *saved;
  s.T = x.shape[0];
  s.D = x.shape[1];
  s.E = cfg.num_experts;
  s.k = cfg.num_experts_per_tok;
  s.F = w.wi.shape[2] / 2;
  s.plan = PlanMoeQuantization(cfg);
  s.act = ActDType(cfg, s.plan);
  MoeForwardResult out;

  // 1-3. Router logits (an f32 GMM with one group), top-k, expert order.
  FP8MOE_ASSIGN_OR_RETURN(Tensor logits, Tensor::Create(DType::kF32, {s.T, s.E}));
  {
    Tensor one = std::move(Tensor::Create(DType::kI32, {1})).value();
    one.data_as<int32_t>()[0] = static_cast<int32_t>(s.T);
    GmmOptions o;
    o.mode = GmmMode::kF32;
    TensorView r3{w.router.data, DType::kF32, {1, s.D, s.E}};
    FP8MOE_RETURN_IF_ERROR(Gmm(o, x, r3, nullptr, one.view(), logits.view()));
  }
  s.routing = internal::Route(logits.data_as<float>(), s.T, s.E, s.k, cfg.norm_topk_prob);
  s.group_sizes = GroupSizes(s.routing);
  out.aux_loss = static_cast<float>(
      internal::LoadBalanceLoss(s.routing, cfg.load_balance_loss_weight));

  // 4. The ragged buffer.
  const int64_t valid = s.T * s.k;
  s.rows = BufferRows(cfg, valid, &out.stats);
  FP8MOE_ASSIGN_OR_RETURN(Tensor x_sorted, Buffer(s.act, s.rows, s.D, options, valid));
  internal::GatherRows(s.routing, x.as<float>(), s.D, x_sorted.data(), s.act);

  // 5. wi GMM with the SwiGLU epilogue, wo GMM.
  FP8MOE_ASSIGN_OR_RETURN(s.wi, Prepare(cfg, s.plan, s.act, w.wi));
  FP8MOE_ASSIGN_OR_RETURN(s.wo, Prepare(cfg, s.plan, s.act, w.wo));
  FP8MOE_ASSIGN_OR_RETURN(s.h, Buffer(s.act, s.rows, 2 * s.F, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(s.a, Buffer(s.act, s.rows, s.F, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(s.y_sorted, Buffer(s.act, s.rows, s.D, options, valid));
  const auto lhs_q = s.plan.fwd.lhs;
  const auto rhs_q = s.plan.fwd.rhs;
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wi_tiles.fwd);
    o.epilogue = GmmEpilogue::kSwiGlu;
    TensorView scale = s.wi.codes ? s.wi.scale.view() : TensorView{};
    TensorView hv = s.h.view();
    Report(options, "wi_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(Gmm(o, x_sorted.view(), s.wi.view, s.wi.codes ? &scale : nullptr,
                               s.group_sizes.view(), s.a.view(), &hv));
  }
  {
    GmmOptions o = ForwardOptions(cfg, s.plan, s.act, cfg.wo_tiles.fwd);
    TensorView scale = s.wo.codes ? s.wo.scale.view() : TensorView{};
    Report(options, "wo_fwd", o.mode, lhs_q, rhs_q);
    FP8MOE_RETURN_IF_ERROR(Gmm(o, s.a.view(), s.wo.view, s.wo.codes ? &scale : nullptr,
                               s.group_sizes.view(), s.y_sorted.view()));
  }
  if (cfg.remat_policy == MoeRematPolicy::kMoeXSorted) s.x_sorted = std::move(x_sorted);

  // 6. Weighted combine in f32.
  FP8MOE_ASSIGN_OR_RETURN(out.y, Tensor::Create(DType::kF32, {s.T, s.D}));
  internal::CombineRows(s.routing, s.y_sorted.data(), s.act, s.D, out.y.data_as<float>());
  out.group_sizes = GroupSizes(s.routing);
  out.saved = std::move(saved);
  return out;
}

namespace {

// The backward of one expert GMM (wi or wo).
//   a_in  [rows, K]  the forward's lhs (x_sorted or a), act dtype
//   g     [rows, N]  the cotangent of its output (act dtype)
//   dlhs  [rows, K]  (or dh [rows, 2F] with dSwiGLU), dw [E, K, N] f32
struct GmmBackwardArgs {
  const char* name;  // "wi" or "wo"
  const TensorView* master;
  const PreparedWeight* weight;
  TensorView a_in, g, dlhs;
  const TensorView* h = nullptr;  // dSwiGLU
  MoeGmmTiles tiles;
};

// deq(q_bwd(g * s, per row)) [rows, N] f32 for fp8_full's dLHS, where s scales
// each column by the weight's per-channel scale of the row's expert.
Result<Tensor> RecipeDlhsOperand(const MoeConfig& cfg, const MoeSaved& s, const TensorView& g,
                                 const Tensor& scale) {
  const int64_t rows = g.shape[0], n = g.shape[1], valid = s.T * s.k;
  FP8MOE_ASSIGN_OR_RETURN(Tensor gs, Tensor::Create(DType::kF32, {rows, n}));
  const int32_t* sizes = s.routing.group_sizes.data();
  int64_t row = 0;
  for (int64_t e = 0; e < s.E; ++e) {
    const float* se = scale.data_as<float>() + e * n;
    const int64_t end = row + sizes[e];
#pragma omp parallel for schedule(static)
    for (int64_t i = row; i < end; ++i) {
      float* dst = gs.data_as<float>() + i * n;
      if (g.dtype == DType::kF32) {
        std::memcpy(dst, g.as<float>() + i * n, static_cast<size_t>(n) * 4);
      } else {
        Bf16ToF32Span(g.as<uint16_t>() + i * n, dst, static_cast<size_t>(n));
      }
      for (int64_t j = 0; j < n; ++j) dst[j] *= se[j];
    }
    row = end;
  }
  Tensor q = std::move(Tensor::Create(QuantStorageDType(*s.plan.bwd_dtype), {rows, n})).value();
  std::vector<float> sc(static_cast<size_t>(rows));
  FP8MOE_RETURN_IF_ERROR(QuantizeRows(gs.data_as<float>(), rows, n, valid, 0, *s.plan.bwd_dtype,
                                      cfg.bwd_quantization_calibration_method,
                                      q.data_as<uint8_t>(), sc.data()));
  DequantizeRows(q.data_as<uint8_t>(), rows, n, 0, sc.data(), *s.plan.bwd_dtype,
                 gs.data_as<float>());
  return gs;
}

Status GmmBackward(const MoeConfig& cfg, const MoeSaved& s, const GmmBackwardArgs& b,
                   const MoeOptions& options, Tensor* dw) {
  const PreparedWeight& wt = *b.weight;
  const std::string name = b.name;
  const int64_t valid = s.T * s.k;
  GmmOptions od;
  od.tiles = b.tiles.dlhs;
  od.epilogue = b.h != nullptr ? GmmEpilogue::kDSwiGlu : GmmEpilogue::kNone;
  TensorView scale = wt.codes ? wt.scale.view() : TensorView{};
  const MoeQatMode mode = s.plan.mode;
  // ---- dLHS ----
  if (mode == MoeQatMode::kRecipeFp8Full) {
    FP8MOE_ASSIGN_OR_RETURN(Tensor lhs, RecipeDlhsOperand(cfg, s, b.g, wt.scale));
    Tensor ones = std::move(Tensor::Create(DType::kF32, wt.scale.shape())).value();
    std::fill(ones.data_as<float>(), ones.data_as<float>() + ones.num_elements(), 1.0f);
    TensorView ov = ones.view();
    od.mode = GmmMode::kF32;
    Report(options, name + "_dlhs", od.mode, s.plan.bwd_dtype, wt.quant);
    FP8MOE_RETURN_IF_ERROR(GmmDlhs(od, lhs.view(), wt.view, &ov, s.group_sizes.view(), b.dlhs, b.h));
  } else if (!wt.codes) {
    od.mode = s.act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
    Report(options, name + "_dlhs", od.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(GmmDlhs(od, b.g, wt.view, nullptr, s.group_sizes.view(), b.dlhs, b.h));
  } else if (wt.quant == QuantDType::kInt8) {
    // int8 weights: their dequantized values as a bf16 copy.
    const TensorView& m = *b.master;
    Tensor f = std::move(Tensor::Create(DType::kF32, m.shape)).value();
    DequantizeChannels(wt.owned.data_as<uint8_t>(), m.shape[0], m.shape[1], m.shape[2],
                       wt.scale.data_as<float>(), QuantDType::kInt8, f.data_as<float>());
    Tensor copy = std::move(Tensor::Create(DType::kBF16, m.shape)).value();
    F32ToBf16Span(f.data_as<float>(), copy.data_as<uint16_t>(), f.num_elements());
    od.mode = GmmMode::kBf16;
    Report(options, name + "_dlhs", od.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(GmmDlhs(od, b.g, copy.view(), nullptr, s.group_sizes.view(), b.dlhs, b.h));
  } else {
    // fp8 codes: the BF16 copy (fake QAT), or tile by tile from the codes
    // (native dLHS); the two are bit-identical.
    od.mode = mode == MoeQatMode::kNativeFwdDlhs ? GmmMode::kBf16 : GmmMode::kFakeQat;
    Report(options, name + "_dlhs", od.mode, std::nullopt, wt.quant);
    FP8MOE_RETURN_IF_ERROR(GmmDlhs(od, b.g, wt.view, &scale, s.group_sizes.view(), b.dlhs, b.h));
  }
  // ---- dW ----
  GmmOptions ow;
  ow.tiles = b.tiles.drhs;
  if (mode == MoeQatMode::kRecipeFp8Full) {
    // f32(q_a)^T @ deq(q_bwd(g * s_a)): q_a, s_a as the forward quantized a_in.
    const int64_t rows = b.a_in.shape[0], kdim = b.a_in.shape[1], n = b.g.shape[1];
    FP8MOE_ASSIGN_OR_RETURN(Tensor a32, Tensor::Create(DType::kF32, {rows, kdim}));
    Bf16ToF32Span(b.a_in.as<uint16_t>(), a32.data_as<float>(), static_cast<size_t>(valid * kdim));
    Tensor qa = std::move(Tensor::Create(DType::kE4M3FN, {rows, kdim})).value();
    std::vector<float> sa(static_cast<size_t>(rows), 0.0f);
    FP8MOE_RETURN_IF_ERROR(QuantizeRows(a32.data_as<float>(), rows, kdim, valid, 0,
                                        QuantDType::kE4M3FN, cfg.act_quantization_calibration_method,
                                        qa.data_as<uint8_t>(), sa.data()));
    FP8MOE_ASSIGN_OR_RETURN(Tensor gs, Tensor::Create(DType::kF32, {rows, n}));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < valid; ++i) {
      float* dst = gs.data_as<float>() + i * n;
      Bf16ToF32Span(b.g.as<uint16_t>() + i * n, dst, static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) dst[j] *= sa[static_cast<size_t>(i)];
    }
    TgmmQuant q;
    q.dout_dtype = s.plan.bwd_dtype;
    q.per_group = !s.plan.inkernel_bwd;
    q.calibration = cfg.bwd_quantization_calibration_method;
    ow.mode = GmmMode::kF32;
    Report(options, name + "_drhs", ow.mode, QuantDType::kE4M3FN, s.plan.bwd_dtype);
    FP8MOE_RETURN_IF_ERROR(Tgmm(ow, q, qa.view(), gs.view(), s.group_sizes.view(), dw->view()));
  } else {
    ow.mode = s.act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
    Report(options, name + "_drhs", ow.mode, std::nullopt, std::nullopt);
    FP8MOE_RETURN_IF_ERROR(Tgmm(ow, {}, b.a_in, b.g, s.group_sizes.view(), dw->view()));
  }
  // Straight-through to the master; fixed calibration masks what it clips.
  const Calibration& wc = cfg.weight_quantization_calibration_method;
  if (mode != MoeQatMode::kNone && wc.kind == Calibration::Kind::kFixed) {
    const float clip = wc.FixedAmax();
    const float* m = b.master->as<float>();
    float* d = dw->data_as<float>();
    for (size_t i = 0; i < dw->num_elements(); ++i) {
      if (std::fabs(m[i]) > clip) d[i] = 0.0f;
    }
  }
  return OkStatus();
}

}  // namespace

Result<MoeGradients> MoeBackward(const MoeConfig& cfg, const TensorView& x,
                                 const MoeWeights& w, const MoeForwardResult& fwd,
                                 const TensorView& dy, const MoeOptions& options) {
  if (fwd.saved == nullptr) return InvalidArgument("MoeBackward needs the result of MoeForward");
  const MoeSaved& s = *fwd.saved;
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w));
  if (x.shape != Shape{s.T, s.D}) {
    return InvalidArgument("x has shape " + ShapeToString(x.shape) +
                           " but the forward ran on " + ShapeToString({s.T, s.D}));
  }
  if (dy.dtype != DType::kF32 || dy.shape != Shape{s.T, s.D}) {
    return InvalidArgument("dy must be F32 " + ShapeToString({s.T, s.D}) + "; got " +
                           std::string(DTypeName(dy.dtype)) + " " + ShapeToString(dy.shape));
  }
  const int64_t valid = s.T * s.k;
  MoeGradients grads;

  // Combine: dy_sorted and the routing weights' gradient.
  FP8MOE_ASSIGN_OR_RETURN(Tensor dy_sorted, Buffer(s.act, s.rows, s.D, options, valid));
  std::vector<float> dweight(static_cast<size_t>(valid));
  internal::CombineBackward(s.routing, dy.as<float>(), s.y_sorted.data(), s.act, s.D,
                            dy_sorted.data(), dweight.data());

  // wo: dh = dSwiGLU(dy_sorted @ wo'^T, h); dwo = a^T dy_sorted.
  FP8MOE_ASSIGN_OR_RETURN(Tensor dh, Buffer(s.act, s.rows, 2 * s.F, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(grads.dwo, Tensor::Create(DType::kF32, w.wo.shape));
  TensorView hv = s.h.view();
  GmmBackwardArgs bo{"wo", &w.wo, &s.wo, s.a.view(), dy_sorted.view(), dh.view(), &hv,
                     cfg.wo_tiles};
  FP8MOE_RETURN_IF_ERROR(GmmBackward(cfg, s, bo, options, &grads.dwo));

  // wi: dx_sorted = dh @ wi'^T; dwi = x_sorted^T dh (x_sorted recomputed
  // unless the forward kept it).
  Tensor x_sorted_recomputed;
  TensorView xs;
  if (s.x_sorted.num_elements() > 0 || s.rows == 0) {
    xs = const_cast<Tensor&>(s.x_sorted).view();
    if (s.rows == 0) xs = TensorView{nullptr, s.act, {0, s.D}};
  } else {
    FP8MOE_ASSIGN_OR_RETURN(x_sorted_recomputed, Buffer(s.act, s.rows, s.D, options, valid));
    internal::GatherRows(s.routing, x.as<float>(), s.D, x_sorted_recomputed.data(), s.act);
    xs = x_sorted_recomputed.view();
  }
  FP8MOE_ASSIGN_OR_RETURN(Tensor dx_sorted, Buffer(DType::kF32, s.rows, s.D, options, valid));
  FP8MOE_ASSIGN_OR_RETURN(grads.dwi, Tensor::Create(DType::kF32, w.wi.shape));
  GmmBackwardArgs bi{"wi", &w.wi, &s.wi, xs, dh.view(), dx_sorted.view(), nullptr, cfg.wi_tiles};
  FP8MOE_RETURN_IF_ERROR(GmmBackward(cfg, s, bi, options, &grads.dwi));

  // Router: dlogits from the routing weights and the load-balancing loss;
  // drouter = x^T dlogits, dx = unpermuted dx_sorted + dlogits Wr^T.
  FP8MOE_ASSIGN_OR_RETURN(Tensor dlogits, Tensor::Create(DType::kF32, {s.T, s.E}));
  internal::RouterBackward(s.routing, dweight.data(), cfg.norm_topk_prob,
                           cfg.load_balance_loss_weight, dlogits.data_as<float>());
  Tensor one = std::move(Tensor::Create(DType::kI32, {1})).value();
  one.data_as<int32_t>()[0] = static_cast<int32_t>(s.T);
  GmmOptions o32;
  o32.mode = GmmMode::kF32;
  FP8MOE_ASSIGN_OR_RETURN(grads.drouter, Tensor::Create(DType::kF32, w.router.shape));
  TensorView dr3{grads.drouter.data(), DType::kF32, {1, s.D, s.E}};
  FP8MOE_RETURN_IF_ERROR(Tgmm(o32, {}, x, dlogits.view(), one.view(), dr3));
  FP8MOE_ASSIGN_OR_RETURN(grads.dx, Tensor::Create(DType::kF32, {s.T, s.D}));
  TensorView r3{w.router.data, DType::kF32, {1, s.D, s.E}};
  FP8MOE_RETURN_IF_ERROR(GmmDlhs(o32, dlogits.view(), r3, nullptr, one.view(), grads.dx.view()));
  internal::ScatterAddRows(s.routing, dx_sorted.data_as<float>(), s.D, grads.dx.data_as<float>());
  return grads;
}

}  // namespace fp8moe
