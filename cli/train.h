// `fp8moe train` and `fp8moe report` (which `fp8moe bench train` draws its
// runs with: bench/bench_train.h).
#ifndef FP8MOE_CLI_TRAIN_H_
#define FP8MOE_CLI_TRAIN_H_

#include <string>
#include <vector>

namespace fp8moe::cli {

// What `fp8moe train` prints instead of training.
struct TrainPrintOptions {
  bool base_config = false;  // --print-base-config: configs/base.yml
  bool config = false;       // --print-config: the resolved flags
};

// fp8moe train [config.yml] [key=value ...]; exit 0, 1 (internal failure) or
// 2 (bad input: flags, data, checkpoint, disk full, non-finite stop).
int RunTrain(const std::vector<std::string>& args, TrainPrintOptions print = {});

// fp8moe report RUN_DIR [RUN_DIR ...] [--out PNG]: one PNG with loss
// curves, step times, per-expert load and FP8 health (gnuplot).
int RunReport(const std::vector<std::string>& run_dirs, const std::string& out);

}  // namespace fp8moe::cli

#endif  // FP8MOE_CLI_TRAIN_H_
