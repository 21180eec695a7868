// The QAT operand helpers of the reference MoE layer: the weights as each mode
// presents them and the three GMMs of one expert weight, in plain loops with
// double sums, straight from the mode table of include/fp8moe/moe.h and
// docs/design.md §3.3, §4. The quantizers are the plain-loop twins of quant.h, so no
// SIMD code sits under the reference.
#include "moe/reference/moe_reference_quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/gmm_problem.h"

namespace fp8moe::reference::moe_internal {
namespace {

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

float RoundToBf16(float v) { return Bf16ToF32(F32ToBf16(v)); }

// The exact value of a code without its scale (fp8 value or int8 integer):
// f32(q) * 1 is exact.
double CodeValue(uint8_t code, QuantDType dtype) {
  return DequantizeValue(code, 1.0f, dtype);
}

// The doubles of a bf16 layer's activation as the f32 a quantizer reads:
// exact, since they are f32 (or bf16) values already.
std::vector<float> ToFloat(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

}  // namespace

LayerNumerics NumericsOf(const MoeConfig& config) {
  const MoeQuantPlan plan = PlanMoeQuantization(config);
  LayerNumerics num;
  num.mode = plan.mode;
  num.quantized_weights = plan.mode != MoeQatMode::kNone;
  // Every QAT mode runs its activations in bf16 whatever `dtype` says.
  num.bf16 = config.dtype == DType::kBF16 || num.quantized_weights;
  num.quantized_fwd = plan.fwd.lhs.has_value();
  if (plan.fwd.rhs) num.fwd_dtype = *plan.fwd.rhs;
  // K-blocks apply to fp8 activations only; the int8 GMM scales full rows
  // (ValidateMoeConfig allows a block size with the native forward only).
  num.lhs_block = num.quantized_fwd && num.fwd_dtype != QuantDType::kInt8
                      ? config.moe_lhs_quant_block_size
                      : 0;
  num.weight_calib = config.weight_quantization_calibration_method;
  num.act_calib = config.act_quantization_calibration_method;
  num.bwd_calib = config.bwd_quantization_calibration_method;
  num.bwd_dtype = plan.bwd_dtype;
  if (plan.inkernel_bwd) {
    num.wi_quant_tile =
        config.wi_tiles.drhs.m.value_or(internal::kTgmmDefaultQuantTile);
    num.wo_quant_tile =
        config.wo_tiles.drhs.m.value_or(internal::kTgmmDefaultQuantTile);
  }
  return num;
}

double Act(const LayerNumerics& num, double v) {
  return num.bf16 ? RoundToBf16(static_cast<float>(v)) : v;
}

double Acc(const LayerNumerics& num, double v) {
  return num.bf16 ? static_cast<double>(static_cast<float>(v)) : v;
}

// master [E, K, N] -> values [E, K, N] (+ codes [E, K, N], scales [E, N]).
Result<WeightOperand> PresentWeight(const LayerNumerics& num,
                                    const float* master, int64_t e, int64_t k,
                                    int64_t n) {
  WeightOperand w;
  w.e = e;
  w.k = k;
  w.n = n;
  const int64_t count = e * k * n;
  w.values.resize(Idx(count));
  if (!num.quantized_weights) {
    for (int64_t i = 0; i < count; ++i) {
      w.values[Idx(i)] = static_cast<float>(Act(num, master[i]));
    }
    return w;
  }
  // One scale per (expert, output channel): amax over K.
  w.codes.resize(Idx(count));
  w.scales.resize(Idx(e * n));
  FP8MOE_RETURN_IF_ERROR(fp8moe::reference::QuantizeChannels(
      master, e, k, n, num.fwd_dtype, num.weight_calib, w.codes.data(),
      w.scales.data()));
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t i = 0; i < k * n; ++i) {
      const int64_t at = g * k * n + i;
      const float s = w.scales[Idx(g * n + i % n)];
      w.values[Idx(at)] =
          RoundToBf16(DequantizeValue(w.codes[Idx(at)], s, num.fwd_dtype));
    }
  }
  // A fixed calibration clips the weight to max(|a|, |b|); the STE passes no
  // gradient to a master weight the quantizer clipped. (absmax never clips.)
  if (num.weight_calib.kind == Calibration::Kind::kFixed) {
    const float clip = num.weight_calib.FixedAmax();
    w.clipped.resize(Idx(count));
    for (int64_t i = 0; i < count; ++i) {
      w.clipped[Idx(i)] = std::fabs(master[i]) > clip ? 1 : 0;
    }
  }
  return w;
}

// out [M, N] = lhs [M, K] x w[expert(i)] [K, N] per row.
Result<std::vector<double>> ForwardGmm(const LayerNumerics& num,
                                       const WeightOperand& w,
                                       const SortedRows& rows,
                                       const std::vector<double>& lhs,
                                       QuantizedRows* lhs_q) {
  const int64_t m = rows.m, k = w.k, n = w.n;
  std::vector<double> out(Idx(m * n));
  if (!num.quantized_fwd) {
    // Float GMM (none, fake QAT): lhs against act(master) or the BF16 copy.
    for (int64_t i = 0; i < m; ++i) {
      const int64_t g = rows.expert[Idx(i)];
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0.0;
        for (int64_t r = 0; r < k; ++r) {
          acc += lhs[Idx(i * k + r)] * w.values[Idx((g * k + r) * n + c)];
        }
        out[Idx(i * n + c)] = Acc(num, acc);
      }
    }
    return out;
  }
  // Quantized GMM (native, fp8_full, hand-crafted): the lhs quantized per row
  // (per K-block), out = (sum_b sa_b sum_{r in b} qa qw) * sw, as
  // reference::Gmm's kNativeFp8 / kInt8. The code sums are exact in double
  // (int8 in int64).
  const bool int8 = num.fwd_dtype == QuantDType::kInt8;
  const int64_t nb = NumBlocks(k, num.lhs_block);
  const int64_t bs = num.lhs_block > 0 ? num.lhs_block : k;
  lhs_q->blocks = nb;
  lhs_q->codes.resize(Idx(m * k));
  lhs_q->scales.resize(Idx(m * nb));
  const std::vector<float> x = ToFloat(lhs);
  FP8MOE_RETURN_IF_ERROR(fp8moe::reference::QuantizeRows(
      x.data(), m, k, m, num.lhs_block, num.fwd_dtype, num.act_calib,
      lhs_q->codes.data(), lhs_q->scales.data()));
  for (int64_t i = 0; i < m; ++i) {
    const int64_t g = rows.expert[Idx(i)];
    for (int64_t c = 0; c < n; ++c) {
      double total = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        double part = 0.0;
        int64_t ipart = 0;
        for (int64_t r = b * bs; r < std::min(k, (b + 1) * bs); ++r) {
          const uint8_t qa = lhs_q->codes[Idx(i * k + r)];
          const uint8_t qw = w.codes[Idx((g * k + r) * n + c)];
          if (int8) {
            ipart += int64_t{static_cast<int8_t>(qa)} * static_cast<int8_t>(qw);
          } else {
            part += CodeValue(qa, num.fwd_dtype) * CodeValue(qw, num.fwd_dtype);
          }
        }
        if (int8) part = static_cast<double>(ipart);
        total += part * lhs_q->scales[Idx(i * nb + b)];
      }
      // Rounded once to f32 (every quantized layer is a bf16 layer).
      out[Idx(i * n + c)] = Acc(num, total * w.scales[Idx(g * n + c)]);
    }
  }
  return out;
}

// dlhs [M, K] = g [M, N] x w[expert(i)]^T per row.
Result<std::vector<double>> DlhsGmm(const LayerNumerics& num,
                                    const WeightOperand& w,
                                    const SortedRows& rows,
                                    const std::vector<double>& g) {
  const int64_t m = rows.m, k = w.k, n = w.n;
  std::vector<double> out(Idx(m * k));
  // b [M, N]: the gradient operand; wv [E, K, N]: the weight operand.
  std::vector<double> b(g);
  std::vector<double> wv(w.values.begin(), w.values.end());
  if (num.bwd_dtype) {
    // fp8_full: the weight scale folded into g per column, g * s_w quantized
    // per row with the bwd dtype and calibration, used dequantized, against
    // the bare weight codes f32(q_w).
    std::vector<float> gs(Idx(m * n));
    for (int64_t i = 0; i < m; ++i) {
      const int64_t e = rows.expert[Idx(i)];
      for (int64_t c = 0; c < n; ++c) {
        gs[Idx(i * n + c)] =
            static_cast<float>(g[Idx(i * n + c)]) * w.scales[Idx(e * n + c)];
      }
    }
    std::vector<uint8_t> q(Idx(m * n));
    std::vector<float> s(Idx(m));
    FP8MOE_RETURN_IF_ERROR(
        fp8moe::reference::QuantizeRows(gs.data(), m, n, m, 0, *num.bwd_dtype,
                                        num.bwd_calib, q.data(), s.data()));
    for (int64_t i = 0; i < m * n; ++i) {
      b[Idx(i)] = DequantizeValue(q[Idx(i)], s[Idx(i / n)], *num.bwd_dtype);
    }
    for (size_t i = 0; i < wv.size(); ++i) {
      wv[i] = CodeValue(w.codes[i], num.fwd_dtype);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t e = rows.expert[Idx(i)];
    for (int64_t r = 0; r < k; ++r) {
      double acc = 0.0;
      for (int64_t c = 0; c < n; ++c) {
        acc += b[Idx(i * n + c)] * wv[Idx((e * k + r) * n + c)];
      }
      out[Idx(i * k + r)] = Acc(num, acc);
    }
  }
  return out;
}

// dw [E, K, N] = lhs[rows of e]^T [K, rows] x g[rows of e] [rows, N].
Result<std::vector<double>> DrhsGmm(
    const LayerNumerics& num, const WeightOperand& w, const SortedRows& rows,
    const std::vector<double>& lhs, const QuantizedRows& lhs_q,
    const std::vector<double>& g, int64_t quant_tile) {
  const int64_t m = rows.m, k = w.k, n = w.n;
  // a [M, K], b [M, N]: the two operands as the sum multiplies them.
  std::vector<double> a(lhs), b(g);
  if (num.bwd_dtype) {
    // fp8_full: the forward's lhs codes f32(q_a) without scale; the row scale
    // folded into g, and g * s_a quantized per (group or group m-tile,
    // channel) over the sorted rows, used dequantized.
    if (lhs_q.blocks != 1) {
      return InvalidArgument(
          "fp8_full needs one activation scale per row; "
          "moe_lhs_quant_block_size must be 0");
    }
    for (int64_t i = 0; i < m * k; ++i) {
      a[Idx(i)] = CodeValue(lhs_q.codes[Idx(i)], num.fwd_dtype);
    }
    std::vector<float> gs(Idx(m * n));
    for (int64_t i = 0; i < m * n; ++i) {
      gs[Idx(i)] = static_cast<float>(g[Idx(i)]) * lhs_q.scales[Idx(i / n)];
    }
    const int32_t* sizes = rows.group_sizes.data();
    const int64_t groups = static_cast<int64_t>(rows.group_sizes.size());
    FP8MOE_ASSIGN_OR_RETURN(const int64_t tiles,
                            NumGroupTiles(sizes, groups, m, quant_tile));
    std::vector<uint8_t> q(Idx(m * n));
    std::vector<float> scales(Idx(tiles * n));
    FP8MOE_RETURN_IF_ERROR(fp8moe::reference::QuantizeGroupTileChannels(
        gs.data(), m, n, sizes, groups, quant_tile, *num.bwd_dtype,
        num.bwd_calib, q.data(), scales.data()));
    // A row's scale tile, found by walking the groups in the quantizer's
    // order: one tile per group (quant_tile 0) or ceil(size / tile) tiles.
    int64_t first_tile = 0, row = 0;
    for (int64_t e = 0; e < groups; ++e) {
      const int64_t size = sizes[e];
      for (int64_t r = 0; r < size; ++r, ++row) {
        const int64_t t = quant_tile == 0 ? e : first_tile + r / quant_tile;
        for (int64_t c = 0; c < n; ++c) {
          b[Idx(row * n + c)] = DequantizeValue(
              q[Idx(row * n + c)], scales[Idx(t * n + c)], *num.bwd_dtype);
        }
      }
      first_tile += quant_tile == 0 ? 1 : (size + quant_tile - 1) / quant_tile;
    }
  }
  std::vector<double> dw(Idx(w.e * k * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t e = rows.expert[Idx(i)];
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        dw[Idx((e * k + r) * n + c)] += a[Idx(i * k + r)] * b[Idx(i * n + c)];
      }
    }
  }
  // Straight through to the master weight, except where it was clipped.
  for (size_t i = 0; i < w.clipped.size(); ++i) {
    if (w.clipped[i]) dw[i] = 0.0;
  }
  return dw;
}

}  // namespace fp8moe::reference::moe_internal
