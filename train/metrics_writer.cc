// The run's files and terminal output (train/metrics_writer.h).
#include "train/metrics_writer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "base/number_text.h"
#include "train/checkpoint.h"

namespace fp8moe::internal {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string Duration(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%.0fs", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%dh%02dm", static_cast<int>(s) / 3600,
                  static_cast<int>(s) % 3600 / 60);
  }
  return buf;
}

std::string Rate(double tokens_per_s) {
  char buf[32];
  if (tokens_per_s >= 1e3) {
    std::snprintf(buf, sizeof(buf), "%.1fk", tokens_per_s / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", tokens_per_s);
  }
  return buf;
}

// metrics.jsonl of a resumed run keeps only the complete lines of steps the
// checkpoint covers.
Status TrimMetrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return OkStatus();
  std::string line, kept;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    if (j["step"].get<int64_t>() <= last_step) kept += line + "\n";
  }
  return WriteTextAtomically(path, kept);
}

json HealthJson(const Fp8Health& h) {
  return {{"saturated", h.saturated}, {"flushed", h.flushed}, {"values", h.values}};
}

// fp8_health of a log step: per layer l, "layers.<l>.wi" / "wo" (weights)
// and "wi_lhs" / "wo_lhs" (activations), each that counted any values.
json Fp8HealthJson(const std::vector<LayerFp8Health>& layers) {
  json health = json::object();
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const LayerFp8Health& h = layers[l];
    if (h.wi.values > 0) health[p + "wi"] = HealthJson(h.wi);
    if (h.wo.values > 0) health[p + "wo"] = HealthJson(h.wo);
    if (h.wi_lhs.values > 0) health[p + "wi_lhs"] = HealthJson(h.wi_lhs);
    if (h.wo_lhs.values > 0) health[p + "wo_lhs"] = HealthJson(h.wo_lhs);
  }
  return health;
}

}  // namespace

Status WriteTextAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return IoError("cannot write '" + path + "' (disk full or not writable?)");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return IoError("cannot write '" + path + "': " + ec.message());
  return OkStatus();
}

MetricsWriter::MetricsWriter(bool lead, bool quiet, std::string run_dir, int64_t tokens,
                             int64_t pairs)
    : lead_(lead),
      quiet_(quiet),
      tty_(!quiet && ::isatty(::fileno(stderr)) != 0),
      run_dir_(std::move(run_dir)),
      metrics_path_((fs::path(run_dir_) / "metrics.jsonl").string()),
      tokens_(tokens),
      pairs_(pairs) {}

MetricsWriter::~MetricsWriter() {
  if (metrics_ != nullptr) std::fclose(metrics_);
}

Status MetricsWriter::Open(int64_t resumed_step) {
  if (!lead_) return OkStatus();
  if (resumed_step > 0) FP8MOE_RETURN_IF_ERROR(TrimMetrics(metrics_path_, resumed_step));
  metrics_ = std::fopen(metrics_path_.c_str(), resumed_step > 0 ? "a" : "w");
  if (metrics_ == nullptr) return IoError("cannot open '" + metrics_path_ + "' for writing");
  return OkStatus();
}

void MetricsWriter::PrintStart(const TrainConfig& c, const ModelConfig& mc,
                               const TrainLayout& layout, const std::string& data_description,
                               const TrainSummary& sum) const {
  const int F = layout.ranks;
  if (!quiet_) {
    std::printf("fp8moe train: %s\n  model %s, S=%lld, B=%lld; QAT mode %s\n  data %s\n"
                "  global_batch_size_to_train_on %lld (per_device_batch_size=%s x %d rank%s)\n",
                run_dir_.c_str(), ModelSignature(mc).c_str(),
                static_cast<long long>(mc.seq_len), static_cast<long long>(mc.batch),
                sum.quantization_mode.c_str(), data_description.c_str(),
                static_cast<long long>(layout.global_batch),
                ShortestDecimal(c.per_device_batch_size).c_str(), F, F == 1 ? "" : "s");
    if (sum.entropy_floor) std::printf("  entropy floor %.4f nats/token\n", *sum.entropy_floor);
    if (sum.resumed_from > 0) {
      std::printf("  resumed from step %lld\n", static_cast<long long>(sum.resumed_from));
    }
    std::fflush(stdout);
  }
  if (lead_ && !sum.resume_changes.empty()) {
    // Not an error (a longer schedule or a lower learning rate is a normal
    // continuation), but no longer the run the checkpoint began.
    std::fprintf(stderr, "warning: resuming %s with %zu setting%s changed since its checkpoint "
                 "was saved:\n", run_dir_.c_str(), sum.resume_changes.size(),
                 sum.resume_changes.size() == 1 ? "" : "s");
    for (const auto& ch : sum.resume_changes) {
      std::fprintf(stderr, "  %s: %s -> %s%s\n", ch.key.c_str(), ch.saved.c_str(), ch.now.c_str(),
                   ch.key == "steps" ? " (the learning-rate schedule follows the new steps)" : "");
    }
    std::fflush(stderr);
  }
}

Status MetricsWriter::Append(const StepReport& rep, const StepMetrics& m, bool multi_rank) {
  if (!lead_) return OkStatus();
  const ModelStepInfo& info = m.info;
  json j = {{"step", rep.step},
            {"loss", rep.skipped ? json(nullptr) : json(info.loss)},
            {"aux_loss", info.aux_loss},
            {"lr", rep.lr},
            {"grad_norm", rep.grad_norm},
            {"step_time_s", rep.step_time_s},
            {"tokens_per_s", static_cast<double>(tokens_) / rep.step_time_s},
            {"dropless_reruns", info.dropless_reruns},
            {"dropped_tokens", 0},
            {"threads", rep.threads},
            {"nonfinite_steps", m.nonfinite_steps}};
  if (multi_rank) {
    j["comm_bytes"] = rep.comm_bytes;  // rank 0's
    // Rank 0's time in the weight gathers (with the experts' quantization)
    // and in forward + backward (with the MoE layers' count all-reduces);
    // the rest of step_time_s is the gradient reduce-scatter and the update.
    j["gather_time_s"] = m.gather_time_s;
    j["compute_time_s"] = m.compute_time_s;
    j["expert_gather_bytes"] = rep.expert_gather_bytes;
  }
  json load = json::array();
  for (const auto& layer : info.expert_load) {
    json l = json::array();
    const double pairs = static_cast<double>(pairs_);
    for (int32_t cnt : layer) l.push_back(static_cast<double>(cnt) / pairs);
    load.push_back(l);
  }
  j["expert_load"] = load;
  if (m.fp8_health) j["fp8_health"] = Fp8HealthJson(*m.fp8_health);
  if (m.router_bias) j["router_bias"] = *m.router_bias;
  if (rep.eval_loss) j["eval_loss"] = *rep.eval_loss;
  const std::string line = j.dump() + "\n";
  if (std::fputs(line.c_str(), metrics_) < 0 || std::fflush(metrics_) != 0) {
    return IoError("cannot append to '" + metrics_path_ + "' (disk full?)");
  }
  return OkStatus();
}

void MetricsWriter::Progress(const TrainConfig& c, const StepReport& rep, double loss,
                             const std::optional<double>& last_eval, double elapsed,
                             int64_t ran) const {
  if (quiet_) return;
  const int64_t s = rep.step - 1;
  const bool last = rep.step == c.steps;
  const double eta = elapsed / static_cast<double>(ran) * static_cast<double>(c.steps - s - 1);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "step %lld/%lld  loss %.4f%s  lr %.2e  %s tok/s  ETA %s",
                static_cast<long long>(s + 1), static_cast<long long>(c.steps), loss,
                last_eval ? ("  eval " + std::to_string(*last_eval).substr(0, 6)).c_str() : "",
                rep.lr, Rate(static_cast<double>(tokens_) / rep.step_time_s).c_str(),
                Duration(eta).c_str());
  if (tty_) {
    std::fprintf(stderr, "\r%s\033[K", buf);
  } else if ((s + 1) % c.log_period == 0 || last) {
    std::printf("%s\n", buf);
    std::fflush(stdout);
  }
}

void MetricsWriter::EndLine() const {
  if (tty_) std::fprintf(stderr, "\n");
}

Status MetricsWriter::WriteSummary(const TrainSummary& sum, size_t losses, double wall_time_s,
                                   const std::string& config_yaml) const {
  json changes = json::array();
  for (const auto& ch : sum.resume_changes) {
    changes.push_back({{"key", ch.key}, {"saved", ch.saved}, {"now", ch.now}});
  }
  json sj = {{"steps", sum.steps},
             {"global_batch_size_to_train_on", sum.global_batch_size_to_train_on},
             {"resumed_from", sum.resumed_from},
             {"final_loss", losses == 0 ? json(nullptr) : json(sum.final_loss)},
             {"final_eval_loss", *sum.final_eval_loss},
             {"entropy_floor", sum.entropy_floor ? json(*sum.entropy_floor) : json(nullptr)},
             {"mean_step_time_s", sum.mean_step_time_s},
             {"tokens_per_s", sum.tokens_per_s},
             {"quantization_mode", sum.quantization_mode},
             {"nonfinite_steps", sum.nonfinite_steps},
             {"peak_bytes", sum.peak_bytes},
             {"memory_plan_bytes", sum.memory_plan_bytes},
             {"allocations_per_step", sum.allocations_per_step},
             {"threads_min", sum.threads_min},
             {"threads_max", sum.threads_max},
             {"resume_changes", changes},
             {"wall_time_s", wall_time_s},
             {"config", config_yaml}};
  if (!lead_) return OkStatus();
  return WriteTextAtomically((fs::path(run_dir_) / "summary.json").string(), sj.dump(2) + "\n");
}

void MetricsWriter::PrintSummary(const TrainSummary& sum, size_t losses,
                                 double wall_time_s) const {
  if (quiet_) return;
  std::printf("\nfp8moe train: done, %s\n", run_dir_.c_str());
  std::printf("  steps            %lld%s\n", static_cast<long long>(sum.steps),
              sum.resumed_from > 0
                  ? (" (resumed from " + std::to_string(sum.resumed_from) + ")").c_str()
                  : "");
  if (losses > 0) {
    std::printf("  final loss       %.4f  (train, mean of the last %zu steps)\n", sum.final_loss,
                losses);
  }
  std::printf("  final eval loss  %.4f\n", *sum.final_eval_loss);
  if (sum.entropy_floor) {
    std::printf("  entropy floor    %.4f  (eval loss - floor = %.4f nats)\n", *sum.entropy_floor,
                *sum.final_eval_loss - *sum.entropy_floor);
  }
  std::printf("  QAT mode         %s\n", sum.quantization_mode.c_str());
  std::printf("  step time        %.4f s mean, %s tokens/s\n", sum.mean_step_time_s,
              Rate(sum.tokens_per_s).c_str());
  std::printf("  wall time        %s\n", Duration(wall_time_s).c_str());
  if (sum.threads_min != sum.threads_max) {
    std::printf("  threads          %d-%d (fewer while other processes kept cores busy)\n",
                sum.threads_min, sum.threads_max);
  } else if (sum.threads_max > 0) {
    std::printf("  threads          %d\n", sum.threads_max);
  }
  if (sum.nonfinite_steps > 0) {
    std::printf("  skipped steps    %lld (non-finite)\n", static_cast<long long>(sum.nonfinite_steps));
  }
  std::fflush(stdout);
}

void MetricsWriter::PrintFinished(const TrainSummary& sum) const {
  if (quiet_) return;
  std::printf("fp8moe train: %s already finished at step %lld (raise steps= to train "
              "further, or use another run_name)\n  final eval loss  %.4f\n",
              run_dir_.c_str(), static_cast<long long>(sum.steps), *sum.final_eval_loss);
  if (sum.entropy_floor) {
    std::printf("  entropy floor    %.4f  (eval loss - floor = %.4f nats)\n",
                *sum.entropy_floor, *sum.final_eval_loss - *sum.entropy_floor);
  }
}

}  // namespace fp8moe::internal
