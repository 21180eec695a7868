// exp(x - m) over a span of f32, per Highway target, for the softmaxes of
// attention (kernels/cpu/attention.cc) and the loss (kernels/cpu/cross_entropy.cc).
//
// With m the span's max the arguments are <= 0, where Highway's Exp is valid
// (it is not above +104). Exp returns 0 for NaN (its lower-bound test fails),
// so NaN lanes keep their NaN: a NaN input reaches the softmax's sum, as
// std::exp did. The tail goes through a padded vector: the same lane
// function, so the same bits as a whole vector.

#if defined(FP8MOE_KERNELS_CPU_EXP_SHIFTED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_EXP_SHIFTED_INL_H_
#undef FP8MOE_KERNELS_CPU_EXP_SHIFTED_INL_H_
#else
#define FP8MOE_KERNELS_CPU_EXP_SHIFTED_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// e [n] = exp(x - m) lane-wise, NaN kept; e may be x (in place). Not
// inlined: a caller inside an OpenMP region is outlined by clang 14 without
// the target's attributes (attention.cc says more).
inline HWY_NOINLINE void ExpShifted(const float* x, int64_t n, float m, float* e) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto mv = hn::Set(d, m);
  auto exp_keep_nan = [&](auto v) {
    const auto a = hn::Sub(v, mv);
    return hn::IfThenElse(hn::IsNaN(a), a, hn::Exp(d, a));
  };
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(exp_keep_nan(hn::LoadU(d, x + i)), d, e + i);
  if (i < n) {
    HWY_ALIGN float in[hn::MaxLanes(d)];
    HWY_ALIGN float out[hn::MaxLanes(d)];
    std::fill(in, in + N, m);
    std::copy(x + i, x + n, in);
    hn::Store(exp_keep_nan(hn::Load(d, in)), d, out);
    std::copy(out, out + (n - i), e + i);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
