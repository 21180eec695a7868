// The flags of `fp8moe train` (TrainConfigSchema), configs/base.yml as
// generated from them, and their conversion to a TrainConfig.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "base/number_text.h"
#include "fp8moe/train.h"

namespace fp8moe {
namespace {

// Batches of one evaluation: a million is already hours; more only looks
// like a hang (and eval batch indices times the batch size stay in int64).
constexpr int64_t kMaxEvalSteps = 1000000;

struct Section {
  const char* title;  // may hold '\n' for a multi-line header
  std::vector<FlagSpec> flags;
};

// The trainer's own flags, in sections, in base.yml's order.
const std::vector<Section>& TrainerSections() {
  static const auto* s = new std::vector<Section>{
      {"Run, output and checkpoints",
       {
           {"run_name", FlagType::kString, "fp8moe_run",
            "Name of the run: its files go to <base_output_directory>/<run_name>/. A directory "
            "that holds a checkpoint is resumed from it."},
           {"base_output_directory", FlagType::kString, "runs",
            "Directory that holds the runs."},
           {"enable_checkpointing", FlagType::kBool, "true",
            "Write checkpoints (and resume from them)."},
           {"checkpoint_period", FlagType::kInt, "500",
            "Steps between checkpoints; one is always written at the end. 0: only at the end."},
           {"log_period", FlagType::kInt, "50",
            "Steps between log lines (when not on a terminal) and FP8 health records in "
            "metrics.jsonl."},
       }},
      {"Model shape (a decoder-only MoE transformer; names follow MaxText)",
       {
           {"vocab_size", FlagType::kInt, "256", "Vocabulary size V (256: byte tokens)."},
           {"base_emb_dim", FlagType::kInt, "64", "Model width D."},
           {"base_num_decoder_layers", FlagType::kInt, "2", "Decoder layers L."},
           {"base_num_query_heads", FlagType::kInt, "4", "Attention heads H."},
           {"head_dim", FlagType::kInt, "16", "Width of one attention head (even: RoPE pairs)."},
           {"base_moe_mlp_dim", FlagType::kInt, "128",
            "Hidden width F of each SwiGLU expert (wi is [E, D, 2F], wo [E, F, D])."},
           {"max_target_length", FlagType::kInt, "64", "Sequence length S of a training example."},
           {"per_device_batch_size", FlagType::kInt, "16",
            "Sequences B per step: the global batch; on N ranks (mpirun) each takes B/N of "
            "them (B must divide by N)."},
           {"rope_max_timescale", FlagType::kFloat, "10000.0",
            "RoPE: the rotation of dimension pair i at position p is p / "
            "rope_max_timescale^(2i / head_dim)."},
           {"normalization_layer_epsilon", FlagType::kFloat, "1e-06",
            "RMSNorm epsilon under the square root."},
           {"init_weights_seed", FlagType::kInt, "0", "Seed of the initial weights."},
       }},
      {"Optimizer (AdamW) and schedule",
       {
           {"steps", FlagType::kInt, "1200", "Training steps."},
           {"learning_rate", FlagType::kFloat, "0.003", "Peak learning rate."},
           {"warmup_steps_fraction", FlagType::kFloat, "0.05",
            "Fraction of the steps with a linear warmup to the peak."},
           {"cosine_learning_rate_final_fraction", FlagType::kFloat, "0.1",
            "After the warmup a cosine decays the rate to this fraction of the peak."},
           {"adam_b1", FlagType::kFloat, "0.9", "AdamW beta1 (first-moment decay)."},
           {"adam_b2", FlagType::kFloat, "0.95", "AdamW beta2 (second-moment decay)."},
           {"adam_eps", FlagType::kFloat, "1e-08", "AdamW epsilon added to sqrt(v)."},
           {"adam_weight_decay", FlagType::kFloat, "0.01",
            "Decoupled weight decay, applied to the matrices (not to the norm gains)."},
           {"gradient_clipping_threshold", FlagType::kFloat, "1.0",
            "Clip the global gradient norm to this; 0 turns clipping off."},
           {"max_nonfinite_steps", FlagType::kInt, "5",
            "A step with a non-finite loss or gradient is skipped and counted; the run stops "
            "with an error when this many were skipped."},
       }},
      {"Data and evaluation",
       {
           {"dataset_type", FlagType::kString, "synthetic",
            "synthetic: a seeded mixture of Markov sources with an exact loss floor; text: the "
            "bytes of dataset_path.",
            {"synthetic", "text"}},
           {"dataset_path", FlagType::kString, "", "The text file of dataset_type=text."},
           {"data_shuffle_seed", FlagType::kInt, "0",
            "Seed of the synthetic corpus and of the order of text windows."},
           {"synthetic_num_sources", FlagType::kInt, "4",
            "Synthetic: Markov sources in the mixture; each sequence starts with its source's "
            "marker token."},
           {"synthetic_alphabet_size", FlagType::kInt, "32",
            "Synthetic: symbols shared by the sources (tokens after the markers)."},
           {"synthetic_branching", FlagType::kInt, "4",
            "Synthetic: random successors drawn for each symbol of each source."},
           {"eval_split_fraction", FlagType::kFloat, "0.1",
            "Text: the last fraction of the file kept for evaluation."},
           {"eval_interval", FlagType::kInt, "100",
            "Steps between evaluations (and one at the end); 0: only at the end."},
           {"eval_steps", FlagType::kInt, "8", "Batches per evaluation (always the same ones)."},
       }},
      {"Distributed: mpirun -np N fp8moe train ... (docs/distributed.md)",
       {
           {"ici_fsdp_parallelism", FlagType::kInt, "-1",
            "Ranks that shard the weights and optimizer state (FSDP); -1: the ranks "
            "ici_expert_parallelism leaves. ici_fsdp_parallelism * ici_expert_parallelism must "
            "equal the ranks of the job (1 without mpirun). The batch per_device_batch_size is "
            "the global batch, split over all the ranks, so a run gives the same model on any "
            "rank count."},
           {"ici_expert_parallelism", FlagType::kInt, "1",
            "Ranks that split the experts (the ring of experts): each holds num_experts / P "
            "of them (num_experts must divide), and the tokens of the ring's ranks are "
            "all-gathered to the experts."},
       }},
  };
  return *s;
}

// Section breaks inside the MoE flags (first flag of each section).
const std::map<std::string, std::string>& MoeSectionStarts() {
  static const auto* m = new std::map<std::string, std::string>{
      {"dtype", "MoE layer: shape and routing"},
      {"sparse_matmul", "Dispatch and buffers"},
      {"quantization", "Quantization schemes and the fp8_full recipe"},
      {"fp8_moe_fake_quant", "Fake and native QAT (quantization must stay \"\")"},
      {"ici_tensor_parallelism", "Parallelism and memory"},
      {"wi_tile_fwd_batch_seq",
       "Grouped-matmul tiles: -1 = chosen per shape, else a positive size (k tiles\neven). Any "
       "valid tile gives the same bits. M = rows of the sorted buffer,\nD = embed dim, F = MoE "
       "MLP dim; wi is fused to 2F columns (gate | up)."},
  };
  return *m;
}

// The trainer's defaults of MoE flags: native FP8 QAT and a small layer.
const std::map<std::string, std::string>& MoeDefaultOverrides() {
  static const auto* m = new std::map<std::string, std::string>{
      {"num_experts", "4"},
      {"fp8_moe_fake_quant", "true"},
      {"fp8_fake_quant_hoist", "gather8"},
      {"fp8_moe_native_fwd", "true"},
      {"fp8_moe_native_bwd_dlhs", "true"},
  };
  return *m;
}

[[noreturn]] void Die(const Status& s) {
  std::fprintf(stderr, "fp8moe: TrainConfigSchema: %s\n", s.ToString().c_str());
  std::abort();
}

// "# "-prefixed lines of `text` wrapped at 79 columns.
std::string Comment(const std::string& text) {
  std::string out, line;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t sp = text.find(' ', i);
    const std::string word = text.substr(i, sp == std::string::npos ? std::string::npos : sp - i);
    if (!line.empty() && line.size() + 1 + word.size() > 77) {
      out += "# " + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    if (sp == std::string::npos) break;
    i = sp + 1;
  }
  if (!line.empty()) out += "# " + line + "\n";
  return out;
}

std::string Header(const std::string& title) {
  std::string out = "# ---------------------------------------------------------------------------\n";
  size_t i = 0;
  while (true) {
    const size_t nl = title.find('\n', i);
    out += "# " + title.substr(i, nl == std::string::npos ? std::string::npos : nl - i) + "\n";
    if (nl == std::string::npos) break;
    i = nl + 1;
  }
  return out + "# ---------------------------------------------------------------------------\n";
}

}  // namespace

ConfigSchema TrainConfigSchema() {
  ConfigSchema schema;
  for (const Section& s : TrainerSections()) {
    for (const FlagSpec& f : s.flags) {
      if (Status st = schema.Add(f); !st.ok()) Die(st);
    }
  }
  const ConfigSchema moe = MoeConfigSchema();
  for (FlagSpec f : moe.flags()) {
    auto it = MoeDefaultOverrides().find(f.name);
    if (it != MoeDefaultOverrides().end()) f.default_value = it->second;
    if (Status st = schema.Add(f); !st.ok()) Die(st);
  }
  return schema;
}

std::string BaseConfigYaml() {
  const ConfigSchema schema = TrainConfigSchema();
  // Each default as YAML, from the config writer itself.
  std::map<std::string, std::string> value;
  const std::string yaml = Config(schema).ToYaml();
  size_t i = 0;
  while (i < yaml.size()) {
    size_t nl = yaml.find('\n', i);
    if (nl == std::string::npos) nl = yaml.size();
    const std::string line = yaml.substr(i, nl - i);
    if (!line.empty() && line[0] != '#') {
      const size_t colon = line.find(": ");
      value[line.substr(0, colon)] = line.substr(colon + 2);
    }
    i = nl + 1;
  }
  std::string out =
      "# fp8moe base configuration: every flag of `fp8moe train` with its default.\n"
      "# Generated from the flag schema (train/train_config.cc); a test keeps it\n"
      "# equal, and `fp8moe train --print-base-config` prints it.\n"
      "#\n"
      "#   fp8moe train [config.yml] [key=value ...]\n"
      "#\n"
      "# A config file sets any subset of these keys; key=value overrides on the\n"
      "# command line apply after it, later ones winning. Names follow MaxText.\n"
      "# Invalid combinations are errors naming the flag and the fix; the QAT modes\n"
      "# and every rule are in docs/config.md, the trainer in docs/train.md. The\n"
      "# defaults train the small model below in native FP8 QAT\n"
      "# (fp8_moe_native_fwd + fp8_moe_native_bwd_dlhs) on the synthetic corpus.\n";
  auto flag = [&](const FlagSpec& f) {
    std::string doc = f.doc;
    if (!f.choices.empty()) {
      std::string c;
      for (const std::string& x : f.choices) c += (c.empty() ? "" : ", ") + (x.empty() ? "\"\"" : x);
      doc += " One of: " + c + ".";
    }
    // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "\n" + string.
    out += '\n';
    out += Comment(doc);
    out += f.name;
    out += ": ";
    out += value[f.name];
    out += '\n';
  };
  for (const Section& s : TrainerSections()) {
    out += "\n" + Header(s.title);
    for (const FlagSpec& f : s.flags) flag(*schema.Find(f.name));
  }
  const ConfigSchema moe = MoeConfigSchema();
  for (const FlagSpec& f : moe.flags()) {
    auto it = MoeSectionStarts().find(f.name);
    if (it != MoeSectionStarts().end()) out += "\n" + Header(it->second);
    flag(*schema.Find(f.name));
  }
  return out;
}

Result<TrainConfig> TrainConfigFrom(const Config& c) {
  TrainConfig t;
  std::vector<std::string> problems;
  auto moe = MoeConfigFrom(c);
  if (!moe.ok()) return moe.status();
  ModelConfig& m = t.model;
  m.moe = *moe;
  m.vocab_size = c.GetInt("vocab_size");
  m.emb_dim = c.GetInt("base_emb_dim");
  m.num_layers = c.GetInt("base_num_decoder_layers");
  m.num_heads = c.GetInt("base_num_query_heads");
  m.head_dim = c.GetInt("head_dim");
  m.mlp_dim = c.GetInt("base_moe_mlp_dim");
  m.seq_len = c.GetInt("max_target_length");
  m.batch = c.GetInt("per_device_batch_size");
  m.rope_max_timescale = c.GetFloat("rope_max_timescale");
  m.norm_eps = c.GetFloat("normalization_layer_epsilon");
  t.run_name = c.GetString("run_name");
  t.base_output_directory = c.GetString("base_output_directory");
  t.steps = c.GetInt("steps");
  t.learning_rate = c.GetFloat("learning_rate");
  t.warmup_steps_fraction = c.GetFloat("warmup_steps_fraction");
  t.cosine_learning_rate_final_fraction = c.GetFloat("cosine_learning_rate_final_fraction");
  t.adam_b1 = c.GetFloat("adam_b1");
  t.adam_b2 = c.GetFloat("adam_b2");
  t.adam_eps = c.GetFloat("adam_eps");
  t.adam_weight_decay = c.GetFloat("adam_weight_decay");
  t.gradient_clipping_threshold = c.GetFloat("gradient_clipping_threshold");
  t.init_weights_seed = static_cast<uint64_t>(c.GetInt("init_weights_seed"));
  t.data_shuffle_seed = static_cast<uint64_t>(c.GetInt("data_shuffle_seed"));
  t.enable_checkpointing = c.GetBool("enable_checkpointing");
  t.checkpoint_period = c.GetInt("checkpoint_period");
  t.eval_interval = c.GetInt("eval_interval");
  t.eval_steps = c.GetInt("eval_steps");
  t.log_period = c.GetInt("log_period");
  t.max_nonfinite_steps = c.GetInt("max_nonfinite_steps");
  t.dataset_type = c.GetString("dataset_type");
  t.dataset_path = c.GetString("dataset_path");
  t.synthetic_num_sources = c.GetInt("synthetic_num_sources");
  t.synthetic_alphabet_size = c.GetInt("synthetic_alphabet_size");
  t.synthetic_branching = c.GetInt("synthetic_branching");
  t.eval_split_fraction = c.GetFloat("eval_split_fraction");
  t.ici_fsdp_parallelism = c.GetInt("ici_fsdp_parallelism");
  t.ici_expert_parallelism = c.GetInt("ici_expert_parallelism");

  auto need = [&](bool ok, const std::string& what) {
    if (!ok) problems.push_back(what);
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
  need(t.steps >= 1, "steps=" + std::to_string(t.steps) + " must be at least 1");
  need(t.learning_rate > 0, "learning_rate must be positive");
  need(t.warmup_steps_fraction >= 0 && t.warmup_steps_fraction <= 1,
       "warmup_steps_fraction must be in [0, 1]");
  need(t.cosine_learning_rate_final_fraction >= 0 && t.cosine_learning_rate_final_fraction <= 1,
       "cosine_learning_rate_final_fraction must be in [0, 1]");
  need(t.adam_b1 >= 0 && t.adam_b1 < 1, "adam_b1 must be in [0, 1)");
  need(t.adam_b2 >= 0 && t.adam_b2 < 1, "adam_b2 must be in [0, 1)");
  // The update runs in float32: a smaller epsilon rounds to 0 there, and 0 / 0
  // turns every weight whose gradient is 0 into NaN.
  need(t.adam_eps >= 1.1754943508222875e-38,
       "adam_eps must be at least 1.2e-38 (the smallest normal float32; the AdamW update "
       "runs in float32)");
  need(t.adam_weight_decay >= 0, "adam_weight_decay must not be negative");
  need(t.gradient_clipping_threshold >= 0,
       "gradient_clipping_threshold must not be negative (0 turns clipping off)");
  need(c.GetInt("init_weights_seed") >= 0, "init_weights_seed must not be negative");
  need(c.GetInt("data_shuffle_seed") >= 0, "data_shuffle_seed must not be negative");
  need(t.checkpoint_period >= 0, "checkpoint_period must not be negative (0: only at the end)");
  need(t.eval_interval >= 0, "eval_interval must not be negative (0: only at the end)");
  need(t.eval_steps >= 1 && t.eval_steps <= kMaxEvalSteps,
       "eval_steps=" + std::to_string(t.eval_steps) + " must be in [1, " +
           std::to_string(kMaxEvalSteps) + "] (batches per evaluation)");
  need(t.log_period >= 1, "log_period must be at least 1");
  need(t.max_nonfinite_steps >= 0, "max_nonfinite_steps must not be negative");
  need(t.eval_split_fraction > 0 && t.eval_split_fraction < 1,
       "eval_split_fraction=" + internal::ShortestDecimal(t.eval_split_fraction) +
           " must be between 0 and 1 (exclusive): the share of the data held out for eval");
  need(t.dataset_type != "synthetic" || t.dataset_path.empty(),
       "dataset_path='" + t.dataset_path + "' is set but dataset_type=synthetic does not read "
       "it; set dataset_type=text to train on the file, or drop dataset_path");
  if (t.dataset_type == "synthetic") {
    // Before the memory plan, which sizes the corpus's tables from these
    // (OpenDataset checks the same and the work of building them).
    const int64_t v = m.vocab_size, M = t.synthetic_num_sources, A = t.synthetic_alphabet_size;
    need(M >= 1 && A >= 2 && t.synthetic_branching >= 1,
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
  if (!problems.empty()) {
    std::string msg = "invalid training configuration: " + problems[0];
    for (size_t i = 1; i < problems.size(); ++i) msg += "; " + problems[i];
    return InvalidArgument(msg);
  }
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(m));
  return t;
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
