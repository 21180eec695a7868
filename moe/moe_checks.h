// The MoE layer's checks of a call's config and tensors, allocating nothing:
// what MoeForward / MoeBackward refuse before they run, for callers that must
// refuse a request before any work (`fp8moe op`, issue 35). Internal.
#ifndef FP8MOE_MOE_MOE_CHECKS_H_
#define FP8MOE_MOE_MOE_CHECKS_H_

#include "fp8moe/moe.h"

namespace fp8moe::internal {

// The config (ValidateMoeConfig), the shapes and dtypes of x [T, D],
// router [D, E], wi [E, D, 2F], wo [E, F, D] (E: the experts this rank holds
// on an expert ring), num_moe_token_chunks against T, and when dy is given
// dy [T, D] F32; with the layer's own messages.
Status CheckMoeCall(const MoeConfig& cfg, const ConstTensorView& x, const MoeWeights& w,
                    const ConstTensorView* dy, const MoeOptions& options = {});

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_MOE_CHECKS_H_
