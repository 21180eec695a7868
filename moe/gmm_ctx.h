// The grouped matmuls called with a Context, for the MoE layer and the model:
// Gmm(Context&, ...), GmmDlhs(Context&, ...) and Tgmm(Context&, ...)
// (fp8moe/gmm.h) run on the context's backend with ctx.threads() workers and
// take their scratch from ctx.scratch(), so a trainer step after the first
// allocates nothing in the kernels. Kept as named wrappers so the MoE layer
// and the model read the same at every call site.
#ifndef FP8MOE_MOE_GMM_CTX_H_
#define FP8MOE_MOE_GMM_CTX_H_

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"

namespace fp8moe::internal {

// out [M, N] = lhs [M, K] x rhs [E, K, N] per group (fp8moe/gmm.h).
inline Status CtxGmm(Context& ctx, const GmmOptions& o, const ConstTensorView& lhs,
                     const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                     const ConstTensorView& group_sizes, const TensorView& out,
                     const TensorView* h_out = nullptr) {
  return Gmm(ctx, o, lhs, rhs, rhs_scale, group_sizes, out, h_out);
}

// dlhs [M, K] = dout [M, N] x rhs[g]^T per group.
inline Status CtxGmmDlhs(Context& ctx, const GmmOptions& o, const ConstTensorView& dout,
                         const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                         const ConstTensorView& group_sizes, const TensorView& out,
                         const ConstTensorView* h = nullptr) {
  return GmmDlhs(ctx, o, dout, rhs, rhs_scale, group_sizes, out, h);
}

// drhs [E, K, N] = lhs[rows of g]^T x dout[rows of g].
inline Status CtxTgmm(Context& ctx, const GmmOptions& o, const TgmmQuant& q,
                      const ConstTensorView& lhs, const ConstTensorView& dout,
                      const ConstTensorView& group_sizes, const TensorView& drhs) {
  return Tgmm(ctx, o, q, lhs, dout, group_sizes, drhs);
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_GMM_CTX_H_
