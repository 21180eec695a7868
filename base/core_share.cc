#include "base/core_share.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#if defined(__linux__)
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#endif

namespace fp8moe::internal {

int ThreadsForFreeCores(int cores, double other_cores, int max_threads) {
  const int hi = std::max(1, max_threads);
  if (!(other_cores >= 0)) other_cores = 0;  // NaN or a negative rounding residue
  // A busy process that shares a core with one of our threads gets about
  // half of it (pinned) to two thirds (free to move): measured at >= 0.45 of
  // a core, it would take a whole one on its own.
  const double busy = std::floor(other_cores + 0.55);
  const double threads = static_cast<double>(cores) - busy;
  if (threads <= 1) return 1;
  return threads >= hi ? hi : static_cast<int>(threads);
}

CoreShare::CoreShare(int max_threads, double window_seconds, int sharing_processes)
    : max_threads_(std::max(1, max_threads)),
      threads_(std::max(1, max_threads)),
      window_seconds_(window_seconds) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return;
  int n = 0;
  for (int c = 0; c < 1024 && c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) {
      cpu_mask_[c / 64] |= uint64_t{1} << (c % 64);
      ++n;
    }
  }
  if (n == 0) return;
  cores_ = n;
  available_ = Take(&last_);
  // Processes that start together would otherwise each start with all the
  // cores (4 ranks x 2 threads on 2 cores spin at every barrier until the
  // first window ends).
  if (available_ && sharing_processes > 1) {
    threads_ = std::clamp(cores_ / sharing_processes, 1, max_threads_);
  }
#else
  (void)sharing_processes;
#endif
}

namespace {

double MonotonicSeconds() {
#if defined(__linux__)
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
#else
  return 0;
#endif
}

}  // namespace

bool CoreShare::Take(Sample* s) const {
#if defined(__linux__)
  s->wall = MonotonicSeconds();
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return false;
  s->self = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
            1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  const long tick = sysconf(_SC_CLK_TCK);
  if (tick <= 0) return false;
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return false;
  // Lines "cpuN user nice system idle iowait irq softirq steal ...", in
  // ticks; busy is everything but idle and iowait (steal included: time the
  // hypervisor gave someone else is not ours to use).
  char line[512];
  unsigned long long busy = 0;
  bool any = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "cpu", 3) != 0) break;  // the cpu lines come first
    if (line[3] < '0' || line[3] > '9') continue;  // the "cpu " total line
    int cpu = -1;
    unsigned long long v[8] = {};
    if (std::sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &v[0], &v[1],
                    &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) < 5) {
      continue;  // a short line
    }
    if (cpu < 0 || cpu >= 1024 || (cpu_mask_[cpu / 64] >> (cpu % 64) & 1) == 0) continue;
    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
    any = true;
  }
  std::fclose(f);
  if (!any) return false;
  s->busy = static_cast<double>(busy) / static_cast<double>(tick);
  return true;
#else
  (void)s;
  return false;
#endif
}

int CoreShare::Update() {
  if (!available_) return threads_;
  // Called every step: read /proc/stat only once a window has passed.
  if (MonotonicSeconds() - last_.wall < window_seconds_) return threads_;
  Sample now;
  if (!Take(&now)) return threads_;
  const double wall = now.wall - last_.wall;
  self_cores_ = (now.self - last_.self) / wall;
  other_cores_ = std::max(0.0, (now.busy - last_.busy) - (now.self - last_.self)) / wall;
  last_ = now;
  threads_ = ThreadsForFreeCores(cores_, other_cores_, max_threads_);
  return threads_;
}

}  // namespace fp8moe::internal
