// The reference backend's ops besides the GMMs (kernels/backend.h): plain
// loops on one thread, written from the formulas of kernels/ops.h, not from
// the cpu code. The row-wise ops keep the cpu code's arithmetic (f32 where
// it is f32, double sums in the same order), so the two agree bit for bit;
// attention and the loss compute in double and round once at the end
// (kernels/backend_ops_test.cc states each op's tolerance).
#ifndef FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_
#define FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_

#include "kernels/backend.h"

namespace fp8moe::reference {

void EmbeddingGather(const internal::EmbeddingGatherArgs& a);
void EmbeddingScatterAdd(const internal::EmbeddingScatterAddArgs& a);
void Add(const internal::AddArgs& a);
void RmsNormForward(const internal::RmsNormForwardArgs& a);
void RmsNormBackward(const internal::RmsNormBackwardArgs& a);
void Rope(const internal::RopeArgs& a);
void AttentionForward(const internal::AttentionForwardArgs& a);
void AttentionBackward(const internal::AttentionBackwardArgs& a);
void CrossEntropy(const internal::CrossEntropyArgs& a);
void AdamW(const internal::AdamWArgs& a);

}  // namespace fp8moe::reference

#endif  // FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_
