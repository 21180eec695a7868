// The flags of `fp8moe train` (TrainConfigFlags), configs/base.yml as
// generated from them, and their conversion to a TrainConfig with the
// trainer's rules.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "base/number_text.h"
#include "fp8moe/train.h"
#include "train/model_presets.h"

namespace fp8moe {
namespace {

// The most sequences one rank runs: an int32 size of the kernels.
constexpr int64_t kMaxModelDim = 2147483647;

// Batches of one evaluation: a million is already hours; more only looks
// like a hang (and eval batch indices times the batch size stay in int64).
constexpr int64_t kMaxEvalSteps = 1000000;

// The smallest normal float32: the AdamW update runs in float32, where a
// smaller epsilon rounds to 0 and 0 / 0 turns every weight whose gradient is
// 0 into NaN.
constexpr double kMinAdamEps = 1.1754943508222875e-38;

FlagTable<TrainConfig> MakeTrainFlags() {
  using T = TrainConfig;
  const FlagRange not_negative = {.min = 0};
  FlagTable<TrainConfig> t;
  // Bookkeeping (ResumeNeutral): output names, periods and the rank layout do
  // not change what is trained.
  t.Section("Run, output and checkpoints");
  t.String("run_name", &T::run_name,
           "Name of the run: its files go to <base_output_directory>/<run_name>/. A directory "
           "that holds a checkpoint is resumed from it.")
      .ResumeNeutral();
  t.String("base_output_directory", &T::base_output_directory, "Directory that holds the runs.")
      .ResumeNeutral();
  t.Bool("enable_checkpointing", &T::enable_checkpointing,
         "Write checkpoints (and resume from them).")
      .ResumeNeutral();
  t.Int("checkpoint_period", &T::checkpoint_period,
        "Steps between checkpoints; one is always written at the end. 0: only at the end.",
        {.min = 0, .note = " (0: only at the end)"})
      .ResumeNeutral();
  t.Int("log_period", &T::log_period,
        "Steps between log lines (when not on a terminal) and FP8 health records in "
        "metrics.jsonl.",
        {.min = 1})
      .ResumeNeutral();
  t.Section("Model shape (a decoder-only MoE transformer; names follow MaxText)");
  t.String("model_name", &T::model_name,
           "A model preset: configs/models/<model_name>.yml sets the architecture's flags "
           "(fp8moe train model_name=NAME --print-config shows them resolved). default: none.")
      .ResumeNeutral();
  t.Bool("override_model_config", &T::override_model_config,
         "Allow the config file and the command line to change flags that the model_name "
         "preset sets (otherwise an error).")
      .ResumeNeutral();
  t.Nest(&T::model, ModelConfigFlags());
  t.Float("per_device_batch_size", &T::per_device_batch_size,
          "Sequences each rank trains on per step (MaxText's meaning: per device). The global "
          "batch global_batch_size_to_train_on is per_device_batch_size x the ranks of the job "
          "(1 without mpirun) and must be a whole number: a fraction such as 1.5 on 2 ranks "
          "gives 3 sequences, 2 on one rank and 1 on the other. The data order depends on the "
          "global batch alone.",
          {.min = 0,
           .max = static_cast<double>(kMaxModelDim),
           .min_open = true,
           .show_value = true,
           .note = " (the sequences of one rank)"})
      // What is trained is the global batch (compared on resume), which the
      // same flag changes with the ranks and another flag can keep.
      .ResumeNeutral();
  t.Int("init_weights_seed", &T::init_weights_seed, "Seed of the initial weights.", not_negative);
  t.Section("Optimizer (AdamW) and schedule");
  t.Int("steps", &T::steps, "Training steps.", {.min = 1, .show_value = true});
  t.Float("learning_rate", &T::learning_rate, "Peak learning rate.",
          {.min = 0, .min_open = true});
  t.Float("warmup_steps_fraction", &T::warmup_steps_fraction,
          "Fraction of the steps with a linear warmup to the peak.", {.min = 0, .max = 1});
  t.Float("cosine_learning_rate_final_fraction", &T::cosine_learning_rate_final_fraction,
          "After the warmup a cosine decays the rate to this fraction of the peak.",
          {.min = 0, .max = 1});
  t.Float("adam_b1", &T::adam_b1, "AdamW beta1 (first-moment decay).",
          {.min = 0, .max = 1, .max_open = true});
  t.Float("adam_b2", &T::adam_b2, "AdamW beta2 (second-moment decay).",
          {.min = 0, .max = 1, .max_open = true});
  t.Float("adam_eps", &T::adam_eps, "AdamW epsilon added to sqrt(v).",
          {.min = kMinAdamEps,
           .phrase = "must be at least 1.2e-38",
           .note = " (the smallest normal float32; the AdamW update runs in float32)"});
  t.Float("adam_weight_decay", &T::adam_weight_decay,
          "Decoupled weight decay, applied to the matrices (not to the norm gains).",
          not_negative);
  t.Float("gradient_clipping_threshold", &T::gradient_clipping_threshold,
          "Clip the global gradient norm to this; 0 turns clipping off.",
          {.min = 0, .note = " (0 turns clipping off)"});
  t.Int("max_nonfinite_steps", &T::max_nonfinite_steps,
        "A step with a non-finite loss or gradient is skipped and counted; the run stops "
        "with an error when this many were skipped.",
        not_negative);
  t.Section("Data and evaluation");
  t.Nest(&T::data, DataConfigFlags());
  t.Int("eval_interval", &T::eval_interval,
        "Steps between evaluations (and one at the end); 0: only at the end.",
        {.min = 0, .note = " (0: only at the end)"})
      .ResumeNeutral();
  t.Int("eval_steps", &T::eval_steps, "Batches per evaluation (always the same ones).",
        {.min = 1,
         .max = static_cast<double>(kMaxEvalSteps),
         .show_value = true,
         .note = " (batches per evaluation)"})
      .ResumeNeutral();
  t.Section("Distributed: mpirun -np N fp8moe train ... (docs/distributed.md)");
  t.Int("ici_fsdp_parallelism", &T::ici_fsdp_parallelism,
        "Ranks that shard the weights and optimizer state (FSDP); -1: the ranks "
        "ici_expert_parallelism leaves. ici_fsdp_parallelism * ici_expert_parallelism must "
        "equal the ranks of the job (1 without mpirun). Every rank is a data-parallel device: "
        "the global batch is per_device_batch_size x the ranks, and the same global batch "
        "gives the same model on any rank count.")
      .ResumeNeutral();
  t.Int("ici_expert_parallelism", &T::ici_expert_parallelism,
        "Ranks that split the experts (the ring of experts): each holds num_experts / P "
        "of them (num_experts must divide), and the tokens of the ring's ranks are "
        "all-gathered to the experts.")
      .ResumeNeutral();
  t.Nest(Field(&T::model, &ModelConfig::moe), MoeConfigFlags());
  return t;
}

// The rules that name the run's directory: checked first, as a user reads
// the message top down.
void CheckNames(const TrainConfig& t, std::vector<std::string>* problems) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) problems->push_back(what);
  };
  need(!t.run_name.empty() && t.run_name.find('/') == std::string::npos && t.run_name != "." &&
           t.run_name != "..",
       "run_name='" + t.run_name + "' must be a plain, non-empty directory name; set run_name=NAME");
  // A directory name: at most NAME_MAX (255) bytes, no control characters
  // (a newline or an escape in a path only confuses the logs and the shell).
  need(t.run_name.size() <= 255 &&
           std::none_of(t.run_name.begin(), t.run_name.end(),
                        [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }),
       "run_name must be at most 255 bytes without control characters; set run_name=NAME");
  need(!t.base_output_directory.empty(),
       "base_output_directory is empty; set base_output_directory=DIR");
}

// The rules between flags (each flag's own range is in the table).
void CheckRules(const TrainConfig& t, std::vector<std::string>* problems) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) problems->push_back(what);
  };
  const DataConfig& d = t.data;
  need(d.type != "synthetic" || d.path.empty(),
       "dataset_path='" + d.path + "' is set but dataset_type=synthetic does not read "
       "it; set dataset_type=text to train on the file, or drop dataset_path");
  if (d.type == "synthetic") {
    // Before the memory plan, which sizes the corpus's tables from these
    // (OpenDataset checks the same and the work of building them).
    const int64_t v = t.model.vocab_size, M = d.num_sources, A = d.alphabet_size;
    need(M >= 1 && A >= 2 && d.branching >= 1,
         "synthetic data needs synthetic_num_sources >= 1, synthetic_alphabet_size >= 2 and "
         "synthetic_branching >= 1");
    need(M <= v && A <= v && M + A <= v,
         "synthetic_num_sources + synthetic_alphabet_size = " + std::to_string(M) + " + " +
             std::to_string(A) + " tokens exceed vocab_size=" + std::to_string(v) +
             "; raise vocab_size or lower the two");
  }
  need(t.ici_fsdp_parallelism == -1 || t.ici_fsdp_parallelism >= 1,
       "ici_fsdp_parallelism=" + std::to_string(t.ici_fsdp_parallelism) +
           " must be -1 (the ranks left) or at least 1");
  need(t.ici_expert_parallelism == -1 || t.ici_expert_parallelism >= 1,
       "ici_expert_parallelism=" + std::to_string(t.ici_expert_parallelism) +
           " must be -1 (the ranks left) or at least 1");
}

}  // namespace

const FlagTable<TrainConfig>& TrainConfigFlags() {
  static const FlagTable<TrainConfig>* const table = new FlagTable<TrainConfig>(MakeTrainFlags());
  return *table;
}

ConfigSchema TrainConfigSchema() { return TrainConfigFlags().Schema(); }

std::string BaseConfigYaml() {
  return "# fp8moe base configuration: every flag of `fp8moe train` with its default.\n"
         "# Generated from the flag tables (train/train_config.cc and the tables it\n"
         "# nests); a test keeps it equal, and `fp8moe train --print-base-config`\n"
         "# prints it.\n"
         "#\n"
         "#   fp8moe train [config.yml] [key=value ...]\n"
         "#\n"
         "# A config file sets any subset of these keys; key=value overrides on the\n"
         "# command line apply after it, later ones winning. Names follow MaxText.\n"
         "# Invalid combinations are errors naming the flag and the fix; the QAT modes\n"
         "# and every rule are in docs/config.md, the trainer in docs/train.md. The\n"
         "# defaults train the small model below in native FP8 QAT\n"
         "# (fp8_moe_native_fwd + fp8_moe_native_bwd_dlhs) on the synthetic corpus.\n" +
         TrainConfigFlags().DocumentedYaml();
}

Result<TrainConfig> TrainConfigFrom(const Config& c) {
  TrainConfig t;
  // The MoE layer's own report first, as the layer gives it.
  FP8MOE_ASSIGN_OR_RETURN(t.model.moe, MoeConfigFrom(c));
  const std::vector<std::string> out_of_range = TrainConfigFlags().Read(c, &t);
  std::vector<std::string> problems;
  CheckNames(t, &problems);
  problems.insert(problems.end(), out_of_range.begin(), out_of_range.end());
  CheckRules(t, &problems);
  if (!problems.empty()) {
    std::string msg = "invalid training configuration: " + problems[0];
    for (size_t i = 1; i < problems.size(); ++i) msg += "; " + problems[i];
    return InvalidArgument(msg);
  }
  // A rank's model runs at most ceil(per_device_batch_size) sequences
  // (CheckTrainLayout splits the global batch); the data reader's shape is
  // the model's and the global batch, which Train sets.
  t.model.batch = static_cast<int64_t>(std::ceil(t.per_device_batch_size));
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(t.model));
  return t;
}

namespace {

// An error for the first flag that both the preset and the user's settings
// set, to different values.
Status CheckPresetKept(const ConfigSchema& schema, const std::string& model,
                       const Config& preset, const Config& user) {
  for (const FlagSpec& f : schema.flags()) {
    if (!preset.IsSet(f.name) || !user.IsSet(f.name)) continue;
    const std::string mine = user.ValueYaml(f.name), theirs = preset.ValueYaml(f.name);
    if (mine == theirs) continue;
    return InvalidArgument("model_name=" + model + " sets " + f.name + " to " + theirs +
                           " (configs/models/" + model + ".yml), and the config file or the "
                           "command line sets it to " + mine +
                           "; pass override_model_config=true to change a preset's flag, or "
                           "drop " + f.name);
  }
  return OkStatus();
}

}  // namespace

Result<TrainConfig> LoadTrainConfig(const std::string& yaml_path,
                                    const std::vector<std::string>& overrides) {
  const ConfigSchema schema = TrainConfigSchema();
  std::string user_text;  // the config file, read once: model_name may be in it
  if (!yaml_path.empty()) {
    FP8MOE_ASSIGN_OR_RETURN(user_text, ReadConfigFile(yaml_path));
  }
  FP8MOE_ASSIGN_OR_RETURN(const Config user,
                          LoadConfigText(schema, user_text, yaml_path, overrides));
  const std::string& model = user.GetString("model_name");
  if (model == internal::kDefaultModelName) return TrainConfigFrom(user);
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view preset_text, internal::ModelPresetYaml(model));
  const std::string source = "configs/models/" + model + ".yml (model_name=" + model + ")";
  FP8MOE_ASSIGN_OR_RETURN(Config c, LoadConfigText(schema, std::string(preset_text), source, {}));
  if (c.IsSet("model_name") || c.IsSet("override_model_config")) {
    return Internal(source + " sets model_name or override_model_config; a preset sets the "
                    "architecture's flags only");
  }
  if (!user.GetBool("override_model_config")) {
    FP8MOE_RETURN_IF_ERROR(CheckPresetKept(schema, model, c, user));
  }
  FP8MOE_RETURN_IF_ERROR(ApplyConfigText(schema, user_text, yaml_path, overrides, &c));
  return TrainConfigFrom(c);
}

Result<std::string> TrainConfigYaml(const TrainConfig& config) {
  return TrainConfigFlags().ToYaml(config);
}

double LearningRate(const TrainConfig& c, int64_t step) {
  const int64_t warmup =
      static_cast<int64_t>(std::llround(c.warmup_steps_fraction * static_cast<double>(c.steps)));
  if (step < warmup) {
    return c.learning_rate * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  const int64_t span = c.steps - warmup;
  const double progress =
      span <= 1 ? 1.0 : static_cast<double>(step - warmup) / static_cast<double>(span - 1);
  const double cosine = 0.5 * (1.0 + std::cos(3.141592653589793 * std::min(progress, 1.0)));
  const double f = c.cosine_learning_rate_final_fraction;
  return c.learning_rate * (f + (1.0 - f) * cosine);
}

}  // namespace fp8moe
