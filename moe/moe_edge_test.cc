// The MoE layer at the edges of f32. Issue 12, part 1: a gate far below
// the range where sigmoid is representable must give silu(gate) = -0, so
// the layer's output is ~-0 in every mode, not gate * up (the sigmoid used
// to come out 1 there) or NaN. Issue 35: where the routing softmax
// saturates (a weight ~1), the router's gradient must not cancel.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "fp8moe/moe.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

Tensor Values(Shape s, const std::vector<float>& v) {
  Tensor t = std::move(Tensor::Create(DType::kF32, std::move(s))).value();
  for (size_t i = 0; i < v.size(); ++i) t.data_as<float>()[i] = v[i];
  return t;
}

// x = [[1]], router = 0, wi = [[[-200, 2]]] (gate -200, up 2), wo = [[[1]]]:
// y = silu(-200) * 2 * 1 = -2.8e-85, i.e. -0 in f32 (it was -400).
TEST(MoeLayerEdges, VeryNegativeGateGivesZeroInEveryMode) {
  const Tensor x = Values({1, 1}, {1}), router = Values({1, 1}, {0});
  const Tensor wi = Values({1, 1, 2}, {-200, 2}), wo = Values({1, 1, 1}, {1});
  const Tensor dy = Values({1, 1}, {1});
  const MoeWeights w{router.view(), wi.view(), wo.view()};
  const std::vector<std::vector<std::string>> modes = {
      {"dtype=float32"},
      {},
      {"fp8_moe_fake_quant=true"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
       "fp8_moe_native_bwd_dlhs=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true"},
      {"quantization=int8"},
      {"quantization=fp8"},
      {"quantization=nanoo_fp8"},
  };
  for (std::vector<std::string> flags : modes) {
    std::string name;
    for (const auto& f : flags) name += f + " ";
    SCOPED_TRACE(name.empty() ? "bf16" : name);
    flags.push_back("num_experts=1");
    flags.push_back("num_experts_per_tok=1");
    const MoeConfig cfg = test::MakeConfig(flags);
    auto f = MoeForward(cfg, x.view(), w);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const float y = f->y.data_as<float>()[0];
    EXPECT_FALSE(std::isnan(y));
    EXPECT_LE(std::fabs(y), 1e-30f) << "y = " << y;
    const ConstTensorView dyv = dy.view();
    auto ref = reference::MoeLayer(cfg, x.view(), w, &dyv);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    EXPECT_LE(std::fabs(ref->y.data_as<float>()[0]), 1e-30f);
    // The backward meets silu'(-200) = -0: finite gradients, none NaN.
    auto g = MoeBackward(cfg, x.view(), w, *f, dy.view());
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    for (const Tensor* t : {&g->dx, &g->drouter, &g->dwi, &g->dwo}) {
      for (size_t i = 0; i < t->num_elements(); ++i) {
        EXPECT_TRUE(std::isfinite(t->data_as<float>()[i])) << "gradient element " << i;
      }
    }
  }
}

// max |got - want| / max |want| of two F32 tensors of the same shape.
double RelativeError(const Tensor& got, const Tensor& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.num_elements(); ++i) {
    const double w = want.data_as<float>()[i];
    err = std::max(err, std::fabs(got.data_as<float>()[i] - w));
    scale = std::max(scale, std::fabs(w));
  }
  return err / scale;
}

// Issue 35's layer: T=64, D=32, F=16, E=4, k=2, x ~ N(0, 1) with rows 0-3
// x200, router / sqrt(D), wi / sqrt(D), wo / sqrt(F), dy ~ N(0, 1). Scaled
// x200, a token's logits are hundreds apart and its softmaxes saturate. Rows
// 0-3 are drawn again until, scaled, their top two logits are 12 to 20
// apart: the second weight is then 2e-9 to 6e-6, the range where f32 weights
// lose it (s_0 rounds to 1, or to within 3e-8 of 1 - s_1); far wider gaps
// leave nothing to lose (the seed had one token at 16.9).
struct SaturatingLayer {
  static constexpr int64_t T = 64, D = 32, F = 16, E = 4;
  Tensor x, router, wi, wo, dy;

  explicit SaturatingLayer(std::mt19937& rng) {
    const float sd = 1.0f / std::sqrt(static_cast<float>(D));
    x = test::LayerInputs::Random(rng, {T, D}, 1.0f);
    router = test::LayerInputs::Random(rng, {D, E}, sd);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t t = 0; t < 4; ++t) {
      float* row = x.data_as<float>() + t * D;
      for (double gap = 0; gap < 12 || gap > 20;) {
        std::vector<double> l(E, 0.0);
        for (int64_t d = 0; d < D; ++d) {
          row[d] = nd(rng);
          for (int64_t e = 0; e < E; ++e) l[e] += 200.0 * row[d] * router.data_as<float>()[d * E + e];
        }
        std::sort(l.begin(), l.end());
        gap = l[E - 1] - l[E - 2];
      }
      for (int64_t d = 0; d < D; ++d) row[d] *= 200.0f;
    }
    wi = test::LayerInputs::Random(rng, {E, D, 2 * F}, sd);
    wo = test::LayerInputs::Random(rng, {E, F, D}, 1.0f / std::sqrt(static_cast<float>(F)));
    dy = test::LayerInputs::Random(rng, {T, D}, 1.0f);
  }
  MoeWeights weights() const { return {router.view(), wi.view(), wo.view()}; }
};

// The layer's gradients and its float64 twin's for the flags.
struct GradientsAndTwin {
  MoeGradients got;
  reference::MoeReferenceResult want;
};
GradientsAndTwin RunLayer(const SaturatingLayer& in, const std::vector<std::string>& flags) {
  const MoeConfig cfg = test::MakeConfig(flags);
  const MoeWeights w = in.weights();
  auto fwd = MoeForward(cfg, in.x.view(), w);
  EXPECT_TRUE(fwd.ok()) << fwd.status().ToString();
  auto g = MoeBackward(cfg, in.x.view(), w, *fwd, in.dy.view());
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  const ConstTensorView dyv = in.dy.view();
  auto ref = reference::MoeLayer(cfg, in.x.view(), w, &dyv);
  EXPECT_TRUE(ref.ok()) << ref.status().ToString();
  return {std::move(*g), std::move(*ref)};
}

// Issue 35: the softmax over the selected logits saturates (s_0 ~ 1), and
// its backward s_j (g_j - sum_i s_i g_i), computed from the f32 weights, left
// s_1 (g_0 - g_1) to the rounding of s_0 times g (~1e5 for such tokens);
// times x200 in drouter = x^T dlogits that was 1.2e-1 of drouter's largest
// entry. Against the float64 twin (dtype=float32: no rounding in the twin at
// all) and every other mode against its own twin, within its bound
// (docs/moe.md); with and without the load-balancing loss, and with
// norm_topk_prob.
TEST(MoeLayerEdges, SaturatedRoutingSoftmaxKeepsTheRouterGradient) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const SaturatingLayer in(rng);
  std::vector<std::vector<std::string>> modes = test::Modes();
  modes.push_back({"dtype=float32", "norm_topk_prob=true"});
  for (const double lbw : {0.0, 0.01}) {
    for (std::vector<std::string> flags : modes) {
      const bool f32 = !flags.empty() && flags[0] == "dtype=float32";
      std::string name = "load_balance_loss_weight=" + std::to_string(lbw);
      for (const auto& f : flags) name += " " + f;
      SCOPED_TRACE(name);
      flags.push_back("num_experts=4");
      flags.push_back("load_balance_loss_weight=" + std::to_string(lbw));
      const GradientsAndTwin r = RunLayer(in, flags);
      // f32: 1e-4, the bound (seen: drouter 2e-6 to 6e-6, the f32
      // logits' rounding carried through the second weight; dx ~2e-7; before
      // the fix drouter 2e-3 to 5e-2). Other modes: their docs/moe.md bound
      // for gradients (seen ~1e-5; before, up to 5e-2).
      const double bound = f32 ? 1e-4 : 2e-2;
      EXPECT_LE(RelativeError(r.got.drouter, r.want.drouter), bound) << "drouter";
      EXPECT_LE(RelativeError(r.got.dx, r.want.dx), bound) << "dx";
    }
  }
}

// The load-balancing loss alone (dy = 0, weight 1): its gradient through the
// softmax over all experts, P_e (f_e - sum_i P_i f_i), cancels the same way
// where P saturates, and f32 probabilities lost 1 - P_top.
TEST(MoeLayerEdges, SaturatedLoadBalanceSoftmaxKeepsTheRouterGradient) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  SaturatingLayer in(rng);
  std::fill_n(in.dy.data_as<float>(), in.dy.num_elements(), 0.0f);
  const GradientsAndTwin r =
      RunLayer(in, {"dtype=float32", "num_experts=4", "load_balance_loss_weight=1"});
  // Seen: drouter 2e-7 to 3e-7, dx 1e-7 to 2e-7; with the probabilities
  // rounded to f32 (as they were), drouter 1e-5 to 2.3e-5.
  EXPECT_LE(RelativeError(r.got.drouter, r.want.drouter), 2e-6) << "drouter";
  EXPECT_LE(RelativeError(r.got.dx, r.want.dx), 2e-6) << "dx";
}

}  // namespace
}  // namespace fp8moe
