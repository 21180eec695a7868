// The training loop (docs/design.md §1, §7, §11): `fp8moe train [config.yml] [key=value]`.
//
// A run lives in <base_output_directory>/<run_name>/:
//   metrics.jsonl   one JSON object per step (loss, lr, grad_norm, tokens/s,
//                   step time, router load, reruns; eval_loss on eval steps;
//                   FP8 health every log_period steps)
//   summary.json    the final figures and the config
//   checkpoints/    step_NNNNNNNN.safetensors: weights, AdamW moments, step,
//                   RNG state, data position and the config; written
//                   atomically every checkpoint_period steps and at the end.
// A run whose directory holds a checkpoint resumes from the newest one and
// gives the same bits as an uninterrupted run.
//
// The trainer owns the f32 master weights and quantizes the expert weights
// once per step (PrepareMoeWeights), runs the model's forward and backward,
// clips the global gradient norm and applies AdamW. On N ranks
// (TrainOptions::comm) it runs FSDP (sharded masters and moments, the experts'
// FP8 codes all-gathered once per step, gradients reduce-scattered) and the
// ring of experts (ici_expert_parallelism), with checkpoints that resume on
// any rank count (docs/distributed.md).
#ifndef FP8MOE_TRAIN_H_
#define FP8MOE_TRAIN_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/config.h"
#include "fp8moe/data.h"
#include "fp8moe/dist.h"
#include "fp8moe/flag_table.h"
#include "fp8moe/model.h"
#include "fp8moe/status.h"

namespace fp8moe {

// The typed trainer settings; field names follow the flags (the table below
// binds each flag to its field). These initializers are the defaults of
// `fp8moe train` (configs/base.yml): the small model, its MoE layer in native
// FP8 QAT (fp8_moe_native_fwd + fp8_moe_native_bwd_dlhs) with 4 experts, and
// the synthetic corpus.
struct TrainConfig {
  // MaxText's model_name: a preset (configs/models/NAME.yml) that
  // LoadTrainConfig lays under the user's settings; "default": none. A
  // preset's flags cannot be changed without override_model_config.
  std::string model_name = "default";
  bool override_model_config = false;
  ModelConfig model{.moe = {.num_experts = 4,
                            .fp8_moe_fake_quant = true,
                            .fp8_fake_quant_hoist = Fp8FakeQuantHoist::kGather8,
                            .fp8_moe_native_fwd = true,
                            .fp8_moe_native_bwd_dlhs = true}};
  // The dataset's flags; its seq_len, vocab_size (the model's) and batch
  // (the global batch, CheckTrainLayout's) are set by Train.
  DataConfig data;
  // MaxText's meaning: the sequences each rank (each device) trains on per
  // step, so global_batch_size_to_train_on = per_device_batch_size x the
  // ranks of the job (CheckTrainLayout; a fraction where that is a whole
  // number). TrainConfigFrom sets model.batch, the most sequences one rank's
  // model runs, to its ceiling.
  double per_device_batch_size = 16;
  std::string run_name = "fp8moe_run", base_output_directory = "runs";
  bool enable_checkpointing = true;
  int64_t checkpoint_period = 500, log_period = 50;
  uint64_t init_weights_seed = 0;
  int64_t steps = 1200;
  double learning_rate = 0.003, warmup_steps_fraction = 0.05,
         cosine_learning_rate_final_fraction = 0.1;
  double adam_b1 = 0.9, adam_b2 = 0.95, adam_eps = 1e-8, adam_weight_decay = 0.01;
  double gradient_clipping_threshold = 1.0;
  int64_t max_nonfinite_steps = 5;
  int64_t eval_interval = 100, eval_steps = 8;
  // MaxText's mesh axes (-1: the ranks the other leaves); checked against the
  // job by CheckDistributedConfig before any work.
  int64_t ici_fsdp_parallelism = -1, ici_expert_parallelism = 1;
};

// Every flag of `fp8moe train` bound to its TrainConfig field, in base.yml's
// sections: the trainer's own (MaxText's names where it has them), the
// model's (ModelConfigFlags), the data's (DataConfigFlags) and the MoE and QAT
// flags (MoeConfigFlags), with TrainConfig{}'s values as the defaults.
const FlagTable<TrainConfig>& TrainConfigFlags();

// TrainConfigFlags().Schema(): what LoadConfig reads for `fp8moe train`.
ConfigSchema TrainConfigSchema();

// configs/base.yml as it must read: every flag of TrainConfigSchema() at its
// default with its comment, in sections. A test keeps the file equal to it;
// `fp8moe train --print-base-config` prints it.
std::string BaseConfigYaml();

// Converts and validates a Config of TrainConfigSchema(): the MoE layer's
// rules first (ValidateMoeConfig's report), then every value outside its
// flag's range and every rule of the trainer named with its flag and fix in
// one InvalidArgument, then the model's shape (ValidateModelConfig).
Result<TrainConfig> TrainConfigFrom(const Config& config);

// The flags' defaults, then the preset of model_name (given in the file or
// the overrides; configs/models/NAME.yml), then the file at yaml_path (none
// when empty), then the overrides in order, later settings winning; then
// TrainConfigFrom. A flag the preset sets that the file or an override sets
// to another value is an InvalidArgument naming both values, unless
// override_model_config=true (MaxText's rule); an unknown model_name lists
// the presets.
Result<TrainConfig> LoadTrainConfig(const std::string& yaml_path,
                                    const std::vector<std::string>& overrides);

// The config as YAML: every flag at its value under its doc, as a config
// file; LoadTrainConfig of it gives the same TrainConfig. Checkpoints and
// summary.json store it, and the ranks compare its fingerprint. Fails only
// for a field no flag value expresses (set by hand, not by TrainConfigFrom).
Result<std::string> TrainConfigYaml(const TrainConfig& config);

// What one rank of a training run holds at its peak, from the config and the
// layout alone (bytes; each saturates at UINT64_MAX): `fsdp` x `expert`
// ranks (ici_fsdp_parallelism x ici_expert_parallelism; 1 x 1: one rank).
struct TrainMemoryPlan {
  uint64_t weights_bytes = 0;     // weights, gradients, FSDP shards, checkpoint buffer
  uint64_t expert_bytes = 0;      // expert weights as the QAT mode presents them
  uint64_t activation_bytes = 0;  // activations kept for the backward, logits, gradients
  uint64_t data_bytes = 0;        // synthetic tables or the text file
  uint64_t scratch_bytes = 0;     // the kernels' scratch, with a margin
  uint64_t total_bytes = 0;
};
TrainMemoryPlan PlanTrainMemory(const TrainConfig& config, int64_t fsdp = 1, int64_t expert = 1);

// Checks the plan against the memory cap (CheckMemoryRequest): Train calls it
// before it creates a directory or allocates anything. ResourceExhausted names
// the bytes of each part, the total and the cap.
Status CheckTrainMemory(const TrainConfig& config, int64_t fsdp = 1, int64_t expert = 1);

// The learning rate of 0-based step `step`: linear warmup from lr/W to lr over
// the first W = round(warmup_steps_fraction * steps) steps, then a cosine
// from lr down to lr * cosine_learning_rate_final_fraction at the last step.
double LearningRate(const TrainConfig& config, int64_t step);

// What a caller sees of each step (benchmarks, tests).
struct StepReport {
  int64_t step = 0;  // 1-based, after the update
  double loss = 0, lr = 0, grad_norm = 0, step_time_s = 0;
  std::optional<double> eval_loss;
  bool skipped = false;          // non-finite loss or gradient
  int64_t allocations = 0;       // library allocations during the step
  // Bytes this rank sent during the step (0 on one rank), and of them the
  // expert weights' gathers (gather8: codes + amax all-reduce; bf16).
  int64_t comm_bytes = 0, expert_gather_bytes = 0;
  int threads = 0;               // OpenMP threads of this rank during the step
};

struct TrainSummary {
  std::string run_dir;
  int64_t global_batch_size_to_train_on = 0;  // sequences of one step, all ranks
  int64_t steps = 0;             // steps run in total (resumed ones included)
  int64_t resumed_from = 0;      // 0: a fresh start
  double final_loss = 0;         // mean training loss of the last log_period steps
  std::optional<double> final_eval_loss;
  std::optional<double> entropy_floor;
  double mean_step_time_s = 0;   // over this process's steps after the first
  double tokens_per_s = 0;
  int64_t nonfinite_steps = 0;
  std::string quantization_mode;  // MoeQatModeName; hand_crafted adds the scheme ("hand_crafted int8")
  int64_t peak_bytes = 0;         // library memory high-water mark (after setup)
  int64_t memory_plan_bytes = 0;  // what PlanTrainMemory allowed for this rank
  double allocations_per_step = 0;  // after this process's first step
  int threads_min = 0, threads_max = 0;  // this rank's threads over its steps
  // A resumed run: the settings that differ from the checkpoint's config
  // (bookkeeping flags aside), also printed as a warning.
  struct ConfigChange {
    std::string key, saved, now;
  };
  std::vector<ConfigChange> resume_changes;
};

struct TrainOptions {
  bool quiet = false;     // no progress, log lines or final summary on the terminal
  std::function<void(const StepReport&)> on_step;
  // Run as many threads as the cores other processes leave free, measured
  // every half second (base/core_share.h), between 1 and OpenMP's maximum;
  // false: OpenMP's thread count throughout. The bits do not change.
  bool threads_follow_load = false;
  // Tests: stop (as if killed) right after this many steps of this process.
  int64_t stop_after_steps = 0;
  // The ranks of the job (every rank calls Train with the same config);
  // null: one rank.
  Communicator* comm = nullptr;
};

// How the ranks of a run share its work: CheckTrainLayout's answer, the same
// on every rank but for this rank's own place and sequences.
struct TrainLayout {
  ParallelLayout mesh;           // ici_fsdp x ici_expert, and this rank's place in it
  int ranks = 1;                 // of the job: mesh.fsdp * mesh.expert
  int64_t global_batch = 0;      // sequences of one step (global_batch_size_to_train_on)
  int64_t first_sequence = 0;    // this rank's sequences of the global batch:
  int64_t sequences = 0;         //   [first_sequence, first_sequence + sequences)
  int64_t fewest_sequences = 0;  // the smallest share of any rank
};

// Every rank of `comm` calls this first, before any work. The ranks compare
// their configs (CheckDistributedConfig on TrainConfigYaml: a flag that
// differs is one error on every rank, naming it), the mesh must cover the
// ranks, and the trainer must run on it: num_experts divides over the ring
// of experts; the global batch, per_device_batch_size x ranks (every rank is
// a data-parallel device, expert-parallel ones too, as in MaxText), is a
// whole number of at least one sequence a rank and at most 2^31 - 1,
// split in consecutive shares (G / N each, the first G % N ranks one more;
// equal shares on a ring of experts); and a rank's tokens hold
// num_moe_token_chunks chunks. The data order depends on the global batch
// alone. The same answer on every rank.
Result<TrainLayout> CheckTrainLayout(const TrainConfig& config, Communicator& comm);

// Runs (or resumes) the run the config describes on the layout
// CheckTrainLayout gave for this config and options.comm (every rank calls
// it with the same config). Errors: InvalidArgument / NotFound /
// FailedPrecondition for bad input (flags, data, a checkpoint of another
// model or mode), IoError when the run directory or a checkpoint cannot be
// written (the previous checkpoint stays intact), DataLoss for an unreadable
// checkpoint, OutOfRange after max_nonfinite_steps non-finite steps.
Result<TrainSummary> Train(const TrainConfig& config, const TrainLayout& layout,
                           const TrainOptions& options);

// CheckTrainLayout on options.comm (one rank when null), then Train.
Result<TrainSummary> Train(const TrainConfig& config, const TrainOptions& options = {});

}  // namespace fp8moe

#endif  // FP8MOE_TRAIN_H_
