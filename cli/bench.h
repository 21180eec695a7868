// Entry points of `fp8moe bench ...`.
#ifndef FP8MOE_CLI_BENCH_H_
#define FP8MOE_CLI_BENCH_H_

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
  int64_t min_payload = int64_t{64} << 10;  // bench comm: smallest payload in bytes
  int64_t max_payload = int64_t{64} << 20;  // bench comm: largest payload in bytes
};

int BenchQuant(const BenchOptions& opt);
int BenchGmm(const BenchOptions& opt);
int BenchMoe(const BenchOptions& opt);
// Under mpirun: ring collectives vs MPI's own, and the gathers' bytes.
int BenchComm(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_CLI_BENCH_H_
