// MergeCeilings: the bookkeeping of the benches' second ceiling measurement
// (the measuring itself depends on the machine and is covered by
// tests/python/test_bench.py); PairedRatioInterval: the statistics of the
// ratios between modes timed in the same rounds; RandomF32 and ToBf16: the
// operands of bench gmm and bench moe.
#include "bench/bench_util.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "fp8moe/numerics.h"

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

// Round times whose ratios a[r] / b[r] are `ratios` (b = 1 + r / 10, so that
// sorting a or b alone would pair the rounds differently).
void RoundsWithRatios(const std::vector<double>& ratios, std::vector<double>* a,
                      std::vector<double>* b) {
  a->clear();
  b->clear();
  for (size_t r = 0; r < ratios.size(); ++r) {
    b->push_back(1.0 + static_cast<double>((r * 7) % ratios.size()) / 10.0);
    a->push_back(ratios[r] * b->back());
  }
}

TEST(PairedRatioInterval, OrderStatisticsOfTheSignTestTable) {
  // n -> k of the interval [x_(k), x_(n+1-k)] and its coverage
  // 1 - 2 P(Binomial(n, 1/2) <= k - 1), from the standard table of
  // distribution-free confidence intervals for a median (95%).
  struct Case {
    int n, k;
    double coverage;
  };
  for (const Case c : {Case{6, 1, 0.96875}, Case{8, 1, 0.9921875}, Case{9, 2, 0.9609375},
                       Case{10, 2, 0.978515625}, Case{12, 3, 0.96142578125},
                       Case{15, 4, 0.96484375}, Case{20, 6, 0.95861053466796875},
                       Case{41, 14, 0.97246684417041}, Case{100, 40, 0.9647997997822952}}) {
    std::vector<double> ratios(static_cast<size_t>(c.n)), a, b;
    // Distinct ratios in a shuffled order (no n is a multiple of 13):
    // x_(i) = 0.9 + i / 1000.
    for (int i = 0; i < c.n; ++i) ratios[static_cast<size_t>((i * 13 + 5) % c.n)] = 0.9 + (i + 1) / 1000.0;
    RoundsWithRatios(ratios, &a, &b);
    const RatioInterval r = PairedRatioInterval(a, b);
    EXPECT_EQ(r.rounds, c.n);
    EXPECT_NEAR(r.low, 0.9 + c.k / 1000.0, 1e-12) << "n = " << c.n;
    EXPECT_NEAR(r.high, 0.9 + (c.n + 1 - c.k) / 1000.0, 1e-12) << "n = " << c.n;
    EXPECT_NEAR(r.coverage, c.coverage, 1e-12) << "n = " << c.n;
    const double mid = c.n % 2 ? 0.9 + (c.n + 1) / 2 / 1000.0 : 0.9 + (c.n + 1) / 2000.0;
    EXPECT_NEAR(r.median, mid, 1e-12) << "n = " << c.n;
    EXPECT_EQ(r.verdict, "faster");  // every ratio below 1
  }
}

TEST(PairedRatioInterval, FewRoundsGiveTheRangeWithItsLowerCoverage) {
  std::vector<double> a, b;
  RoundsWithRatios({1.02, 0.97, 1.05, 0.99, 1.01}, &a, &b);
  RatioInterval r = PairedRatioInterval(a, b);
  EXPECT_NEAR(r.low, 0.97, 1e-12);
  EXPECT_NEAR(r.high, 1.05, 1e-12);
  EXPECT_NEAR(r.median, 1.01, 1e-12);
  EXPECT_DOUBLE_EQ(r.coverage, 1.0 - 2.0 / 32.0);
  EXPECT_EQ(r.verdict, "parity");
  RoundsWithRatios({1.2}, &a, &b);
  r = PairedRatioInterval(a, b);
  EXPECT_EQ(r.rounds, 1);
  EXPECT_NEAR(r.low, 1.2, 1e-12);
  EXPECT_NEAR(r.high, 1.2, 1e-12);
  EXPECT_EQ(r.coverage, 0.0);  // one round says nothing about the noise
  EXPECT_EQ(PairedRatioInterval({}, {}).rounds, 0);
}

TEST(PairedRatioInterval, RatiosAreTakenRoundByRound) {
  // Round by round: 0.5, 2, 1 (median 1). Best against best would be 1 / 1.
  const RatioInterval r = PairedRatioInterval({1, 2, 3}, {2, 1, 3});
  EXPECT_DOUBLE_EQ(r.median, 1.0);
  EXPECT_DOUBLE_EQ(r.low, 0.5);
  EXPECT_DOUBLE_EQ(r.high, 2.0);
}

TEST(PairedRatioInterval, VerdictNeedsTheWholeIntervalOnOneSide) {
  std::vector<double> a, b;
  // 15 rounds: the interval is [x_(4), x_(12)].
  std::vector<double> ratios = {1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08,
                                1.09, 1.10, 1.11, 1.12, 1.13, 1.14, 1.15};
  RoundsWithRatios(ratios, &a, &b);
  EXPECT_EQ(PairedRatioInterval(a, b).verdict, "slower");
  // Three rounds below 1 still leave x_(4) above 1: slower.
  ratios[0] = 0.9;
  ratios[1] = 0.95;
  ratios[2] = 0.97;
  RoundsWithRatios(ratios, &a, &b);
  EXPECT_EQ(PairedRatioInterval(a, b).verdict, "slower");
  // A fourth: x_(4) = 0.99, the interval holds 1.
  ratios[3] = 0.99;
  RoundsWithRatios(ratios, &a, &b);
  const RatioInterval r = PairedRatioInterval(a, b);
  EXPECT_EQ(r.verdict, "parity");
  EXPECT_EQ(DescribeInterval(r), "1.080 median of 15 rounds' ratios, 96.4% interval 0.990-1.120: parity");
  const nlohmann::json j = IntervalJson(r);
  EXPECT_EQ(j["verdict"], "parity");
  EXPECT_EQ(j["rounds"], 15);
  EXPECT_DOUBLE_EQ(j["low"].get<double>(), r.low);
}

TEST(SecondsInterleaved, WarmsUpOnceThenTimesEveryFunctionEachRound) {
  std::vector<int> calls(3, 0);
  std::vector<std::function<void()>> fns;
  for (int i = 0; i < 3; ++i) fns.push_back([&calls, i] { ++calls[static_cast<size_t>(i)]; });
  const auto seconds = SecondsInterleaved(4, fns);
  ASSERT_EQ(seconds.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(calls[static_cast<size_t>(i)], 5);
    EXPECT_EQ(seconds[static_cast<size_t>(i)].size(), 4u);
  }
  const std::vector<double> best = BestSecondsInterleaved(2, fns);
  EXPECT_EQ(best.size(), 3u);
  EXPECT_EQ(calls[0], 8);
}

TEST(RandomF32, SameSeedSameValuesDrawnWithTheAskedSpread) {
  std::mt19937 a(7), b(7);
  const Tensor x = RandomF32(a, {64, 96}, 0.03f), y = RandomF32(b, {64, 96}, 0.03f);
  ASSERT_EQ(x.dtype(), DType::kF32);
  ASSERT_EQ(x.shape(), (Shape{64, 96}));
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.num_elements() * 4), 0);
  double sum = 0, sum2 = 0;
  for (size_t i = 0; i < x.num_elements(); ++i) {
    const double v = x.data_as<float>()[i];
    sum += v;
    sum2 += v * v;
  }
  const double n = static_cast<double>(x.num_elements());
  EXPECT_NEAR(sum / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(sum2 / n - (sum / n) * (sum / n)), 0.03, 0.0015);
  // The next draw goes on from where the last one stopped.
  const Tensor z = RandomF32(a, {64, 96}, 0.03f);
  EXPECT_NE(std::memcmp(x.data(), z.data(), x.num_elements() * 4), 0);
}

TEST(ToBf16, EveryElementRoundedToNearestEvenInItsPlace) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> values = {1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -0.0f, inf, -inf,
                                     1e-40f, -1e30f, 3.14159f, std::nanf("")};
  // 1 + 2^-8 is a tie that rounds to the even 1.0; 1 + 3 * 2^-8 one that
  // rounds up to 1 + 2^-6.
  const std::vector<uint16_t> expected = {0x3F80, 0x3F80, 0x3F82, 0x8000, 0x7F80, 0xFF80};
  Tensor f = MustCreate(DType::kF32, {2, 5});
  std::memcpy(f.data(), values.data(), values.size() * 4);
  const Tensor b = ToBf16(f);
  ASSERT_EQ(b.dtype(), DType::kBF16);
  ASSERT_EQ(b.shape(), (Shape{2, 5}));
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t got = b.data_as<uint16_t>()[i];
    if (i < expected.size()) {
      EXPECT_EQ(got, expected[i]) << i;
    }
    EXPECT_EQ(got, F32ToBf16(values[i])) << i;
  }
}

}  // namespace
}  // namespace fp8moe::bench
