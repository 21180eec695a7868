// `fp8moe bench moe`: one MoE layer's forward + backward per QAT mode, as the
// trainer runs it, with each mode's memory high-water and the ceilings of the
// same run (the model: bench_moe.cc). Reads json, threads, reps, tokens,
// shape (which modes), sgemm_core.
#ifndef FP8MOE_BENCH_BENCH_MOE_H_
#define FP8MOE_BENCH_BENCH_MOE_H_

#include "bench/bench_options.h"

namespace fp8moe::bench {

int BenchMoe(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_MOE_H_
