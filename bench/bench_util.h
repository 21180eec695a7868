// Shared pieces of the `fp8moe bench` commands: timing, the ceilings every
// benchmark measures in its own run, and a table that prints as text.
//
// Ceilings (docs/benchmarks.md): the machine's register-only arithmetic
// peaks and its streaming read and memcpy bandwidths (MachineCeilings, for
// every bench, `bench train` and `bench comm` included), and OpenBLAS sgemm
// from a core right for the CPU (bench/sgemm_ceiling.h).
#ifndef FP8MOE_BENCH_BENCH_UTIL_H_
#define FP8MOE_BENCH_BENCH_UTIL_H_

#include <cstddef>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/machine_peaks.h"
#include "fp8moe/tensor.h"

namespace fp8moe::bench {

double NowSeconds();

// A new tensor, or (after printing the refusal, e.g. the memory cap's) exit
// status 1: a bench cannot go on without its buffers.
Tensor MustCreate(DType dtype, Shape shape);
// Exits with status 1, printing the error, unless `status` is ok.
void MustSucceed(const Status& status);

// A new f32 tensor of `shape` drawn from N(0, sd^2) by `rng`, element by
// element in order (the same seed gives the same operands run after run).
Tensor RandomF32(std::mt19937& rng, Shape shape, float sd);
// f32 `f` rounded to bf16 (F32ToBf16Span: to nearest even), a new tensor of
// f's shape.
Tensor ToBf16(const Tensor& f);

// Runs fn once to warm up, then `reps` times; returns the fastest time in
// seconds (the least disturbed by other work on a shared machine).
double BestSeconds(int reps, const std::function<void()>& fn);

// The same for several functions timed in rounds: each once to warm up, then
// `reps` rounds running every function once; the fastest time of each. A load
// that comes and goes on a shared machine then falls on all of them alike,
// which keeps their ratios honest.
std::vector<double> BestSecondsInterleaved(int reps, const std::vector<std::function<void()>>& fns);

// The rounds of BestSecondsInterleaved themselves: seconds[i][r] is function
// i's time in round r (after the warm-up), for ratios taken round by round.
std::vector<std::vector<double>> SecondsInterleaved(int reps,
                                                    const std::vector<std::function<void()>>& fns);

// The ratio of two modes timed in the same rounds, as a median with a
// distribution-free confidence interval: the per-round ratios a[r] / b[r]
// (the two ran seconds apart under the same load), their median, and the
// interval between two of them, the k-th smallest and the k-th largest, that
// holds the true median with probability `coverage` whatever the noise's
// distribution (the sign test: the number of ratios below the median is
// Binomial(n, 1/2)); k is the largest with coverage >= 0.95. Below 6 rounds
// no such k exists and the interval is [min, max] with its lower coverage
// (1 - 2^(1-n)). `verdict`: "faster" when the whole interval is below 1 (a
// is faster than b), "slower" when above, else "parity" (the interval holds
// 1: the rounds cannot tell the two apart).
struct RatioInterval {
  int rounds = 0;
  double median = 0, low = 0, high = 0;
  double coverage = 0;
  std::string verdict;
};
// a, b: the same number (>= 1) of positive round times.
RatioInterval PairedRatioInterval(const std::vector<double>& a, const std::vector<double>& b);
// "0.994 median of 15 rounds' ratios, 95% interval 0.985-1.010: parity"
std::string DescribeInterval(const RatioInterval& r);
nlohmann::json IntervalJson(const RatioInterval& r);

// memcpy of a `bytes` buffer split over `threads` threads; GB/s counting
// bytes read plus bytes written. Best of max(reps, 3) runs; a small buffer is
// copied again and again within a run (>= 64 MiB moved), so the rate is that
// of the cache level it fits in.
double MemcpyGBs(size_t bytes, int threads, int reps);

// A streaming read of a `bytes` buffer split over `threads` threads (a sum
// of its words); GB/s read. The ceiling of ops that only stream a weight in.
// Runs and passes as for MemcpyGBs.
double ReadGBs(size_t bytes, int threads, int reps);

// The loop ReadGBs times, on a buffer of its own, for benches that time it
// among their own rows (a bandwidth that drifts over a run then falls on the
// kernel and its ceiling alike).
class StreamingRead {
 public:
  StreamingRead(size_t bytes, int threads);
  // One timed run: the buffer read PassesFor(bytes) times, plain or with a
  // software prefetch 4 KiB ahead (the best of the two is the ceiling).
  void Run(bool prefetch) const;
  double BytesPerRun() const { return static_cast<double>(bytes_ * passes_); }

 private:
  Tensor buffer_;
  size_t bytes_;
  int threads_;
  size_t passes_;
};

// Every ceiling a benchmark compares with, measured in its own run with its
// own thread count.
struct MachineCeilings {
  MachinePeaks peaks;
  double read_gbs = 0;    // streaming read of `bytes`
  double memcpy_gbs = 0;  // memcpy of `bytes`, read + written
  size_t bytes = 0;
  int reps = 0;
  // How many times they were measured (MeasureMachineCeilings, then
  // RemeasureCeilings); each value above is the highest of them.
  int measurements = 0;
  // Ceilings whose measurements differ by more than 10%, in words ("f32_fma
  // 263.1 then 501.0 GFLOP/s"): the machine was busy during the lower one.
  std::vector<std::string> moved;
};
// The peaks (~0.2 s each) and both bandwidths over `bytes`-sized buffers.
MachineCeilings MeasureMachineCeilings(int threads, int reps, size_t bytes);
// Measures every ceiling of `c` again and keeps the higher value of each. A
// ceiling is a rate the machine can reach, so the higher is the better
// estimate: a neighbour that takes a core's pipes or the memory bus for the
// fraction of a second a peak loop runs pulls one measurement down (seen on a
// shared Zen 5: f32_fma 264 instead of 500 GFLOP/s, and 'x peak' 1.57 in the
// table), and rarely both when they are the whole run apart. Benches call it
// after their timed work and compute ratios after it.
void RemeasureCeilings(MachineCeilings* c);
// RemeasureCeilings' bookkeeping: each peak and bandwidth of `again` that is
// higher replaces the kept one; moves over 10% either way are added to
// kept->moved; the core clock follows the kept f32 FMA peak's measurement
// and every peak's ops per cycle is recomputed over it.
void MergeCeilings(MachineCeilings* kept, const MachineCeilings& again);
// Lines that say what was measured and how (for a table's notes).
std::vector<std::string> CeilingNotes(const MachineCeilings& c);
nlohmann::json CeilingsJson(const MachineCeilings& c);

// The arithmetic a GMM kernel runs on (kernels/cpu/gemm_exec.cc, ChooseKind).
enum class KernelArith {
  kF32,        // f32 FMA
  kBf16Pairs,  // bf16 / fp8 operands: vdpbf16ps where the kernels use it, else f32 FMA
  kInt16Pairs, // int8 operands as int16 pairs: vpdpwssd where used, else vpmaddwd + vpaddd
};
// The arithmetic of a `bench gmm` mode name: "f32" and "openblas" (its
// sgemm rows) -> kF32, "int8" -> kInt16Pairs, every other mode (bf16,
// fake_qat, native*, fp8_*) -> kBf16Pairs.
KernelArith ArithOfMode(const std::string& mode);
// The measured peak that bounds a kernel of this arithmetic on this run's
// target and CPU: the instruction the kernels actually issue there.
const Peak& BoundingPeak(const MachinePeaks& peaks, KernelArith arith);

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
// "256 MiB", "32 KiB", "100 B".
std::string SizeText(size_t bytes);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_UTIL_H_
