#include "model/ffn_block.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fp8moe/numerics.h"
#include "kernels/ops.h"
#include "moe/gmm_ctx.h"

namespace fp8moe::internal {
namespace {

// The dtype of the dense MLPs' GMM operands and saved activations: the
// configured dtype (the routed experts' in QAT mode none).
DType ActOf(const ModelConfig& c) {
  return c.moe.dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
}

Status Make(Tensor* t, DType d, Shape s) {
  FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Create(d, std::move(s)));
  return OkStatus();
}

// f32 data [shape] as the GMMs read it in act: itself (float32), or its bf16
// copy, written into `copy` when `convert` (bfloat16).
ConstTensorView AsAct(const float* f32, Shape shape, DType act, Tensor* copy, bool convert) {
  if (act == DType::kF32) return ConstTensorView{f32, DType::kF32, std::move(shape)};
  if (convert) F32ToBf16Span(f32, static_cast<uint16_t*>(copy->data()), NumElements(shape));
  return ConstTensorView{copy->data(), DType::kBF16, std::move(shape)};
}

// One dense SwiGLU MLP's forward: y [N, D] f32 = (silu(gate) * up) @ wo with
// gate | up = x @ wi; x [N, D] f32, wi [D, 2W], wo [W, D] f32 masters.
Status DenseMlpForward(Context& ctx, DType act, const ConstTensorView& group, const float* x,
                       const float* wi, const float* wo, int64_t N, int64_t D, int64_t W,
                       DenseMlpState* st, float* y) {
  const ConstTensorView xa = AsAct(x, {N, D}, act, &st->x_act, true);
  const ConstTensorView wia = AsAct(wi, {1, D, 2 * W}, act, &st->wi_act, true);
  const ConstTensorView woa = AsAct(wo, {1, W, D}, act, &st->wo_act, true);
  GmmOptions o;
  o.mode = act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
  o.epilogue = GmmEpilogue::kSwiGlu;
  const TensorView a{st->a.data(), act, {N, W}};
  const TensorView h{st->h.data(), act, {N, 2 * W}};
  FP8MOE_RETURN_IF_ERROR(CtxGmm(ctx, o, xa, wia, nullptr, group, a, &h));
  o.epilogue = GmmEpilogue::kNone;
  return CtxGmm(ctx, o, a, woa, nullptr, group, TensorView{y, DType::kF32, {N, D}});
}

// Its backward from dy [N, D] f32: dx [N, D] f32 (overwritten), dwi [D, 2W]
// and dwo [W, D] f32 (overwritten), from the forward's saved state.
Status DenseMlpBackward(Context& ctx, DType act, const ConstTensorView& group, const float* x,
                        const float* wi, const float* wo, int64_t N, int64_t D, int64_t W,
                        const DenseMlpState& st, DenseMlpScratch* sc, const float* dy, float* dx,
                        float* dwi, float* dwo) {
  // The operands as the forward read them: the f32 ones, or its bf16 copies.
  auto saved = [&](const float* f32, Shape s, const Tensor& copy) {
    return act == DType::kF32 ? ConstTensorView{f32, DType::kF32, std::move(s)}
                              : ConstTensorView{copy.data(), DType::kBF16, std::move(s)};
  };
  const ConstTensorView xa = saved(x, {N, D}, st.x_act);
  const ConstTensorView wia = saved(wi, {1, D, 2 * W}, st.wi_act);
  const ConstTensorView woa = saved(wo, {1, W, D}, st.wo_act);
  const ConstTensorView a{st.a.data(), act, {N, W}};
  const ConstTensorView h{st.h.data(), act, {N, 2 * W}};
  const ConstTensorView dya = AsAct(dy, {N, D}, act, &sc->dy_act, true);
  const TensorView dh{sc->dh.data(), act, {N, 2 * W}};
  GmmOptions o;
  o.mode = act == DType::kF32 ? GmmMode::kF32 : GmmMode::kBf16;
  // wo: dh = dSwiGLU(dy @ wo^T, h); dwo = a^T dy.
  o.epilogue = GmmEpilogue::kDSwiGlu;
  FP8MOE_RETURN_IF_ERROR(CtxGmmDlhs(ctx, o, dya, woa, nullptr, group, dh, &h));
  o.epilogue = GmmEpilogue::kNone;
  FP8MOE_RETURN_IF_ERROR(
      CtxTgmm(ctx, o, {}, a, dya, group, TensorView{dwo, DType::kF32, {1, W, D}}));
  // wi: dx = dh @ wi^T; dwi = x^T dh.
  FP8MOE_RETURN_IF_ERROR(
      CtxGmmDlhs(ctx, o, dh, wia, nullptr, group, TensorView{dx, DType::kF32, {N, D}}));
  return CtxTgmm(ctx, o, {}, xa, dh, group, TensorView{dwi, DType::kF32, {1, D, 2 * W}});
}

// An error unless L holds the shared experts' tensors exactly when the config
// has shared experts, shaped [D, 2W] and [W, D] (ModelParams::Layout and
// AllocateParams make them so).
Status CheckShared(const ModelConfig& c, const LayerParams& L, const char* what) {
  const int64_t D = c.emb_dim, W = c.shared_experts * c.mlp_dim;
  if (L.shared != (c.shared_experts > 0) ||
      (L.shared && (L.shared_wi.shape() != Shape{D, 2 * W} ||
                    L.shared_wo.shape() != Shape{W, D} || L.shared_wi.dtype() != DType::kF32 ||
                    L.shared_wo.dtype() != DType::kF32))) {
    return InvalidArgument(std::string("the ") + what + "' shared experts do not match " +
                           "shared_experts=" + std::to_string(c.shared_experts) +
                           " (shared_wi [D, 2 S F], shared_wo [S F, D] f32); allocate them with "
                           "AllocateParams of this config");
  }
  return OkStatus();
}

}  // namespace

Status AllocateFfn(const ModelConfig& c, std::vector<DenseMlpState>* layers,
                   DenseMlpScratch* scratch) {
  layers->clear();
  layers->resize(static_cast<size_t>(c.num_layers));
  if (c.shared_experts == 0) return OkStatus();
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, W = c.shared_experts * c.mlp_dim;
  const DType act = ActOf(c);
  const bool bf16 = act == DType::kBF16;
  for (DenseMlpState& st : *layers) {
    FP8MOE_RETURN_IF_ERROR(Make(&st.h, act, {N, 2 * W}));
    FP8MOE_RETURN_IF_ERROR(Make(&st.a, act, {N, W}));
    if (bf16) {
      FP8MOE_RETURN_IF_ERROR(Make(&st.x_act, act, {N, D}));
      FP8MOE_RETURN_IF_ERROR(Make(&st.wi_act, act, {1, D, 2 * W}));
      FP8MOE_RETURN_IF_ERROR(Make(&st.wo_act, act, {1, W, D}));
    }
  }
  FP8MOE_RETURN_IF_ERROR(Make(&scratch->group, DType::kI32, {1}));
  scratch->group.data_as<int32_t>()[0] = static_cast<int32_t>(N);
  FP8MOE_RETURN_IF_ERROR(Make(&scratch->y, DType::kF32, {N, D}));
  FP8MOE_RETURN_IF_ERROR(Make(&scratch->dx, DType::kF32, {N, D}));
  FP8MOE_RETURN_IF_ERROR(Make(&scratch->dh, act, {N, 2 * W}));
  if (bf16) FP8MOE_RETURN_IF_ERROR(Make(&scratch->dy_act, act, {N, D}));
  return OkStatus();
}

Status FfnForward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, const LayerParams& P,
                  const MoeWeights& master, const PreparedMoeWeights& prepared,
                  const ConstTensorView& x, MoeWorkspace* moe, DenseMlpState* state,
                  DenseMlpScratch* scratch, const TensorView& y, MoeStepInfo* info) {
  FP8MOE_RETURN_IF_ERROR(CheckShared(c, P, "parameters"));
  FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, c.moe, x, master, prepared, moe, y, info, mo));
  if (!P.shared) return OkStatus();
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, W = c.shared_experts * c.mlp_dim;
  FP8MOE_RETURN_IF_ERROR(DenseMlpForward(ctx, ActOf(c), scratch->group.view(), x.as<float>(),
                                         P.shared_wi.data_as<float>(),
                                         P.shared_wo.data_as<float>(), N, D, W, state,
                                         scratch->y.data_as<float>()));
  return Add(ctx, y.as<float>(), scratch->y.data_as<float>(), N * D, y.as<float>());
}

Status FfnBackward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, const LayerParams& P,
                   const MoeWeights& master, const PreparedMoeWeights& prepared,
                   const ConstTensorView& x, MoeWorkspace* moe, const DenseMlpState& state,
                   DenseMlpScratch* scratch, const ConstTensorView& dy,
                   const MoeGradientViews& grads, LayerParams* G) {
  FP8MOE_RETURN_IF_ERROR(CheckShared(c, *G, "gradients"));
  FP8MOE_RETURN_IF_ERROR(MoeBackward(ctx, c.moe, x, master, prepared, moe, dy, grads, mo));
  if (!P.shared) return OkStatus();
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, W = c.shared_experts * c.mlp_dim;
  float* dx = scratch->dx.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(DenseMlpBackward(
      ctx, ActOf(c), scratch->group.view(), x.as<float>(), P.shared_wi.data_as<float>(),
      P.shared_wo.data_as<float>(), N, D, W, state, scratch, dy.as<float>(), dx,
      G->shared_wi.data_as<float>(), G->shared_wo.data_as<float>()));
  return Add(ctx, grads.dx.as<float>(), dx, N * D, grads.dx.as<float>());
}

}  // namespace fp8moe::internal
