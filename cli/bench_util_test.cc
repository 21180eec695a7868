// MergeCeilings: the bookkeeping of the benches' second ceiling measurement
// (the measuring itself depends on the machine and is covered by
// tests/python/test_bench.py).
#include "cli/bench_util.h"

#include "gtest/gtest.h"

namespace fp8moe::bench {
namespace {

MachineCeilings Ceilings(std::vector<double> gops, double core_ghz, double read, double copy) {
  MachineCeilings c;
  c.peaks.threads = 2;
  c.peaks.core_ghz = core_ghz;
  c.peaks.tsc_ghz = 2.6;
  for (int k = 0; k < static_cast<int>(PeakKind::kCount); ++k) {
    Peak p;
    p.kind = static_cast<PeakKind>(k);
    p.gops = gops[static_cast<size_t>(k)];
    p.ops_per_cycle = p.gops > 0 ? p.gops / (core_ghz * 2) : 0;
    c.peaks.peaks.push_back(p);
  }
  c.read_gbs = read;
  c.memcpy_gbs = copy;
  c.measurements = 1;
  return c;
}

TEST(MergeCeilings, KeepsTheHigherOfEachAndNamesMovesOverTenPercent) {
  // f32 FMA disturbed at the start (264 then 500), bf16 dot 3% apart, the
  // int8 peaks unavailable in both, the read faster at the start.
  MachineCeilings kept = Ceilings({264, 1000, 880, 0, 0}, 3.9, 75, 70);
  const MachineCeilings again = Ceilings({500, 1030, 870, 0, 0}, 4.0, 50, 69);
  MergeCeilings(&kept, again);
  EXPECT_EQ(kept.peaks.Get(PeakKind::kF32Fma).gops, 500);
  EXPECT_EQ(kept.peaks.Get(PeakKind::kBf16Dot).gops, 1030);
  EXPECT_EQ(kept.peaks.Get(PeakKind::kInt16Pairs).gops, 880);
  EXPECT_EQ(kept.peaks.Get(PeakKind::kInt16Vnni).gops, 0);
  EXPECT_EQ(kept.read_gbs, 75);
  EXPECT_EQ(kept.memcpy_gbs, 70);
  EXPECT_EQ(kept.measurements, 2);
  ASSERT_EQ(kept.moved.size(), 2u);
  EXPECT_EQ(kept.moved[0], "f32_fma 264.0 then 500.0 GFLOP/s");
  EXPECT_EQ(kept.moved[1], "streaming read 75.0 then 50.0 GB/s");
}

TEST(MergeCeilings, ClockFollowsTheKeptFmaPeakAndOpsPerCycleFollowTheClock) {
  // f32 FMA from the second measurement: its clock comes with it.
  MachineCeilings kept = Ceilings({400, 900, 800, 0, 0}, 3.0, 50, 40);
  MergeCeilings(&kept, Ceilings({500, 800, 700, 0, 0}, 4.0, 50, 40));
  EXPECT_EQ(kept.peaks.core_ghz, 4.0);
  for (const Peak& p : kept.peaks.peaks) {
    EXPECT_DOUBLE_EQ(p.ops_per_cycle, p.gops > 0 ? p.gops / (4.0 * 2) : 0.0) << PeakName(p.kind);
  }
  // f32 FMA from the first: its clock stays, even when the second's is higher.
  kept = Ceilings({500, 900, 800, 0, 0}, 3.5, 50, 40);
  MergeCeilings(&kept, Ceilings({470, 950, 760, 0, 0}, 4.2, 50, 40));
  EXPECT_EQ(kept.peaks.core_ghz, 3.5);
  EXPECT_EQ(kept.peaks.Get(PeakKind::kBf16Dot).gops, 950);
  EXPECT_DOUBLE_EQ(kept.peaks.Get(PeakKind::kBf16Dot).ops_per_cycle, 950 / (3.5 * 2));
  EXPECT_TRUE(kept.moved.empty());  // every move within 10%
}

}  // namespace
}  // namespace fp8moe::bench
