// The model's dense pieces in f32 (internal to model/): the RoPE tables and
// f32 matmuls on the GMM kernel with one group. RMSNorm, RoPE, attention,
// the loss and the rest of a step's ops are behind the backend seam
// (kernels/ops.h, included here). model/reference/layers_reference.h has
// the float64 twins.
#ifndef FP8MOE_MODEL_LAYERS_H_
#define FP8MOE_MODEL_LAYERS_H_

#include <cstdint>

#include "fp8moe/context.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"
#include "kernels/ops.h"

namespace fp8moe::internal {

// *t = a zero-filled tensor of dtype and shape (the model's buffers,
// allocated once per Model; zeros, so a buffer no op has written yet reads
// as 0, never as leftover memory).
Status CreateZeroed(Tensor* t, Shape shape, DType dtype = DType::kF32);

// cos, sin [seq, hd/2]: angle(p, i) = p / max_timescale^(2i / hd).
void RopeTables(int64_t seq, int64_t hd, double max_timescale, float* cos, float* sin);
// Dense f32 matmuls on the GMM kernel with one group of m rows
// (group: I32 [1] holding m).
// out [m, n] = x [m, k] @ w [k, n]
Status Linear(Context& ctx, const ConstTensorView& group, const float* x, const float* w, int64_t m,
              int64_t k, int64_t n, float* out);
// dx [m, k] = dout [m, n] @ w^T (overwritten)
Status LinearDx(Context& ctx, const ConstTensorView& group, const float* dout, const float* w,
                int64_t m, int64_t k, int64_t n, float* dx);
// dw [k, n] = x^T @ dout (overwritten)
Status LinearDw(Context& ctx, const ConstTensorView& group, const float* x, const float* dout,
                int64_t m, int64_t k, int64_t n, float* dw);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MODEL_LAYERS_H_
