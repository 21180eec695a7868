// What a training run tells the user and writes beside its checkpoints
// (internal to train/; include/fp8moe/train.h names the files): the header
// and the progress line on the terminal, metrics.jsonl (one object per step,
// FP8 health every log_period steps), summary.json and the final summary.
// Only rank 0 writes files; a quiet run (every rank but 0) prints nothing.
#ifndef FP8MOE_TRAIN_METRICS_WRITER_H_
#define FP8MOE_TRAIN_METRICS_WRITER_H_

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/model.h"
#include "fp8moe/moe.h"
#include "fp8moe/status.h"
#include "fp8moe/train.h"

namespace fp8moe::internal {

// Writes `text` to `path` atomically (temporary file + rename).
Status WriteTextAtomically(const std::string& path, const std::string& text);

// The FP8 health of one MoE layer on a log step: its expert weights (counted
// over the whole tensors, every ring rank's experts) and the activations
// that feed them (rank 0's slice). A part with values == 0 is not logged.
struct LayerFp8Health {
  Fp8Health wi, wo, wi_lhs, wo_lhs;
};

// One step's line of metrics.jsonl beside its StepReport: what the model
// measured (the ranks' sums) and where the step's time went.
struct StepMetrics {
  ModelStepInfo info;            // loss, aux_loss, reruns, expert_load [L][E]
  double gather_time_s = 0;      // weight gathers with the experts' quantization
  double compute_time_s = 0;     // forward + backward with the MoE count all-reduces
  int64_t nonfinite_steps = 0;   // of the run so far, this one included
  // What was non-finite: "loss", the first gradient's name, or "" (none).
  std::string nonfinite;
  // [L] on log steps of rank 0 (logged even where no part counted values).
  std::optional<std::vector<LayerFp8Health>> fp8_health;
  // routed_bias: [L][E] every layer's router_bias after this step's update
  // (empty for a dense layer), on log steps of rank 0.
  std::optional<std::vector<std::vector<float>>> router_bias;
};

class MetricsWriter {
 public:
  // `lead`: this rank writes the files; `quiet`: it prints nothing.
  // `tokens`: of the global batch (N = B*S); `pairs`: N * num_experts_per_tok.
  MetricsWriter(bool lead, bool quiet, std::string run_dir, int64_t tokens, int64_t pairs);
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();

  // Whether the progress is a live line on a terminal (stderr is one and
  // the run is not quiet): messages printed mid-run start on a new line.
  bool tty() const { return tty_; }

  // Opens metrics.jsonl for this run: a resumed run (resumed_step > 0)
  // keeps the complete lines of the steps its checkpoint covers and appends,
  // a fresh one starts it anew. Rank 0 only.
  Status Open(int64_t resumed_step);

  // The header: run directory, model, data, global batch, entropy floor and
  // the step resumed from; then the settings a resume changed (warning).
  void PrintStart(const TrainConfig& c, const ModelConfig& mc, const TrainLayout& layout,
                  const std::string& data_description, const TrainSummary& sum) const;

  // Appends step `rep`'s line (eval_loss on eval steps). Rank 0 only.
  Status Append(const StepReport& rep, const StepMetrics& m, bool multi_rank);

  // A live line on a terminal, a log line every log_period steps (and the
  // last) otherwise: `elapsed` seconds for `ran` steps of this process.
  void Progress(const TrainConfig& c, const StepReport& rep, double loss,
                const std::optional<double>& last_eval, double elapsed, int64_t ran) const;

  // Ends the live line before a message of its own or the summary.
  void EndLine() const;

  // summary.json (rank 0) and the final summary on the terminal.
  // `losses`: the training losses final_loss averages (none: null).
  Status WriteSummary(const TrainSummary& sum, size_t losses, double wall_time_s,
                      const std::string& config_yaml) const;
  void PrintSummary(const TrainSummary& sum, size_t losses, double wall_time_s) const;

  // The summary of a run that had finished before it was resumed.
  void PrintFinished(const TrainSummary& sum) const;

 private:
  bool lead_, quiet_, tty_;
  std::string run_dir_, metrics_path_;
  int64_t tokens_, pairs_;
  std::FILE* metrics_ = nullptr;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_METRICS_WRITER_H_
