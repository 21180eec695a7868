// The fp8moe command: info, bench, op (train and checkpoint come with the
// trainer). Exit codes: 0 ok, 1 runtime failure, 2 bad usage or input.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/bench.h"
#include "cli/op.h"
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
  std::printf("memory cap: %s, from %s\n", fp8moe::FormatBytes(fp8moe::MemoryCap()).c_str(),
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp8moe: FP8 quantization-aware training of Mixture-of-Experts models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(fp8moe::kVersion));

  auto* info = app.add_subcommand("info", "version, SIMD target, threads");

  fp8moe::bench::BenchOptions bopt;
  bopt.threads = omp_get_max_threads();
  std::string bench_what;
  auto* bench = app.add_subcommand("bench", "benchmarks with their own ceilings: quant, gmm, moe");
  bench->add_option("what", bench_what, "which benchmark: quant, gmm or moe")
      ->required()
      ->check(CLI::IsMember({"quant", "gmm", "moe"}));
  bench->add_option("--tokens", bopt.tokens, "bench moe: tokens T")->check(CLI::Range(1, 1 << 20));
  bench->add_flag("--json", bopt.json, "print JSON instead of a table");
  bench->add_option("--threads", bopt.threads, "threads (default: OpenMP's)")
      ->check(CLI::Range(1, 1024));
  bench->add_option("--reps", bopt.reps, "timed repetitions (best is kept)")
      ->check(CLI::Range(1, 1000));
  std::string simd;
  app.add_option("--simd", simd, "restrict SIMD dispatch to this target and below (e.g. AVX2)")
      ->envname("FP8MOE_SIMD");
  std::string memory_cap;
  app.add_option("--memory-cap", memory_cap,
                 "refuse requests needing more memory than this (bytes, or e.g. 8G, 512MiB; "
                 "0 = no cap; default: FP8MOE_MEMORY_CAP, else the available memory)");
  bench->add_option("--shape", bopt.shape,
                    "bench gmm: only shapes whose name contains this; bench moe: only such modes");
  bool fwd_only = false;
  bench->add_flag("--fwd-only", fwd_only, "bench gmm: forward passes only");
  bench->add_option("--tiles", bopt.fwd_tiles,
                    "bench gmm: forward tiles M K N (0 keeps a default; k must be even)")
      ->expected(3)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  bench->add_option("--elements", bopt.elements, "bench quant: elements per pass")
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 32));

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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (!simd.empty()) {
    const fp8moe::Status s = fp8moe::RestrictSimdTarget(simd);
    if (!s.ok()) {
      std::fprintf(stderr, "error: --simd: %s\n", s.message().c_str());
      return 2;
    }
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
  // An interrupted op never leaves a partial or temporary output file.
  fp8moe::RemoveTempFilesOnSignals();
  if (*info) return Info();
  if (*bench) {
    bopt.all_passes = !fwd_only;
    if (bopt.fwd_tiles.size() == 3 && bopt.fwd_tiles[1] % 2 != 0) {
      std::fprintf(stderr,
                   "error: --tiles: k = %lld is odd; the kernels reduce k in pairs, so use an even "
                   "k (or 0 for the default)\n",
                   static_cast<long long>(bopt.fwd_tiles[1]));
      return 2;
    }
    if (bench_what == "gmm") return fp8moe::bench::BenchGmm(bopt);
    if (bench_what == "moe") return fp8moe::bench::BenchMoe(bopt);
    return fp8moe::bench::BenchQuant(bopt);
  }
  if (*op) return fp8moe::cli::RunOp(op_name, in_path, out_path, op_keys);
  return 2;
}
