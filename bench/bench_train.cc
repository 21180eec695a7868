// `fp8moe bench train [key=value ...]`: trains one seed of the default model
// in each QAT mode of docs/design.md §4 (none = bf16, fake QAT, native forward,
// native forward + dLHS, fp8_full, int8) and prints, side by side, the final
// eval loss, the mean step time, the allocations per step after the first
// (target 0) and the peak memory; then draws the runs into one PNG with
// `fp8moe report`. The default schedule takes a few minutes in all; steps=
// sets a longer one. Native's final eval loss must be within 1% of none's.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_train.h"
#include "fp8moe/numerics.h"
#include "fp8moe/train.h"

namespace fp8moe::bench {
namespace fs = std::filesystem;

namespace {

struct Mode {
  const char* name;
  std::vector<std::string> flags;
};

const std::vector<Mode>& Modes() {
  static const std::vector<Mode> modes = {
      {"none (bf16)", {"fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=", "fp8_moe_native_fwd=false",
                       "fp8_moe_native_bwd_dlhs=false"}},
      {"fake QAT", {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                    "fp8_moe_native_fwd=false", "fp8_moe_native_bwd_dlhs=false"}},
      {"native fwd", {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                      "fp8_moe_native_fwd=true", "fp8_moe_native_bwd_dlhs=false"}},
      {"native fwd+dlhs", {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                           "fp8_moe_native_fwd=true", "fp8_moe_native_bwd_dlhs=true"}},
      {"fp8_full", {"fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=", "fp8_moe_native_fwd=false",
                    "fp8_moe_native_bwd_dlhs=false", "quantization=fp8_full",
                    "use_qwix_quantization=true"}},
      {"int8", {"fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=", "fp8_moe_native_fwd=false",
                "fp8_moe_native_bwd_dlhs=false", "quantization=int8"}},
  };
  return modes;
}

std::string Slug(const std::string& name) {
  std::string s;
  for (char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      s += c;
    } else if (!s.empty() && s.back() != '_') {
      s += '_';
    }
  }
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

// The keys each mode sets itself: a user's value would make every mode the
// same run (run_name: all six in one directory, each deleting the last).
constexpr const char* kModeKeys[] = {"run_name", "fp8_moe_fake_quant", "fp8_fake_quant_hoist",
                                     "fp8_moe_native_fwd", "fp8_moe_native_bwd_dlhs",
                                     "quantization", "use_qwix_quantization"};

// Written into every run directory the bench makes; a directory without it
// is never deleted (it may be a user's run, checkpoints and all).
constexpr const char* kMarker = ".fp8moe_bench_train";

Status CheckKeys(const std::vector<std::string>& keys) {
  for (const std::string& kv : keys) {
    const std::string key = kv.substr(0, kv.find('='));
    for (const char* own : kModeKeys) {
      if (key == own) {
        return InvalidArgument("bench train sets '" + key +
                                    "' itself for each mode (its runs go to "
                                    "<base_output_directory>/<mode>); drop '" + kv + "'");
      }
    }
  }
  return OkStatus();
}

// Refuses an existing `dir` that the bench did not make.
Status CheckBenchRun(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::exists(dir / kMarker, ec)) {
    return FailedPrecondition(
        dir.string() + " exists and was not made by bench train (no " + kMarker +
        " in it); it is left alone: pass another base_output_directory= or move it away");
  }
  return OkStatus();
}

// Empties `dir` for a fresh run when the bench made it; refuses any other
// existing directory.
Status ClearBenchRun(const fs::path& dir) {
  FP8MOE_RETURN_IF_ERROR(CheckBenchRun(dir));
  std::error_code ec;
  if (!fs::exists(dir, ec)) return OkStatus();
  fs::remove_all(dir, ec);
  if (ec) return IoError("cannot remove " + dir.string() + ": " + ec.message());
  return OkStatus();
}

}  // namespace

int BenchTrain(const BenchOptions& opt, const std::vector<std::string>& keys,
               const DrawRuns& draw_runs) {
  omp_set_num_threads(opt.threads);
  const bool json_out = opt.json;
  // The bench's own defaults, before the user's keys: a short schedule, no
  // checkpoints, its own output directory.
  if (Status st = CheckKeys(keys); !st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return 2;
  }
  std::vector<std::string> base = {"steps=400", "eval_interval=100", "enable_checkpointing=false",
                                   "base_output_directory=runs/bench_train"};
  base.insert(base.end(), keys.begin(), keys.end());
  struct Row {
    std::string mode;
    TrainSummary s;
  };
  std::vector<Row> rows;
  std::vector<std::string> dirs;
  // Every mode's directory, <base_output_directory>/<mode> (CheckKeys
  // refused run_name), is checked before the first run: minutes of training
  // before a refusal would waste them. Bad keys are reported by the loop.
  if (auto raw = LoadConfig(TrainConfigSchema(), "", base); raw.ok()) {
    const fs::path out = raw->GetString("base_output_directory");
    for (const Mode& m : Modes()) {
      if (Status st = CheckBenchRun(out / Slug(m.name)); !st.ok()) {
        std::fprintf(stderr, "error: %s\n", st.message().c_str());
        return 2;
      }
    }
  }
  for (const Mode& m : Modes()) {
    std::vector<std::string> flags = base;
    flags.insert(flags.begin(), m.flags.begin(), m.flags.end());
    flags.insert(flags.begin(), "run_name=" + Slug(m.name));
    // LoadTrainConfig, as `fp8moe train` reads its flags: model_name's
    // preset under the keys (reading the keys alone ignored it).
    auto cfg = LoadTrainConfig("", flags);
    if (!cfg.ok()) {
      std::fprintf(stderr, "error: %s: %s\n", m.name, cfg.status().message().c_str());
      return 2;
    }
    const fs::path dir = fs::path(cfg->base_output_directory) / cfg->run_name;
    if (Status st = ClearBenchRun(dir); !st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return st.code() == StatusCode::kInternal ? 1 : 2;
    }
    {
      std::error_code ec;
      fs::create_directories(dir, ec);
      std::FILE* f = ec ? nullptr : std::fopen((dir / kMarker).c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "error: cannot write %s\n", (dir / kMarker).c_str());
        return 2;
      }
      std::fputs("made by fp8moe bench train; the next bench train empties this directory\n", f);
      std::fclose(f);
    }
    if (!json_out) {
      std::fprintf(stderr, "  %-16s %lld steps ...", m.name, static_cast<long long>(cfg->steps));
      std::fflush(stderr);
    }
    TrainOptions o;
    o.quiet = true;
    auto s = Train(*cfg, o);
    if (!s.ok()) {
      std::fprintf(stderr, "\nerror: %s: %s\n", m.name, s.status().message().c_str());
      return s.status().code() == StatusCode::kInternal ? 1 : 2;
    }
    if (!json_out) {
      std::fprintf(stderr, " eval %.4f, %.1f ms/step\n", *s->final_eval_loss, s->mean_step_time_s * 1e3);
    }
    rows.push_back({m.name, *s});
    dirs.push_back(s->run_dir);
  }
  const double none = *rows[0].s.final_eval_loss;
  const double fake_ms = rows[1].s.mean_step_time_s;
  const double native = *rows[3].s.final_eval_loss;
  const double native_gap = (native - none) / none;
  const std::string png = (fs::path(rows[0].s.run_dir).parent_path() / "bench_train.png").string();
  if (json_out) {
    nlohmann::json j = {{"bench", "train"}, {"simd_target", SimdTargetName()}, {"png", png}};
    nlohmann::json rs = nlohmann::json::array();
    for (const Row& r : rows) {
      rs.push_back({{"mode", r.mode},
                    {"quantization_mode", r.s.quantization_mode},
                    {"steps", r.s.steps},
                    {"final_eval_loss", *r.s.final_eval_loss},
                    {"final_loss", r.s.final_loss},
                    {"entropy_floor", r.s.entropy_floor ? nlohmann::json(*r.s.entropy_floor) : nlohmann::json(nullptr)},
                    {"mean_step_time_s", r.s.mean_step_time_s},
                    {"tokens_per_s", r.s.tokens_per_s},
                    {"allocations_per_step", r.s.allocations_per_step},
                    {"peak_bytes", r.s.peak_bytes}});
    }
    j["rows"] = rs;
    j["native_vs_none_eval_loss"] = native_gap;
    j["native_within_1pct"] = std::fabs(native_gap) <= 0.01;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("\nfp8moe bench train: %lld steps per mode, one seed, SIMD %s\n",
                static_cast<long long>(rows[0].s.steps), SimdTargetName());
    std::printf("  %-16s %-16s %10s %9s %10s %9s %10s %11s %9s\n", "mode", "QAT mode", "eval loss",
                "vs none", "step ms", "vs fake", "tokens/s", "allocs/step", "peak MiB");
    for (const Row& r : rows) {
      std::printf("  %-16s %-16s %10.4f %+8.2f%% %10.2f %9.3f %10.0f %11.2f %9.1f\n", r.mode.c_str(),
                  r.s.quantization_mode.c_str(), *r.s.final_eval_loss,
                  100.0 * (*r.s.final_eval_loss - none) / none, r.s.mean_step_time_s * 1e3,
                  r.s.mean_step_time_s / fake_ms, r.s.tokens_per_s, r.s.allocations_per_step,
                  static_cast<double>(r.s.peak_bytes) / (1 << 20));
    }
    if (rows[0].s.entropy_floor) std::printf("  entropy floor of the data: %.4f nats/token\n", *rows[0].s.entropy_floor);
    std::printf("  native fwd+dlhs vs none final eval loss: %+.2f%% (%s: must be within 1%%)\n",
                100.0 * native_gap, std::fabs(native_gap) <= 0.01 ? "ok" : "NOT MET");
    std::printf("  step ms: mean over the steps after the first (eval and logging excluded); "
                "allocs/step: library allocations per step after the first (target 0); peak: "
                "library high-water mark of the run\n");
  }
  std::fflush(stdout);
  return draw_runs(dirs, png);
}

}  // namespace fp8moe::bench
