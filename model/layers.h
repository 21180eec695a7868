// The model's dense pieces in f32 (internal to model/): RMSNorm, RoPE,
// causal multi-head attention, cross-entropy, and f32 matmuls on the GMM
// kernel with one group. Every loop is either per row or per (batch, head)
// with a fixed summation order, so the bits do not depend on the thread
// count. model/reference/layers_reference.h has the float64 twins.
#ifndef FP8MOE_MODEL_LAYERS_H_
#define FP8MOE_MODEL_LAYERS_H_

#include <cstdint>

#include "fp8moe/context.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe::internal {

// y [rows, d] = x * inv_rms * g, inv_rms[r] = 1 / sqrt(mean(x[r]^2) + eps).
void RmsNormForward(Context& ctx, const float* x, const float* g, int64_t rows, int64_t d,
                    float eps, float* y, float* inv_rms);
// dx [rows, d] += d/dx of sum(y * dy); dg [d] = sum over rows of dy * x * inv_rms
// (overwritten).
void RmsNormBackward(Context& ctx, const float* x, const float* g, const float* inv_rms,
                     const float* dy, int64_t rows, int64_t d, float* dx, float* dg);

// cos, sin [seq, hd/2]: angle(p, i) = p / max_timescale^(2i / hd).
void RopeTables(int64_t seq, int64_t hd, double max_timescale, float* cos, float* sin);
// Rotates the q and k columns of qkv [B*S, 3*H*hd] in place: pairs
// (i, i + hd/2) of each head at position s by angle(s, i); inverse rotates
// back (the backward of the rotation).
void RopeApply(Context& ctx, float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t hd,
               const float* cos, const float* sin, bool inverse);

// Causal softmax attention per (batch, head) on qkv [B*S, 3*H*hd] (q | k | v,
// q and k already rotated): probs [B, H, S, S] (zero above the diagonal),
// out [B*S, H*hd].
void AttentionForward(Context& ctx, const float* qkv, int64_t batch, int64_t seq, int64_t heads,
                      int64_t hd, float* probs, float* out);
// dqkv [B*S, 3*H*hd] (overwritten) from dout [B*S, H*hd].
void AttentionBackward(Context& ctx, const float* qkv, const float* probs, const float* dout,
                       int64_t batch, int64_t seq, int64_t heads, int64_t hd, float* dqkv);

// Mean over rows of -log softmax(logits[r])[target[r]]; logits [rows, v].
// With dlogits non-null: its gradient (softmax - onehot) / rows. A target
// outside [0, v) is an error.
Result<double> CrossEntropy(Context& ctx, const float* logits, const int32_t* targets,
                            int64_t rows, int64_t v, float* dlogits);

// Dense f32 matmuls on the GMM kernel with one group of m rows
// (group: I32 [1] holding m).
// out [m, n] = x [m, k] @ w [k, n]
Status Linear(Context& ctx, const TensorView& group, const float* x, const float* w, int64_t m,
              int64_t k, int64_t n, float* out);
// dx [m, k] = dout [m, n] @ w^T (overwritten)
Status LinearDx(Context& ctx, const TensorView& group, const float* dout, const float* w,
                int64_t m, int64_t k, int64_t n, float* dx);
// dw [k, n] = x^T @ dout (overwritten)
Status LinearDw(Context& ctx, const TensorView& group, const float* x, const float* dout,
                int64_t m, int64_t k, int64_t n, float* dw);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_LAYERS_H_
