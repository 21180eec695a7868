// Shared helpers of the MoE layer tests: random layer inputs and configs
// from key=value flags.
#ifndef FP8MOE_MOE_MOE_TEST_UTIL_H_
#define FP8MOE_MOE_MOE_TEST_UTIL_H_

#include <random>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/moe.h"

namespace fp8moe::test {

// x [T, D], dy [T, D], router [D, E], wi [E, D, 2F], wo [E, F, D], random
// normal with scales that keep the layer's values O(1).
struct LayerInputs {
  Tensor x, dy, router, wi, wo;
  Tensor bias;  // routed_bias's choice bias [E]; none unless a test sets it
  LayerInputs(unsigned seed, int64_t t, int64_t d, int64_t f, int64_t e) {
    std::mt19937 rng(seed);
    x = Random(rng, {t, d}, 1.0f);
    dy = Random(rng, {t, d}, 1.0f);
    router = Random(rng, {d, e}, 0.5f);
    wi = Random(rng, {e, d, 2 * f}, 1.0f / std::sqrt(static_cast<float>(d)));
    wo = Random(rng, {e, f, d}, 1.0f / std::sqrt(static_cast<float>(f)));
  }
  // A choice bias of sd 0.1 (sigmoid scores are in (0, 1): it moves some
  // choices), drawn after the other inputs so they keep their values.
  void SetBias(unsigned seed) {
    std::mt19937 rng(seed + 7919);
    bias = Random(rng, {router.shape()[1]}, 0.1f);
  }
  MoeWeights weights() const {
    MoeWeights w{router.view(), wi.view(), wo.view()};
    if (bias.num_elements() > 0) w.route_bias = bias.view();
    return w;
  }

  static Tensor Random(std::mt19937& rng, Shape s, float sd) {
    Tensor t = std::move(Tensor::Create(DType::kF32, std::move(s))).value();
    std::normal_distribution<float> nd(0.0f, sd);
    for (size_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = nd(rng);
    return t;
  }
};

// A validated config from flags (the defaults of configs/base.yml otherwise);
// aborts the test binary on a bad flag (a bug in the test).
inline MoeConfig MakeConfig(const std::vector<std::string>& flags) {
  auto c = LoadConfig(MoeConfigSchema(), "", flags);
  if (!c.ok()) {
    std::fprintf(stderr, "bad test flags: %s\n", c.status().ToString().c_str());
    std::abort();
  }
  auto m = MoeConfigFrom(*c);
  if (!m.ok()) {
    std::fprintf(stderr, "bad test config: %s\n", m.status().ToString().c_str());
    std::abort();
  }
  return *m;
}

// Every QAT mode (and bf16 without quantization) as flags.
inline const std::vector<std::vector<std::string>>& Modes() {
  static const std::vector<std::vector<std::string>> modes = {
      {"dtype=float32"},
      {},
      {"fp8_moe_fake_quant=true"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
       "fp8_moe_native_bwd_dlhs=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true"},
      {"quantization=int8"},
  };
  return modes;
}

// Modes() and the modes it leaves out (native fwd alone, fp8_full with e4m3
// gradients quantized in the kernel, fp8, nanoo_fp8): every routed QAT mode.
inline std::vector<std::vector<std::string>> EveryQatMode() {
  std::vector<std::vector<std::string>> modes = Modes();
  modes.push_back({"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                   "fp8_moe_native_fwd=true"});
  modes.push_back({"quantization=fp8_full", "use_qwix_quantization=true",
                   "bwd_quantization_dtype=e4m3", "moe_bwd_inkernel_quant=true"});
  modes.push_back({"quantization=fp8"});
  modes.push_back({"quantization=nanoo_fp8"});
  return modes;
}

}  // namespace fp8moe::test

#endif  // FP8MOE_MOE_MOE_TEST_UTIL_H_
