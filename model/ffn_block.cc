#include "model/ffn_block.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fp8moe/numerics.h"
#include "kernels/ops.h"
#include "model/layers.h"
#include "moe/gmm_ctx.h"

namespace fp8moe::internal {
namespace {

// The dtype of the dense MLPs' GMM operands and saved activations: the
// configured dtype (the routed experts' in QAT mode none).
DType ActOf(const ModelConfig& c) {
  return c.moe.dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
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

// The hidden width of layer L's dense MLP: base_mlp_dim on a dense layer,
// S*F with shared experts, 0 without either.
int64_t MlpWidth(const ModelConfig& c, const LayerParams& L) {
  if (L.dense) return c.base_mlp_dim;
  return L.shared ? c.shared_experts * c.mlp_dim : 0;
}

// An error unless L is the layer `l` of this config (AllocateParams): dense
// or MoE as IsDenseLayer says, the shared experts exactly with
// shared_experts > 0 on an MoE layer, and the MLP's tensors f32 [D, 2W] and
// [W, D].
Status CheckLayer(const ModelConfig& c, int64_t l, const LayerParams& L, const char* what) {
  const bool dense = IsDenseLayer(c, l);
  const int64_t D = c.emb_dim, W = MlpWidth(c, L);
  const Tensor& wi = dense ? L.mlp_wi : L.shared_wi;
  const Tensor& wo = dense ? L.mlp_wo : L.shared_wo;
  if (L.dense != dense || L.shared != (!dense && c.shared_experts > 0) ||
      (W > 0 && (wi.shape() != Shape{D, 2 * W} || wo.shape() != Shape{W, D} ||
                 wi.dtype() != DType::kF32 || wo.dtype() != DType::kF32))) {
    return InvalidArgument(
        std::string("layer ") + std::to_string(l) + " of the " + what +
        " does not match first_num_dense_layers=" + std::to_string(c.first_num_dense_layers) +
        " and shared_experts=" + std::to_string(c.shared_experts) +
        " (mlp_wi [D, 2 base_mlp_dim] and mlp_wo on a dense layer, shared_wi [D, 2 S F] and "
        "shared_wo on an MoE layer, f32); allocate them with AllocateParams of this config");
  }
  // routed_bias: the MoE layer reads its router_bias (a missing one would
  // route without it, silently). The gradients' is never written.
  if (std::string_view(what) == "parameters" && !dense && c.moe.routed_bias &&
      (L.router_bias.rank() != 1 || L.router_bias.dim(0) != c.moe.num_experts ||
       L.router_bias.dtype() != DType::kF32)) {
    return InvalidArgument("layer " + std::to_string(l) + " of the parameters has no router_bias "
                           "f32 [num_experts] but routed_bias=true; allocate them with "
                           "AllocateParams of this config");
  }
  return OkStatus();
}

}  // namespace

Status AllocateFfn(const ModelConfig& c, std::vector<DenseMlpState>* layers,
                   DenseMlpScratch* scratch) {
  layers->clear();
  layers->resize(static_cast<size_t>(c.num_layers));
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim;
  const DType act = ActOf(c);
  const bool bf16 = act == DType::kBF16;
  int64_t widest = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const int64_t W = IsDenseLayer(c, l) ? c.base_mlp_dim : c.shared_experts * c.mlp_dim;
    if (W == 0) continue;
    widest = std::max(widest, W);
    DenseMlpState& st = (*layers)[static_cast<size_t>(l)];
    FP8MOE_RETURN_IF_ERROR(CreateZeroed(&st.h, {N, 2 * W}, act));
    FP8MOE_RETURN_IF_ERROR(CreateZeroed(&st.a, {N, W}, act));
    if (bf16) {
      FP8MOE_RETURN_IF_ERROR(CreateZeroed(&st.x_act, {N, D}, act));
      FP8MOE_RETURN_IF_ERROR(CreateZeroed(&st.wi_act, {1, D, 2 * W}, act));
      FP8MOE_RETURN_IF_ERROR(CreateZeroed(&st.wo_act, {1, W, D}, act));
    }
  }
  if (widest == 0) return OkStatus();
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&scratch->group, {1}, DType::kI32));
  scratch->group.data_as<int32_t>()[0] = static_cast<int32_t>(N);
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&scratch->y, {N, D}, DType::kF32));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&scratch->dx, {N, D}, DType::kF32));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&scratch->dh, {N, 2 * widest}, act));
  if (bf16) FP8MOE_RETURN_IF_ERROR(CreateZeroed(&scratch->dy_act, {N, D}, act));
  return OkStatus();
}

Status FfnForward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, int64_t layer,
                  const LayerParams& P, const MoeWeights& master,
                  const PreparedMoeWeights& prepared, const ConstTensorView& x,
                  MoeWorkspace* moe, DenseMlpState* state, DenseMlpScratch* scratch,
                  const TensorView& y, MoeStepInfo* info, std::vector<int32_t>* load) {
  FP8MOE_RETURN_IF_ERROR(CheckLayer(c, layer, P, "parameters"));
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, W = MlpWidth(c, P);
  const Tensor& wi = P.dense ? P.mlp_wi : P.shared_wi;
  const Tensor& wo = P.dense ? P.mlp_wo : P.shared_wo;
  if (P.dense) {
    load->clear();
    return DenseMlpForward(ctx, ActOf(c), scratch->group.view(), x.as<float>(),
                           wi.data_as<float>(), wo.data_as<float>(), N, D, W, state,
                           y.as<float>());
  }
  FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, c.moe, x, master, prepared, moe, y, info, mo));
  const ConstTensorView gs = moe->group_sizes();
  load->assign(gs.as<int32_t>(), gs.as<int32_t>() + gs.num_elements());
  if (!P.shared) return OkStatus();
  FP8MOE_RETURN_IF_ERROR(DenseMlpForward(ctx, ActOf(c), scratch->group.view(), x.as<float>(),
                                         wi.data_as<float>(), wo.data_as<float>(), N, D, W,
                                         state, scratch->y.data_as<float>()));
  return Add(ctx, y.as<float>(), scratch->y.data_as<float>(), N * D, y.as<float>());
}

Status FfnBackward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, int64_t layer,
                   const LayerParams& P, const MoeWeights& master,
                   const PreparedMoeWeights& prepared, const ConstTensorView& x,
                   MoeWorkspace* moe, const DenseMlpState& state, DenseMlpScratch* scratch,
                   const ConstTensorView& dy, const MoeGradientViews& grads, LayerParams* G) {
  FP8MOE_RETURN_IF_ERROR(CheckLayer(c, layer, *G, "gradients"));
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, W = MlpWidth(c, P);
  const Tensor& wi = P.dense ? P.mlp_wi : P.shared_wi;
  const Tensor& wo = P.dense ? P.mlp_wo : P.shared_wo;
  Tensor& dwi = P.dense ? G->mlp_wi : G->shared_wi;
  Tensor& dwo = P.dense ? G->mlp_wo : G->shared_wo;
  if (P.dense) {
    return DenseMlpBackward(ctx, ActOf(c), scratch->group.view(), x.as<float>(),
                            wi.data_as<float>(), wo.data_as<float>(), N, D, W, state, scratch,
                            dy.as<float>(), grads.dx.as<float>(), dwi.data_as<float>(),
                            dwo.data_as<float>());
  }
  FP8MOE_RETURN_IF_ERROR(MoeBackward(ctx, c.moe, x, master, prepared, moe, dy, grads, mo));
  if (!P.shared) return OkStatus();
  float* dx = scratch->dx.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(DenseMlpBackward(ctx, ActOf(c), scratch->group.view(), x.as<float>(),
                                          wi.data_as<float>(), wo.data_as<float>(), N, D, W,
                                          state, scratch, dy.as<float>(), dx,
                                          dwi.data_as<float>(), dwo.data_as<float>()));
  return Add(ctx, grads.dx.as<float>(), dx, N * D, grads.dx.as<float>());
}

}  // namespace fp8moe::internal
