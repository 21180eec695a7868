// The model's output projection (include/fp8moe/model.h), internal to model/:
// logits [N, V] from the final norm's output nf [N, D], through the untied
// lm_head [D, V] or, with logits_via_embedding (MaxText's tied embedding),
// through the embedding table's transpose, divided by sqrt(D) where
// normalize_embedding_logits (MaxText's decoder: logits / sqrt(emb_dim)).
// model/reference/ has the float64 twin (reference::ModelLoss).
#ifndef FP8MOE_MODEL_LOGITS_BLOCK_H_
#define FP8MOE_MODEL_LOGITS_BLOCK_H_

#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe::internal {

// The tied projection's buffers (empty without logits_via_embedding).
struct LogitsBuffers {
  Tensor raw;        // [N, V] nf @ embed^T before the 1/sqrt(D) (normalized only)
  Tensor row_scale;  // [N] f32(1/sqrt(D)) (normalized only)
  Tensor dembed;     // [V, D] the projection's part of embed's gradient
};

Status AllocateLogits(const ModelConfig& c, LogitsBuffers* b);

// logits [N, V] of nf [N, D]; group: I32 [1] holding N.
Status LogitsForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                     const ModelParams& p, const float* nf, LogitsBuffers* b, float* logits);

// The backward: dnf [N, D] (overwritten) from dlogits [N, V]; untied, the
// gradient of lm_head (overwritten); tied, the projection's part of embed's
// gradient into b->dembed, for AddTiedEmbeddingGradient once the
// embedding's own gradient is in place.
Status LogitsBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                      const ModelParams& p, const float* nf, const float* dlogits,
                      LogitsBuffers* b, float* dnf, ModelParams* g);

// Tied: dembed [V, D] += b.dembed (the gradient through the logits); untied:
// nothing.
Status AddTiedEmbeddingGradient(Context& ctx, const ModelConfig& c, const LogitsBuffers& b,
                                float* dembed);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_LOGITS_BLOCK_H_
