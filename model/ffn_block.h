// The model's FFN sublayer (docs/design.md §5.1), internal to model/: the
// MoE layer on the normalized input, plus, with shared_experts S > 0, the
// shared experts fused as one dense SwiGLU MLP of width S*F on the same
// input, its output added to the routed one; or, on the first
// first_num_dense_layers layers, a dense SwiGLU MLP of width base_mlp_dim
// instead of MoE. The dense MLPs run on the
// library's GMM with one group and its SwiGLU / dSwiGLU epilogues, in the
// configured dtype (float32: f32 operands; bfloat16: bf16 operands and
// activations, f32 accumulation and outputs, as the routed experts in QAT mode
// none), never quantized.
#ifndef FP8MOE_MODEL_FFN_BLOCK_H_
#define FP8MOE_MODEL_FFN_BLOCK_H_

#include <cstdint>
#include <vector>

#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/moe.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe::internal {

// A dense SwiGLU MLP's activations of one layer, saved by the forward for the
// backward (act: the configured dtype; N = B*S rows, W the hidden width).
struct DenseMlpState {
  Tensor x_act;   // [N, D] act: the input as the GMMs read it (bfloat16 only)
  Tensor wi_act;  // [1, D, 2W] act: wi as the GMMs read it (bfloat16 only)
  Tensor wo_act;  // [1, W, D] act (bfloat16 only)
  Tensor h;       // [N, 2W] act: the pre-activation gate | up
  Tensor a;       // [N, W] act: silu(gate) * up
};

// Buffers shared by every layer's dense MLP (reused layer after layer).
struct DenseMlpScratch {
  Tensor group;   // I32 [1] = N: the one group of the GMMs
  Tensor y;       // [N, D] f32: the MLP's output
  Tensor dy_act;  // [N, D] act: dy as the GMMs read it (bfloat16 only)
  Tensor dh;      // [N, 2W] act, W the widest MLP
  Tensor dx;      // [N, D] f32: the gradient of the MLP's input
};

// Allocates the dense MLPs' state of every layer (the shared experts' or a
// dense layer's; none for a plain MoE layer) and the scratch. Called once,
// with the model's other buffers.
Status AllocateFfn(const ModelConfig& c, std::vector<DenseMlpState>* layers,
                   DenseMlpScratch* scratch);

// The FFN sublayer's forward: y [N, D] f32 = MoE(x) (+ the shared experts'
// MLP of x with P.shared), or the dense MLP of x on a dense layer (P.dense:
// no MoE, *info untouched). x [N, D] f32 (the normalized residual). *load:
// the tokens routed to each expert [E] (empty on a dense layer).
Status FfnForward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, int64_t layer,
                  const LayerParams& P, const MoeWeights& master,
                  const PreparedMoeWeights& prepared, const ConstTensorView& x,
                  MoeWorkspace* moe, DenseMlpState* state, DenseMlpScratch* scratch,
                  const TensorView& y, MoeStepInfo* info, std::vector<int32_t>* load);

// Its backward from dy [N, D] f32: grads.dx [N, D] = the gradient of x
// (overwritten), the MoE's gradients into grads' views and the shared MLP's
// into G.shared_wi / G.shared_wo, or on a dense layer the MLP's into
// G.mlp_wi / G.mlp_wo (overwritten).
Status FfnBackward(Context& ctx, const ModelConfig& c, const MoeOptions& mo, int64_t layer,
                   const LayerParams& P, const MoeWeights& master,
                   const PreparedMoeWeights& prepared, const ConstTensorView& x,
                   MoeWorkspace* moe, const DenseMlpState& state, DenseMlpScratch* scratch,
                   const ConstTensorView& dy, const MoeGradientViews& grads, LayerParams* G);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_FFN_BLOCK_H_
