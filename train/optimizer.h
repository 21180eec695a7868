// AdamW, global-norm clipping and the non-finite check (internal to train/).
// Every reduction runs in a fixed order, so the bits do not depend on the
// thread count.
#ifndef FP8MOE_TRAIN_OPTIMIZER_H_
#define FP8MOE_TRAIN_OPTIMIZER_H_

#include <string>

#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/train.h"

namespace fp8moe::internal {

// sqrt(sum of squares of every gradient), in double.
double GlobalNorm(const ModelParams& grads);

// The name of the first tensor holding a NaN or an infinity, or "".
std::string FirstNonFinite(const ModelParams& grads);

// One AdamW step (t: 1-based update count for the bias correction) with the
// gradient scaled by `grad_scale` (clipping):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr wd p
// with the decoupled weight decay wd on matrices only (not on norm gains).
Status AdamWUpdate(Context& ctx, const TrainConfig& config, int64_t t, double lr,
                   double grad_scale, const ModelParams& grads, ModelParams* params,
                   ModelParams* m, ModelParams* v);

// The same update on n elements of one tensor (a whole one or an FSDP
// shard); `decay`: the tensor is a matrix (weight decay applies). Runs on
// the context's backend (kernels/ops.h: AdamW).
Status AdamWSpan(Context& ctx, const TrainConfig& config, int64_t t, double lr,
                 double grad_scale, bool decay, const float* g, float* p, float* m, float* v,
                 int64_t n);

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_OPTIMIZER_H_
