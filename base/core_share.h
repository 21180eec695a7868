// How many threads a long job should run while it shares the machine's cores
// with other processes (the trainer's "threads follow the load").
//
// Why not OpenMP's dynamic threads: libgomp sizes a team as the online CPUs
// minus the 1-minute load average, and the job's own threads are part of that
// average. A trainer alone on 2 cores pushes the load to ~2 and so runs itself
// on one thread (measured: the default model's step 0.028 s with dynamic
// threads against 0.019 s with two fixed threads on an idle machine). Fixed
// threads are no answer either: with one other busy process on the second
// core the same step took 0.050 s with two threads (every barrier waits for a
// thread that has no core) against 0.028 s with one.
//
// CoreShare measures what the other processes take: the busy time of the
// CPUs this process may run on (/proc/stat) minus this process's own CPU time
// (getrusage), over windows of at least `window_seconds`. The thread count is
// the cores left free (ThreadsForFreeCores), between 1 and the maximum. The bits of every
// kernel do not depend on the thread count, so following the load changes
// only the time.
#ifndef FP8MOE_BASE_CORE_SHARE_H_
#define FP8MOE_BASE_CORE_SHARE_H_

#include <cstdint>

namespace fp8moe::internal {

// The thread count for `cores` CPUs of which other processes keep
// `other_cores` busy (a mean over a window), capped to [1, max_threads]:
// cores - floor(other_cores + 0.55). An other process measured at 0.45 of a
// core or more counts as a whole one: while it shares a core with one of
// this process's threads it gets only half of it (two thirds when it may
// move). Pure, for the tests.
int ThreadsForFreeCores(int cores, double other_cores, int max_threads);

class CoreShare {
 public:
  // `max_threads` >= 1: the most threads ever returned (the user's
  // OMP_NUM_THREADS or the cores). `sharing_processes` (>= 1) that start
  // together on these cores, e.g. the ranks of an mpirun on one machine,
  // start at an equal share of them, at most max_threads; one process starts
  // at max_threads. Until the first window has passed nothing is measured.
  explicit CoreShare(int max_threads, double window_seconds = 0.5, int sharing_processes = 1);

  // False where /proc/stat or the affinity mask cannot be read (not Linux):
  // Update then always returns max_threads.
  bool available() const { return available_; }
  // The CPUs this process may run on.
  int cores() const { return cores_; }

  // Call between pieces of work (a training step). Once a window has passed
  // since the last measurement, measures the other processes' share and
  // returns the new thread count; otherwise returns the current one.
  int Update();
  int threads() const { return threads_; }
  // The other processes' mean busy cores over the last full window (0 before one).
  double other_cores() const { return other_cores_; }
  // This process's own mean busy cores (all its threads) over that window.
  double self_cores() const { return self_cores_; }

 private:
  struct Sample {
    double wall = 0, busy = 0, self = 0;  // seconds
  };
  bool Take(Sample* s) const;

  int max_threads_, cores_ = 1, threads_;
  double window_seconds_, other_cores_ = 0, self_cores_ = 0;
  bool available_ = false;
  uint64_t cpu_mask_[16] = {};  // the allowed CPUs (up to 1024)
  Sample last_;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_CORE_SHARE_H_
