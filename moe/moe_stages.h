// The MoE layer as stages (docs/design.md §7.3; docs/distributed.md "The ring of
// experts"): route, dispatch, expert GMMs, combine, and the backward of each.
// MoeForward / MoeBackward (moe/moe_layer.cc) are their composition. On one
// rank dispatch and combine are the permute and the weighted unpermute
// (kernels/ops.h PermuteRows, CombineRows) over the routing of
// moe/routing.h; on an expert ring (MoeRanks::expert_ring) the same ops run
// over the ring's maps between the all-gather of tokens + routing and the
// reduce-scatter of the partial outputs (moe/moe_ring.cc), and the route
// and expert stages do not change.
// Internal to moe/; every buffer lives in the workspace's State.
#ifndef FP8MOE_MOE_MOE_STAGES_H_
#define FP8MOE_MOE_MOE_STAGES_H_

#include <cstdint>

#include "fp8moe/context.h"
#include "fp8moe/moe.h"
#include "moe/moe_workspace.h"

namespace fp8moe::internal {

using MoeState = MoeWorkspace::State;

// ---- Forward ----

// Route: logits = x @ router (f32), top-k, the stable expert order of this
// rank's T*k pairs, the load fractions and the aux loss.
//   x [T, D] f32, router [D, E] f32
Status RouteForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                    const ConstTensorView& router, const MoeOptions& options, MoeState& s,
                    float* aux_loss);

// Dispatch: the ragged buffer x_sorted [rows, D] (act dtype) of the pairs the
// local experts run, sorted stably by expert, and their group sizes
// [E_local]; the buffer's size and the collective overflow decision in
// *stats. One rank: the T*k pairs of x. Ring: the P*T tokens of the ring.
//   x [T, D] f32
Status DispatchForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeOptions& options, MoeState& s, MoeStats* stats);

// Expert GMMs: h = x_sorted @ wi' [rows, 2F], a = SwiGLU(h) [rows, F],
// y_sorted = a @ wo' [rows, D], on the local experts.
Status ExpertsForward(Context& ctx, const MoeConfig& cfg, const PreparedMoeWeights& prepared,
                      const MoeOptions& options, MoeState& s);

// Combine: y [T, D] f32 = the routing-weighted sum of each token's k rows.
Status CombineForward(Context& ctx, MoeState& s, const TensorView& y);

// ---- Backward (the mirror, run in this order) ----

// Combine backward: dy_sorted [rows, D] (act) and dweight [T*k] f32 of this
// rank's pairs.   dy [T, D] f32
Status CombineBackwardStage(Context& ctx, const MoeOptions& options, MoeState& s,
                            const ConstTensorView& dy);

// Expert GMMs backward: dh, dx_sorted [rows, D] f32, dwi and dwo of the
// local experts (overwritten). x [T, D] is re-gathered with remat=full.
Status ExpertsBackward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeWeights& w, const PreparedMoeWeights& prepared,
                       const MoeOptions& options, MoeState& s, const TensorView& dwi,
                       const TensorView& dwo);

// Route backward: dlogits [T, E] from dweight and the aux loss; drouter =
// x^T dlogits [D, E] (this rank's tokens) and dx = dlogits router^T [T, D]
// (overwritten).
Status RouteBackwardStage(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                          const ConstTensorView& router, MoeState& s, const TensorView& drouter,
                          const TensorView& dx);

// Dispatch backward: dx [T, D] += the rows of dx_sorted scattered back to
// their tokens (ring: summed over the ranks that ran them).
Status DispatchBackward(Context& ctx, MoeState& s, const TensorView& dx);

// A ragged buffer [rows, cols] from the workspace; tail rows past `valid`
// NaN-poisoned when the options ask.
Result<TensorView> RaggedBuffer(Tensor* t, DType d, int64_t rows, int64_t cols,
                                const MoeOptions& o, int64_t valid);
void PoisonTail(const TensorView& t, int64_t valid_rows);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_MOE_STAGES_H_
