// The grouped matmuls called with a Context, for the MoE layer and the model.
//
// The kernels branch adds Gmm(Context&, ...), GmmDlhs(Context&, ...) and
// Tgmm(Context&, ...) (kernel scratch in ctx.scratch(), ctx.threads()
// workers). Until it lands, these forward to the overloads without a context
// (which use DefaultContext()); switching is one line in each function below.
#ifndef FP8MOE_MOE_GMM_CTX_H_
#define FP8MOE_MOE_GMM_CTX_H_

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"

namespace fp8moe::internal {

// out [M, N] = lhs [M, K] x rhs [E, K, N] per group (fp8moe/gmm.h).
inline Status CtxGmm(Context& ctx, const GmmOptions& o, const TensorView& lhs,
                     const TensorView& rhs, const TensorView* rhs_scale,
                     const TensorView& group_sizes, const TensorView& out,
                     const TensorView* h_out = nullptr) {
  (void)ctx;  // CONTEXT-SWITCH: return Gmm(ctx, o, lhs, ...);
  return Gmm(o, lhs, rhs, rhs_scale, group_sizes, out, h_out);
}

// dlhs [M, K] = dout [M, N] x rhs[g]^T per group.
inline Status CtxGmmDlhs(Context& ctx, const GmmOptions& o, const TensorView& dout,
                         const TensorView& rhs, const TensorView* rhs_scale,
                         const TensorView& group_sizes, const TensorView& out,
                         const TensorView* h = nullptr) {
  (void)ctx;  // CONTEXT-SWITCH: return GmmDlhs(ctx, o, dout, ...);
  return GmmDlhs(o, dout, rhs, rhs_scale, group_sizes, out, h);
}

// drhs [E, K, N] = lhs[rows of g]^T x dout[rows of g].
inline Status CtxTgmm(Context& ctx, const GmmOptions& o, const TgmmQuant& q,
                      const TensorView& lhs, const TensorView& dout,
                      const TensorView& group_sizes, const TensorView& drhs) {
  (void)ctx;  // CONTEXT-SWITCH: return Tgmm(ctx, o, q, lhs, ...);
  return Tgmm(o, q, lhs, dout, group_sizes, drhs);
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_GMM_CTX_H_
