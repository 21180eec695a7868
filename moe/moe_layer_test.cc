// The fast MoE layer: what its GMMs are handed in every scheme (docs/design.md §4.1),
// the bit-identities docs/design.md promises (native dLHS vs fake-QAT dLHS, thread
// counts, remat policy, buffer policy), and clear errors. The comparison with
// the dense reference and with finite differences is moe_layer_reference_test.cc.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

TEST(MoeLayer, SchemeToGmmDtypes) {
  struct Case {
    std::vector<std::string> flags;
    std::optional<QuantDType> lhs, rhs;
  };
  const std::vector<Case> cases = {
      {{"quantization=fp8"}, QuantDType::kE4M3FN, QuantDType::kE4M3FN},
      {{"quantization=nanoo_fp8"}, QuantDType::kE4M3FNUZ, QuantDType::kE4M3FNUZ},
      {{"quantization=int8"}, QuantDType::kInt8, QuantDType::kInt8},
      {{}, std::nullopt, std::nullopt},
      {{"quantization=fp8", "use_qwix_quantization=true"}, std::nullopt, std::nullopt},
      {{"quantization=int8", "use_qwix_quantization=true"}, std::nullopt, std::nullopt},
  };
  LayerInputs in(/*seed=*/5, 40, 16, 12, 4);
  for (const Case& c : cases) {
    std::vector<std::string> flags = c.flags;
    flags.push_back("num_experts=4");
    const MoeConfig cfg = MakeConfig(flags);
    std::vector<MoeGmmCall> calls;
    MoeOptions o;
    o.on_gmm = [&](const MoeGmmCall& call) { calls.push_back(call); };
    auto f = MoeForward(cfg, in.x.view(), in.weights(), o);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_EQ(calls.size(), 2u);
    for (const MoeGmmCall& call : calls) {
      SCOPED_TRACE(call.name + " for " + (c.flags.empty() ? "unquantized" : c.flags[0]) +
                   (c.flags.size() > 1 ? " " + c.flags[1] : ""));
      EXPECT_EQ(call.lhs_quant, c.lhs);
      EXPECT_EQ(call.rhs_quant, c.rhs);
    }
    EXPECT_EQ(calls[0].name, "wi_fwd");
    EXPECT_EQ(calls[1].name, "wo_fwd");
  }
}

// All of a forward + backward's outputs, for bit comparisons.
struct Outputs {
  std::vector<Tensor> t;
  float aux = 0;
  bool operator==(const Outputs& o) const {
    if (aux != o.aux || t.size() != o.t.size()) return false;
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i].num_bytes() != o.t[i].num_bytes() ||
          std::memcmp(t[i].data(), o.t[i].data(), t[i].num_bytes()) != 0) {
        return false;
      }
    }
    return true;
  }
};

Outputs RunLayer(const MoeConfig& cfg, const LayerInputs& in, MoeStats* stats = nullptr,
            const MoeOptions& o = {}) {
  Outputs out;
  auto f = MoeForward(cfg, in.x.view(), in.weights(), o);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return out;
  auto g = MoeBackward(cfg, in.x.view(), in.weights(), *f, in.dy.view(), o);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  if (!g.ok()) return out;
  if (stats != nullptr) *stats = f->stats;
  out.aux = f->aux_loss;
  out.t.push_back(std::move(f->y));
  out.t.push_back(std::move(f->group_sizes));
  out.t.push_back(std::move(g->dx));
  out.t.push_back(std::move(g->drouter));
  out.t.push_back(std::move(g->dwi));
  out.t.push_back(std::move(g->dwo));
  return out;
}

TEST(MoeLayer, NativeDlhsIsBitIdenticalToFakeQatDlhs) {
  LayerInputs in(7, 96, 64, 48, 4);
  const std::vector<std::string> native = {"num_experts=4", "fp8_moe_fake_quant=true",
                                           "fp8_fake_quant_hoist=gather8",
                                           "fp8_moe_native_fwd=true"};
  std::vector<std::string> with_dlhs = native;
  with_dlhs.push_back("fp8_moe_native_bwd_dlhs=true");
  std::vector<std::string> calls;
  MoeOptions o;
  o.on_gmm = [&](const MoeGmmCall& c) { calls.push_back(c.name + ":" + std::string(GmmModeName(c.mode))); };
  const Outputs a = RunLayer(MakeConfig(native), in, nullptr, o);
  const Outputs b = RunLayer(MakeConfig(with_dlhs), in, nullptr, o);
  EXPECT_TRUE(a == b);
  // The two runs really took different dLHS paths: BF16 copy vs codes.
  EXPECT_NE(std::find(calls.begin(), calls.end(), "wi_dlhs:fake_qat"), calls.end());
  EXPECT_NE(std::find(calls.begin(), calls.end(), "wi_dlhs:bf16"), calls.end());
}

const std::vector<std::vector<std::string>>& AllModes() {
  static const std::vector<std::vector<std::string>> modes = {
      {"dtype=float32"},
      {},
      {"fp8_moe_fake_quant=true"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
       "moe_lhs_quant_block_size=128"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
       "fp8_moe_native_bwd_dlhs=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true", "moe_bwd_inkernel_quant=true",
       "bwd_quantization_dtype=e4m3", "wi_tile_drhs_batch_seq=16"},
      {"quantization=int8"},
      {"quantization=fp8", "weight_quantization_calibration_method=fixed,-0.2,0.2"},
      {"quantization=nanoo_fp8"},
  };
  return modes;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s.empty() ? "bf16" : s;
}

TEST(MoeLayer, BitsDoNotDependOnThreadsRematOrBufferPolicy) {
  LayerInputs in(9, 150, 64, 48, 4);
  const int saved = omp_get_max_threads();
  for (std::vector<std::string> flags : AllModes()) {
    SCOPED_TRACE(Join(flags));
    flags.push_back("num_experts=4");
    omp_set_num_threads(1);
    const Outputs base = RunLayer(MakeConfig(flags), in);
    omp_set_num_threads(std::max(2, saved));
    EXPECT_TRUE(RunLayer(MakeConfig(flags), in) == base) << "thread count changed the bits";
    std::vector<std::string> remat = flags;
    remat.push_back("remat_policy=moe_x_sorted");
    EXPECT_TRUE(RunLayer(MakeConfig(remat), in) == base) << "remat policy changed the bits";
    // A static buffer twice the balanced size has tail rows; poison them.
    std::vector<std::string> big = flags;
    big.push_back("ragged_buffer_factor=2.0");
    MoeOptions poison;
    poison.poison_tail_rows = true;
    MoeStats stats;
    EXPECT_TRUE(RunLayer(MakeConfig(big), in, &stats, poison) == base) << "tail rows leaked";
    EXPECT_EQ(stats.buffer_rows, 2 * stats.valid_rows);
    EXPECT_EQ(stats.dropless_reruns, 0);
    // A buffer too small for the routing reruns on the dropless buffer.
    std::vector<std::string> small = flags;
    small.push_back("ragged_buffer_factor=0.5");
    EXPECT_TRUE(RunLayer(MakeConfig(small), in, &stats) == base) << "overflow rerun differs";
    EXPECT_EQ(stats.dropless_reruns, 1);
    EXPECT_EQ(stats.buffer_rows, stats.valid_rows);
  }
  omp_set_num_threads(saved);
}

TEST(MoeLayer, FixedCalibrationMasksClippedWeights) {
  LayerInputs in(13, 60, 32, 24, 4);
  const float clip = 0.2f;
  auto f = MoeForward(MakeConfig({"num_experts=4", "quantization=fp8",
                                  "weight_quantization_calibration_method=fixed,-0.2,0.2"}),
                      in.x.view(), in.weights());
  ASSERT_TRUE(f.ok());
  auto g = MoeBackward(MakeConfig({"num_experts=4", "quantization=fp8",
                                   "weight_quantization_calibration_method=fixed,-0.2,0.2"}),
                       in.x.view(), in.weights(), *f, in.dy.view());
  ASSERT_TRUE(g.ok());
  int clipped = 0, kept_nonzero = 0;
  for (const auto& [w, dw] : {std::pair{&in.wi, &g->dwi}, std::pair{&in.wo, &g->dwo}}) {
    for (size_t i = 0; i < w->num_elements(); ++i) {
      if (std::fabs(w->data_as<float>()[i]) > clip) {
        ++clipped;
        ASSERT_EQ(dw->data_as<float>()[i], 0.0f);
      } else if (dw->data_as<float>()[i] != 0.0f) {
        ++kept_nonzero;
      }
    }
  }
  EXPECT_GT(clipped, 10);  // the test weights do cross the clip range
  EXPECT_GT(kept_nonzero, 100);
}

TEST(MoeLayer, BadInputsAreClearErrors) {
  LayerInputs in(3, 10, 8, 6, 4);
  const MoeConfig cfg = MakeConfig({"num_experts=4"});
  auto expect = [](const Status& s, const char* needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  MoeWeights w = in.weights();
  w.router.shape = {8, 3};
  expect(MoeForward(cfg, in.x.view(), w).status(), "num_experts");
  w = in.weights();
  w.wo.shape = {4, 5, 8};
  expect(MoeForward(cfg, in.x.view(), w).status(), "wo must be");
  expect(MoeForward(MakeConfig({"num_experts=5"}), in.x.view(), in.weights()).status(),
         "num_experts");
  auto f = MoeForward(cfg, in.x.view(), in.weights());
  ASSERT_TRUE(f.ok());
  ConstTensorView dy = in.dy.view();
  dy.shape = {9, 8};
  expect(MoeBackward(cfg, in.x.view(), in.weights(), *f, dy).status(), "dy must be");
  MoeForwardResult empty;
  expect(MoeBackward(cfg, in.x.view(), in.weights(), empty, in.dy.view()).status(),
         "MoeForward");
}

}  // namespace
}  // namespace fp8moe
