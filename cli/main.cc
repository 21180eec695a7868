// The fp8moe command: info, bench, op, train, report. Exit codes: 0 ok,
// 1 runtime failure, 2 bad usage or input.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/bench_comm.h"
#include "bench/bench_gmm.h"
#include "bench/bench_moe.h"
#include "bench/bench_quant.h"
#include "bench/bench_train.h"
#include "bench/openblas_core.h"
#include "bench/sgemm_ceiling.h"
#include "cli/op.h"
#include "cli/train.h"
#include "distributed/world.h"
#include "fp8moe/memory.h"
#include "fp8moe/numerics.h"
#include "fp8moe/safetensors.h"
#include "fp8moe/version.h"

namespace {

int Info() {
  std::printf("fp8moe %s\n", fp8moe::kVersion);
  std::printf("simd target: %s (chosen at run time)\n", fp8moe::SimdTargetName());
  std::printf("threads: %d (OpenMP; set OMP_NUM_THREADS to change)\n",
              omp_get_max_threads());
  std::printf("mpi: %s\n", fp8moe::MpiInfo().c_str());
  const uint64_t cap = fp8moe::MemoryCap();
  std::printf("memory cap: %s, from %s\n",
              cap == 0 ? "none" : fp8moe::FormatBytes(cap).c_str(),
              fp8moe::MemoryCapSource().c_str());
  return 0;
}

std::string OpList() {
  std::string s = "ops:\n";
  for (const auto& op : fp8moe::cli::AllOps()) {
    s += "  " + op.name + std::string(op.name.size() < 12 ? 12 - op.name.size() : 1, ' ') +
         op.summary + "\n    keys:";
    for (const auto& k : op.keys.flags()) s += " " + k.name + "=" + k.default_value;
    s += "\n";
  }
  return s;
}

// `fp8moe bench`: what its options fill, for RunBench.
struct BenchArgs {
  fp8moe::bench::BenchOptions opt;
  std::string what;               // quant, gmm, moe, train, sgemm or comm
  std::vector<std::string> keys;  // bench train's key=value flags
  bool fwd_only = false;
};

CLI::App* AddBenchCommand(CLI::App& app, BenchArgs* args) {
  fp8moe::bench::BenchOptions& bopt = args->opt;
  bopt.threads = omp_get_max_threads();
  auto* bench = app.add_subcommand(
      "bench", "benchmarks with their own ceilings: quant, gmm, moe, train, comm (sgemm: the "
               "OpenBLAS ceiling alone)");
  bench->add_option("what", args->what,
                    "which benchmark: quant, gmm, moe, train, sgemm or comm (comm: under "
                    "mpirun -np N)")
      ->required()
      ->check(CLI::IsMember({"quant", "gmm", "moe", "train", "sgemm", "comm"}));
  bench->add_option("--tokens", bopt.tokens, "bench moe: tokens T; bench comm: tokens per rank")
      ->check(CLI::Range(1, 1 << 20));
  bench->add_option("--min-payload", bopt.min_payload,
                    "bench comm: smallest payload in bytes (default 64 KiB; x4 each row)")
      ->check(CLI::Range(int64_t{1} << 10, int64_t{1} << 30));
  bench->add_option("--max-payload", bopt.max_payload,
                    "bench comm: largest payload in bytes (default 64 MiB)")
      ->check(CLI::Range(int64_t{1} << 10, int64_t{1} << 30));
  bench->add_flag("--json", bopt.json, "print JSON instead of a table");
  bench->add_option("--threads", bopt.threads, "threads (default: OpenMP's)")
      ->check(CLI::Range(1, 1024));
  bench->add_option("--reps", bopt.reps, "timed repetitions (best is kept)")
      ->check(CLI::Range(1, 1000));
  bench->add_option("--shape", bopt.shape,
                    "bench gmm: the shape of this name, else shapes whose name contains it; bench moe: "
                    "only such modes, or a comma-separated list of exact mode names");
  bench->add_flag("--fwd-only", args->fwd_only, "bench gmm: forward passes only");
  bench->add_option("--tiles", bopt.fwd_tiles,
                    "bench gmm: forward tiles M K N (0 keeps a default; k must be even)")
      ->expected(3)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  bench->add_option("--sgemm-core", bopt.sgemm_core,
                    "measure the sgemm ceiling in a child with OPENBLAS_CORETYPE=this (default: "
                    "the loaded core if right for the CPU, else a right one)");
  bench->add_option("--sizes", bopt.sgemm_sizes, "bench sgemm: MxKxN[,MxKxN...]");
  bench->add_flag("--serve", bopt.sgemm_serve,
                  "bench sgemm: run the shape of each index read from stdin once and print its "
                  "seconds (how the other benches time sgemm among their own rounds)");
  bench->add_option("--elements", bopt.elements,
                    "bench quant: elements per pass (rounded down to rows of 1024, at least 8 "
                    "rows: 8192)")
      ->check(CLI::Range(int64_t{8192}, int64_t{1} << 32));
  bench->add_option("keys", args->keys, "bench train: key=value flags of fp8moe train (e.g. steps=1200)");
  return bench;
}

// The bench options CLI11's checks cannot judge alone, then the bench itself.
int RunBench(BenchArgs& args) {
  fp8moe::bench::BenchOptions& bopt = args.opt;
  const std::string& bench_what = args.what;
  bopt.all_passes = !args.fwd_only;
  fp8moe::bench::IsaTier tier;
  if (!bopt.sgemm_core.empty() && !fp8moe::bench::CoreTier(bopt.sgemm_core, &tier)) {
    std::fprintf(stderr, "error: --sgemm-core: '%s' is not an OpenBLAS core name; use one of: %s\n",
                 bopt.sgemm_core.c_str(), fp8moe::bench::KnownCoreNames().c_str());
    return 2;
  }
  if (bopt.fwd_tiles.size() == 3 && bopt.fwd_tiles[1] % 2 != 0) {
    std::fprintf(stderr,
                 "error: --tiles: k = %lld is odd; the kernels reduce k in pairs, so use an even "
                 "k (or 0 for the default)\n",
                 static_cast<long long>(bopt.fwd_tiles[1]));
    return 2;
  }
  if (bopt.sgemm_serve && bench_what != "sgemm") {
    std::fprintf(stderr, "error: --serve is an option of bench sgemm only, not of bench %s\n",
                 bench_what.c_str());
    return 2;
  }
  if (bench_what == "train") {
    return fp8moe::bench::BenchTrain(bopt, args.keys, fp8moe::cli::RunReport);
  }
  if (!args.keys.empty()) {
    std::fprintf(stderr, "error: bench %s takes no key=value settings\n", bench_what.c_str());
    return 2;
  }
  if (bench_what == "gmm") return fp8moe::bench::BenchGmm(bopt);
  if (bench_what == "moe") return fp8moe::bench::BenchMoe(bopt);
  if (bench_what == "sgemm") return fp8moe::bench::BenchSgemm(bopt);
  if (bench_what == "comm") return fp8moe::bench::BenchComm(bopt);
  return fp8moe::bench::BenchQuant(bopt);
}

// The first word that is not an option (nor --simd's or --memory-cap's
// value) must name a subcommand; CLI11 would say only "A subcommand is
// required". False, after saying so, when it names none.
bool FirstWordNamesASubcommand(CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--simd" || a == "--memory-cap") {
      ++i;
      continue;
    }
    if (a.starts_with("-")) continue;
    std::vector<std::string> names;
    for (const auto* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), a) != names.end()) return true;
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    std::fprintf(stderr, "error: unknown subcommand '%s'; the subcommands: %s (fp8moe --help)\n",
                 a.c_str(), list.c_str());
    return false;
  }
  return true;
}

// The settings every subcommand runs under: --simd, FP8MOE_BF16_DOT,
// FP8MOE_MEMORY_CAP and --memory-cap, each refused (exit 2) when malformed;
// 0 when all are applied.
int ApplyProcessSettings(const std::string& simd, const std::string& memory_cap) {
  if (!simd.empty()) {
    const fp8moe::Status s = fp8moe::RestrictSimdTarget(simd);
    if (!s.ok()) {
      std::fprintf(stderr, "error: --simd: %s\n", s.message().c_str());
      return 2;
    }
  }
  // Nor is a FP8MOE_BF16_DOT that is neither on nor off (the library would
  // warn and keep its default choice of kernels).
  if (const auto setting = fp8moe::Bf16DotSetting(); !setting.ok()) {
    std::fprintf(stderr, "error: %s\n", setting.status().message().c_str());
    return 2;
  }
  // A malformed FP8MOE_MEMORY_CAP is a bad request, not a silent default.
  if (const char* env = std::getenv("FP8MOE_MEMORY_CAP"); env != nullptr && *env != '\0') {
    if (const auto cap = fp8moe::ParseByteSize(env); !cap.ok()) {
      std::fprintf(stderr, "error: FP8MOE_MEMORY_CAP: %s\n", cap.status().message().c_str());
      return 2;
    }
  }
  if (!memory_cap.empty()) {
    const auto cap = fp8moe::ParseByteSize(memory_cap);
    if (!cap.ok()) {
      std::fprintf(stderr, "error: --memory-cap: %s\n", cap.status().message().c_str());
      return 2;
    }
    fp8moe::SetMemoryCap(*cap, "--memory-cap");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp8moe: FP8 quantization-aware training of Mixture-of-Experts models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(fp8moe::kVersion));

  auto* info = app.add_subcommand("info", "version, SIMD target, threads, MPI and the memory cap");
  BenchArgs bench_args;
  auto* bench = AddBenchCommand(app, &bench_args);
  std::string simd;
  app.add_option("--simd", simd, "restrict SIMD dispatch to this target and below (e.g. AVX2)")
      ->envname("FP8MOE_SIMD");
  std::string memory_cap;
  app.add_option("--memory-cap", memory_cap,
                 "refuse requests needing more memory than this (bytes, or e.g. 8G, 512MiB; "
                 "0 = no cap; default: FP8MOE_MEMORY_CAP, else the available memory)");

  std::vector<std::string> train_args;
  bool print_base_config = false;
  auto* train = app.add_subcommand("train", "train a MoE transformer: fp8moe train [config.yml] [key=value ...]");
  train->add_option("args", train_args, "a config file first (optional), then key=value flags (configs/base.yml)");
  train->add_flag("--print-base-config", print_base_config, "print configs/base.yml as the flag schema makes it");
  bool print_config = false;
  train->add_flag("--print-config", print_config,
                  "print the resolved flags (model_name's preset, the config file, the flags) as a "
                  "config file, and exit");
  std::vector<std::string> report_dirs;
  std::string report_out;
  auto* report = app.add_subcommand("report", "plot runs into one PNG: fp8moe report RUN_DIR [RUN_DIR ...]");
  report->add_option("runs", report_dirs, "run directories (each with a metrics.jsonl)")->required();
  report->add_option("--out", report_out, "the PNG (default: RUN_DIR/report.png of the first run)");

  std::string op_name, in_path, out_path;
  std::vector<std::string> op_keys;
  auto* op = app.add_subcommand("op", "run one operation on tensors from a safetensors file");
  op->add_option("name", op_name, "the op")->required();
  op->add_option("keys", op_keys, "key=value settings of the op");
  op->add_option("--in", in_path, "input .safetensors")->required();
  op->add_option("--out", out_path, "output .safetensors (written atomically)")->required();
  op->footer(OpList());
  // --simd and --memory-cap may also follow the subcommand.
  op->fallthrough();
  bench->fallthrough();
  train->fallthrough();
  info->fallthrough();
  report->fallthrough();

  if (!FirstWordNamesASubcommand(app, argc, argv)) return 2;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (const int rc = ApplyProcessSettings(simd, memory_cap); rc != 0) return rc;
  // An interrupted op never leaves a partial or temporary output file.
  fp8moe::RemoveTempFilesOnSignals();
  if (*info) return Info();
  if (*bench) return RunBench(bench_args);
  if (*op) return fp8moe::cli::RunOp(op_name, in_path, out_path, op_keys);
  if (*train) return fp8moe::cli::RunTrain(train_args, {print_base_config, print_config});
  if (*report) return fp8moe::cli::RunReport(report_dirs, report_out);
  return 2;
}
