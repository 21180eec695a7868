// SwiGLU's elementwise functions as the fast kernels compute them
// (activation-inl.h), dispatched to the best SIMD target, over spans: what
// the GMM epilogues run, exposed so tests can sweep them over the whole f32
// range on every target (docs/numerics.md states the promises).
#ifndef FP8MOE_KERNELS_CPU_ACTIVATION_H_
#define FP8MOE_KERNELS_CPU_ACTIVATION_H_

#include <cstdint>

namespace fp8moe::internal {

// out[i] = f(x[i]) for i < n, f = sigmoid, silu or silu'.
void SigmoidSpan(const float* x, int64_t n, float* out);
void SiluSpan(const float* x, int64_t n, float* out);
void SiluGradSpan(const float* x, int64_t n, float* out);
// out = silu(gate) * up (the SwiGLU epilogue of Gmm).
void SwiGluSpan(const float* gate, const float* up, int64_t n, float* out);
// dgate = da * up * silu'(gate), dup = da * silu(gate) (dSwiGLU of GmmDlhs).
void DSwiGluSpan(const float* da, const float* gate, const float* up, int64_t n,
                 float* dgate, float* dup);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_ACTIVATION_H_
