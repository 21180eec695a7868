#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "moe/gmm_ctx.h"

namespace fp8moe::internal {

void RmsNormForward(Context& ctx, const float* x, const float* g, int64_t rows, int64_t d,
                    float eps, float* y, float* inv_rms) {
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    inv_rms[r] = inv;
    float* yr = y + r * d;
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * g[i];
  }
}

void RmsNormBackward(Context& ctx, const float* x, const float* g, const float* inv_rms,
                     const float* dy, int64_t rows, int64_t d, float* dx, float* dg) {
  // dx = inv * (g*dy - xhat * mean(g*dy*xhat)), xhat = x * inv.
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const double inv = inv_rms[r];
    double dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(g[i]) * dyr[i] * xr[i] * inv;
    const double mean = dot / static_cast<double>(d);
    float* dxr = dx + r * d;
    for (int64_t i = 0; i < d; ++i) {
      dxr[i] += static_cast<float>(inv * (static_cast<double>(g[i]) * dyr[i] - xr[i] * inv * mean));
    }
  }
  // dg: per column over rows in row order (parallel over columns).
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t i = 0; i < d; ++i) {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) {
      s += static_cast<double>(dy[r * d + i]) * x[r * d + i] * inv_rms[r];
    }
    dg[i] = static_cast<float>(s);
  }
}

void RopeTables(int64_t seq, int64_t hd, double max_timescale, float* cos, float* sin) {
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < seq; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) /
                           std::pow(max_timescale, 2.0 * static_cast<double>(i) / static_cast<double>(hd));
      cos[p * half + i] = static_cast<float>(std::cos(angle));
      sin[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

void RopeApply(Context& ctx, float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t hd,
               const float* cos, const float* sin, bool inverse) {
  const int64_t half = hd / 2, width = 3 * heads * hd;
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < batch * seq; ++r) {
    const int64_t p = r % seq;
    const float* c = cos + p * half;
    const float* s = sin + p * half;
    for (int64_t part = 0; part < 2; ++part) {  // q, then k
      for (int64_t h = 0; h < heads; ++h) {
        float* v = qkv + r * width + part * heads * hd + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half], si = sign * s[i];
          v[i] = a * c[i] - b * si;
          v[i + half] = b * c[i] + a * si;
        }
      }
    }
  }
}

// AttentionForward and AttentionBackward: model/attention.cc (per SIMD target).

// CrossEntropy: model/cross_entropy.cc (per SIMD target).

Status Linear(Context& ctx, const TensorView& group, const float* x, const float* w, int64_t m,
              int64_t k, int64_t n, float* out) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const TensorView xv{const_cast<float*>(x), DType::kF32, {m, k}};
  const TensorView wv{const_cast<float*>(w), DType::kF32, {1, k, n}};
  const TensorView ov{out, DType::kF32, {m, n}};
  return CtxGmm(ctx, o, xv, wv, nullptr, group, ov);
}

Status LinearDx(Context& ctx, const TensorView& group, const float* dout, const float* w,
                int64_t m, int64_t k, int64_t n, float* dx) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const TensorView dv{const_cast<float*>(dout), DType::kF32, {m, n}};
  const TensorView wv{const_cast<float*>(w), DType::kF32, {1, k, n}};
  const TensorView xv{dx, DType::kF32, {m, k}};
  return CtxGmmDlhs(ctx, o, dv, wv, nullptr, group, xv);
}

Status LinearDw(Context& ctx, const TensorView& group, const float* x, const float* dout,
                int64_t m, int64_t k, int64_t n, float* dw) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const TensorView xv{const_cast<float*>(x), DType::kF32, {m, k}};
  const TensorView dv{const_cast<float*>(dout), DType::kF32, {m, n}};
  const TensorView wv{dw, DType::kF32, {1, k, n}};
  return CtxTgmm(ctx, o, {}, xv, dv, group, wv);
}

}  // namespace fp8moe::internal
