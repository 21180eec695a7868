// The options of `fp8moe bench ...`, as the command parses them (cli/main.cc);
// each bench reads the ones its comment names. Every bench returns the
// command's exit code: 0 done, 1 a runtime failure (a buffer refused, a
// child process or a rank that failed), 2 a bad request (an option out of
// place, a name that matches nothing, a run too big for the memory).
#ifndef FP8MOE_BENCH_BENCH_OPTIONS_H_
#define FP8MOE_BENCH_BENCH_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe::bench {

struct BenchOptions {
  bool json = false;
  int threads = 2;
  int reps = 5;
  int64_t elements = int64_t{64} << 20;  // bench quant
  std::string shape;        // bench gmm: only shapes whose name contains this
  bool all_passes = true;   // bench gmm: dlhs and tgmm too (else fwd only)
  int64_t tokens = 4096;    // bench moe: T
  std::vector<int64_t> fwd_tiles;  // bench gmm: forward tiles m, k, n (0 = default)
  std::string sgemm_core;   // "" : the loaded OpenBLAS core if right for the CPU, else a
                            // child with a right one; a name: a child with that core
  std::string sgemm_sizes = "2048x2048x2048";  // bench sgemm: MxKxN[,MxKxN...]
  bool sgemm_serve = false;  // bench sgemm: time shapes on request (SgemmRounds' child)
  int64_t min_payload = int64_t{64} << 10;  // bench comm: smallest payload in bytes
  int64_t max_payload = int64_t{64} << 20;  // bench comm: largest payload in bytes
};

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_OPTIONS_H_
