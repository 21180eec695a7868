// SwiGLU's activation on vectors, per Highway target: sigmoid, silu and
// silu', and the epilogue rows built from them (gemm_exec's epilogue).
//
// Valid over the whole f32 range (docs/numerics.md, "Activations"):
//  sigmoid(x) = e / (1 + t) with t = exp(-|x|) and e = 1 (x >= 0) or t
//  (x < 0). exp only ever sees arguments <= 0, where Highway's Exp is valid
//  (it is not above +104: 1/(1 + exp(-x)) gave 1 or NaN for x < -104);
//  t underflows to 0 below -104, so sigmoid(-inf) = +0, sigmoid(+inf) = 1.
//  silu(x)  = x * sigmoid(x), with silu(-inf) = -0 (the limit; -inf * 0
//             would be NaN) and silu(+inf) = +inf.
//  silu'(x) = s (1 + x (1 - s)) with 1 - s = sigmoid(-x) computed as
//             such (no cancellation for large x); silu'(+inf) = 1,
//             silu'(-inf) = -0 (the limits).
//  NaN in gives NaN out in all three.

#if defined(FP8MOE_KERNELS_CPU_ACTIVATION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_ACTIVATION_INL_H_
#undef FP8MOE_KERNELS_CPU_ACTIVATION_INL_H_
#else
#define FP8MOE_KERNELS_CPU_ACTIVATION_INL_H_
#endif

#include <cstdint>
#include <cstring>
#include <limits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// sigmoid(x) and sigmoid(-x) = 1 - sigmoid(x), both without cancellation.
template <class D, class V = hn::Vec<D>>
HWY_INLINE void SigmoidPair(D d, V x, V* pos, V* neg) {
  const V one = hn::Set(d, 1.0f);
  const V t = hn::Exp(d, hn::Neg(hn::Abs(x)));  // in [0, 1]; NaN -> 0 (masked below)
  const V denom = hn::Add(one, t);
  const auto negative = hn::Lt(x, hn::Zero(d));
  const V p = hn::Div(hn::IfThenElse(negative, t, one), denom);
  const V n = hn::Div(hn::IfThenElse(negative, one, t), denom);
  const auto nan = hn::IsNaN(x);
  *pos = hn::IfThenElse(nan, x, p);
  *neg = hn::IfThenElse(nan, x, n);
}

template <class D, class V = hn::Vec<D>>
HWY_INLINE V Sigmoid(D d, V x) {
  V pos, neg;
  SigmoidPair(d, x, &pos, &neg);
  return pos;
}

// x clamped into [-FLT_MAX, FLT_MAX] (NaN stays NaN): the silu formulas give
// the limits at +-inf when they see +-FLT_MAX instead.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ClampFinite(D d, V x) {
  const V hi = hn::Set(d, std::numeric_limits<float>::max());
  const V lo = hn::Neg(hi);
  x = hn::IfThenElse(hn::Gt(x, hi), hi, x);
  return hn::IfThenElse(hn::Lt(x, lo), lo, x);
}

// silu(x) = x * sigmoid(x); -inf -> -0 (via -FLT_MAX * 0), +inf -> +inf.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Silu(D d, V x) {
  const V lo = hn::Set(d, -std::numeric_limits<float>::max());
  const V xl = hn::IfThenElse(hn::Lt(x, lo), lo, x);
  return hn::Mul(xl, Sigmoid(d, x));
}

// silu'(x) = s (1 + x (1 - s)), s = sigmoid(x); +-inf -> the limits 1, -0.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V SiluGrad(D d, V x) {
  const V xc = ClampFinite(d, x);
  V s, one_minus_s;
  SigmoidPair(d, xc, &s, &one_minus_s);
  return hn::Mul(s, hn::MulAdd(xc, one_minus_s, hn::Set(d, 1.0f)));
}

// Applies fn to whole vectors of n lanes; the tail runs the same vector code
// on a zero-padded copy, so an element's bits never depend on where a tile
// boundary puts it. fn(const float* const* in, float* const* out) reads
// kIn and writes kOut pointers' lanes.
template <size_t kIn, size_t kOut, class Fn>
HWY_INLINE void ForEachVector(const float* const (&in)[kIn], float* const (&out)[kOut],
                              int64_t n, const Fn& fn) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t j = 0;
  for (; j + N <= n; j += N) {
    const float* i2[kIn];
    float* o2[kOut];
    for (size_t a = 0; a < kIn; ++a) i2[a] = in[a] + j;
    for (size_t a = 0; a < kOut; ++a) o2[a] = out[a] + j;
    fn(i2, o2);
  }
  if (j < n) {
    HWY_ALIGN float ibuf[kIn][hn::MaxLanes(d)] = {};
    HWY_ALIGN float obuf[kOut][hn::MaxLanes(d)];
    const size_t bytes = static_cast<size_t>(n - j) * sizeof(float);
    const float* i2[kIn];
    float* o2[kOut];
    for (size_t a = 0; a < kIn; ++a) {
      std::memcpy(ibuf[a], in[a] + j, bytes);
      i2[a] = ibuf[a];
    }
    for (size_t a = 0; a < kOut; ++a) o2[a] = obuf[a];
    fn(i2, o2);
    for (size_t a = 0; a < kOut; ++a) std::memcpy(out[a] + j, obuf[a], bytes);
  }
}

// out = silu(gate) * up over n elements.
inline void SiluMulRow(const float* gate, const float* up, int64_t n, float* out) {
  const hn::ScalableTag<float> d;
  ForEachVector<2, 1>({gate, up}, {out}, n, [&](const float* const* in, float* const* o) {
    hn::StoreU(hn::Mul(Silu(d, hn::LoadU(d, in[0])), hn::LoadU(d, in[1])), d, o[0]);
  });
}

// dgate = da * (up * silu'(gate)), dup = da * silu(gate); dgate may alias
// da (each vector is loaded before it is stored). |silu'| < 1.1, so up *
// silu' overflows only where the result would: (da * up) first could
// overflow to inf and then meet silu' = 0 as NaN.
inline void DSiluRow(const float* da, const float* gate, const float* up, int64_t n,
                     float* dgate, float* dup) {
  const hn::ScalableTag<float> d;
  ForEachVector<3, 2>({da, gate, up}, {dgate, dup}, n,
                      [&](const float* const* in, float* const* o) {
                        const auto a = hn::LoadU(d, in[0]);
                        const auto g = hn::LoadU(d, in[1]);
                        const auto u = hn::LoadU(d, in[2]);
                        hn::StoreU(hn::Mul(a, hn::Mul(u, SiluGrad(d, g))), d, o[0]);
                        hn::StoreU(hn::Mul(a, Silu(d, g)), d, o[1]);
                      });
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
