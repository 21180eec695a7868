// The training loop in named steps (internal to train/; the API is
// include/fp8moe/train.h, whose Train is Setup then Run):
//
//   Setup     ranks and sub-communicators, the memory check, the run
//             directory, its lock and what to resume from, the data, the
//             FSDP state, the model and the weights (drawn or loaded);
//   Run       per step: Step, the FP8 health on log steps, Evaluate on eval
//             steps, the metrics line and the progress, Save on checkpoint
//             steps; then the summary;
//   Step      one optimizer step: gather the weights, forward + backward,
//             the ranks' loss sums, reduce the gradients, the non-finite
//             check, the clip and AdamW;
//   Evaluate  the mean loss of the eval batches;
//   Save      a checkpoint of the whole run state.
//
// Every rank of the job runs the same calls in the same order (the
// collectives inside them pair up); rank 0 writes the files.
#ifndef FP8MOE_TRAIN_TRAINER_H_
#define FP8MOE_TRAIN_TRAINER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/context.h"
#include "fp8moe/data.h"
#include "fp8moe/model.h"
#include "fp8moe/moe.h"
#include "fp8moe/status.h"
#include "base/core_share.h"
#include "fp8moe/train.h"
#include "train/checkpoint.h"
#include "train/fsdp.h"
#include "train/metrics_writer.h"

namespace fp8moe::internal {

// An exclusive flock on <run_dir>/train.lock, held until destruction.
class RunLock {
 public:
  RunLock() = default;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();
  Status Acquire(const std::filesystem::path& path);

 private:
  int fd_ = -1;
};

class Trainer {
 public:
  // `layout`: CheckTrainLayout's for `config` and options.comm (null: one rank).
  Trainer(const TrainConfig& config, const TrainLayout& layout, const TrainOptions& options);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  ~Trainer();

  // Everything before the first step; nothing is created or allocated when
  // it refuses the config, the memory or the data. A run that had already
  // finished (resumed at or past `steps` with its summary.json) is not
  // trained again: Run then returns that summary.
  Status Setup();

  // The steps from the one resumed to `steps` (or stop_after_steps), the
  // final eval and the summary.
  Result<TrainSummary> Run();

 private:
  // Setup's parts, in order.
  Status SetupRanks();
  Status SetupMemoryAndData();
  Status ChooseResume();
  Status SetupWeights();
  bool LoadFinishedSummary();
  Status SetupModel();

  // Gathers the weights for a forward and prepares the experts.
  Status Gather();
  // Step `s` (0-based): the weights updated unless a loss or gradient is
  // non-finite (rep.skipped). m: what metrics.jsonl adds.
  Result<StepReport> Step(int64_t s, int threads, StepMetrics* m);
  // The losses, router loads and reruns of the global batch (the ranks' sums).
  Status SumStepInfoOverRanks(ModelStepInfo* info);
  // Clip and AdamW of step `s` with the gradient norm `norm`; an error when
  // the update made a weight non-finite.
  // load [L][E]: the global batch's expert loads (routed_bias's update).
  Status Update(int64_t s, double lr, double norm,
                const std::vector<std::vector<int32_t>>& load);
  // The FP8 health of every MoE layer after a step (rank 0, log steps).
  Result<std::vector<LayerFp8Health>> Fp8HealthOfLayers();
  Result<double> Evaluate();
  Status Save(int64_t step);
  // Bytes this rank sent on the job's communicator and, with expert
  // parallelism, on the expert ring and the expert FSDP group.
  int64_t BytesSent() const;
  // Step s (0-based) is a log step (FP8 health, a log line), an eval step,
  // a checkpoint step; the last step is all three.
  bool IsLogStep(int64_t s) const;
  bool IsEvalStep(int64_t s) const;
  bool IsCheckpointStep(int64_t s) const;
  // The OpenMP threads of the next step (threads_follow_load: as many as
  // the cores other processes leave free), tallied for the summary.
  int SetThreads(CoreShare* core_share);
  // The step's time and allocations, for the summary's means.
  void Tally(const StepReport& rep);
  // The training losses final_loss averages: the last log_period finite ones.
  void KeepRecentLoss(double loss);
  // OutOfRange once max_nonfinite_steps steps were skipped.
  Status StopAfterTooManyNonFinite(const StepReport& rep, const StepMetrics& m) const;
  // The figures of the summary after the last step (`completed` in all).
  void Summarize(int64_t completed);

  const TrainConfig& c_;
  const TrainLayout& layout_;
  TrainOptions opt_;
  std::unique_ptr<Communicator> own_comm_;
  Communicator* comm_ = nullptr;
  // Expert parallelism: the expert ring (the P consecutive ranks of one
  // fsdp_index) and the group of the F ranks that hold the same experts.
  std::unique_ptr<Communicator> ring_, expert_group_;
  int F_ = 1;          // ranks that split the batch: all of them
  bool lead_ = false;  // writes files and prints
  // The data reader's model (the whole global batch) and this rank's (its
  // share of the sequences).
  ModelConfig mc_, local_mc_;
  TrainSummary sum_;
  std::filesystem::path run_dir_, ckpt_dir_;
  std::string config_yaml_;
  std::unique_ptr<Dataset> data_;
  RunLock lock_;
  std::optional<std::string> latest_;  // the checkpoint to resume from
  std::optional<Context> ctx_;
  ParamShapeList shapes_;
  std::vector<CheckpointTensor> ckpt_layout_;
  std::unique_ptr<FsdpState> fsdp_;
  TrainState state_;
  bool f32_experts_ = false;
  ModelParams params_, grads_;
  bool finished_ = false;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<Model> model_;
  std::vector<PreparedMoeWeights> prepared_;
  int64_t N_ = 0;  // tokens of the global batch
  std::vector<int32_t> inputs_, targets_;  // [B, S] of the global batch
  const int32_t* my_inputs_ = nullptr;     // this rank's slice of them
  const int32_t* my_targets_ = nullptr;
  double share_ = 1;
  ExpertWeightSource* expert_source_ = nullptr;
  // The loop's bookkeeping for the summary.
  double t_start_ = 0, time_sum_ = 0;
  int64_t timed_ = 0, allocs_after_first_ = 0, ran_ = 0;
  int threads_min_ = 0, threads_max_ = 0;
  std::vector<double> recent_losses_;
  std::optional<double> last_eval_;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_TRAINER_H_
