// The cpu backend's implementations of the ops of kernels/ops.h besides the
// GMMs, arguments already checked (kernels/backend.h). The code the layers
// ran before the seam, moved: OpenMP over rows or (batch, head) with a fixed
// summation order per output, so the bits do not depend on the thread
// count; attention and the loss vectorized per Highway target.
#ifndef FP8MOE_KERNELS_CPU_CPU_OPS_H_
#define FP8MOE_KERNELS_CPU_CPU_OPS_H_

#include "kernels/backend.h"

namespace fp8moe::internal {

// Shapes: kernels/ops.h, at each entry point.
struct CpuOps {
  static void EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a);  // cpu/model_ops.cc
  static void EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a);
  static void Add(Context& ctx, const AddArgs& a);
  static void RmsNormForward(Context& ctx, const RmsNormForwardArgs& a);
  static void RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a);
  static void Rope(Context& ctx, const RopeArgs& a);
  static void CopyColumns(Context& ctx, const CopyColumnsArgs& a);
  static void AdamW(Context& ctx, const AdamWArgs& a);
  // The MoE layer: routing and row permutation (cpu/routing.cc)
  static void Route(Context& ctx, const RouteArgs& a);
  static void SortByExpert(Context& ctx, const SortByExpertArgs& a);
  static void PermuteRows(Context& ctx, const PermuteRowsArgs& a);
  static void CombineRows(Context& ctx, const CombineRowsArgs& a);
  static void CombineRowsBackward(Context& ctx, const CombineRowsBackwardArgs& a);
  static void ScatterAddRows(Context& ctx, const ScatterAddRowsArgs& a);
  static void RouterBackward(Context& ctx, const RouterBackwardArgs& a);
  static void AttentionForward(Context& ctx, const AttentionForwardArgs& a);  // cpu/attention.cc
  static void AttentionBackward(Context& ctx, const AttentionBackwardArgs& a);
  static void CrossEntropy(Context& ctx, const CrossEntropyArgs& a);  // cpu/cross_entropy.cc
  // Quantization (quant/ is the cpu implementation's code): cpu/quant_ops.cc
  static void QuantizeRows(Context& ctx, const QuantizeRowsArgs& a);
  static void DequantizeRows(Context& ctx, const DequantizeRowsArgs& a);
  static void QuantizeChannels(Context& ctx, const QuantizeChannelsArgs& a);
  static void DequantizeChannelsToBf16(Context& ctx, const DequantizeChannelsToBf16Args& a);
  static void ScaleToF32(Context& ctx, const ScaleToF32Args& a);
  static void Fp8HealthCount(Context& ctx, const Fp8HealthCountArgs& a);
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_CPU_OPS_H_
