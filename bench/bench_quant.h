// `fp8moe bench quant`: the GB/s of every conversion and quantization next
// to the memcpy bandwidth of the same run (the model: bench_quant.cc).
// Reads json, threads, reps, elements.
#ifndef FP8MOE_BENCH_BENCH_QUANT_H_
#define FP8MOE_BENCH_BENCH_QUANT_H_

#include "bench/bench_options.h"

namespace fp8moe::bench {

int BenchQuant(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_QUANT_H_
