#include "train/optimizer.h"

#include <cmath>

#include "kernels/ops.h"

namespace fp8moe::internal {

double GlobalNorm(const ModelParams& grads) {
  double s = 0;
  for (const auto& [name, t] : grads.Named()) {
    if (IsModelState(name)) continue;  // state (router_bias): no gradient
    const float* g = t->data_as<float>();
    const size_t n = t->num_elements();
    for (size_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  }
  return std::sqrt(s);
}

std::string FirstNonFinite(const ModelParams& grads) {
  for (const auto& [name, t] : grads.Named()) {
    if (IsModelState(name)) continue;  // state (router_bias): no gradient
    const float* g = t->data_as<float>();
    const size_t n = t->num_elements();
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(g[i])) return name;
    }
  }
  return "";
}

Status AdamWSpan(Context& ctx, const TrainConfig& c, int64_t t, double lr, double grad_scale,
                 bool decay, const float* gk, float* pk, float* mk, float* vk, int64_t n) {
  AdamWConstants k;
  k.b1 = static_cast<float>(c.adam_b1);
  k.b2 = static_cast<float>(c.adam_b2);
  k.c1 = static_cast<float>(1.0 / (1.0 - std::pow(c.adam_b1, static_cast<double>(t))));
  k.c2 = static_cast<float>(1.0 / (1.0 - std::pow(c.adam_b2, static_cast<double>(t))));
  k.eps = static_cast<float>(c.adam_eps);
  k.lr = static_cast<float>(lr);
  k.grad_scale = static_cast<float>(grad_scale);
  k.weight_decay = decay ? static_cast<float>(c.adam_weight_decay) : 0.0f;
  return AdamW(ctx, k, gk, pk, mk, vk, n);
}

Status AdamWUpdate(Context& ctx, const TrainConfig& c, int64_t t, double lr, double grad_scale,
                   const ModelParams& grads, ModelParams* params, ModelParams* m,
                   ModelParams* v) {
  const auto g = grads.Named();
  const auto p = params->Named();
  const auto ms = m->Named();
  const auto vs = v->Named();
  for (size_t k = 0; k < g.size(); ++k) {
    if (IsModelState(g[k].first)) continue;  // moved by UpdateRoutedBias alone
    FP8MOE_RETURN_IF_ERROR(AdamWSpan(ctx, c, t, lr, grad_scale, p[k].second->rank() >= 2,
                                     g[k].second->data_as<float>(),
                                     p[k].second->data_as<float>(),
                                     ms[k].second->data_as<float>(),
                                     vs[k].second->data_as<float>(),
                                     static_cast<int64_t>(g[k].second->num_elements())));
  }
  return OkStatus();
}

}  // namespace fp8moe::internal
