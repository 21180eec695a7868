// OpenBLAS sgemm as a benchmark's ceiling, only from a core that is right
// for this CPU (bench/openblas_core.h says how OpenBLAS picks its core and why
// a wrong one cannot be replaced inside the process).
#ifndef FP8MOE_BENCH_SGEMM_CEILING_H_
#define FP8MOE_BENCH_SGEMM_CEILING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_options.h"

namespace fp8moe::bench {

// Row-major C [m, n] = A [m, k] x B [k, n].
struct SgemmShape {
  int64_t m = 0, k = 0, n = 0;
  double Flops() const { return 2.0 * static_cast<double>(m) * k * n; }
};

// "MxKxN,MxKxN" <-> shapes. Parse returns false (and says why) on anything
// else or on a size outside [1, 2^20].
std::string FormatSgemmShapes(const std::vector<SgemmShape>& shapes);
bool ParseSgemmShapes(const std::string& text, std::vector<SgemmShape>* shapes,
                      std::string* error);

struct SgemmCeiling {
  // This process's OpenBLAS, as loaded.
  std::string loaded_core, loaded_config;
  bool loaded_fallback = false;
  std::string advice;  // why the loaded core is or is not good here
  // The core whose numbers are in `seconds`.
  std::string core, config;
  std::string coretype_env;  // OPENBLAS_CORETYPE of the child that ran them; "" = this process
  bool trusted = false;      // `core` is right for this CPU: a real ceiling
  std::vector<double> seconds;  // best time per shape; 0 where nothing ran
  std::vector<std::string> attempts;  // every child tried, and how it went

  double Gflops(const std::vector<SgemmShape>& shapes, size_t i) const {
    return seconds[i] > 0 ? shapes[i].Flops() / seconds[i] / 1e9 : 0.0;
  }
};

// The ceiling's sgemm timed again and again among a benchmark's own rounds
// (a machine whose speed drifts within a run then moves the kernels and
// their ceiling alike), always in a child process that stays up: this
// binary as `bench sgemm --serve`, with the trusted ceiling's core
// (OPENBLAS_CORETYPE as it had, else this process's environment) and
// OPENBLAS_THREAD_TIMEOUT=4, so that its OpenBLAS threads sleep at once
// after each sgemm instead of spinning over the next kernel's time (2^28
// cycles by default). The child waits 20 ms after each request before it
// starts its clock, so this process's OpenMP workers, which spin a
// few ms after their last parallel region, are asleep by then (without the
// wait: 99-110 instead of 177-191 GFLOP/s on a 4.5 ms decode-shaped sgemm,
// 2 threads on 2 cores).
class SgemmRounds {
 public:
  // Null, and why in *error, when the ceiling is not trusted or the child
  // does not start or reports another core than the ceiling's.
  static std::unique_ptr<SgemmRounds> Start(const SgemmCeiling& ceiling,
                                            const std::vector<SgemmShape>& shapes, int threads,
                                            std::string* error);
  ~SgemmRounds();  // ends the child and waits for it
  SgemmRounds(const SgemmRounds&) = delete;
  SgemmRounds& operator=(const SgemmRounds&) = delete;

  // Runs shapes[i] once in the child; its seconds as the child timed them
  // (the request's round trip and the settling wait not counted). Prints the
  // error and exits with status 1 if the child stops answering.
  double Run(size_t i);

 private:
  SgemmRounds(int fd, int pid) : fd_(fd), pid_(pid) {}
  int fd_;
  int pid_;
};

// Times each shape (best of `reps` after a warm-up) with `threads` OpenBLAS
// threads. force_core "" uses the loaded core when it is right for the CPU,
// else children with OPENBLAS_CORETYPE set to each advised core in turn;
// otherwise only a child with OPENBLAS_CORETYPE=force_core runs (its core is
// judged the same way). When no right core can be had, `trusted` is false and
// `seconds` holds whatever did run (for reference, never as a ceiling).
SgemmCeiling MeasureSgemmCeiling(const std::vector<SgemmShape>& shapes, int threads, int reps,
                                 const std::string& force_core);

// Lines for a table's notes: the core, where it ran, and a loud warning when
// it is not a ceiling.
std::vector<std::string> SgemmNotes(const SgemmCeiling& c);
nlohmann::json SgemmJson(const SgemmCeiling& c, const std::vector<SgemmShape>& shapes);

// `fp8moe bench sgemm`: OpenBLAS sgemm in this process as loaded, on
// sgemm_sizes (the other benches run it in a child with OPENBLAS_CORETYPE set
// when the loaded core is a fallback); with sgemm_serve, SgemmRounds' child.
// Reads json, threads, reps, sgemm_sizes, sgemm_serve.
int BenchSgemm(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_SGEMM_CEILING_H_
