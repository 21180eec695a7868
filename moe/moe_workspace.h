// The MoE layer's workspace (internal to moe/): the routing, the ragged
// buffers and the saved activations of one layer, kept from step to step.
#ifndef FP8MOE_MOE_MOE_WORKSPACE_H_
#define FP8MOE_MOE_MOE_WORKSPACE_H_

#include <cstdint>
#include <memory>
#include <vector>

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
  std::vector<int64_t> lb_counts;    // [E + 1] the batch's pairs per expert, tokens
  std::vector<double> lb_fraction;   // [E] f_e of the load-balancing loss
  const float* route_bias = nullptr; // [E] this step's choice bias (MoeWeights), or null
  MoeQuantPlan plan;
  DType act = DType::kBF16;
  int64_t T = 0, D = 0, F = 0, E = 0, k = 0, rows = 0;
  // The pairs this rank's experts run: valid rows of the ragged buffer (T*k
  // on one rank), and their count per local expert [E_local].
  int64_t valid = 0, E_local = 0;
  const int32_t* local_sizes = nullptr;
  bool forward_done = false;

  // The expert ring (moe/moe_ring.cc); P = 1: the single-rank layer.
  Communicator* ring = nullptr;
  int64_t P = 1, ring_index = 0, e0 = 0;
  std::vector<int32_t> ring_expert;      // [P*T*k] gathered expert ids
  std::vector<float> ring_weight;        // [P*T*k] gathered routing weights
  std::vector<int32_t> ring_sizes;       // [E_local] pairs per local expert
  std::vector<int64_t> ring_row_of_pair; // [P*T*k] buffer row, -1: not local
  std::vector<int64_t> ring_pair_of_row; // [P*T*k] ring pair of valid row i < valid
  Tensor x_ring, y_ring, dy_ring, dw_ring, dx_ring, ring_tmp;
  // moe_quantize_token_all_gather: codes [P*T, D], scales [P*T], and the
  // dequantized tokens x_deq [P*T, D] f32 (one rank: [T, D]).
  Tensor x_codes, x_scales, x_deq;
  bool quantized_tokens = false;

  // Forward: the buffers and views of this step's shapes.
  Tensor one, logits, group_sizes, x_sorted, h, a, y_sorted;
  TensorView group_sizes_view, xs, hv, av, ysv;
  // Backward.
  Tensor dy_sorted, dweight, dh, dx_sorted, dlogits;
  TensorView dys, dhv, dxs, dwv;
  // fp8_full backward operands.
  Tensor recipe_g, recipe_q, recipe_sc, recipe_a32, recipe_qa, recipe_sa;
  // Activation health.
  Tensor health_f32, health_q, health_sc;

  // num_moe_token_chunks > 1 (moe/moe_chunks.cc): the route is this
  // state's, each chunk's dispatch, GMMs and combine run on chunks[c];
  // empty without chunks. chunk_dwi / chunk_dwo: a chunk's expert weight
  // gradients before they are added.
  std::vector<std::unique_ptr<State>> chunks;
  Tensor chunk_dwi, chunk_dwo;
};

}  // namespace fp8moe

#endif  // FP8MOE_MOE_MOE_WORKSPACE_H_
