#include "bench/openblas_core.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fp8moe::bench {
namespace {

CpuIsa Sse() { return {}; }
CpuIsa Avx() {
  CpuIsa c;
  c.avx = true;
  return c;
}
CpuIsa IntelAvx2() {
  CpuIsa c = Avx();
  c.avx2 = c.fma = true;
  return c;
}
CpuIsa Zen3() {
  CpuIsa c = IntelAvx2();
  c.amd = true;
  return c;
}
CpuIsa Skx() {  // AVX-512 F/BW/DQ/VL, no BF16 (the AVX3 Xeon of issue 12)
  CpuIsa c = IntelAvx2();
  c.avx512f = c.avx512bw = c.avx512dq = c.avx512vl = true;
  return c;
}
CpuIsa Spr() {
  CpuIsa c = Skx();
  c.avx512bf16 = true;
  return c;
}
CpuIsa Zen4() {
  CpuIsa c = Spr();
  c.amd = true;
  return c;
}
CpuIsa Knl() {  // AVX-512F without BW/DQ/VL: OpenBLAS's SkylakeX kernels need VL
  CpuIsa c = IntelAvx2();
  c.avx512f = true;
  return c;
}

TEST(OpenBlasCore, TierOfCpu) {
  EXPECT_EQ(TierOf(Sse()), IsaTier::kSse);
  EXPECT_EQ(TierOf(Avx()), IsaTier::kAvx);
  EXPECT_EQ(TierOf(Zen3()), IsaTier::kAvx2);
  EXPECT_EQ(TierOf(Knl()), IsaTier::kAvx2);
  EXPECT_EQ(TierOf(Skx()), IsaTier::kAvx512);
  CpuIsa avx2_no_fma = IntelAvx2();
  avx2_no_fma.fma = false;
  EXPECT_EQ(TierOf(avx2_no_fma), IsaTier::kAvx);
}

TEST(OpenBlasCore, CoreNames) {
  IsaTier t;
  ASSERT_TRUE(CoreTier("Prescott", &t));
  EXPECT_EQ(t, IsaTier::kSse);
  ASSERT_TRUE(CoreTier("haswell", &t));  // OpenBLAS compares case-insensitively
  EXPECT_EQ(t, IsaTier::kAvx2);
  ASSERT_TRUE(CoreTier("Cooperlake", &t));
  EXPECT_EQ(t, IsaTier::kAvx512);
  ASSERT_TRUE(CoreTier("Excavator", &t));
  EXPECT_EQ(t, IsaTier::kAvx);
  EXPECT_FALSE(CoreTier("Unknown", &t));
  EXPECT_FALSE(CoreTier("Zen5", &t));
  EXPECT_FALSE(CoreTier("", &t));
}

struct Case {
  const char* what;
  const char* core;
  CpuIsa cpu;
  bool fallback;
  std::vector<std::string> coretypes;
};

TEST(OpenBlasCore, AdviceTable) {
  const std::vector<Case> cases = {
      // The generic core on the CPUs it is a fallback for.
      {"Prescott on Zen 3", "Prescott", Zen3(), true, {"Zen", "Haswell"}},
      {"Prescott on Intel AVX2", "Prescott", IntelAvx2(), true, {"Haswell"}},
      {"Prescott on AVX3 Xeon", "Prescott", Skx(), true, {"SkylakeX"}},
      {"Prescott on AVX3_SPR", "Prescott", Spr(), true, {"Cooperlake", "SkylakeX"}},
      {"Core2 on Intel AVX2", "Core2", IntelAvx2(), true, {"Haswell"}},
      {"Nehalem on AVX3 Xeon", "Nehalem", Skx(), true, {"SkylakeX"}},
      {"Sandybridge on Intel AVX2", "Sandybridge", IntelAvx2(), true, {"Haswell"}},
      {"Haswell on AVX3 Xeon", "Haswell", Skx(), true, {"SkylakeX"}},
      {"Zen on Zen 4", "Zen", Zen4(), true, {"Cooperlake", "SkylakeX"}},
      {"Excavator on Zen 3", "Excavator", Zen3(), true, {"Zen", "Haswell"}},
      {"Prescott on AVX-only", "Prescott", Avx(), true, {"Sandybridge"}},
      // The right core for the CPU.
      {"Zen on Zen 3", "Zen", Zen3(), false, {}},
      {"Haswell on Zen 3", "Haswell", Zen3(), false, {}},
      {"Haswell on Intel AVX2", "Haswell", IntelAvx2(), false, {}},
      {"Haswell on KNL-like", "Haswell", Knl(), false, {}},
      {"SkylakeX on AVX3 Xeon", "SkylakeX", Skx(), false, {}},
      {"Cooperlake on AVX3_SPR", "Cooperlake", Spr(), false, {}},
      {"SkylakeX on AVX3_SPR", "SkylakeX", Spr(), false, {}},
      {"SapphireRapids on AVX3_SPR", "SapphireRapids", Spr(), false, {}},
      {"Sandybridge on AVX-only", "Sandybridge", Avx(), false, {}},
      {"Prescott on SSE-only", "Prescott", Sse(), false, {}},
      // A core this CPU cannot run (forced by OPENBLAS_CORETYPE).
      {"SkylakeX on Zen 3", "SkylakeX", Zen3(), true, {"Zen", "Haswell"}},
      // Names the table does not know are never trusted.
      {"Unknown on Zen 3", "Unknown", Zen3(), true, {"Zen", "Haswell"}},
      {"Unknown on SSE-only", "Unknown", Sse(), true, {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const CoreAdvice a = AdviseCore(c.core, c.cpu);
    EXPECT_EQ(a.fallback, c.fallback) << a.why;
    EXPECT_EQ(a.coretypes, c.coretypes) << a.why;
    EXPECT_NE(a.why.find(c.core), std::string::npos) << a.why;
  }
}

// Under --simd below the CPU the ceiling is OpenBLAS's kernels of that
// class: the loaded AVX-512 core is then above the target and a child runs
// the target's cores.
TEST(OpenBlasCore, SimdTargetBelowTheCpuCapsItsClass) {
  const CpuIsa spr_avx2 = CapToSimdTarget(Spr(), "AVX2");
  EXPECT_EQ(TierOf(spr_avx2), IsaTier::kAvx2);
  EXPECT_EQ(spr_avx2.target, "AVX2");
  const CoreAdvice a = AdviseCore("SkylakeX", spr_avx2);
  EXPECT_TRUE(a.fallback);
  EXPECT_EQ(a.coretypes, std::vector<std::string>{"Haswell"});
  EXPECT_NE(a.why.find("--simd AVX2"), std::string::npos) << a.why;
  EXPECT_FALSE(AdviseCore("Haswell", spr_avx2).fallback);
  EXPECT_EQ(AdviseCore("Prescott", CapToSimdTarget(Zen4(), "AVX2")).coretypes,
            (std::vector<std::string>{"Zen", "Haswell"}));
  // AVX3 keeps AVX-512 (SkylakeX only); AVX3_SPR and the CPU's own class cap nothing.
  const CpuIsa spr_avx3 = CapToSimdTarget(Spr(), "AVX3");
  EXPECT_EQ(TierOf(spr_avx3), IsaTier::kAvx512);
  EXPECT_TRUE(spr_avx3.target.empty());
  EXPECT_FALSE(AdviseCore("SkylakeX", spr_avx3).fallback);
  EXPECT_TRUE(CapToSimdTarget(Spr(), "AVX3_SPR").target.empty());
  EXPECT_TRUE(CapToSimdTarget(Zen3(), "AVX2").target.empty());
  EXPECT_FALSE(AdviseCore("Zen", CapToSimdTarget(Zen3(), "AVX2")).fallback);
  // SSE4 and below: no AVX core is a ceiling, and none is offered.
  const CpuIsa sse = CapToSimdTarget(Zen3(), "SSE4");
  EXPECT_EQ(TierOf(sse), IsaTier::kSse);
  EXPECT_TRUE(AdviseCore("Zen", sse).fallback);
  EXPECT_TRUE(AdviseCore("Zen", sse).coretypes.empty());
}

// Every advised core runs kernels of the CPU's own tier.
TEST(OpenBlasCore, AdvisedCoresMatchTheCpu) {
  for (const CpuIsa& cpu : {Sse(), Avx(), IntelAvx2(), Zen3(), Knl(), Skx(), Spr(), Zen4()}) {
    for (const std::string& name : AdviseCore("Prescott", cpu).coretypes) {
      IsaTier t;
      ASSERT_TRUE(CoreTier(name, &t)) << name;
      EXPECT_EQ(t, TierOf(cpu)) << name;
      EXPECT_FALSE(AdviseCore(name, cpu).fallback) << name;
    }
  }
}

}  // namespace
}  // namespace fp8moe::bench
