// Validation of GMM / dLHS / TGMM arguments, shared by the fast kernels and
// their reference twins so both accept and reject exactly the same calls.
#ifndef FP8MOE_KERNELS_GMM_PROBLEM_H_
#define FP8MOE_KERNELS_GMM_PROBLEM_H_

#include <cstdint>
#include <vector>

#include "fp8moe/gmm.h"

namespace fp8moe::internal {

// The checked shape of one call. Dimensions follow the forward GMM:
// lhs [m, k], rhs [e, k, n]. For dLHS the product is dout [m, n] x rhs^T,
// for TGMM lhs [m, k]^T x dout [m, n] -> [e, k, n].
struct GmmProblem {
  int64_t m = 0, k = 0, n = 0, e = 0;
  std::vector<int64_t> offsets;  // e + 1 prefix sums of group_sizes
  int64_t valid_rows = 0;        // offsets[e]
  bool rhs_codes = false;        // rhs holds codes (+ rhs_scale)
  bool lhs_codes = false;        // TGMM: lhs holds fp8 codes
  QuantDType rhs_codes_dtype = QuantDType::kE4M3FN;
  QuantDType lhs_codes_dtype = QuantDType::kE4M3FN;

  // Back to the defaults, keeping offsets' capacity (a problem object kept
  // in a Context is refilled by every call without allocating).
  void Reset() {
    m = k = n = e = valid_rows = 0;
    offsets.clear();
    rhs_codes = lhs_codes = false;
    rhs_codes_dtype = lhs_codes_dtype = QuantDType::kE4M3FN;
  }
};

// Check a call and fill *p (Reset first); p is unspecified on an error.
Status CheckGmm(const GmmOptions& options, const ConstTensorView& lhs, const ConstTensorView& rhs,
                const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                const TensorView& out, const TensorView* h_out, GmmProblem* p);
Status CheckDlhs(const GmmOptions& options, const ConstTensorView& dout, const ConstTensorView& rhs,
                 const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                 const TensorView& out, const ConstTensorView* h, GmmProblem* p);
Status CheckTgmm(const GmmOptions& options, const TgmmQuant& quant, const ConstTensorView& lhs,
                 const ConstTensorView& dout, const ConstTensorView& group_sizes,
                 const TensorView& drhs, GmmProblem* p);

// The same, returning a fresh problem.
Result<GmmProblem> CheckGmm(const GmmOptions& options, const ConstTensorView& lhs,
                            const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                            const ConstTensorView& group_sizes, const TensorView& out,
                            const TensorView* h_out);
Result<GmmProblem> CheckDlhs(const GmmOptions& options, const ConstTensorView& dout,
                             const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                             const ConstTensorView& group_sizes, const TensorView& out,
                             const ConstTensorView* h);
Result<GmmProblem> CheckTgmm(const GmmOptions& options, const TgmmQuant& quant,
                             const ConstTensorView& lhs, const ConstTensorView& dout,
                             const ConstTensorView& group_sizes, const TensorView& drhs);

// TGMM's in-kernel quantization of dout (TgmmQuant::per_group = false) scales
// each m-tile of a group separately; this is the tile when tiles.m is unset.
// It is part of the numerics (it decides which rows share a scale), so the
// fast kernel and the reference twin must both use it.
inline constexpr int64_t kTgmmDefaultQuantTile = 512;

// sigmoid, silu(x) = x * sigmoid(x) and silu', in double (reference) form,
// with the promises of docs/numerics.md at +-inf and NaN: sigmoid(-inf) = 0,
// silu(-inf) = -0, silu'(+inf) = 1, silu'(-inf) = -0, NaN -> NaN.
double SigmoidRef(double x);
double SiluRef(double x);
double SiluGradRef(double x);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_GMM_PROBLEM_H_
