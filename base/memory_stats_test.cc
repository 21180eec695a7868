// Memory accounting (base/memory.cc) and the scratch arena's kept objects:
// in use, high-water mark, allocation count, from many threads at once.
#include <omp.h>

#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "base/scratch_arena.h"
#include "fp8moe/context.h"
#include "fp8moe/memory.h"
#include "fp8moe/tensor.h"

namespace fp8moe {
namespace {

TEST(Memory, InUsePeakAndAllocations) {
  const MemoryStats s0 = GetMemoryStats();
  internal::TrackAllocation(1000);
  internal::TrackAllocation(500);
  MemoryStats s = GetMemoryStats();
  EXPECT_EQ(s.in_use, s0.in_use + 1500);
  EXPECT_GE(s.peak, s0.in_use + 1500);
  EXPECT_EQ(s.allocations, s0.allocations + 2);
  internal::TrackRelease(1000);
  s = GetMemoryStats();
  EXPECT_EQ(s.in_use, s0.in_use + 500);
  EXPECT_GE(s.peak, s0.in_use + 1500) << "the peak stays after a release";
  ResetMemoryPeak();
  EXPECT_EQ(GetMemoryStats().peak, s0.in_use + 500) << "a new peak starts at the current use";
  internal::TrackRelease(500);
  EXPECT_EQ(GetMemoryStats().in_use, s0.in_use);
  EXPECT_EQ(GetMemoryStats().allocations, s0.allocations + 2) << "releases are not allocations";
}

TEST(Memory, TensorsAreCounted) {
  const MemoryStats s0 = GetMemoryStats();
  {
    auto t = Tensor::Create(DType::kF32, {10, 10});
    ASSERT_TRUE(t.ok());
    EXPECT_GE(GetMemoryStats().in_use, s0.in_use + 400);
    EXPECT_EQ(GetMemoryStats().allocations, s0.allocations + 1);
  }
  EXPECT_EQ(GetMemoryStats().in_use, s0.in_use);
}

TEST(Memory, ConcurrentTrackingLosesNothing) {
  const MemoryStats s0 = GetMemoryStats();
  constexpr int kThreads = 4, kEach = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < kEach; ++i) internal::TrackAllocation(8);
      for (int i = 0; i < kEach; ++i) internal::TrackRelease(8);
    });
  }
  for (auto& t : threads) t.join();
  const MemoryStats s = GetMemoryStats();
  EXPECT_EQ(s.in_use, s0.in_use);
  EXPECT_EQ(s.allocations, s0.allocations + kThreads * kEach);
  EXPECT_LE(s.peak, s0.in_use + 8 * kThreads * kEach);
  EXPECT_GE(s.peak, s0.in_use + 8);
}

// Objects kept by the arena survive calls (their vectors keep capacity),
// one per type, and are destroyed by Release.
TEST(ScratchArena, ObjectsAreKeptPerTypeUntilRelease) {
  internal::ScratchArena a;
  std::vector<int>& v = a.Object<std::vector<int>>();
  v.assign(100, 7);
  const int* data = v.data();
  EXPECT_EQ(&a.Object<std::vector<int>>(), &v);
  EXPECT_EQ(a.Object<std::vector<int>>().data(), data);
  std::vector<double>& d = a.Object<std::vector<double>>();
  EXPECT_NE(static_cast<void*>(&d), static_cast<void*>(&v));
  EXPECT_TRUE(d.empty());
  a.Release();
  EXPECT_TRUE(a.Object<std::vector<int>>().empty()) << "Release destroys the objects";
}

// threads = 0 follows OpenMP's setting at each call, so omp_set_num_threads
// still steers callers that use the default context.
TEST(ContextThreads, ZeroFollowsOpenMP) {
  Context ctx;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  EXPECT_EQ(ctx.threads(), 3);
  omp_set_num_threads(1);
  EXPECT_EQ(ctx.threads(), 1);
  omp_set_num_threads(saved);
  ContextOptions o;
  o.threads = 2;
  EXPECT_EQ(Context(o).threads(), 2);
}

}  // namespace
}  // namespace fp8moe
