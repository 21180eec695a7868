// The ring of experts' dispatch and combine (docs/distributed.md): the
// stages of moe/moe_stages.h call these when the layer runs on an expert ring
// of P > 1 ranks (MoeRanks::expert_ring). Internal to moe/.
#ifndef FP8MOE_MOE_MOE_RING_H_
#define FP8MOE_MOE_MOE_RING_H_

#include <cstdint>

#include "fp8moe/context.h"
#include "fp8moe/moe.h"
#include "moe/moe_workspace.h"

namespace fp8moe::internal {

// All-gathers x [T, D] (rounded to the activation dtype first, as the
// single-rank permute rounds it) into x_ring [P*T, D], and each token's
// experts and routing weights [P*T*k]; keeps the ring's pairs whose expert
// is local, sorted stably by expert (ring pair p = t*k + j over the P*T
// ring tokens, rank r's tokens at [r T, (r+1) T)); sets valid, E_local,
// local_sizes.
// With moe_quantize_token_all_gather the codes + per-token scales are
// gathered (GatherQuantizedTokens) and dequantized into x_ring instead.
Status RingDispatch(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                    const MoeOptions& options, MoeWorkspace::State& s);

// The largest valid row count of the ring (an all-reduce max).
Result<int64_t> RingMaxValid(MoeWorkspace::State& s);

// buffer [rows, D] (dtype act): valid row i <- x_ring[ring token of row i].
Status RingGatherRows(Context& ctx, const MoeWorkspace::State& s, void* buffer, DType act);

// y [T, D] f32: each rank's weighted rows for all P*T ring tokens (zero
// where none of its experts was chosen), reduce-scattered over the ring.
Status RingCombine(Context& ctx, MoeWorkspace::State& s, const TensorView& y);

// Combine backward: dy [T, D] all-gathered over the ring (f32); dy_sorted of
// the local pairs; dweight [T*k] of this rank's tokens (each pair's value
// comes from the one rank that ran its expert: a reduce-scatter, exact).
Status RingCombineBackward(Context& ctx, const ConstTensorView& dy, MoeWorkspace::State& s);

// dx [T, D] += the ring's dx_sorted rows scattered to their ring tokens and
// reduce-scattered back to the tokens' ranks.
Status RingDispatchBackward(Context& ctx, MoeWorkspace::State& s, const TensorView& dx);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_MOE_RING_H_
