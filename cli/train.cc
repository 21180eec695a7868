// `fp8moe train [config.yml] [key=value ...]`.
#include "cli/train.h"

#include <omp.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp8moe/train.h"

namespace fp8moe::cli {

namespace {

// Exit code of a failed run: 1 for a bug in fp8moe, 2 for everything the
// user can fix (flags, data, checkpoints, disk space, divergence).
int ExitCode(const Status& s) { return s.code() == StatusCode::kInternal ? 1 : 2; }

}  // namespace

int RunTrain(const std::vector<std::string>& args, bool print_base_config) {
  if (print_base_config) {
    std::fputs(BaseConfigYaml().c_str(), stdout);
    return 0;
  }
  // A file-size limit (ulimit -f) must fail a write with EFBIG, which the
  // checkpoint writer reports, instead of killing the process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  // The default model's matmuls are small, and on a machine that is busy
  // with other work a second OpenMP thread waiting at every barrier costs
  // far more than it gains (measured: 0.9 s per step with two threads
  // against 0.5 s with one at a load of 16 on 2 cores). With dynamic
  // threads OpenMP uses fewer threads while the machine's load is high. The
  // bits do not depend on the thread count. OMP_DYNAMIC, when set, decides.
  if (std::getenv("OMP_DYNAMIC") == nullptr) omp_set_dynamic(1);
  std::string yaml;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i == 0 && args[i].find('=') == std::string::npos) {
      yaml = args[i];
    } else {
      overrides.push_back(args[i]);
    }
  }
  auto raw = LoadConfig(TrainConfigSchema(), yaml, overrides);
  if (!raw.ok()) {
    std::fprintf(stderr, "error: %s\n", raw.status().message().c_str());
    return 2;
  }
  auto cfg = TrainConfigFrom(*raw);
  if (!cfg.ok()) {
    std::fprintf(stderr, "error: %s\n", cfg.status().message().c_str());
    return 2;
  }
  auto summary = Train(*cfg, *raw);
  if (!summary.ok()) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", summary.status().message().c_str());
    return ExitCode(summary.status());
  }
  return 0;
}

}  // namespace fp8moe::cli
