// The MoE layer at the edges of f32 (issue 12, part 1): a gate far below
// the range where sigmoid is representable must give silu(gate) = -0, so
// the layer's output is ~-0 in every mode, not gate * up (the sigmoid used
// to come out 1 there) or NaN.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

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
    const TensorView dyv = dy.view();
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

}  // namespace
}  // namespace fp8moe
