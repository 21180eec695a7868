#include "moe/routing.h"

#include <algorithm>

#include "kernels/ops.h"

namespace fp8moe::internal {

RouteScoring ScoringOf(const MoeConfig& cfg, const float* bias) {
  RouteScoring s;
  s.bias = bias;
  s.sigmoid = cfg.routed_score_func == RoutedScoreFunc::kSigmoid;
  s.norm_topk_prob = cfg.norm_topk_prob;
  s.scaling = cfg.routed_scaling_factor;
  if (cfg.n_routing_groups != -1) {
    s.groups = cfg.n_routing_groups;
    s.topk_groups = cfg.topk_routing_group;
  }
  return s;
}

Status Route(Context& ctx, const float* logits, int64_t tokens, int64_t experts, int64_t k,
             const RouteScoring& scoring, Routing* out) {
  Routing& r = *out;
  r.tokens = tokens;
  r.experts = experts;
  r.k = k;
  const auto pairs = static_cast<size_t>(tokens * k);
  r.expert.resize(pairs);
  r.weight.resize(pairs);
  r.softmax.resize(pairs);
  r.probs.resize(static_cast<size_t>(tokens * experts));
  FP8MOE_RETURN_IF_ERROR(RouteTopK(ctx, logits, tokens, experts, k, scoring,
                                   r.expert.data(), r.weight.data(), r.softmax.data(),
                                   r.probs.data()));
  r.group_sizes.resize(static_cast<size_t>(experts));
  r.next_row.resize(static_cast<size_t>(experts));
  r.row_of_pair.resize(pairs);
  r.pair_of_row.resize(pairs);
  return SortByExpert(ctx, r.expert.data(), tokens * k, 0, experts, r.group_sizes.data(),
                      r.row_of_pair.data(), r.pair_of_row.data(), r.next_row.data())
      .status();
}

void LoadFractions(const Routing& r, const int64_t* batch, std::vector<double>* f) {
  const int64_t E = r.experts;
  f->resize(static_cast<size_t>(E));
  const int64_t tokens = batch != nullptr ? batch[E] : r.tokens;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t pairs = batch != nullptr ? batch[e] : r.group_sizes[static_cast<size_t>(e)];
    (*f)[static_cast<size_t>(e)] =
        static_cast<double>(pairs) / static_cast<double>(std::max<int64_t>(tokens * r.k, 1));
  }
}

double LoadBalanceLoss(const Routing& r, const std::vector<double>& f, double weight) {
  if (weight == 0.0 || r.tokens == 0) return 0.0;
  double loss = 0.0;
  for (int64_t e = 0; e < r.experts; ++e) {
    double p = 0.0;
    for (int64_t t = 0; t < r.tokens; ++t) p += r.probs[static_cast<size_t>(t * r.experts + e)];
    loss += f[static_cast<size_t>(e)] * (p / static_cast<double>(r.tokens));
  }
  return weight * static_cast<double>(r.experts) * loss;
}

}  // namespace fp8moe::internal
