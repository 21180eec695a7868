// Shared pieces of the `fp8moe bench` commands: timing, the ceilings every
// benchmark measures in its own run (memcpy GB/s for bytes, OpenBLAS sgemm
// GFLOP/s for arithmetic), and a table that prints as text or JSON.
#ifndef FP8MOE_CLI_BENCH_UTIL_H_
#define FP8MOE_CLI_BENCH_UTIL_H_

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace fp8moe::bench {

double NowSeconds();

// Runs fn once to warm up, then `reps` times; returns the fastest time in
// seconds (the least disturbed by other work on a shared machine).
double BestSeconds(int reps, const std::function<void()>& fn);

// memcpy of a `bytes` buffer split over `threads` threads; GB/s counting
// bytes read plus bytes written.
double MemcpyGBs(size_t bytes, int threads, int reps);

// A streaming read of a `bytes` buffer split over `threads` threads (a sum
// of its words); GB/s read. The ceiling of ops that only stream a weight in.
double ReadGBs(size_t bytes, int threads, int reps);

// A table of string cells with a title; columns right-aligned except the
// first.
struct Table {
  std::string title;
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> notes;  // printed under the table

  void Print() const;
};

std::string Fixed(double v, int decimals);

}  // namespace fp8moe::bench

#endif  // FP8MOE_CLI_BENCH_UTIL_H_
