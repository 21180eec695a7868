// Preparing the expert weights once per step (codes + per-channel scales, or
// a bf16 copy), the MoE workspace, and FP8 health counts.
#include <cstring>

#include "fp8moe/moe.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/ops.h"
#include "moe/moe_workspace.h"

namespace fp8moe {

namespace internal {

Result<TensorView> Grow(Tensor* t, DType dtype, const Shape& shape) {
  FP8MOE_ASSIGN_OR_RETURN(const size_t n, CheckedNumElements(shape, DTypeSize(dtype)));
  if (t->data() == nullptr || t->dtype() != dtype || t->num_elements() < n) {
    FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Create(dtype, {static_cast<int64_t>(n)}));
  }
  return TensorView{t->data(), dtype, shape};
}

}  // namespace internal

MoeWorkspace::MoeWorkspace() : state_(std::make_unique<State>()) {}
MoeWorkspace::~MoeWorkspace() = default;
MoeWorkspace::MoeWorkspace(MoeWorkspace&&) noexcept = default;
MoeWorkspace& MoeWorkspace::operator=(MoeWorkspace&&) noexcept = default;

ConstTensorView MoeWorkspace::group_sizes() const {
  // The routing's counts of the layer's own tokens (on one rank the GMMs'
  // group sizes; on an expert ring those are of the local experts only).
  const std::vector<int32_t>& g = state_->routing.group_sizes;
  return ConstTensorView{g.data(), DType::kI32, {static_cast<int64_t>(g.size())}};
}

namespace {

using internal::Grow;

// *t with exactly this dtype and shape (kept when it already has them).
Result<TensorView> Exact(Tensor* t, DType dtype, const Shape& shape) {
  if (t->data() == nullptr || t->dtype() != dtype || t->shape() != shape) {
    FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Create(dtype, shape));
  }
  return t->view();
}

}  // namespace

Result<Fp8HealthCounts> CountFp8Health(Context& ctx, const uint8_t* q, const float* x, int64_t n,
                                       QuantDType dtype) {
  FP8MOE_ASSIGN_OR_RETURN(const internal::Fp8CodeCounts c,
                          internal::Fp8HealthCount(ctx, q, x, n, dtype));
  return Fp8HealthCounts{c.saturated, c.flushed, n};
}

Fp8Health Fp8HealthCounts::Fractions() const {
  Fp8Health h;
  h.values = values;
  if (values > 0) {
    h.saturated = static_cast<double>(saturated) / static_cast<double>(values);
    h.flushed = static_cast<double>(flushed) / static_cast<double>(values);
  }
  return h;
}

namespace {

// source: null, or where the codes / bf16 copy come from (FSDP), for
// expert weight `wo` of layer `layer`.
Status PrepareWeight(Context& ctx, const MoeConfig& cfg, const MoeQuantPlan& plan, DType act,
                     const ConstTensorView& master, PreparedExpertWeight* p,
                     ExpertWeightSource* source, int64_t layer, bool wo) {
  const int64_t E = master.shape[0], K = master.shape[1], N = master.shape[2];
  p->health = {};
  if (plan.mode == MoeQatMode::kNone) {
    p->codes = false;
    if (act == DType::kF32) {
      p->view = master;
    } else {
      FP8MOE_ASSIGN_OR_RETURN(const TensorView copy,
                              Grow(&p->owned, DType::kBF16, master.shape));
      p->view = copy;
      if (source != nullptr) {
        FP8MOE_RETURN_IF_ERROR(source->RoundToBf16(layer, wo, master.shape, copy.as<uint16_t>()));
      } else {
        F32ToBf16Span(master.as<float>(), copy.as<uint16_t>(), master.num_elements());
      }
    }
    return OkStatus();
  }
  p->codes = true;
  p->quant = *plan.fwd.rhs;
  FP8MOE_ASSIGN_OR_RETURN(const TensorView codes,
                          Grow(&p->owned, QuantStorageDType(p->quant), master.shape));
  p->view = codes;
  FP8MOE_ASSIGN_OR_RETURN(TensorView scale, Exact(&p->scale, DType::kF32, {E, N}));
  if (source != nullptr) {
    FP8MOE_RETURN_IF_ERROR(source->Quantize(ctx, layer, wo, master.shape, p->quant,
                                            cfg.weight_quantization_calibration_method,
                                            codes.as<uint8_t>(), scale.as<float>(),
                                            &p->health));
  } else {
    FP8MOE_RETURN_IF_ERROR(internal::QuantizeChannels(
        ctx, master.as<float>(), E, K, N, p->quant, cfg.weight_quantization_calibration_method,
        codes.as<uint8_t>(), scale.as<float>()));
    FP8MOE_ASSIGN_OR_RETURN(const Fp8HealthCounts counts,
                            CountFp8Health(ctx, p->view.as<uint8_t>(), master.as<float>(),
                                           E * K * N, p->quant));
    p->health = counts.Fractions();
  }
  if (p->quant == QuantDType::kInt8) {
    // The backward dLHS of the int8 scheme reads bf16(f32(q) * s).
    FP8MOE_ASSIGN_OR_RETURN(TensorView copy, Exact(&p->dlhs_copy, DType::kBF16, master.shape));
    FP8MOE_RETURN_IF_ERROR(internal::DequantizeChannelsToBf16(
        ctx, p->view.as<uint8_t>(), E, K, N, scale.as<float>(), QuantDType::kInt8,
        copy.as<uint16_t>()));
  }
  if (plan.mode == MoeQatMode::kRecipeFp8Full) {
    FP8MOE_ASSIGN_OR_RETURN(TensorView ones, Exact(&p->unit_scale, DType::kF32, {E, N}));
    std::fill(ones.as<float>(), ones.as<float>() + E * N, 1.0f);
  }
  return OkStatus();
}

}  // namespace

Status PrepareMoeWeights(Context& ctx, const MoeConfig& cfg, const ConstTensorView& wi,
                         const ConstTensorView& wo, PreparedMoeWeights* prepared) {
  return PrepareMoeWeights(ctx, cfg, wi, wo, prepared, nullptr, 0);
}

Status PrepareMoeWeights(Context& ctx, const MoeConfig& cfg, const ConstTensorView& wi,
                         const ConstTensorView& wo, PreparedMoeWeights* prepared,
                         ExpertWeightSource* source, int64_t layer) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
  const bool ok = wi.dtype == DType::kF32 && wo.dtype == DType::kF32 && wi.rank() == 3 &&
                  wo.rank() == 3 && wi.shape[2] % 2 == 0 && wi.shape[0] == wo.shape[0] &&
                  wo.shape == Shape{wi.shape[0], wi.shape[2] / 2, wi.shape[1]};
  if (!ok) {
    return InvalidArgument("PrepareMoeWeights needs F32 wi [E, D, 2F] and wo [E, F, D]; got " +
                           std::string(DTypeName(wi.dtype)) + " " + ShapeToString(wi.shape) +
                           " and " + std::string(DTypeName(wo.dtype)) + " " +
                           ShapeToString(wo.shape));
  }
  PreparedMoeWeights& p = *prepared;
  p.plan = PlanMoeQuantization(cfg);
  // Activations are bf16 in every quantized mode (their GMMs take bf16).
  p.act = p.plan.mode == MoeQatMode::kNone ? cfg.dtype : DType::kBF16;
  p.wi_shape = wi.shape;
  p.wo_shape = wo.shape;
  FP8MOE_RETURN_IF_ERROR(
      PrepareWeight(ctx, cfg, p.plan, p.act, wi, &p.wi, source, layer, false));
  return PrepareWeight(ctx, cfg, p.plan, p.act, wo, &p.wo, source, layer, true);
}

namespace {

// Quantizes the valid rows of `buffer` [rows, cols] (act dtype) the way the
// forward GMM does and adds the health counts to *out.
Status ActivationHealth(Context& ctx, const MoeConfig& cfg, MoeWorkspace::State& s,
                        const ConstTensorView& buffer, QuantDType dtype, int64_t block,
                        Fp8HealthCounts* out) {
  const int64_t valid = s.valid, cols = buffer.shape[1];
  FP8MOE_ASSIGN_OR_RETURN(TensorView f, Grow(&s.health_f32, DType::kF32, {valid, cols}));
  if (buffer.dtype == DType::kF32) {
    std::memcpy(f.data, buffer.data, f.num_bytes());
  } else {
    Bf16ToF32Span(buffer.as<uint16_t>(), f.as<float>(), f.num_elements());
  }
  FP8MOE_ASSIGN_OR_RETURN(TensorView q, Grow(&s.health_q, DType::kU8, {valid, cols}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView sc,
                          Grow(&s.health_sc, DType::kF32, {valid, NumBlocks(cols, block)}));
  FP8MOE_RETURN_IF_ERROR(internal::QuantizeRows(ctx, f.as<float>(), valid, cols, valid, block,
                                                dtype, cfg.act_quantization_calibration_method,
                                                q.as<uint8_t>(), sc.as<float>()));
  FP8MOE_ASSIGN_OR_RETURN(const Fp8HealthCounts n,
                          CountFp8Health(ctx, q.as<uint8_t>(), f.as<float>(), valid * cols, dtype));
  out->saturated += n.saturated;
  out->flushed += n.flushed;
  out->values += n.values;
  return OkStatus();
}

}  // namespace

Status MoeActivationHealth(Context& ctx, const MoeConfig& cfg, const PreparedMoeWeights& prepared,
                           MoeWorkspace* workspace, Fp8Health* wi_lhs, Fp8Health* wo_lhs) {
  MoeWorkspace::State& s = workspace->state();
  *wi_lhs = {};
  *wo_lhs = {};
  if (!s.forward_done) {
    return FailedPrecondition("MoeActivationHealth needs a MoeForward on the workspace first");
  }
  if (!prepared.plan.fwd.lhs.has_value()) return OkStatus();
  const QuantDType dtype = *prepared.plan.fwd.lhs;
  const bool native = prepared.plan.mode == MoeQatMode::kNativeFwd ||
                      prepared.plan.mode == MoeQatMode::kNativeFwdDlhs;
  const int64_t block = native ? cfg.moe_lhs_quant_block_size : 0;
  // With num_moe_token_chunks the rows are the chunks' (counts add up).
  Fp8HealthCounts wi, wo;
  if (s.chunks.empty()) {
    FP8MOE_RETURN_IF_ERROR(ActivationHealth(ctx, cfg, s, s.xs, dtype, block, &wi));
    FP8MOE_RETURN_IF_ERROR(ActivationHealth(ctx, cfg, s, s.av, dtype, block, &wo));
  }
  for (const auto& cs : s.chunks) {
    FP8MOE_RETURN_IF_ERROR(ActivationHealth(ctx, cfg, *cs, cs->xs, dtype, block, &wi));
    FP8MOE_RETURN_IF_ERROR(ActivationHealth(ctx, cfg, *cs, cs->av, dtype, block, &wo));
  }
  *wi_lhs = wi.Fractions();
  *wo_lhs = wo.Fractions();
  return OkStatus();
}

}  // namespace fp8moe
