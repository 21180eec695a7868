// num_moe_token_chunks (include/fp8moe/moe_config.h): the MoE layer's tokens
// in C chunks, each through dispatch, expert GMMs and combine, composed from
// the stages of moe/moe_stages.h. Internal to moe/.
#ifndef FP8MOE_MOE_MOE_CHUNKS_H_
#define FP8MOE_MOE_MOE_CHUNKS_H_

#include "fp8moe/context.h"
#include "fp8moe/moe.h"
#include "moe/moe_workspace.h"

namespace fp8moe::internal {

// Route all T tokens on `s` (the aux loss and its fractions as without
// chunks), then chunk c of GetShardRange(T, C, c) through dispatch, expert
// GMMs and combine on its own state s.chunks[c]. On an expert ring the
// dispatch of chunk c + 1 (its all-gathers) runs on a helper thread while
// chunk c's GMMs run; every rank issues the ring's collectives in the same
// order (dispatch 0, dispatch 1, combine 0, dispatch 2, combine 1, ...).
//   x [T, D] f32, y [T, D] f32 (written chunk by chunk)
Status ChunkedForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                      const ConstTensorView& router, const PreparedMoeWeights& prepared,
                      const MoeOptions& options, MoeWorkspace::State& s, const TensorView& y,
                      MoeStepInfo* info);

// The mirror: combine and expert backward chunk by chunk (dwi, dwo the sum
// of the chunks' gradients, added in chunk order), the route backward on all
// T tokens, then each chunk's dispatch backward into dx.
Status ChunkedBackward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeWeights& w, const PreparedMoeWeights& prepared,
                       const MoeOptions& options, MoeWorkspace::State& s, const ConstTensorView& dy,
                       const MoeGradientViews& grads);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_MOE_CHUNKS_H_
