#include "moe/reference/routing_reference.h"

#include <cmath>

namespace fp8moe::reference {
namespace {

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

double Sigmoid(double l) {
  return l >= 0 ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l) / (1.0 + std::exp(l));
}

// The index of the largest c[x] over the x in [begin, end) that open(x)
// allows, scanning in index order and moving only to a strictly larger
// value; -1 if none.
template <class Open>
int64_t Largest(const std::vector<double>& c, int64_t begin, int64_t end, const Open& open) {
  int64_t best = -1;
  for (int64_t x = begin; x < end; ++x) {
    if (open(x) && (best == -1 || c[Idx(x)] > c[Idx(best)])) best = x;
  }
  return best;
}

}  // namespace

TokenRoute RouteToken(const MoeConfig& config, const double* logits, const float* bias,
                      int64_t experts) {
  const bool sigmoid = config.routed_score_func == RoutedScoreFunc::kSigmoid;
  const int64_t k = config.num_experts_per_tok;
  std::vector<double> c(Idx(experts));
  for (int64_t x = 0; x < experts; ++x) {
    c[Idx(x)] = sigmoid ? Sigmoid(logits[x]) + (bias != nullptr ? bias[x] : 0.0) : logits[x];
  }
  // Group-limited routing: mark the open experts.
  std::vector<bool> open(Idx(experts), true);
  if (config.n_routing_groups != -1) {
    const int64_t groups = config.n_routing_groups, per = experts / groups;
    std::vector<double> group(Idx(groups));
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t a = Largest(c, g * per, (g + 1) * per, [](int64_t) { return true; });
      const int64_t b = Largest(c, g * per, (g + 1) * per, [&](int64_t x) { return x != a; });
      group[Idx(g)] = c[Idx(a)] + c[Idx(b)];
    }
    std::vector<bool> kept(Idx(groups), false);
    for (int64_t j = 0; j < config.topk_routing_group; ++j) {
      kept[Idx(Largest(group, 0, groups, [&](int64_t g) { return !kept[Idx(g)]; }))] = true;
    }
    for (int64_t x = 0; x < experts; ++x) open[Idx(x)] = kept[Idx(x / per)];
  }
  TokenRoute r;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t best = Largest(c, 0, experts, [&](int64_t x) { return open[Idx(x)]; });
    open[Idx(best)] = false;
    r.expert.push_back(best);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const double l = logits[r.expert[Idx(j)]];
    r.score.push_back(sigmoid ? Sigmoid(l) : std::exp(l - logits[r.expert[0]]));
    sum += r.score.back();
  }
  double norm = sigmoid ? sum + 1e-20 : 1.0;
  if (!sigmoid) {
    // The softmax over the selected; norm_topk_prob divides by its sum.
    norm = 0.0;
    for (double& s : r.score) norm += (s /= sum);
  }
  for (double s : r.score) {
    const double w = config.norm_topk_prob ? s / norm : s;
    r.weight.push_back(w * config.routed_scaling_factor);
  }
  return r;
}

void RouteTokenBackward(const MoeConfig& config, const double* logits, const TokenRoute& r,
                        const double* dweight, double* dlogits) {
  const bool sigmoid = config.routed_score_func == RoutedScoreFunc::kSigmoid;
  const int64_t k = static_cast<int64_t>(r.expert.size());
  const double c = config.routed_scaling_factor;
  // dL/du of u = w / c, then through norm_topk_prob's u = s / S:
  // ds_j = (G_j - sum_i G_i s_i / S) / S.
  std::vector<double> ds(Idx(k));
  double S = sigmoid ? 1e-20 : 0.0, gs = 0.0;
  for (int64_t j = 0; j < k; ++j) S += r.score[Idx(j)];
  for (int64_t j = 0; j < k; ++j) gs += c * dweight[j] * r.score[Idx(j)] / S;
  for (int64_t j = 0; j < k; ++j) {
    ds[Idx(j)] = config.norm_topk_prob ? (c * dweight[j] - gs) / S : c * dweight[j];
  }
  if (sigmoid) {
    // ds/dl = sigmoid(l) sigmoid(-l), without the cancellation of 1 - s.
    for (int64_t j = 0; j < k; ++j) {
      const double l = logits[r.expert[Idx(j)]];
      dlogits[r.expert[Idx(j)]] += ds[Idx(j)] * Sigmoid(l) * Sigmoid(-l);
    }
    return;
  }
  // The softmax over the selected: dl_j = s_j (ds_j - sum_i s_i ds_i).
  double sds = 0.0;
  for (int64_t j = 0; j < k; ++j) sds += r.score[Idx(j)] * ds[Idx(j)];
  for (int64_t j = 0; j < k; ++j) {
    dlogits[r.expert[Idx(j)]] += r.score[Idx(j)] * (ds[Idx(j)] - sds);
  }
}

}  // namespace fp8moe::reference
