// `fp8moe bench gmm`: GFLOP/s of every GMM pass and mode on the issue's
// shapes, next to the OpenBLAS sgemm and register-only peak ceilings of the
// same run, and GB/s next to the read and memcpy bandwidths for the
// weight-bound decode shapes (the model: bench_gmm.cc). Reads json, threads,
// reps, shape, all_passes, fwd_tiles, sgemm_core.
#ifndef FP8MOE_BENCH_BENCH_GMM_H_
#define FP8MOE_BENCH_BENCH_GMM_H_

#include "bench/bench_options.h"

namespace fp8moe::bench {

int BenchGmm(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_GMM_H_
