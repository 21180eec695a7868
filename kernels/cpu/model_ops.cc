// The cpu backend's row-wise ops (kernels/cpu/cpu_ops.h): the loops the
// model (embedding, residual adds, RMSNorm, RoPE) and the optimizer (AdamW)
// ran before the seam, moved unchanged. Every loop is per row (or per
// column, or per element) with a fixed summation order, so the bits do not
// depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"

namespace fp8moe::internal {

void CpuOps::EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a) {
  (void)ctx;
  if (a.d == 0) return;  // empty rows: out and table may be null (memcpy's arguments must not)
  for (int64_t i = 0; i < a.n; ++i) {
    std::memcpy(a.out + i * a.d, a.table + a.tokens[i] * a.d,
                static_cast<size_t>(a.d) * sizeof(float));
  }
}

void CpuOps::EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a) {
  (void)ctx;
  std::fill(a.dtable, a.dtable + a.vocab * a.d, 0.0f);
  for (int64_t i = 0; i < a.n; ++i) {  // in token order: deterministic
    float* row = a.dtable + a.tokens[i] * a.d;
    const float* g = a.dout + i * a.d;
    for (int64_t c = 0; c < a.d; ++c) row[c] += g[c];
  }
}

// Elementwise; in parallel only where the sum is large enough to pay for
// waking the team (the MoE layer's chunk sums of expert weight gradients;
// a residual add of a small batch stays on the calling thread).
void CpuOps::Add(Context& ctx, const AddArgs& a) {
  constexpr int64_t kParallelFrom = int64_t{1} << 15;
#pragma omp parallel for schedule(static) num_threads(ctx.threads()) if (a.n >= kParallelFrom)
  for (int64_t i = 0; i < a.n; ++i) a.out[i] = a.a[i] + a.b[i];
}

void CpuOps::RmsNormForward(Context& ctx, const RmsNormForwardArgs& a) {
  const float* x = a.x;
  const float* g = a.g;
  const int64_t rows = a.rows, d = a.d;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + a.eps));
    a.inv_rms[r] = inv;
    float* yr = a.y + r * d;
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * g[i];
  }
}

void CpuOps::RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a) {
  const float* x = a.x;
  const float* g = a.g;
  const float* dy = a.dy;
  const float* inv_rms = a.inv_rms;
  const int64_t rows = a.rows, d = a.d;
  // dx = inv * (g*dy - xhat * mean(g*dy*xhat)), xhat = x * inv.
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const double inv = inv_rms[r];
    double dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(g[i]) * dyr[i] * xr[i] * inv;
    const double mean = dot / static_cast<double>(d);
    float* dxr = a.dx + r * d;
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
    a.dg[i] = static_cast<float>(s);
  }
}

void CpuOps::Rope(Context& ctx, const RopeArgs& a) {
  // The q heads, then the k heads: the first heads + kv_heads of a row; of
  // each, the last rope_dim columns (pairs (i, i + half), or (2i, 2i + 1)
  // interleaved).
  const int64_t rotated = a.heads + a.kv_heads, hd = a.hd, seq = a.seq;
  const int64_t half = a.rope_dim / 2, width = (a.heads + a.kv_heads) * hd + a.kv_heads * a.vd;
  const int64_t first = hd - a.rope_dim;
  const int64_t step = a.interleaved ? 2 : 1, other = a.interleaved ? 1 : half;
  const float sign = a.inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < a.batch * seq; ++r) {
    const int64_t p = r % seq;
    const float* c = a.cos + p * half;
    const float* s = a.sin + p * half;
    for (int64_t h = 0; h < rotated; ++h) {
      float* v = a.qkv + r * width + h * hd + first;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i0 = i * step, i1 = i0 + other;
        const float x0 = v[i0], x1 = v[i1], si = sign * s[i];
        v[i0] = x0 * c[i] - x1 * si;
        v[i1] = x1 * c[i] + x0 * si;
      }
    }
  }
}

void CpuOps::CopyColumns(Context& ctx, const CopyColumnsArgs& a) {
  // Rows in parallel; within a row the blocks in order, so a sum over
  // blocks (dst_step 0) has one order for any thread count.
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* src = a.src + r * a.src_cols + a.src_offset;
    float* dst = a.dst + r * a.dst_cols + a.dst_offset;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const float* sb = src + b * a.src_step;
      float* db = dst + b * a.dst_step;
      if (a.accumulate) {
        for (int64_t j = 0; j < a.width; ++j) db[j] += sb[j];
      } else {
        std::copy(sb, sb + a.width, db);
      }
    }
  }
}

void CpuOps::AdamW(Context& ctx, const AdamWArgs& a) {
  const AdamWConstants& k = a.k;
  const float b1 = k.b1, b2 = k.b2, c1 = k.c1, c2 = k.c2, eps = k.eps, lrf = k.lr;
  const float scale = k.grad_scale, wd = k.weight_decay;
  const float* gk = a.g;
  float* pk = a.p;
  float* mk = a.m;
  float* vk = a.v;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t i = 0; i < a.n; ++i) {
    const float gi = gk[i] * scale;
    mk[i] = b1 * mk[i] + (1.0f - b1) * gi;
    vk[i] = b2 * vk[i] + (1.0f - b2) * gi * gi;
    const float update = (mk[i] * c1) / (std::sqrt(vk[i] * c2) + eps);
    pk[i] -= lrf * (update + wd * pk[i]);
  }
}

}  // namespace fp8moe::internal
