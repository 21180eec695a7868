// The seam between the GMM API and its implementations (docs/design.md §7.2). gmm.cc
// validates a call once (gmm_problem.h) and hands it, with the checked
// problem, to the backend its Context names:
//   cpu        the fast SIMD kernels (kernels/cpu/cpu_backend.cc)
//   reference  the plain-loop twins (kernels/reference/gmm_reference.cc)
// A later GPU backend is another implementation of this interface.
//
// A backend that cannot run a case returns a FailedPrecondition Status
// saying so; nothing falls back to another backend silently.
#ifndef FP8MOE_KERNELS_GMM_BACKEND_H_
#define FP8MOE_KERNELS_GMM_BACKEND_H_

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "kernels/gmm_problem.h"

namespace fp8moe::internal {

class GmmBackend {
 public:
  virtual ~GmmBackend() = default;
  virtual BackendKind kind() const = 0;

  // The arguments of Gmm / GmmDlhs / Tgmm (gmm.h), already checked: p is
  // their problem. Outputs are written in full (tail rows as zero).
  virtual Status Gmm(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                     const TensorView& lhs, const TensorView& rhs, const TensorView* rhs_scale,
                     const TensorView& group_sizes, const TensorView& out,
                     const TensorView* h_out) = 0;
  virtual Status Dlhs(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                      const TensorView& dout, const TensorView& rhs, const TensorView* rhs_scale,
                      const TensorView& group_sizes, const TensorView& out,
                      const TensorView* h) = 0;
  virtual Status Tgmm(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                      const TgmmQuant& quant, const TensorView& lhs, const TensorView& dout,
                      const TensorView& group_sizes, const TensorView& drhs) = 0;
};

GmmBackend& CpuGmmBackend();
GmmBackend& ReferenceGmmBackend();

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_GMM_BACKEND_H_
