// The reference backend's ops besides the GMMs (kernels/backend.h): plain
// loops on one thread, written from the formulas of kernels/ops.h, not from
// the cpu code. The row-wise ops keep the cpu code's arithmetic (f32 where
// it is f32, double sums in the same order), so the two agree bit for bit;
// attention and the loss compute in double and round once at the end
// (kernels/backend_ops_test.cc states each op's tolerance).
#ifndef FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_
#define FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_

#include "kernels/backend.h"

namespace fp8moe::internal {

// Shapes: kernels/ops.h, at each entry point. One thread; the Context is
// not read.
struct ReferenceOps {
  static void EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a);
  static void EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a);
  static void Add(Context& ctx, const AddArgs& a);
  static void RmsNormForward(Context& ctx, const RmsNormForwardArgs& a);
  static void RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a);
  static void Rope(Context& ctx, const RopeArgs& a);
  static void CopyColumns(Context& ctx, const CopyColumnsArgs& a);
  static void AttentionForward(Context& ctx, const AttentionForwardArgs& a);
  static void AttentionBackward(Context& ctx, const AttentionBackwardArgs& a);
  static void CrossEntropy(Context& ctx, const CrossEntropyArgs& a);
  static void AdamW(Context& ctx, const AdamWArgs& a);
  // The MoE layer: routing and row permutation (reference/routing_reference.cc)
  static void Route(Context& ctx, const RouteArgs& a);
  static void SortByExpert(Context& ctx, const SortByExpertArgs& a);
  static void PermuteRows(Context& ctx, const PermuteRowsArgs& a);
  static void CombineRows(Context& ctx, const CombineRowsArgs& a);
  static void CombineRowsBackward(Context& ctx, const CombineRowsBackwardArgs& a);
  static void ScatterAddRows(Context& ctx, const ScatterAddRowsArgs& a);
  static void RouterBackward(Context& ctx, const RouterBackwardArgs& a);
  // Quantization (quant/ is the cpu implementation's code): per element from
  // quant.h's scalars (CalibratedScale, QuantizeValue, DequantizeValue), which
  // are tested bit-exact against ml_dtypes; the same bits as the cpu's.
  static void QuantizeRows(Context& ctx, const QuantizeRowsArgs& a);
  static void DequantizeRows(Context& ctx, const DequantizeRowsArgs& a);
  static void QuantizeChannels(Context& ctx, const QuantizeChannelsArgs& a);
  static void DequantizeChannelsToBf16(Context& ctx, const DequantizeChannelsToBf16Args& a);
  static void ScaleToF32(Context& ctx, const ScaleToF32Args& a);
  static void Fp8HealthCount(Context& ctx, const Fp8HealthCountArgs& a);
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_REFERENCE_OPS_REFERENCE_H_
