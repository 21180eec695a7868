// The fast MoE layer against its dense per-token reference in every QAT mode,
// and against central finite differences of the reference's f64 loss.
//
// Bounds (max |fast - reference| / max |reference| per tensor):
//  - f32 mode: 1e-5 (the bound); only f32 summation order differs.
//  - bf16 and quantized modes: the two compute the same quantized values, but
//    a last-bit difference in an f32 sum can move a value across a bf16 or
//    fp8 rounding boundary; that element then differs by one bf16 ulp (2^-8
//    relative) or one fp8 step (2^-3 relative for e4m3, 2^-2 for e5m2), and
//    flows on through the later GMMs: y within 1e-2, gradients within 2e-2
//    (derivation and observed values at the test).
#include <cmath>
#include <cstring>
#include <tuple>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/moe.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

using test::LayerInputs;
using test::MakeConfig;

double MaxAbs(const Tensor& t) {
  double m = 0;
  for (size_t i = 0; i < t.num_elements(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(t.data_as<float>()[i])));
  }
  return m;
}

// max |a - b| / max |b|.
double RelDiff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double m = 0;
  for (size_t i = 0; i < a.num_elements(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(a.data_as<float>()[i]) - b.data_as<float>()[i]));
  }
  return m / std::max(MaxAbs(b), 1e-30);
}

struct ModeCase {
  std::vector<std::string> flags;
  double y_bound, grad_bound;
};

// Per mode: fast vs reference on fresh random inputs, all outputs.
void CheckAgainstReference(const ModeCase& c, unsigned seed, int64_t t, int64_t d, int64_t f) {
  std::vector<std::string> flags = c.flags;
  flags.push_back("num_experts=4");
  flags.push_back("load_balance_loss_weight=0.1");
  std::string name;
  for (const auto& x : c.flags) name += x + " ";
  SCOPED_TRACE(name.empty() ? "bf16" : name);
  const MoeConfig cfg = MakeConfig(flags);
  LayerInputs in(seed, t, d, f, 4);
  if (cfg.routed_bias) in.SetBias(seed);
  auto fwd = MoeForward(cfg, in.x.view(), in.weights());
  ASSERT_TRUE(fwd.ok()) << fwd.status().ToString();
  auto grads = MoeBackward(cfg, in.x.view(), in.weights(), *fwd, in.dy.view());
  ASSERT_TRUE(grads.ok()) << grads.status().ToString();
  ConstTensorView dy = in.dy.view();
  auto ref = reference::MoeLayer(cfg, in.x.view(), in.weights(), &dy);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  ASSERT_EQ(0, std::memcmp(fwd->group_sizes.data(), ref->group_sizes.data(),
                           ref->group_sizes.num_bytes()));
  EXPECT_NEAR(fwd->aux_loss, ref->aux_loss, 1e-6 * std::fabs(ref->aux_loss) + 1e-9);
  const double ry = RelDiff(fwd->y, ref->y);
  EXPECT_LE(ry, c.y_bound) << "y";
  double worst_grad = 0;
  for (const auto& [got, want, what] :
       {std::tuple{&grads->dx, &ref->dx, "dx"}, {&grads->drouter, &ref->drouter, "drouter"},
        {&grads->dwi, &ref->dwi, "dwi"}, {&grads->dwo, &ref->dwo, "dwo"}}) {
    const double r = RelDiff(*got, *want);
    worst_grad = std::max(worst_grad, r);
    EXPECT_LE(r, c.grad_bound) << what;
  }
  std::printf("  %-60s y %.2e grads %.2e\n", name.c_str(), ry, worst_grad);
}

TEST(MoeLayerReference, F32MatchesTo1e5) {
  for (unsigned seed : {1u, 2u, 3u}) {
    CheckAgainstReference({{"dtype=float32"}, 1e-5, 1e-5}, seed, 70, 48, 40);
    CheckAgainstReference({{"dtype=float32", "norm_topk_prob=true"}, 1e-5, 1e-5}, seed, 33, 24, 20);
  }
}

TEST(MoeLayerReference, EveryQuantizedModeWithinItsBound) {
  // One bf16 ulp (2^-8) at the largest element is 3.9e-3 of max |y|; a few
  // such flips, or one fp8 step in one of K products, stay below 1e-2. The
  // gradients pass through two more roundings: 2e-2. Observed here (150
  // tokens): y ~1e-6 (5e-4 for fake QAT), gradients ~1e-3 (1e-6 for fp8_full,
  // whose backward GMMs run in f32).
  const double y = 1e-2, g = 2e-2;
  const std::vector<ModeCase> cases = {
      {{}, y, g},
      {{"fp8_moe_fake_quant=true"}, y, g},
      {{"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true"},
       y, g},
      {{"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
        "fp8_moe_native_bwd_dlhs=true", "moe_lhs_quant_block_size=128"},
       y, g},
      {{"quantization=fp8_full", "use_qwix_quantization=true"}, y, g},
      {{"quantization=fp8_full", "use_qwix_quantization=true", "bwd_quantization_dtype=e4m3",
        "moe_bwd_inkernel_quant=true", "wi_tile_drhs_batch_seq=16",
        "wo_tile_drhs_batch_seq=8", "bwd_quantization_calibration_method=fixed,-2,2"},
       y, g},
      {{"quantization=int8"}, y, g},
      {{"quantization=fp8", "weight_quantization_calibration_method=fixed,-0.3,0.3",
        "act_quantization_calibration_method=fixed,-3,3"},
       y, g},
      {{"quantization=nanoo_fp8"}, y, g},
  };
  for (const ModeCase& c : cases) CheckAgainstReference(c, 17, 150, 136, 72);
}

// The routing functions (sigmoid scores, routed_scaling_factor, routing
// groups, norm_topk_prob) in f32 at 1e-5 and with every QAT mode of the
// routed experts within that mode's bound.
TEST(MoeLayerReference, RoutingFunctionsMatchInF32AndEveryQatMode) {
  const std::vector<std::vector<std::string>> routings = {
      {"routed_score_func=sigmoid"},
      {"routed_score_func=sigmoid", "norm_topk_prob=true", "routed_scaling_factor=2.5"},
      {"routed_score_func=sigmoid", "norm_topk_prob=true", "n_routing_groups=2",
       "topk_routing_group=1"},
      {"norm_topk_prob=true", "routed_scaling_factor=0.5"},
      // routed_bias: a random choice bias (with groups).
      {"routed_score_func=sigmoid", "routed_bias=true", "n_routing_groups=2",
       "topk_routing_group=1"}};
  const std::vector<std::vector<std::string>> modes = test::EveryQatMode();
  for (const std::vector<std::string>& routing : routings) {
    std::vector<std::string> f32 = routing;
    f32.push_back("dtype=float32");
    CheckAgainstReference({f32, 1e-5, 1e-5}, 5, 33, 24, 20);
    for (const std::vector<std::string>& mode : modes) {
      std::vector<std::string> flags = routing;
      flags.insert(flags.end(), mode.begin(), mode.end());
      CheckAgainstReference({flags, 1e-2, 2e-2}, 17, 60, 48, 40);
    }
  }
  // The token chunks route each chunk's rows with the same bias (f32: the
  // reference has no chunks, and a QAT mode's chunks change its scaling
  // groups).
  CheckAgainstReference({{"routed_score_func=sigmoid", "routed_bias=true", "norm_topk_prob=true",
                          "num_moe_token_chunks=3", "dtype=float32"},
                         1e-5, 1e-5},
                        5, 33, 24, 20);
}

// MoeWeights::route_bias must be F32 [E] and needs sigmoid scores: a clear
// error naming it before any work, from the layer and from the reference.
TEST(MoeLayerReference, ARouteBiasOfTheWrongShapeOrWithSoftmaxIsAClearError) {
  LayerInputs in(3, 9, 8, 6, 4);
  std::mt19937 rng(1);
  in.bias = LayerInputs::Random(rng, {3}, 0.1f);
  const MoeConfig sigmoid = MakeConfig({"dtype=float32", "num_experts=4",
                                        "routed_score_func=sigmoid", "routed_bias=true"});
  auto fwd = MoeForward(sigmoid, in.x.view(), in.weights());
  ASSERT_FALSE(fwd.ok());
  EXPECT_NE(fwd.status().message().find("route_bias must be F32 [E] = [4]; got [3]"),
            std::string::npos)
      << fwd.status().message();
  EXPECT_FALSE(reference::MoeLayer(sigmoid, in.x.view(), in.weights(), nullptr).ok());
  in.SetBias(3);
  EXPECT_TRUE(MoeForward(sigmoid, in.x.view(), in.weights()).ok());
  fwd = MoeForward(MakeConfig({"dtype=float32", "num_experts=4"}), in.x.view(), in.weights());
  ASSERT_FALSE(fwd.ok());
  EXPECT_NE(fwd.status().message().find("set routed_score_func=sigmoid"), std::string::npos)
      << fwd.status().message();
}

// Gradients of the fast layer (f32 mode) against central differences of the
// reference's f64 loss, on a sample of entries of every input.
TEST(MoeLayerReference, F32GradientsMatchFiniteDifferences) {
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "norm_topk_prob" : "plain");
    std::vector<std::string> flags = {"dtype=float32", "num_experts=4",
                                      "load_balance_loss_weight=0.1"};
    if (norm) flags.push_back("norm_topk_prob=true");
    const MoeConfig cfg = MakeConfig(flags);
    LayerInputs in(23, 9, 8, 6, 4);
    auto fwd = MoeForward(cfg, in.x.view(), in.weights());
    ASSERT_TRUE(fwd.ok());
    auto g = MoeBackward(cfg, in.x.view(), in.weights(), *fwd, in.dy.view());
    ASSERT_TRUE(g.ok());
    ConstTensorView dy = in.dy.view();
    auto loss_of = [&]() {
      auto r = reference::MoeLayer(cfg, in.x.view(), in.weights(), &dy);
      EXPECT_TRUE(r.ok());
      return r->loss;
    };
    auto routing_of = [&]() {
      auto r = reference::MoeLayer(cfg, in.x.view(), in.weights(), nullptr);
      std::vector<int32_t> v(4);
      std::memcpy(v.data(), r->group_sizes.data(), 16);
      return v;
    };
    const auto routing = routing_of();
    std::mt19937 rng(99);
    for (const auto& [param, grad, what] :
         {std::tuple{&in.x, &g->dx, "x"}, {&in.router, &g->drouter, "router"},
          {&in.wi, &g->dwi, "wi"}, {&in.wo, &g->dwo, "wo"}}) {
      const double scale = MaxAbs(*grad);
      for (int s = 0; s < 24; ++s) {
        const size_t i = std::uniform_int_distribution<size_t>(0, param->num_elements() - 1)(rng);
        float& v = param->data_as<float>()[i];
        const float v0 = v;
        const float h = 1e-3f * std::max(1.0f, std::fabs(v0));
        v = v0 + h;
        const double up = loss_of();
        const auto routing_up = routing_of();
        v = v0 - h;
        const double down = loss_of();
        const auto routing_down = routing_of();
        const double step = static_cast<double>(v0 + h) - static_cast<double>(v0 - h);
        v = v0;
        if (routing_up != routing || routing_down != routing) continue;  // a top-k flip
        const double fd = (up - down) / step;
        EXPECT_NEAR(grad->data_as<float>()[i], fd, 1e-4 * scale + 1e-7)
            << what << "[" << i << "]";
      }
    }
  }
}

}  // namespace
}  // namespace fp8moe
