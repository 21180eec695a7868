// Multi-head latent attention (attention_type=mla, DeepSeek-V2/V3;
// docs/design.md "Multi-head latent attention"), the attention sublayer of a
// decoder layer under mla, forward and backward on the ops of kernels/ops.h,
// internal to model/. With H heads, qk = nope + r, x [N, D]:
//   n1     = RMSNorm(x) * attn_norm
//   q      = n1 @ wq, or (RMSNorm(n1 @ wq_a) * q_a_norm) @ wq_b   [N, H qk]
//   kv_a   = n1 @ wkv_a = latent [kvl] | k_rope [r]                [N, kvl + r]
//   kv_b   = (RMSNorm(latent) * kv_a_norm) @ wkv_b                 [N, H (nope + vd)]
//   head h: query q_h (nope | rope), key k_nope_h | k_rope (one k_rope for
//   every head), value v_h; the rope columns rotated (rope_interleave: pairs
//   (2i, 2i+1), else halves; angle p / rope_max_timescale^(2i / r));
//   attn = causal softmax attention, scale 1/sqrt(qk)                [N, H vd]
//   x1   = x + attn @ wo_attn
// The attention op runs on one fused buffer q | k | v: H query and H key
// heads of qk columns, H value heads of vd (its value head width).
// model/reference/ has the float64 twin (reference::ModelLoss).
#ifndef FP8MOE_MODEL_MLA_BLOCK_H_
#define FP8MOE_MODEL_MLA_BLOCK_H_

#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe::internal {

// What the layers' MLA sublayers share: the RoPE tables and scratch for
// the forward's projections, which the backward reuses for their gradients.
struct MlaShared {
  Tensor cos, sin;   // [S, r/2]
  Tensor q;          // [N, H qk] the q projection (backward: its gradient)
  Tensor kv_a;       // [N, kvl + r] (backward: its gradient)
  Tensor kv_b;       // [N, H (nope + vd)] (backward: its gradient)
  Tensor dqkv;       // [N, 2 H qk + H vd]
  Tensor dattn;      // [N, H vd]
  Tensor dlatent;    // [N, kvl] the gradient of the normed latent
  Tensor dlatent_in;  // [N, kvl] the gradient of the latent
  Tensor dq_a_n;     // [N, ql] the gradient of the normed compressed q (q_lora_rank > 0)
  Tensor dq_a;       // [N, ql] the gradient of the compressed q (q_lora_rank > 0)
  Tensor dn1;        // [N, D] the q path's part of the gradient of n1
};

// One layer's activations, kept from the forward for the backward.
struct MlaActivations {
  Tensor n1;          // [N, D] the normed input
  Tensor inv1;        // [N] its 1 / rms
  Tensor q_a;         // [N, ql] n1 @ wq_a (q_lora_rank > 0)
  Tensor q_a_inv;     // [N] its 1 / rms
  Tensor q_a_n;       // [N, ql] RMSNorm(q_a) * q_a_norm
  Tensor latent;      // [N, kvl]
  Tensor latent_inv;  // [N] its 1 / rms
  Tensor latent_n;    // [N, kvl] RMSNorm(latent) * kv_a_norm
  Tensor qkv;         // [N, 2 H qk + H vd] q | k | v heads, rope columns rotated
  Tensor probs;       // [B, H, S, S]
  Tensor attn;        // [N, H vd]
};

// The buffers of a config (validated, attention_type=mla), allocated once.
Status AllocateMla(const ModelConfig& c, MlaShared* shared);
Status AllocateMla(const ModelConfig& c, MlaActivations* a);

// x1 [N, D] = x [N, D] + the MLA sublayer of x; group: I32 [1] holding N
// (the dense matmuls' single group).
Status MlaSublayerForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                          MlaShared* shared, const LayerParams& p, const float* x,
                          MlaActivations* a, float* x1);

// The backward of MlaSublayerForward: dx [N, D] holds the gradient of x1
// and becomes that of x; g's attention tensors (attn_norm, the MLA
// projections and norms, wo_attn) are overwritten with their gradients;
// dtmp [N, D] is scratch.
Status MlaSublayerBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                           MlaShared* shared, const LayerParams& p, const float* x,
                           const MlaActivations& a, LayerParams* g, float* dx, float* dtmp);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_MLA_BLOCK_H_
