// CoreShare: the thread-count rule, and a measurement that sees another
// process's busy core but not this process's own threads.
#include "base/core_share.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <time.h>

#include <gtest/gtest.h>

#if defined(__linux__)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace fp8moe::internal {
namespace {

TEST(CoreShare, ThreadsAreTheFreeCoresAndCapped) {
  EXPECT_EQ(ThreadsForFreeCores(2, 0.0, 2), 2);
  EXPECT_EQ(ThreadsForFreeCores(2, 0.44, 2), 2);  // light background work
  EXPECT_EQ(ThreadsForFreeCores(2, 0.45, 2), 1);  // a busy process sharing a core
  EXPECT_EQ(ThreadsForFreeCores(2, 0.67, 2), 1);
  EXPECT_EQ(ThreadsForFreeCores(2, 1.0, 2), 1);
  EXPECT_EQ(ThreadsForFreeCores(2, 5.0, 2), 1);   // never below 1
  EXPECT_EQ(ThreadsForFreeCores(16, 3.2, 16), 13);
  EXPECT_EQ(ThreadsForFreeCores(16, 3.5, 16), 12);
  EXPECT_EQ(ThreadsForFreeCores(16, 0.0, 4), 4);  // never above the maximum
  EXPECT_EQ(ThreadsForFreeCores(16, 3.2, 0), 1);  // a maximum below 1 means 1
  EXPECT_EQ(ThreadsForFreeCores(2, -0.01, 2), 2);
  EXPECT_EQ(ThreadsForFreeCores(2, std::nan(""), 2), 2);
}

TEST(CoreShare, StartsAtTheMaximumAndWaitsForAWindow) {
  CoreShare share(3, /*window_seconds=*/3600.0);
  EXPECT_EQ(share.threads(), 3);
  EXPECT_EQ(share.Update(), 3);  // no window has passed
  EXPECT_EQ(share.other_cores(), 0.0);
  EXPECT_GE(share.cores(), 1);
}

TEST(CoreShare, ProcessesStartingTogetherStartAtAShareOfTheCores) {
  CoreShare one(64, 3600.0, 1);
  ASSERT_TRUE(one.available());
  const int cores = one.cores();
  EXPECT_EQ(one.threads(), 64);  // alone: the maximum (measured later)
  CoreShare four(64, 3600.0, 4);
  EXPECT_EQ(four.threads(), std::max(1, cores / 4));
  CoreShare many(64, 3600.0, 4 * cores);
  EXPECT_EQ(many.threads(), 1);
  CoreShare capped(1, 3600.0, 1);
  EXPECT_EQ(capped.threads(), 1);
  EXPECT_EQ(CoreShare(2, 3600.0, 2).threads(), std::clamp(cores / 2, 1, 2));
}

#if defined(__linux__)
// Spins until this thread has run for `seconds` of CPU time (however long
// that takes on a machine shared with other tests).
void SpinCpu(double seconds) {
  auto now = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  };
  const double end = now() + seconds;
  volatile uint64_t x = 0;
  while (now() < end) {
    for (int i = 0; i < 10000; ++i) x = x + 1;
  }
}

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

TEST(CoreShare, OwnTimeCountsEveryThreadOfThisProcess) {
  // other_cores is the CPUs' busy time minus this process's: the subtraction
  // must take all of this process's threads, not only the calling one.
  CoreShare share(2, 0.2);  // the spin below takes >= 0.3 s
  ASSERT_TRUE(share.available());
  const double cpu0 = ProcessCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread t([] { SpinCpu(0.3); });
  SpinCpu(0.3);
  t.join();
  share.Update();
  const double cpu = ProcessCpuSeconds() - cpu0;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The window started at construction, just before t0, and ended at Update.
  EXPECT_NEAR(share.self_cores(), cpu / wall, 0.15 * cpu / wall);
}

TEST(CoreShare, AnotherProcessSpinningIsSeen) {
  CoreShare share(2, 0.5);
  ASSERT_TRUE(share.available());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    SpinCpu(10.0);  // killed long before
    _exit(0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  share.Update();
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  // The child had a core for most of the window (ctest may run one other
  // test beside this one, so it may have had less than all of it).
  EXPECT_GT(share.other_cores(), 0.5) << "a busy child process was not seen";
  if (share.cores() == 2) {
    EXPECT_EQ(share.threads(), 1);
  }
}
#endif

}  // namespace
}  // namespace fp8moe::internal
