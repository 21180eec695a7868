// The float64 twin of the router's routing functions (include/fp8moe/moe.h
// steps 1-2 with routed_score_func, routed_scaling_factor, n_routing_groups,
// topk_routing_group and norm_topk_prob; kernels/ops.h RouteScoring states
// the same arithmetic for the fast ops): one token at a time, plain loops,
// written from MaxText's RoutedMoE.get_topk / deepseek_routing semantics. The
// MoE reference (moe_reference.cc) and the model twin (model/reference/)
// both route through it, so the two twins cannot disagree on the routing.
#ifndef FP8MOE_MOE_REFERENCE_ROUTING_REFERENCE_H_
#define FP8MOE_MOE_REFERENCE_ROUTING_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "fp8moe/moe_config.h"

namespace fp8moe::reference {

// One token's routing.
struct TokenRoute {
  std::vector<int64_t> expert;  // [k] slot j: the j-th largest choice score (ties: lower index)
  std::vector<double> score;    // [k] softmax over the selected logits, or their sigmoid scores
  std::vector<double> weight;   // [k] the routing weights
};

// logits [E] of one token -> its k experts and weights. Choice score: the
// logit (softmax) or sigmoid(logit) + bias (bias [E] or null: 0). With
// n_routing_groups only the topk_routing_group groups of the largest sum
// of their two largest choice scores are open. Weights: softmax over the
// selected logits (/ their sum with norm_topk_prob), or the selected
// sigmoid scores (/ (their sum + 1e-20) with norm_topk_prob); times
// routed_scaling_factor.
TokenRoute RouteToken(const MoeConfig& config, const double* logits, const float* bias,
                      int64_t experts);

// dlogits [E] += the gradient through the weights of dweight [k] (dL/dw)
// for the routing r of logits [E]; the choice (bias, groups, top-k) is
// held fixed.
void RouteTokenBackward(const MoeConfig& config, const double* logits, const TokenRoute& r,
                        const double* dweight, double* dlogits);

}  // namespace fp8moe::reference

#endif  // FP8MOE_MOE_REFERENCE_ROUTING_REFERENCE_H_
