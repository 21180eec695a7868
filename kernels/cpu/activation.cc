// Run-time dispatch of the activation spans (activation.h).
#include "kernels/cpu/activation.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/activation.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/activation-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

// f applied lane-wise over a span, through the same padded-tail loop as the
// epilogue rows.
template <class F>
void MapSpan(const float* x, int64_t n, float* out, const F& f) {
  const hn::ScalableTag<float> d;
  ForEachVector<1, 1>({x}, {out}, n, [&](const float* const* in, float* const* o) {
    hn::StoreU(f(d, hn::LoadU(d, in[0])), d, o[0]);
  });
}

void SigmoidSpanT(const float* x, int64_t n, float* out) {
  MapSpan(x, n, out, [](auto d, auto v) { return Sigmoid(d, v); });
}
void SiluSpanT(const float* x, int64_t n, float* out) {
  MapSpan(x, n, out, [](auto d, auto v) { return Silu(d, v); });
}
void SiluGradSpanT(const float* x, int64_t n, float* out) {
  MapSpan(x, n, out, [](auto d, auto v) { return SiluGrad(d, v); });
}
void SwiGluSpanT(const float* gate, const float* up, int64_t n, float* out) {
  SiluMulRow(gate, up, n, out);
}
void DSwiGluSpanT(const float* da, const float* gate, const float* up, int64_t n,
                  float* dgate, float* dup) {
  DSiluRow(da, gate, up, n, dgate, dup);
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(SigmoidSpanT);
HWY_EXPORT(SiluSpanT);
HWY_EXPORT(SiluGradSpanT);
HWY_EXPORT(SwiGluSpanT);
HWY_EXPORT(DSwiGluSpanT);

void SigmoidSpan(const float* x, int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(SigmoidSpanT)(x, n, out);
}
void SiluSpan(const float* x, int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(SiluSpanT)(x, n, out);
}
void SiluGradSpan(const float* x, int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(SiluGradSpanT)(x, n, out);
}
void SwiGluSpan(const float* gate, const float* up, int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(SwiGluSpanT)(gate, up, n, out);
}
void DSwiGluSpan(const float* da, const float* gate, const float* up, int64_t n,
                 float* dgate, float* dup) {
  HWY_DYNAMIC_DISPATCH(DSwiGluSpanT)(da, gate, up, n, dgate, dup);
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
