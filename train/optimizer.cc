#include "train/optimizer.h"

#include <cmath>

namespace fp8moe::internal {

double GlobalNorm(const ModelParams& grads) {
  double s = 0;
  for (const auto& [name, t] : grads.Named()) {
    const float* g = t->data_as<float>();
    const size_t n = t->num_elements();
    for (size_t i = 0; i < n; ++i) s += static_cast<double>(g[i]) * g[i];
  }
  return std::sqrt(s);
}

std::string FirstNonFinite(const ModelParams& grads) {
  for (const auto& [name, t] : grads.Named()) {
    const float* g = t->data_as<float>();
    const size_t n = t->num_elements();
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(g[i])) return name;
    }
  }
  return "";
}

void AdamWUpdate(Context& ctx, const TrainConfig& c, int64_t t, double lr, double grad_scale,
                 const ModelParams& grads, ModelParams* params, ModelParams* m, ModelParams* v) {
  const auto g = grads.Named();
  const auto p = params->Named();
  const auto ms = m->Named();
  const auto vs = v->Named();
  const float b1 = static_cast<float>(c.adam_b1), b2 = static_cast<float>(c.adam_b2);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(c.adam_b1, static_cast<double>(t))));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(c.adam_b2, static_cast<double>(t))));
  const float eps = static_cast<float>(c.adam_eps), lrf = static_cast<float>(lr);
  const float scale = static_cast<float>(grad_scale);
  for (size_t k = 0; k < g.size(); ++k) {
    const float wd = p[k].second->rank() >= 2 ? static_cast<float>(c.adam_weight_decay) : 0.0f;
    const float* gk = g[k].second->data_as<float>();
    float* pk = p[k].second->data_as<float>();
    float* mk = ms[k].second->data_as<float>();
    float* vk = vs[k].second->data_as<float>();
    const int64_t n = static_cast<int64_t>(g[k].second->num_elements());
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
    for (int64_t i = 0; i < n; ++i) {
      const float gi = gk[i] * scale;
      mk[i] = b1 * mk[i] + (1.0f - b1) * gi;
      vk[i] = b2 * vk[i] + (1.0f - b2) * gi * gi;
      const float update = (mk[i] * c1) / (std::sqrt(vk[i] * c2) + eps);
      pk[i] -= lrf * (update + wd * pk[i]);
    }
  }
}

}  // namespace fp8moe::internal
