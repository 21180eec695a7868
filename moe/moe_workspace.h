// The MoE layer's workspace (internal to moe/): the routing, the ragged
// buffers and the saved activations of one layer, kept from step to step.
#ifndef FP8MOE_MOE_MOE_WORKSPACE_H_
#define FP8MOE_MOE_MOE_WORKSPACE_H_

#include <cstdint>

#include "fp8moe/moe.h"
#include "fp8moe/tensor.h"
#include "moe/routing.h"

namespace fp8moe {
namespace internal {

// A view of `shape` on *t's bytes, re-allocating *t only when it is too
// small or of another dtype: buffers reused step to step grow once.
Result<TensorView> Grow(Tensor* t, DType dtype, const Shape& shape);

}  // namespace internal

struct MoeWorkspace::State {
  internal::Routing routing;
  MoeQuantPlan plan;
  DType act = DType::kBF16;
  int64_t T = 0, D = 0, F = 0, E = 0, k = 0, rows = 0;
  bool forward_done = false;

  // Forward: the buffers and views of this step's shapes.
  Tensor one, logits, group_sizes, x_sorted, h, a, y_sorted;
  TensorView group_sizes_view, xs, hv, av, ysv;
  // Backward.
  Tensor dy_sorted, dweight, dh, dx_sorted, dlogits;
  // fp8_full backward operands.
  Tensor recipe_g, recipe_q, recipe_sc, recipe_a32, recipe_qa, recipe_sa;
  // Activation health.
  Tensor health_f32, health_q, health_sc;
};

}  // namespace fp8moe

#endif  // FP8MOE_MOE_MOE_WORKSPACE_H_
