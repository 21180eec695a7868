// `fp8moe bench train [key=value ...]`: one seed of the default model trained
// in every QAT mode, side by side (eval loss, step time, allocations per
// step, peak memory), then drawn into one PNG. Reads json and threads; the
// keys are `fp8moe train`'s flags.
#ifndef FP8MOE_BENCH_BENCH_TRAIN_H_
#define FP8MOE_BENCH_BENCH_TRAIN_H_

#include <functional>
#include <string>
#include <vector>

#include "bench/bench_options.h"

namespace fp8moe::bench {

// Draws run directories into one PNG and returns an exit code: the command
// passes `fp8moe report` (cli/train.h, RunReport).
using DrawRuns = std::function<int(const std::vector<std::string>& run_dirs, const std::string& png)>;

// Exit code: 0, 1 (internal failure), 2 (bad keys, data or output
// directory, as `fp8moe train`), else draw_runs' own.
int BenchTrain(const BenchOptions& opt, const std::vector<std::string>& keys,
               const DrawRuns& draw_runs);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_TRAIN_H_
