// The QAT operand helpers of the reference MoE layer (moe_reference.cc): how
// each QAT mode of include/fp8moe/moe.h presents the expert weights and runs
// the three GMMs of one expert weight (forward, dLHS, dW), one sorted row at a
// time with double accumulation.
//
// Activations travel as std::vector<double>. In a bf16 layer every value in
// them is an f32 (GMM outputs) or bf16 (act) value held exactly; in an f32
// layer they keep the full double so the reference's loss is smooth for
// finite differences (moe.h's f32 rounding is within the 1e-5 comparison
// tolerance).
#ifndef FP8MOE_MOE_REFERENCE_MOE_REFERENCE_QUANT_H_
#define FP8MOE_MOE_REFERENCE_MOE_REFERENCE_QUANT_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "fp8moe/moe_config.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"

namespace fp8moe::reference::moe_internal {

// The numerics of one QAT mode, read once from the config.
struct LayerNumerics {
  MoeQatMode mode = MoeQatMode::kNone;
  // act() rounds to bf16 and GMM outputs to f32: dtype = bfloat16 or any QAT
  // mode. Otherwise both are the identity on doubles.
  bool bf16 = true;
  bool quantized_weights = false;              // every QAT mode
  bool quantized_fwd = false;                  // native, fp8_full, hand-crafted
  QuantDType fwd_dtype = QuantDType::kE4M3FN;  // weight codes and forward lhs
  int64_t lhs_block = 0;  // forward lhs K-block (native modes; 0 = full row)
  Calibration weight_calib, act_calib, bwd_calib;
  std::optional<QuantDType> bwd_dtype;  // fp8_full only
  // fp8_full dW: rows sharing a gradient scale. 0 = the whole group (dense
  // path), else the m-tile of that weight's TGMM (moe_bwd_inkernel_quant).
  int64_t wi_quant_tile = 0, wo_quant_tile = 0;
};
LayerNumerics NumericsOf(const MoeConfig& config);

// act(v): bf16(f32(v)) in a bf16 layer, else v.
double Act(const LayerNumerics& num, double v);
// A GMM accumulator's rounding: f32(v) in a bf16 layer, else v.
double Acc(const LayerNumerics& num, double v);

// One expert weight w [E, K, N] as the GMMs of the mode see it.
struct WeightOperand {
  int64_t e = 0, k = 0, n = 0;
  // [E, K, N] what float GMMs multiply: act(master) in mode none, else the
  // BF16 copy bf16(f32(q) * s) (fake QAT forward, every non-recipe dLHS).
  std::vector<float> values;
  std::vector<uint8_t> codes;  // [E, K, N] per-channel codes (QAT modes)
  std::vector<float> scales;   // [E, N]
  // [E, K, N] the STE mask: 1 where a fixed weight calibration clips the
  // master weight (|w| > max(|a|, |b|)); empty when nothing is masked.
  std::vector<uint8_t> clipped;
};
// master [E, K, N] f32 -> the weight as presented.
Result<WeightOperand> PresentWeight(const LayerNumerics& num,
                                    const float* master, int64_t e, int64_t k,
                                    int64_t n);

// The routed rows in sorted order: row i belongs to expert[i]; the rows of
// expert e are contiguous, group_sizes[e] of them.
struct SortedRows {
  int64_t m = 0;
  std::vector<int64_t> expert;       // [M]
  std::vector<int32_t> group_sizes;  // [E]
};

// A forward GMM's lhs [M, K] as quantized per row (quantized forward only):
// codes [M, K], scales [M, blocks].
struct QuantizedRows {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  int64_t blocks = 1;
};

// out [M, N] = lhs [M, K] x w[expert(i)] per row, rounded by Acc. The
// quantized forward quantizes lhs per row into *lhs_q (for fp8_full's dW).
Result<std::vector<double>> ForwardGmm(const LayerNumerics& num,
                                       const WeightOperand& w,
                                       const SortedRows& rows,
                                       const std::vector<double>& lhs,
                                       QuantizedRows* lhs_q);

// dlhs [M, K] = g [M, N] x w[expert(i)]^T per row, rounded by Acc.
Result<std::vector<double>> DlhsGmm(const LayerNumerics& num,
                                    const WeightOperand& w,
                                    const SortedRows& rows,
                                    const std::vector<double>& g);

// The master weight's gradient [E, K, N]: lhs [M, K]^T x g [M, N] per group
// (fp8_full: lhs_q's codes against the quantized g), STE mask applied.
Result<std::vector<double>> DrhsGmm(
    const LayerNumerics& num, const WeightOperand& w, const SortedRows& rows,
    const std::vector<double>& lhs, const QuantizedRows& lhs_q,
    const std::vector<double>& g, int64_t quant_tile);

}  // namespace fp8moe::reference::moe_internal

#endif  // FP8MOE_MOE_REFERENCE_MOE_REFERENCE_QUANT_H_
