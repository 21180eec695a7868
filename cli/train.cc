// `fp8moe train [config.yml] [key=value ...]`.
#include "cli/train.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "distributed/world.h"
#include "fp8moe/dist.h"
#include "fp8moe/train.h"

namespace fp8moe::cli {

namespace {

// Exit code of a failed run: 1 for a bug in fp8moe, 2 for everything the
// user can fix (flags, data, checkpoints, disk space, divergence).
int ExitCode(const Status& s) { return s.code() == StatusCode::kInternal ? 1 : 2; }

// The longest a failing rank waits for the others to fail too (RunTrain's
// fail): ranks that fail together arrive within milliseconds of each other,
// even on a machine whose cores are all busy.
constexpr double kEndWaitSeconds = 10;

// The config file (a first argument without '='), then the key=value flags.
void SplitTrainArgs(const std::vector<std::string>& args, std::string* yaml,
                    std::vector<std::string>* overrides) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (i == 0 && args[i].find('=') == std::string::npos) {
      *yaml = args[i];
    } else {
      overrides->push_back(args[i]);
    }
  }
}

// --print-config: the flags as LoadTrainConfig resolves and validates them,
// as a config file that trains the same run.
int PrintConfig(const std::vector<std::string>& args) {
  std::string yaml;
  std::vector<std::string> overrides;
  SplitTrainArgs(args, &yaml, &overrides);
  const Result<TrainConfig> cfg = LoadTrainConfig(yaml, overrides);
  const Result<std::string> text = cfg.ok() ? TrainConfigYaml(*cfg) : cfg.status();
  if (!text.ok()) {
    std::fprintf(stderr, "error: %s\n", text.status().message().c_str());
    return 2;
  }
  std::fputs(text->c_str(), stdout);
  return 0;
}

}  // namespace

int RunTrain(const std::vector<std::string>& args, TrainPrintOptions print) {
  if (print.base_config) {
    if (!args.empty() || print.config) {
      std::fprintf(stderr, "error: --print-base-config prints the defaults and takes no config "
                   "file or flags (got '%s'); drop them, or drop --print-base-config to train\n",
                   args.empty() ? "--print-config" : args[0].c_str());
      return 2;
    }
    std::fputs(BaseConfigYaml().c_str(), stdout);
    return 0;
  }
  if (print.config) return PrintConfig(args);
  // A file-size limit (ulimit -f) must fail a write with EFBIG, which the
  // checkpoint writer reports, instead of killing the process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  // The default model's matmuls are small, and on a machine that is busy
  // with other work a thread that waits at every barrier for a core held by
  // another process costs more than it gains (measured on 2 cores with one
  // other busy process: 0.050 s per step with two threads, 0.028 s with
  // one; idle: 0.019 s with two). So the trainer's threads follow the load
  // the other processes put on the cores (base/core_share.h), unless
  // OMP_DYNAMIC is set, which then decides as OpenMP defines it. OpenMP's
  // own dynamic threads count this process's threads as load and so ran it
  // on one thread even on an idle machine. The bits do not depend on the
  // thread count.
  const bool threads_follow_load = std::getenv("OMP_DYNAMIC") == nullptr;
  std::string yaml;
  std::vector<std::string> overrides;
  SplitTrainArgs(args, &yaml, &overrides);
  // The ranks: MPI under mpirun, else one.
  auto world = StartWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "error: %s\n", world.status().message().c_str());
    return 2;
  }
  // How long a rank waits in one collective before it decides a peer died or
  // hangs and ends the job: FP8MOE_COMM_TIMEOUT seconds (0: no limit), else
  // CommOptions' 600 s. Read before the config (the ranks compare configs
  // over the communicator); under mpirun on several machines pass it with
  // -x FP8MOE_COMM_TIMEOUT. A bad value is reported once the communicator
  // is open, so that every rank can report it (fail, below).
  CommOptions comm_options;
  Status timeout_status;
  if (const char* t = std::getenv("FP8MOE_COMM_TIMEOUT"); t != nullptr && *t != '\0') {
    char* end = nullptr;
    const double v = std::strtod(t, &end);
    if (end == t || *end != '\0' || !(v >= 0) || v > 1e9) {
      timeout_status = InvalidArgument(
          "FP8MOE_COMM_TIMEOUT='" + std::string(t) + "' is not a number of seconds in [0, 1e9] "
          "(0: no limit); unset it for the default of " +
          std::to_string(static_cast<int>(comm_options.timeout_seconds)) + " s");
    } else {
      comm_options.timeout_seconds = v;
    }
  }
  auto comm_or = (*world)->Open(comm_options);
  if (!comm_or.ok()) {
    std::fprintf(stderr, "error: %s\n", comm_or.status().message().c_str());
    return 2;
  }
  Communicator& comm = **comm_or;
  // Every rank reports its own errors (under mpirun with its rank), then
  // waits for the others before it exits: the launcher ends the whole job
  // as soon as one rank exits with an error, and a peer still on its way to
  // printing the same error was cut off ("the message on 1 of 2 ranks").
  // So a failing rank prints, flushes and waits at a barrier of its own
  // (World::BarrierWithin) for at most kEndWaitSeconds (or the comm
  // timeout, if shorter). Where the ranks fail together (flags, a layout, a
  // checkpoint they read differently or a save that failed, which they
  // agree on; a dataset every rank refuses), every rank comes, each having
  // printed, and all exit with the code. A rank whose error is its own (a
  // file only it cannot read), its peers waiting for it in a collective,
  // finds nobody there and ends the whole job (MPI_Abort) rather than
  // leave them to the watchdog's timeout, as it always did, only that much
  // later. An internal error (a bug, or MPI failing) ends the job at once.
  auto fail = [&](const Status& s, int code) {
    std::fflush(stdout);
    if (comm.size() > 1) {
      std::fprintf(stderr, "fp8moe rank %d/%d: error: %s\n", comm.rank(), comm.size(),
                   s.message().c_str());
    } else {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
    }
    std::fflush(stderr);
    if (comm.size() == 1) return code;
    if (s.code() == StatusCode::kInternal) comm.Abort(code, "ending the job");
    const double limit = comm_options.timeout_seconds > 0
                             ? std::min(kEndWaitSeconds, comm_options.timeout_seconds)
                             : kEndWaitSeconds;
    if (!(*world)->BarrierWithin(limit)) {
      comm.Abort(code, "the other ranks did not stop with an error (the one above is this "
                       "rank's alone); ending the job");
    }
    return code;
  };
  if (!timeout_status.ok()) return fail(timeout_status, 2);
  auto cfg = LoadTrainConfig(yaml, overrides);
  // Before anything else every rank compares its configuration with the
  // others' (CheckTrainLayout, once), so flags that differ across ranks are
  // one clear error on every rank, never a hang. A rank whose flags did not
  // parse takes part with its error as its configuration, then reports it
  // (where every rank has the same flags, every rank reports the same).
  if (!cfg.ok()) {
    const std::string text = std::string(kInvalidConfigText) + cfg.status().message();
    if (auto agreed = CheckDistributedConfig(comm, text, -1, 1); !agreed.ok()) {
      return fail(agreed.status(), 2);
    }
    return fail(cfg.status(), 2);
  }
  auto layout = CheckTrainLayout(*cfg, comm);
  if (!layout.ok()) return fail(layout.status(), 2);
  TrainOptions options;
  options.comm = &comm;
  options.threads_follow_load = threads_follow_load;
  auto summary = Train(*cfg, *layout, options);
  if (!summary.ok()) return fail(summary.status(), ExitCode(summary.status()));
  return 0;
}

}  // namespace fp8moe::cli
