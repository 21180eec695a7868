// The loss, the cpu backend's (kernels/ops.h: CrossEntropy), its exp on
// Highway vectors per SIMD target. The reference backend's (ReferenceOps) is
// the same formula in double; kernels/backend_ops_test.cc compares the two.
// model/layers_test.cc holds this to the model's float64 twin
// (model/reference/layers_reference.h) on every SIMD target, at the edges of
// the f32 range too.
//
// Per row of logits l [v]: m = max l; e_i = exp(l_i - m) in f32 lanes
// (arguments <= 0, where Highway's Exp is valid); s = sum e_i in double, in
// order; loss = m + log(s) - l[target]; gradient (e_i / s - onehot) / rows.
// The scalar version took two double exps per logit, 8-9 % of the default
// model's step (perf, 2 threads); this takes one f32 vector exp per 16 logits.
// Lane-wise exp and in-order sums: the same bits on every target with FMA
// (AVX2 and wider) and for any thread count (a row is one thread's).
//
// Non-finite logits: Exp gives 0 for NaN, so NaN lanes keep their NaN and a
// NaN logit makes the row's loss and gradient NaN; a +inf logit gives
// inf - inf = NaN too; -inf logits contribute 0 (a -inf target: loss +inf).
// Finite logits as far apart as +-FLT_MAX: l_i - m may round to -inf, whose
// exp is 0, the true value's rounding.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cross_entropy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/exp_shifted-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows' losses (losses[r]) and, with dlogits, their gradients / rows.
void CrossEntropyRowsT(const float* logits, const int32_t* targets, int64_t rows, int64_t v,
                       int threads, double* losses, float* dlogits) {
  const double inv_rows = rows > 0 ? 1.0 / static_cast<double>(rows) : 0.0;
#pragma omp parallel num_threads(threads)
  {
    // Per thread, kept across calls: the exps of a row when no gradient is
    // asked for (with one, they are built in its row).
    static thread_local std::vector<float> scratch;
    if (dlogits == nullptr && scratch.size() < static_cast<size_t>(v)) {
      scratch.resize(static_cast<size_t>(v));
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* l = logits + r * v;
      float* e = dlogits != nullptr ? dlogits + r * v : scratch.data();
      float mx = l[0];
      for (int64_t i = 1; i < v; ++i) mx = std::max(mx, l[i]);
      ExpShifted(l, v, mx, e);
      double sum = 0;
      for (int64_t i = 0; i < v; ++i) sum += e[i];
      losses[r] = static_cast<double>(mx) + std::log(sum) - static_cast<double>(l[targets[r]]);
      if (dlogits != nullptr) {
        const float c = static_cast<float>(inv_rows / sum);
        for (int64_t i = 0; i < v; ++i) e[i] *= c;
        e[targets[r]] -= static_cast<float>(inv_rows);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(CrossEntropyRowsT);

void CpuOps::CrossEntropy(Context& ctx, const CrossEntropyArgs& a) {
  static thread_local std::vector<double> row_loss;
  if (row_loss.size() < static_cast<size_t>(a.rows)) row_loss.resize(static_cast<size_t>(a.rows));
  HWY_DYNAMIC_DISPATCH(CrossEntropyRowsT)(a.logits, a.targets, a.rows, a.v, ctx.threads(),
                                          row_loss.data(), a.dlogits);
  double total = 0;
  for (int64_t r = 0; r < a.rows; ++r) total += row_loss[static_cast<size_t>(r)];
  *a.loss = total * (a.rows > 0 ? 1.0 / static_cast<double>(a.rows) : 0.0);
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
