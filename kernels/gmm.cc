// The GMM API (include/fp8moe/gmm.h): validate once, then run on the
// Context's backend (kernels/backend.h). The overloads without a Context use
// DefaultContext(), one call at a time (base/default_context.h), so existing
// callers that call from several threads stay correct.
#include <mutex>
#include <string>

#include "base/default_context.h"
#include "base/scratch_arena.h"
#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "kernels/backend.h"
#include "kernels/gmm_problem.h"

namespace fp8moe {
namespace {

using internal::Backend;
using internal::GmmProblem;

// The context's backend, if it runs the GMM op in this mode.
Result<Backend*> GmmBackendOf(const Context& ctx, internal::Op op, const GmmOptions& options) {
  Backend& b = internal::BackendOf(ctx);
  if (!b.Supports(internal::GmmArgs{{op}, options.mode})) {
    return FailedPrecondition("the " + std::string(BackendName(b.kind())) +
                              " backend does not run op " + std::string(internal::OpName(op)) +
                              " in mode " + std::string(GmmModeName(options.mode)));
  }
  return &b;
}

// The checked problem lives in the context, so its offsets keep their
// capacity from call to call.
GmmProblem& ProblemOf(Context& ctx) { return ctx.scratch().Object<GmmProblem>(); }

}  // namespace

Status Gmm(Context& ctx, const GmmOptions& options, const ConstTensorView& lhs,
           const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
           const ConstTensorView& group_sizes, const TensorView& out, const TensorView* h_out) {
  GmmProblem& p = ProblemOf(ctx);
  FP8MOE_RETURN_IF_ERROR(
      internal::CheckGmm(options, lhs, rhs, rhs_scale, group_sizes, out, h_out, &p));
  // Nothing to write (h_out is empty too): return before any pre-pass, so a
  // zero-element call costs nothing whatever its other dimensions.
  if (out.num_elements() == 0) return OkStatus();
  FP8MOE_ASSIGN_OR_RETURN(Backend* const b, GmmBackendOf(ctx, internal::Op::kGmm, options));
  return b->Gmm(ctx, p, options, lhs, rhs, rhs_scale, group_sizes, out, h_out);
}

Status GmmDlhs(Context& ctx, const GmmOptions& options, const ConstTensorView& dout,
               const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
               const ConstTensorView& group_sizes, const TensorView& out,
               const ConstTensorView* h) {
  GmmProblem& p = ProblemOf(ctx);
  FP8MOE_RETURN_IF_ERROR(
      internal::CheckDlhs(options, dout, rhs, rhs_scale, group_sizes, out, h, &p));
  if (out.num_elements() == 0) return OkStatus();  // nothing to write
  FP8MOE_ASSIGN_OR_RETURN(Backend* const b, GmmBackendOf(ctx, internal::Op::kGmmDlhs, options));
  return b->Dlhs(ctx, p, options, dout, rhs, rhs_scale, group_sizes, out, h);
}

Status Tgmm(Context& ctx, const GmmOptions& options, const TgmmQuant& quant,
            const ConstTensorView& lhs, const ConstTensorView& dout,
            const ConstTensorView& group_sizes, const TensorView& drhs) {
  GmmProblem& p = ProblemOf(ctx);
  FP8MOE_RETURN_IF_ERROR(internal::CheckTgmm(options, quant, lhs, dout, group_sizes, drhs, &p));
  if (drhs.num_elements() == 0) return OkStatus();  // nothing to write
  FP8MOE_ASSIGN_OR_RETURN(Backend* const b, GmmBackendOf(ctx, internal::Op::kTgmm, options));
  return b->Tgmm(ctx, p, options, quant, lhs, dout, group_sizes, drhs);
}

Status Gmm(const GmmOptions& options, const ConstTensorView& lhs, const ConstTensorView& rhs,
           const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
           const TensorView& out, const TensorView* h_out) {
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  return Gmm(DefaultContext(), options, lhs, rhs, rhs_scale, group_sizes, out, h_out);
}

Status GmmDlhs(const GmmOptions& options, const ConstTensorView& dout, const ConstTensorView& rhs,
               const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
               const TensorView& out, const ConstTensorView* h) {
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  return GmmDlhs(DefaultContext(), options, dout, rhs, rhs_scale, group_sizes, out, h);
}

Status Tgmm(const GmmOptions& options, const TgmmQuant& quant, const ConstTensorView& lhs,
            const ConstTensorView& dout, const ConstTensorView& group_sizes,
            const TensorView& drhs) {
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  return Tgmm(DefaultContext(), options, quant, lhs, dout, group_sizes, drhs);
}

void ReleaseGmmScratch() {
  std::lock_guard<std::recursive_mutex> lock(internal::DefaultContextMutex());
  DefaultContext().ReleaseScratch();
}

}  // namespace fp8moe
