#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "moe/gmm_ctx.h"

namespace fp8moe::internal {

Status CreateZeroed(Tensor* t, Shape shape, DType dtype) {
  FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Zeros(dtype, std::move(shape)));
  return OkStatus();
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

Status Linear(Context& ctx, const ConstTensorView& group, const float* x, const float* w, int64_t m,
              int64_t k, int64_t n, float* out) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const ConstTensorView xv{x, DType::kF32, {m, k}};
  const ConstTensorView wv{w, DType::kF32, {1, k, n}};
  const TensorView ov{out, DType::kF32, {m, n}};
  return CtxGmm(ctx, o, xv, wv, nullptr, group, ov);
}

Status LinearDx(Context& ctx, const ConstTensorView& group, const float* dout, const float* w,
                int64_t m, int64_t k, int64_t n, float* dx) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const ConstTensorView dv{dout, DType::kF32, {m, n}};
  const ConstTensorView wv{w, DType::kF32, {1, k, n}};
  const TensorView xv{dx, DType::kF32, {m, k}};
  return CtxGmmDlhs(ctx, o, dv, wv, nullptr, group, xv);
}

Status LinearDw(Context& ctx, const ConstTensorView& group, const float* x, const float* dout,
                int64_t m, int64_t k, int64_t n, float* dw) {
  GmmOptions o;
  o.mode = GmmMode::kF32;
  const ConstTensorView xv{x, DType::kF32, {m, k}};
  const ConstTensorView dv{dout, DType::kF32, {m, n}};
  const TensorView wv{dw, DType::kF32, {1, k, n}};
  return CtxTgmm(ctx, o, {}, xv, dv, group, wv);
}

}  // namespace fp8moe::internal
