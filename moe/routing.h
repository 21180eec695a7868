// Routing of the MoE layer: top-k with softmax over the selected logits, the
// stable sort of (token, slot) pairs by expert, and the load-balancing loss.
// The ops themselves (the route, the sort, the gathers and scatters between
// token order and the ragged buffer, the router's backward) are the
// backend's (kernels/ops.h); this holds their results for the layer.
// Internal to moe/; semantics in include/fp8moe/moe.h.
#ifndef FP8MOE_MOE_ROUTING_H_
#define FP8MOE_MOE_ROUTING_H_

#include <cstdint>
#include <vector>

#include "fp8moe/context.h"
#include "fp8moe/moe_config.h"
#include "fp8moe/status.h"
#include "kernels/ops.h"

namespace fp8moe::internal {

struct Routing {
  int64_t tokens = 0, experts = 0, k = 0;
  std::vector<int32_t> expert;       // [T, k] chosen experts, slot j = j-th largest
  std::vector<float> weight;         // [T, k] routing weights (norm_topk_prob applied)
  // In double, for the backward: where a softmax saturates its small values
  // keep their digits, and 1 - p is not lost to f32 rounding (issue 35).
  std::vector<double> softmax;       // [T, k] softmax over the k selected logits (sigmoid: their scores)
  std::vector<double> probs;         // [T, E] softmax over all logits (aux loss)
  std::vector<int32_t> group_sizes;  // [E]
  std::vector<int64_t> row_of_pair;  // [T*k] buffer row of pair p = t*k + j
  std::vector<int64_t> pair_of_row;  // [T*k] inverse: pair of valid row i
  std::vector<int64_t> next_row;     // [E] scratch of the sort
};

// logits [T, E] -> routing (top-k, weights, stable expert order) in *out,
// on the context's backend (kernels/ops.h RouteTopK and SortByExpert); its
// vectors keep their capacity, so a routing reused step to step does not
// allocate.
Status Route(Context& ctx, const float* logits, int64_t tokens, int64_t experts, int64_t k,
             const RouteScoring& scoring, Routing* out);

// The route op's scoring of the layer's flags (routed_score_func,
// norm_topk_prob, routed_scaling_factor, n_routing_groups,
// topk_routing_group); the config has passed ValidateMoeConfig.
// bias [E] (MoeWeights::route_bias) or null: the choice bias.
RouteScoring ScoringOf(const MoeConfig& cfg, const float* bias = nullptr);

// f_e [E] of the load-balancing loss: routed pairs of expert e over all
// pairs. Of this batch when `batch` is null; else of the larger batch this
// one is a part of (FSDP): batch [E + 1] holds its pairs per expert and, last,
// its tokens.
void LoadFractions(const Routing& r, const int64_t* batch, std::vector<double>* f);

// The load-balancing loss weight * E * sum_e f_e p_e (p_e: this batch's mean
// probability).
double LoadBalanceLoss(const Routing& r, const std::vector<double>& f, double weight);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_ROUTING_H_
