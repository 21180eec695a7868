// The attention sublayer of a decoder layer (include/fp8moe/model.h), forward
// and backward on the ops of kernels/ops.h, internal to model/:
//   n1  = RMSNorm(x) * attn_norm
//   qkv = n1 @ wqkv                  [N, (H + 2 Hkv) hd]: q | k | v heads
//   with use_qk_norm, each q head RMSNorm(q) * q_norm, each k head
//   RMSNorm(k) * k_norm (over hd, before RoPE; Qwen3)
//   q, k rotated (RoPE); attn = causal softmax attention (query head h reads
//   kv head h / (H / Hkv))
//   x1  = x + attn @ wo_attn
// model/reference/ has the float64 twin (reference::ModelLoss).
#ifndef FP8MOE_MODEL_ATTENTION_BLOCK_H_
#define FP8MOE_MODEL_ATTENTION_BLOCK_H_

#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"
#include "model/mla_block.h"

namespace fp8moe::internal {

// What the layers' attention sublayers share: the RoPE tables and the
// backward's scratch.
struct AttentionShared {
  Tensor cos, sin;  // [S, hd/2]
  Tensor dqkv;      // [N, (H + 2 Hkv) hd]
  Tensor dattn;     // [N, H hd]
  // use_qk_norm only. The norms run on head rows [hd] gathered head-major
  // (every token's q heads, then its k heads, then its v heads) by the
  // seam's PermuteRows, so that each gain's rows are one contiguous block
  // for the RmsNorm ops, and are permuted back.
  Tensor raw;        // [N, (H + 2 Hkv) hd] the projection before the norms (backward: its gradient)
  Tensor head_rows;  // [N (H + 2 Hkv), hd] head-major rows (normed q | normed k | v, or gradients)
  Tensor to_head_major;  // I64 [N (H + 2 Hkv)]: head-major row i is token-major head row [i]
  Tensor to_token_major;  // I64 [N (H + 2 Hkv)]: the inverse
  MlaShared mla;  // attention_type=mla: the MLA sublayer's (the tensors above stay empty)
};

// One layer's activations, kept from the forward for the backward.
struct AttentionActivations {
  Tensor n1;     // [N, D] the normed input
  Tensor inv1;   // [N] its 1 / rms
  Tensor qkv;    // [N, (H + 2 Hkv) hd] q | k | v, q and k rotated
  Tensor probs;  // [B, H, S, S]
  Tensor attn;   // [N, H hd]
  Tensor qk_in;  // [N (H + Hkv), hd] the q and k heads before their norm, head-major (use_qk_norm)
  Tensor qk_inv;  // [N (H + Hkv)] their 1 / rms (use_qk_norm)
  MlaActivations mla;  // attention_type=mla: the MLA sublayer's (the tensors above stay empty)
};

// The buffers of a config (validated), allocated once.
Status AllocateAttention(const ModelConfig& c, AttentionShared* shared);
Status AllocateAttention(const ModelConfig& c, AttentionActivations* a);

// x1 [N, D] = x [N, D] + the sublayer of x; group: I32 [1] holding N (the
// dense matmuls' single group). attention_type=mla runs MlaSublayerForward
// (model/mla_block.h) on the buffers' mla members, and the backward its
// backward: the one place the attention type is chosen. Parameters (and,
// in the backward, gradients) not holding this attention type's tensors of
// c are an InvalidArgument naming the type, before anything is read.
Status AttentionSublayerForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                                AttentionShared* shared, const LayerParams& p, const float* x,
                                AttentionActivations* a, float* x1);

// The backward of AttentionSublayerForward: dx [N, D] holds the gradient of
// x1 and becomes that of x; g's attention tensors (attn_norm, wqkv,
// wo_attn, and q_norm, k_norm with use_qk_norm) are overwritten with their
// gradients; dtmp [N, D] is scratch.
Status AttentionSublayerBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                                 AttentionShared* shared, const LayerParams& p, const float* x,
                                 const AttentionActivations& a, LayerParams* g, float* dx,
                                 float* dtmp);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_ATTENTION_BLOCK_H_
