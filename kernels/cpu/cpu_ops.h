// The cpu backend's implementations of the ops of kernels/ops.h besides the
// GMMs, arguments already checked (kernels/backend.h). The code the layers
// ran before the seam, moved: OpenMP over rows or (batch, head) with a fixed
// summation order per output, so the bits do not depend on the thread
// count; attention and the loss vectorized per Highway target.
#ifndef FP8MOE_KERNELS_CPU_CPU_OPS_H_
#define FP8MOE_KERNELS_CPU_CPU_OPS_H_

#include "kernels/backend.h"

namespace fp8moe::internal::cpu {

void EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a);      // cpu/model_ops.cc
void EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a);
void Add(Context& ctx, const AddArgs& a);
void RmsNormForward(Context& ctx, const RmsNormForwardArgs& a);
void RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a);
void Rope(Context& ctx, const RopeArgs& a);
void AdamW(Context& ctx, const AdamWArgs& a);
void AttentionForward(Context& ctx, const AttentionForwardArgs& a);    // cpu/attention.cc
void AttentionBackward(Context& ctx, const AttentionBackwardArgs& a);
void CrossEntropy(Context& ctx, const CrossEntropyArgs& a);            // cpu/cross_entropy.cc

}  // namespace fp8moe::internal::cpu

#endif  // FP8MOE_KERNELS_CPU_CPU_OPS_H_
