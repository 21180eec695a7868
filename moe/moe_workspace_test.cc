// The step-to-step API of the MoE layer: weights prepared once per step, a
// caller-owned workspace and caller-owned gradients. A reused workspace gives
// the same bits as a fresh one, a steady-state step allocates nothing, and
// FP8 health counts what the quantizer really did.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/memory.h"
#include "fp8moe/moe.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

using test::LayerInputs;
using test::MakeConfig;

// y, dx, drouter, dwi, dwo of one step.
struct StepOut {
  Tensor y, dx, dr, dwi, dwo;
  explicit StepOut(const LayerInputs& in) {
    y = std::move(Tensor::Create(DType::kF32, in.x.shape())).value();
    dx = std::move(Tensor::Create(DType::kF32, in.x.shape())).value();
    dr = std::move(Tensor::Create(DType::kF32, in.router.shape())).value();
    dwi = std::move(Tensor::Create(DType::kF32, in.wi.shape())).value();
    dwo = std::move(Tensor::Create(DType::kF32, in.wo.shape())).value();
  }
  bool SameBits(const StepOut& o) const {
    for (auto [a, b] : {std::pair{&y, &o.y}, {&dx, &o.dx}, {&dr, &o.dr}, {&dwi, &o.dwi},
                        {&dwo, &o.dwo}}) {
      if (std::memcmp(a->data(), b->data(), a->num_bytes()) != 0) return false;
    }
    return true;
  }
};

Status Step(Context& ctx, const MoeConfig& cfg, const LayerInputs& in, PreparedMoeWeights* p,
            MoeWorkspace* ws, StepOut* out, const MoeOptions& o = {}) {
  FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), p));
  MoeStepInfo info;
  FP8MOE_RETURN_IF_ERROR(
      MoeForward(ctx, cfg, in.x.view(), in.weights(), *p, ws, out->y.view(), &info, o));
  return MoeBackward(ctx, cfg, in.x.view(), in.weights(), *p, ws, in.dy.view(),
                     {out->dx.view(), out->dr.view(), out->dwi.view(), out->dwo.view()}, o);
}

using test::Modes;

TEST(MoeWorkspace, ReusedWorkspaceGivesTheBitsOfAFreshOne) {
  LayerInputs a(31, 80, 32, 24, 4), b(32, 80, 32, 24, 4);
  Context ctx;
  for (std::vector<std::string> flags : Modes()) {
    flags.push_back("num_experts=4");
    flags.push_back("ragged_buffer_factor=1.5");
    SCOPED_TRACE(flags[0]);
    const MoeConfig cfg = MakeConfig(flags);
    MoeOptions poison;
    poison.poison_tail_rows = true;
    PreparedMoeWeights p;
    MoeWorkspace ws;
    StepOut out_a(a), out_b(b), fresh_b(b);
    ASSERT_TRUE(Step(ctx, cfg, a, &p, &ws, &out_a, poison).ok());
    ASSERT_TRUE(Step(ctx, cfg, b, &p, &ws, &out_b, poison).ok());
    PreparedMoeWeights p2;
    MoeWorkspace ws2;
    ASSERT_TRUE(Step(ctx, cfg, b, &p2, &ws2, &fresh_b).ok());
    EXPECT_TRUE(out_b.SameBits(fresh_b));
    EXPECT_FALSE(out_a.SameBits(fresh_b));  // the inputs really differ
    // And the one-call API agrees.
    auto f = MoeForward(cfg, b.x.view(), b.weights());
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(0, std::memcmp(f->y.data(), fresh_b.y.data(), f->y.num_bytes()));
  }
}

TEST(MoeWorkspace, SteadyStateStepAllocatesNothing) {
  LayerInputs in(33, 96, 64, 48, 4);
  Context ctx;
  // Every mode, fp8_full with both gradient quantizations included (its
  // quantized-gradient TGMM keeps its codes in ctx.scratch()).
  std::vector<std::vector<std::string>> modes = Modes();
  modes.push_back({"quantization=fp8_full", "use_qwix_quantization=true",
                   "moe_bwd_inkernel_quant=true"});
  for (std::vector<std::string> flags : modes) {
    flags.push_back("num_experts=4");
    SCOPED_TRACE(flags.back() == "" ? "" : flags.size() > 1 ? flags[flags.size() - 2] : "bf16");
    const MoeConfig cfg = MakeConfig(flags);
    PreparedMoeWeights p;
    MoeWorkspace ws;
    StepOut out(in);
    Fp8Health h1, h2;
    // Warm-up: the first step and the first health count size the buffers.
    ASSERT_TRUE(Step(ctx, cfg, in, &p, &ws, &out).ok());
    ASSERT_TRUE(MoeActivationHealth(ctx, cfg, p, &ws, &h1, &h2).ok());
    const int64_t before = GetMemoryStats().allocations;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(Step(ctx, cfg, in, &p, &ws, &out).ok());
      ASSERT_TRUE(MoeActivationHealth(ctx, cfg, p, &ws, &h1, &h2).ok());
    }
    EXPECT_EQ(GetMemoryStats().allocations, before);
  }
}

TEST(MoeWorkspace, WeightHealthCountsSaturatedAndFlushedCodes) {
  LayerInputs in(34, 40, 32, 24, 4);
  Context ctx;
  // Fixed calibration: amax 0.2, so the e4m3fn scale is 0.2 / 448; a weight
  // saturates when |w| / scale rounds to 448 (>= 432, the midpoint to 416,
  // ties to even) and flushes when |w| / scale <= 2^-10 (half the smallest
  // subnormal, the tie going to even 0).
  const MoeConfig cfg = MakeConfig({"num_experts=4", "quantization=fp8",
                                    "weight_quantization_calibration_method=fixed,-0.2,0.2"});
  // Put a few tiny values in, so the flush count is not trivially 0.
  for (int i = 0; i < 37; ++i) in.wi.data_as<float>()[i * 11] = 1e-9f * static_cast<float>(i + 1);
  PreparedMoeWeights p;
  ASSERT_TRUE(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), &p).ok());
  const float scale = 0.2f / 448.0f;
  int64_t sat = 0, flushed = 0;
  const int64_t n = static_cast<int64_t>(in.wi.num_elements());
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::fabs(in.wi.data_as<float>()[i]) / scale;
    sat += r >= 432.0f;
    flushed += in.wi.data_as<float>()[i] != 0.0f && r <= 0x1.0p-10f;
  }
  EXPECT_GT(sat, 10);
  EXPECT_GT(flushed, 5);
  EXPECT_EQ(p.wi.health.values, n);
  EXPECT_DOUBLE_EQ(p.wi.health.saturated, static_cast<double>(sat) / n);
  EXPECT_DOUBLE_EQ(p.wi.health.flushed, static_cast<double>(flushed) / n);
  // Activation health: absmax per row puts exactly one value per row at max
  // unless a row ties; the bf16 modes quantize no activation.
  MoeWorkspace ws;
  Tensor y = std::move(Tensor::Create(DType::kF32, in.x.shape())).value();
  ASSERT_TRUE(MoeForward(ctx, cfg, in.x.view(), in.weights(), p, &ws, y.view(), nullptr).ok());
  Fp8Health hx, ha;
  ASSERT_TRUE(MoeActivationHealth(ctx, cfg, p, &ws, &hx, &ha).ok());
  EXPECT_EQ(hx.values, 40 * 2 * 32);
  EXPECT_GE(hx.saturated * static_cast<double>(hx.values), 80.0);  // >= one per row
  EXPECT_LE(hx.saturated * static_cast<double>(hx.values), 80.0 * 2);
  const MoeConfig none = MakeConfig({"num_experts=4"});
  ASSERT_TRUE(PrepareMoeWeights(ctx, none, in.wi.view(), in.wo.view(), &p).ok());
  EXPECT_EQ(p.wi.health.values, 0);
  ASSERT_TRUE(MoeForward(ctx, none, in.x.view(), in.weights(), p, &ws, y.view(), nullptr).ok());
  ASSERT_TRUE(MoeActivationHealth(ctx, none, p, &ws, &hx, &ha).ok());
  EXPECT_EQ(hx.values, 0);
}

TEST(MoeWorkspace, ForwardRecordsIntoTheContextsMetricsSink) {
  struct Sink : MetricsSink {
    std::vector<std::pair<std::string, double>> got;
    void Record(std::string_view name, double value) override { got.emplace_back(name, value); }
  } sink;
  LayerInputs in(36, 30, 16, 12, 4);
  ContextOptions o;
  o.metrics = &sink;
  Context ctx(o);
  const MoeConfig cfg = MakeConfig({"num_experts=4", "ragged_buffer_factor=0.5"});
  PreparedMoeWeights p;
  ASSERT_TRUE(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), &p).ok());
  MoeWorkspace ws;
  StepOut out(in);
  MoeStepInfo info;
  ASSERT_TRUE(MoeForward(ctx, cfg, in.x.view(), in.weights(), p, &ws, out.y.view(), &info).ok());
  ASSERT_EQ(sink.got.size(), 2u);
  EXPECT_EQ(sink.got[0].first, "moe/aux_loss");
  EXPECT_EQ(sink.got[0].second, info.aux_loss);
  EXPECT_EQ(sink.got[1].first, "moe/dropless_reruns");
  EXPECT_EQ(sink.got[1].second, 1.0);  // half the dropless buffer always overflows
}

TEST(MoeWorkspace, MismatchedPreparationAndMisuseAreErrors) {
  LayerInputs in(35, 20, 16, 12, 4);
  Context ctx;
  const MoeConfig bf16 = MakeConfig({"num_experts=4"});
  const MoeConfig fake = MakeConfig({"num_experts=4", "fp8_moe_fake_quant=true"});
  PreparedMoeWeights p;
  ASSERT_TRUE(PrepareMoeWeights(ctx, bf16, in.wi.view(), in.wo.view(), &p).ok());
  MoeWorkspace ws;
  StepOut out(in);
  Status s = MoeForward(ctx, fake, in.x.view(), in.weights(), p, &ws, out.y.view(), nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("PrepareMoeWeights"), std::string::npos) << s.message();
  // Backward before any forward on this workspace.
  s = MoeBackward(ctx, bf16, in.x.view(), in.weights(), p, &ws, in.dy.view(),
                  {out.dx.view(), out.dr.view(), out.dwi.view(), out.dwo.view()});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("MoeForward"), std::string::npos) << s.message();
  // A gradient buffer of the wrong shape.
  ASSERT_TRUE(MoeForward(ctx, bf16, in.x.view(), in.weights(), p, &ws, out.y.view(), nullptr).ok());
  TensorView bad = out.dwi.view();
  bad.shape = {4, 16, 10};
  s = MoeBackward(ctx, bf16, in.x.view(), in.weights(), p, &ws, in.dy.view(),
                  {out.dx.view(), out.dr.view(), bad, out.dwo.view()});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("dwi"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fp8moe
