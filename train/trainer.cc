// The training loop (include/fp8moe/train.h) as a Trainer in named steps
// (train/trainer.h), and the checks of the layout before it.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <omp.h>

#include "base/core_share.h"
#include "base/number_text.h"
#include "fp8moe/data.h"
#include "fp8moe/dist.h"
#include "fp8moe/memory.h"
#include "fp8moe/safetensors.h"
#include "fp8moe/train.h"
#include "train/checkpoint.h"
#include "train/fsdp.h"
#include "train/optimizer.h"
#include "train/trainer.h"

namespace fp8moe {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The largest global batch: its sequences are indices of int32 tensors.
constexpr int64_t kMaxGlobalBatch = 2147483647;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Every rank read `path` (status `loaded`, its checksum): an error on every
// rank when one could not read it or the ranks read different files (a run
// directory that is not one shared filesystem), so that none trains on
// weights the others do not have.
Status AgreeOnCheckpoint(Communicator& comm, const std::string& path, const Status& loaded,
                         uint64_t checksum) {
  const int n = comm.size();
  const int64_t mine[2] = {static_cast<int64_t>(loaded.code()),
                           static_cast<int64_t>(loaded.ok() ? checksum : 0)};
  std::vector<int64_t> all(2 * static_cast<size_t>(n));
  FP8MOE_RETURN_IF_ERROR(comm.AllGather(mine, all.data(), 2, DType::kI64));
  if (!loaded.ok()) return loaded;
  for (int r = 0; r < n; ++r) {
    const auto code = static_cast<StatusCode>(all[2 * static_cast<size_t>(r)]);
    if (code != StatusCode::kOk) {
      return Status(code, "rank " + std::to_string(r) + " could not resume from '" + path +
                              "' (see its message)");
    }
  }
  for (int r = 1; r < n; ++r) {
    if (all[2 * static_cast<size_t>(r) + 1] != all[1]) {
      const std::string a = internal::Hex64(static_cast<uint64_t>(all[1]));
      const std::string b = internal::Hex64(static_cast<uint64_t>(all[2 * static_cast<size_t>(r) + 1]));
      return FailedPrecondition("ranks 0 and " + std::to_string(r) + " read different files at '" +
                                path + "' (checksums " + a + " and " + b +
                                "); every rank must see the same run directory (one shared "
                                "filesystem under base_output_directory)");
    }
  }
  return OkStatus();
}

// Multiplies every gradient of `grads` by `factor`.
void ScaleGradients(ModelParams* grads, float factor) {
  for (auto& [name, t] : grads->Named()) {
    if (IsModelState(name)) continue;  // no gradient (router_bias)
    float* d = t->data_as<float>();
    for (size_t i = 0; i < t->num_elements(); ++i) d[i] *= factor;
  }
}

// The global batch of `c` on out->ranks ranks and this rank's share of it,
// MaxText's way: every rank of the job is a data-parallel device (with the
// ring of experts too, which all-gathers its ranks' tokens), so
// global_batch_size_to_train_on = per_device_batch_size x ranks. It must be
// a whole number of sequences, and the data reader reads it whole, so the
// data order depends on it alone, never on the rank count. Rank r takes the
// consecutive sequences after those of ranks 0..r-1: G / N each, the first
// G % N ranks one more (a fractional per_device_batch_size). Every rank
// needs at least one sequence, and the ranks of a ring of experts the same
// number. Fills out->global_batch and the shares; the same on every rank.
Status SplitGlobalBatch(const TrainConfig& c, int rank, TrainLayout* out) {
  const int n = out->ranks;
  const double p = c.per_device_batch_size;
  const std::string on = "per_device_batch_size=" + internal::ShortestDecimal(p) + " on " +
                         std::to_string(n) + (n == 1 ? " rank" : " ranks");
  const std::string given = on + " is a global batch (global_batch_size_to_train_on) of ";
  const double product = p * static_cast<double>(n);
  if (!(product <= static_cast<double>(kMaxGlobalBatch) + 0.5)) {
    return InvalidArgument(given + internal::ShortestDecimal(product) + " sequences, more than " +
                           std::to_string(kMaxGlobalBatch) + "; lower per_device_batch_size");
  }
  // p x n of a p written with every digit (old / n, say) is within a few
  // ulps of the whole number it means.
  const double whole = std::round(product);
  if (std::fabs(product - whole) > 1e-6) {
    // The whole global batches next to it, of at least one sequence a rank.
    const double lo = std::max(std::floor(product), static_cast<double>(n));
    const double hi = std::max(std::ceil(product), static_cast<double>(n));
    const std::string step = n == 1 ? "a whole number" : "a multiple of 1/" + std::to_string(n);
    return InvalidArgument(given + internal::ShortestDecimal(product) +
                           " sequences, not a whole number; set per_device_batch_size to " +
                           step + " (such as " +
                           (lo < hi ? internal::ShortestDecimal(lo / n) + " or " : std::string()) +
                           internal::ShortestDecimal(hi / n) + ")");
  }
  const int64_t g = static_cast<int64_t>(whole);
  if (g < n) {
    return InvalidArgument(
        given + std::to_string(g) + (g == 1 ? " sequence" : " sequences") + ", fewer than the " +
        std::to_string(n) + (n == 1 ? " rank" : " ranks") +
        ": every rank trains on at least one whole sequence; set per_device_batch_size to at "
        "least 1" +
        (g >= 1 ? ", or run on at most " + std::to_string(g) + (g == 1 ? " rank" : " ranks")
                : std::string()));
  }
  if (out->mesh.expert > 1 && g % n != 0) {
    return InvalidArgument(
        given + std::to_string(g) + " sequences, which does not divide over the " +
        std::to_string(n) + " ranks, but with ici_expert_parallelism=" +
        std::to_string(out->mesh.expert) +
        " the ranks of a ring of experts hold the same number of sequences (the ring "
        "all-gathers their tokens); set per_device_batch_size to a whole number");
  }
  // The sizes the kernels hold in int32 (as ValidateModelConfig bounds one
  // rank's): the routed rows of the whole batch bound those of any ring.
  const __int128 rows = static_cast<__int128>(g) * c.model.seq_len * c.model.moe.num_experts_per_tok;
  if (rows > (1 << 30)) {
    return InvalidArgument("global_batch_size_to_train_on=" + std::to_string(g) + " (" + on +
                           ") x max_target_length=" + std::to_string(c.model.seq_len) +
                           " x num_experts_per_tok=" +
                           std::to_string(c.model.moe.num_experts_per_tok) +
                           " is more than 2^30 routed rows for one step (group sizes are int32); "
                           "lower per_device_batch_size or max_target_length");
  }
  out->global_batch = g;
  out->fewest_sequences = g / n;
  const int64_t extra = g % n;
  out->sequences = g / n + (rank < extra ? 1 : 0);
  out->first_sequence = rank * (g / n) + std::min<int64_t>(rank, extra);
  return OkStatus();
}

}  // namespace

Result<TrainLayout> CheckTrainLayout(const TrainConfig& c, Communicator& comm) {
  // The ranks first: the same config everywhere and a mesh that covers them
  // (every rank sees every fingerprint, so every rank reports the same error).
  FP8MOE_ASSIGN_OR_RETURN(const std::string yaml, TrainConfigYaml(c));
  TrainLayout out;
  FP8MOE_ASSIGN_OR_RETURN(out.mesh, CheckDistributedConfig(comm, yaml, c.ici_fsdp_parallelism,
                                                           c.ici_expert_parallelism));
  const ParallelLayout& mesh = out.mesh;
  const int ranks = comm.size();
  out.ranks = ranks;
  if (mesh.expert > 1 && c.model.moe.num_experts % mesh.expert != 0) {
    return InvalidArgument("num_experts=" + std::to_string(c.model.moe.num_experts) +
                           " does not divide over ici_expert_parallelism=" +
                           std::to_string(mesh.expert) +
                           " ranks (the ring of experts holds E / P experts per rank); make "
                           "num_experts a multiple of " + std::to_string(mesh.expert) +
                           " or change ici_expert_parallelism");
  }
  FP8MOE_RETURN_IF_ERROR(SplitGlobalBatch(c, comm.rank(), &out));
  // Each MoE layer call splits a rank's sequences x S tokens into the chunks
  // (it would refuse the call at the first step, after the run had started).
  const int64_t tokens = out.fewest_sequences * c.model.seq_len;
  if (c.model.moe.num_moe_token_chunks > tokens) {
    const bool even = out.fewest_sequences * ranks == out.global_batch;
    return InvalidArgument(
        "num_moe_token_chunks=" + std::to_string(c.model.moe.num_moe_token_chunks) +
        " exceeds the " + std::to_string(tokens) + " tokens each MoE layer call " +
        (ranks == 1 ? std::string("has")
         : even     ? "has on each of the " + std::to_string(ranks) + " ranks"
                    : std::string("has on the ranks with the fewest sequences")) +
        " (" +
        (even ? "per_device_batch_size=" + internal::ShortestDecimal(c.per_device_batch_size)
              : "their " + std::to_string(out.fewest_sequences) + " sequences") +
        " x max_target_length=" + std::to_string(c.model.seq_len) + "); use at most " +
        std::to_string(tokens) + " chunks");
  }
  return out;
}

Result<TrainSummary> Train(const TrainConfig& c, const TrainOptions& options) {
  TrainOptions o = options;
  std::unique_ptr<Communicator> own_comm;
  if (o.comm == nullptr) {
    own_comm = MakeSingleRankCommunicator();
    o.comm = own_comm.get();
  }
  FP8MOE_ASSIGN_OR_RETURN(const TrainLayout layout, CheckTrainLayout(c, *o.comm));
  return Train(c, layout, o);
}

Result<TrainSummary> Train(const TrainConfig& c, const TrainLayout& layout,
                           const TrainOptions& options) {
  internal::Trainer trainer(c, layout, options);
  FP8MOE_RETURN_IF_ERROR(trainer.Setup());
  return trainer.Run();
}

namespace internal {

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

Status RunLock::Acquire(const fs::path& path) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    return IoError("cannot open '" + path.string() + "': " + std::strerror(errno) +
                   "; set base_output_directory to a writable directory");
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return FailedPrecondition("the run directory '" + path.parent_path().string() +
                                "' is in use by another fp8moe train; wait for it to end, "
                                "or set run_name to start a separate run");
    }
    return IoError("cannot lock '" + path.string() + "': " + std::strerror(errno));
  }
  return OkStatus();
}

Trainer::Trainer(const TrainConfig& config, const TrainLayout& layout, const TrainOptions& options)
    : c_(config), layout_(layout), opt_(options) {}

Trainer::~Trainer() = default;

Status Trainer::Setup() {
  FP8MOE_RETURN_IF_ERROR(SetupRanks());
  FP8MOE_RETURN_IF_ERROR(SetupMemoryAndData());
  FP8MOE_RETURN_IF_ERROR(ChooseResume());
  FP8MOE_RETURN_IF_ERROR(SetupWeights());
  metrics_ = std::make_unique<MetricsWriter>(lead_, opt_.quiet, run_dir_.string(), N_,
                                             N_ * mc_.moe.num_experts_per_tok);
  if (LoadFinishedSummary()) {
    finished_ = true;
    metrics_->PrintFinished(sum_);
    return OkStatus();
  }
  FP8MOE_RETURN_IF_ERROR(metrics_->Open(sum_.resumed_from > 0 ? state_.step : 0));
  metrics_->PrintStart(c_, mc_, layout_, data_->Describe(), sum_);
  return SetupModel();
}

Status Trainer::SetupRanks() {
  comm_ = opt_.comm;
  if (comm_ == nullptr) {
    own_comm_ = MakeSingleRankCommunicator();
    comm_ = own_comm_.get();
  }
  if (layout_.ranks != comm_->size() || layout_.sequences < 1) {
    return Internal("Train was given a layout of " + std::to_string(layout_.ranks) +
                    " ranks for a job of " + std::to_string(comm_->size()) +
                    "; pass the layout CheckTrainLayout gave for this config and communicator");
  }
  const ParallelLayout& mesh = layout_.mesh;
  F_ = comm_->size();
  lead_ = comm_->rank() == 0;
  if (!lead_) opt_.quiet = true;
  if (mesh.expert > 1) {
    FP8MOE_ASSIGN_OR_RETURN(ring_, comm_->Split(mesh.fsdp_index, mesh.expert_index));
    FP8MOE_ASSIGN_OR_RETURN(expert_group_, comm_->Split(mesh.expert_index, mesh.fsdp_index));
  }
  return OkStatus();
}

Status Trainer::SetupMemoryAndData() {
  const ParallelLayout& mesh = layout_.mesh;
  // This rank's model runs its share of the sequences; the data reader the
  // whole global batch.
  mc_ = c_.model;
  mc_.batch = layout_.global_batch;
  local_mc_ = c_.model;
  local_mc_.batch = layout_.sequences;
  // The whole run's memory against the cap, before a directory is created or
  // a byte allocated.
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(mc_));
  FP8MOE_RETURN_IF_ERROR(CheckTrainMemory(c_, mesh.fsdp, mesh.expert));
  N_ = mc_.batch * mc_.seq_len;
  sum_.memory_plan_bytes = static_cast<int64_t>(
      std::min<uint64_t>(PlanTrainMemory(c_, mesh.fsdp, mesh.expert).total_bytes,
                         std::numeric_limits<int64_t>::max()));
  sum_.quantization_mode = std::string(MoeQatModeName(PlanMoeQuantization(mc_.moe).mode));
  if (PlanMoeQuantization(mc_.moe).mode == MoeQatMode::kHandCrafted) {
    sum_.quantization_mode += " " + std::string(MoeQuantizationName(mc_.moe.quantization));
  }
  run_dir_ = fs::path(c_.base_output_directory) / c_.run_name;
  ckpt_dir_ = run_dir_ / "checkpoints";
  sum_.run_dir = run_dir_.string();
  // The config as it is saved (checkpoints, summary.json): CheckTrainLayout
  // wrote it already, so this cannot fail here.
  FP8MOE_ASSIGN_OR_RETURN(config_yaml_, TrainConfigYaml(c_));
  // The data first: a run refused for its dataset leaves no directory behind.
  // The dataset's flags are the table's; its shape is the model's and the
  // global batch.
  DataConfig dc = c_.data;
  dc.seq_len = mc_.seq_len;
  dc.vocab_size = mc_.vocab_size;
  dc.batch = mc_.batch;
  FP8MOE_ASSIGN_OR_RETURN(data_, OpenDataset(dc));
  sum_.entropy_floor = data_->EntropyFloor();
  sum_.global_batch_size_to_train_on = layout_.global_batch;
  return OkStatus();
}

Status Trainer::ChooseResume() {
  std::error_code ec;
  fs::create_directories(c_.enable_checkpointing ? ckpt_dir_ : run_dir_, ec);
  if (ec) {
    return IoError("cannot create the run directory '" + run_dir_.string() + "': " +
                   ec.message() + "; set base_output_directory to a writable directory");
  }
  // One process per run directory: two trainers resuming the same run would
  // both append to metrics.jsonl (every step twice) and race on the
  // checkpoints. The lock dies with the process, SIGKILL included. Under
  // mpirun the writing rank (0) holds it for the job.
  // Rank 0 takes the lock and then chooses what every rank resumes from, and
  // tells the others in one all-reduce. No other rank touches the run
  // directory before that: LatestCheckpoint removes the temporary files of a
  // killed save, and a refused second job's rank 1 removed the first job's
  // save in progress. And ranks that list different files (no shared
  // filesystem) cannot resume from different checkpoints.
  Status lead_status;
  int64_t choice[2] = {std::numeric_limits<int64_t>::min(),
                       std::numeric_limits<int64_t>::min()};  // {status code, step or -1}
  if (lead_) {
    lead_status = lock_.Acquire(run_dir_ / "train.lock");
    std::optional<std::string> newest;
    if (lead_status.ok()) newest = LatestCheckpoint(ckpt_dir_.string());
    // Without checkpointing the run starts at step 0 and rewrites
    // metrics.jsonl; over a run that has checkpoints that would lose its
    // history, and a later resume would mix the two runs' metrics.
    if (lead_status.ok() && !c_.enable_checkpointing && newest) {
      lead_status = FailedPrecondition(
          "run directory '" + run_dir_.string() + "' holds checkpoints (the newest '" + *newest +
          "') but enable_checkpointing=false would train it again from step 0 over its "
          "metrics; resume it with enable_checkpointing=true, or use another run_name");
    }
    if (c_.enable_checkpointing) latest_ = newest;
    choice[0] = static_cast<int64_t>(lead_status.code());
    choice[1] = latest_ ? CheckpointStep(*latest_) : -1;
  }
  FP8MOE_RETURN_IF_ERROR(comm_->AllReduce(choice, choice, 2, DType::kI64, ReduceOp::kMax));
  if (!lead_status.ok()) return lead_status;
  if (choice[0] != 0) {
    return Status(static_cast<StatusCode>(choice[0]),
                  "rank 0 refused the run directory '" + run_dir_.string() + "' (see its message)");
  }
  if (!lead_ && choice[1] >= 0) latest_ = CheckpointPath(ckpt_dir_.string(), choice[1]);
  return OkStatus();
}

Status Trainer::SetupWeights() {
  ContextOptions co;
  co.seed = c_.data.seed;
  ctx_.emplace(co);
  // The masters and the AdamW moments live only in the FSDP shards, and no
  // rank ever holds a whole set of them: the initial weights are drawn a
  // tensor at a time (InitParams' sink) and sliced, a checkpoint is read into
  // the shards a tensor at a time (resharding is slicing: whatever rank count
  // wrote it) and saved the same way.
  shapes_ = ParamShapes(mc_);
  ckpt_layout_ = CheckpointLayout(shapes_);
  FP8MOE_ASSIGN_OR_RETURN(fsdp_, FsdpState::Create(*comm_, shapes_, expert_group_.get(),
                                                   ring_.get()));
  if (!latest_) {
    FP8MOE_RETURN_IF_ERROR(InitParams(mc_, c_.init_weights_seed, [&](size_t k, const float* whole) {
      fsdp_->LoadTensor({CheckpointSet::kParams, k, shapes_[k].first, shapes_[k].second}, whole);
    }));
  } else {
    const Status loaded = LoadCheckpoint(
        *latest_, c_, layout_, ckpt_layout_,
        [&](const CheckpointTensor& t, const float* whole) { fsdp_->LoadTensor(t, whole); },
        &state_);
    FP8MOE_RETURN_IF_ERROR(AgreeOnCheckpoint(*comm_, *latest_, loaded, state_.checksum));
    if (Status st = data_->SetPosition(state_.data_position); !st.ok()) {
      return DataLoss("checkpoint '" + *latest_ + "' has a data_position this dataset cannot "
                      "use: " + st.message() + "; resume with the dataset flags it was "
                      "trained with, or use another run_name to start a new run");
    }
    ctx_->rng().set_state(state_.rng);
    sum_.resumed_from = state_.step;
    sum_.resume_changes = ConfigChangesOnResume(state_.config_yaml, state_.global_batch, c_,
                                                layout_.global_batch);
  }
  // params: the weights the model reads, gathered each step; grads: this
  // rank's gradient. The expert weights reach the GMMs as gathered codes
  // (gather8) or bf16 copies, never in f32, except in the f32 mode (the GMMs
  // read the master) and with a fixed weight calibration (its
  // straight-through mask reads the master). So params hold f32 experts only
  // in those modes, and then only this ring rank's E/P; the gradients hold
  // this ring rank's E/P experts.
  f32_experts_ = MoeReadsF32Masters(mc_.moe);
  const int64_t local_experts = mc_.moe.num_experts / (ring_ ? ring_->size() : 1);
  FP8MOE_ASSIGN_OR_RETURN(params_, AllocateParams(mc_, f32_experts_ ? local_experts : 0));
  FP8MOE_ASSIGN_OR_RETURN(grads_, AllocateParams(mc_, local_experts));
  return OkStatus();
}

// A finished run is not trained again: its summary stands. True when the
// resumed checkpoint is at or past `steps` and summary.json has its figures
// (then in sum_).
bool Trainer::LoadFinishedSummary() {
  if (state_.step < c_.steps || !fs::exists(run_dir_ / "summary.json")) return false;
  std::ifstream in(run_dir_ / "summary.json");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("final_eval_loss") || !j["final_eval_loss"].is_number()) {
    return false;
  }
  sum_.steps = state_.step;
  sum_.final_eval_loss = j["final_eval_loss"].get<double>();
  if (j.contains("final_loss") && j["final_loss"].is_number()) sum_.final_loss = j["final_loss"].get<double>();
  if (j.contains("mean_step_time_s")) sum_.mean_step_time_s = j["mean_step_time_s"].get<double>();
  if (j.contains("tokens_per_s")) sum_.tokens_per_s = j["tokens_per_s"].get<double>();
  sum_.nonfinite_steps = state_.nonfinite_steps;
  return true;
}

Status Trainer::SetupModel() {
  model_ = std::make_unique<Model>(local_mc_);
  // Every rank shares the batch (the load-balancing loss over the global
  // batch, as one rank computes it); the ring of experts, if any.
  model_->SetRanks({comm_, ring_.get()});
  inputs_.resize(static_cast<size_t>(N_));
  targets_.resize(static_cast<size_t>(N_));
  // This rank's slice of the global batch (SplitGlobalBatch): consecutive
  // sequences after those of the ranks before it (rank i of the job is
  // fsdp_index * P + expert_index).
  const size_t slice = static_cast<size_t>(layout_.first_sequence * mc_.seq_len);
  // A rank's means are over its own sequences; the global batch's mean is
  // sum_r (sequences_r / G) mean_r, i.e. the mean over the ranks of
  // share * mean_r. With equal shares share is exactly 1 and changes no bit.
  share_ = static_cast<double>(layout_.sequences) * static_cast<double>(F_) /
           static_cast<double>(layout_.global_batch);
  my_inputs_ = inputs_.data() + slice;
  my_targets_ = targets_.data() + slice;
  expert_source_ = f32_experts_ ? nullptr : fsdp_.get();
  return OkStatus();
}

Result<TrainSummary> Trainer::Run() {
  if (finished_) return sum_;
  ResetMemoryPeak();
  t_start_ = Now();
  StepMetrics m;  // reused step to step, as the model's buffers are
  int64_t completed = state_.step;
  // threads_follow_load: the team shrinks while other processes keep cores
  // busy and grows back when they stop (see base/core_share.h).
  // The job's ranks start at an equal share of the cores (they may all be
  // on this machine; where they are not, the first window grows the team).
  CoreShare core_share(omp_get_max_threads(), 0.5, comm_->size());
  struct RestoreThreads {  // the caller's OpenMP thread count, however Run returns
    int n = omp_get_max_threads();
    ~RestoreThreads() { omp_set_num_threads(n); }
  } restore_threads;
  for (int64_t s = state_.step; s < c_.steps; ++s) {
    completed = s + 1;
    const int threads = SetThreads(&core_share);
    FP8MOE_ASSIGN_OR_RETURN(StepReport rep, Step(s, threads, &m));
    Tally(rep);
    m.fp8_health.reset();
    m.router_bias.reset();
    if (lead_ && IsLogStep(s)) {
      FP8MOE_ASSIGN_OR_RETURN(m.fp8_health, Fp8HealthOfLayers());
      if (mc_.moe.routed_bias) m.router_bias = fsdp_->RouterBias(mc_.num_layers);
    }
    if (IsEvalStep(s)) {
      FP8MOE_ASSIGN_OR_RETURN(rep.eval_loss, Evaluate());
      last_eval_ = rep.eval_loss;
    }
    FP8MOE_RETURN_IF_ERROR(metrics_->Append(rep, m, comm_->size() > 1));
    if (!rep.skipped) KeepRecentLoss(m.info.loss);
    if (opt_.on_step) opt_.on_step(rep);
    metrics_->Progress(c_, rep, m.info.loss, last_eval_, Now() - t_start_, ran_);
    FP8MOE_RETURN_IF_ERROR(StopAfterTooManyNonFinite(rep, m));
    if (IsCheckpointStep(s)) {
      FP8MOE_RETURN_IF_ERROR(Save(s + 1));
    }
    if (opt_.stop_after_steps > 0 && ran_ >= opt_.stop_after_steps) break;
  }
  metrics_->EndLine();
  if (!last_eval_) {  // a finished run resumed, or stopped early
    FP8MOE_ASSIGN_OR_RETURN(last_eval_, Evaluate());
  }
  Summarize(completed);
  FP8MOE_RETURN_IF_ERROR(
      metrics_->WriteSummary(sum_, recent_losses_.size(), Now() - t_start_, config_yaml_));
  metrics_->PrintSummary(sum_, recent_losses_.size(), Now() - t_start_);
  return sum_;
}

bool Trainer::IsLogStep(int64_t s) const {
  return (s + 1) % c_.log_period == 0 || s + 1 == c_.steps;
}

bool Trainer::IsEvalStep(int64_t s) const {
  return (c_.eval_interval > 0 && (s + 1) % c_.eval_interval == 0) || s + 1 == c_.steps;
}

bool Trainer::IsCheckpointStep(int64_t s) const {
  return c_.enable_checkpointing &&
         ((c_.checkpoint_period > 0 && (s + 1) % c_.checkpoint_period == 0) || s + 1 == c_.steps);
}

int Trainer::SetThreads(CoreShare* core_share) {
  if (opt_.threads_follow_load) omp_set_num_threads(core_share->Update());
  const int threads = omp_get_max_threads();
  threads_min_ = threads_min_ == 0 ? threads : std::min(threads_min_, threads);
  threads_max_ = std::max(threads_max_, threads);
  return threads;
}

void Trainer::Tally(const StepReport& rep) {
  if (ran_ > 0) {  // the first step of a process warms up: not in the means
    time_sum_ += rep.step_time_s;
    allocs_after_first_ += rep.allocations;
    ++timed_;
  }
  ++ran_;
}

void Trainer::KeepRecentLoss(double loss) {
  recent_losses_.push_back(loss);
  if (recent_losses_.size() > static_cast<size_t>(c_.log_period)) {
    recent_losses_.erase(recent_losses_.begin());
  }
}

Status Trainer::StopAfterTooManyNonFinite(const StepReport& rep, const StepMetrics& m) const {
  if (state_.nonfinite_steps > 0 && state_.nonfinite_steps >= c_.max_nonfinite_steps &&
      rep.skipped) {
    metrics_->EndLine();
    return OutOfRange("stopping: " + std::to_string(state_.nonfinite_steps) +
                      " steps had a non-finite loss or gradient (the last: " + m.nonfinite +
                      ", step " + std::to_string(rep.step) + "); max_nonfinite_steps=" +
                      std::to_string(c_.max_nonfinite_steps) +
                      ". Lower learning_rate or set gradient_clipping_threshold");
  }
  return OkStatus();
}

Status Trainer::Gather() {
  FP8MOE_RETURN_IF_ERROR(fsdp_->GatherParams(&params_, /*skip_experts=*/!f32_experts_));
  return model_->PrepareExperts(*ctx_, params_, &prepared_, expert_source_);
}

Result<StepReport> Trainer::Step(int64_t s, int threads, StepMetrics* m) {
  const int64_t allocs0 = GetMemoryStats().allocations;
  const int64_t sent0 = BytesSent(), expert0 = fsdp_->expert_gather_bytes();
  const double t0 = Now();
  data_->NextTrainBatch(inputs_.data(), targets_.data());
  fsdp_->set_count_health(IsLogStep(s));
  FP8MOE_RETURN_IF_ERROR(Gather());
  const double t_gathered = Now();
  ModelStepInfo& info = m->info;
  FP8MOE_RETURN_IF_ERROR(
      model_->Step(*ctx_, params_, prepared_, my_inputs_, my_targets_, &grads_, &info));
  const double t_computed = Now();
  FP8MOE_RETURN_IF_ERROR(SumStepInfoOverRanks(&info));
  // ReduceGradients averages the ranks' gradients: weighted by the shares,
  // that is the gradient of the global batch's mean loss.
  if (share_ != 1.0) ScaleGradients(&grads_, static_cast<float>(share_));
  FP8MOE_RETURN_IF_ERROR(fsdp_->ReduceGradients(grads_));
  StepReport rep;
  rep.step = s + 1;
  rep.loss = info.loss;
  rep.lr = LearningRate(c_, s);
  FP8MOE_ASSIGN_OR_RETURN(const FsdpState::GradientCheck check, fsdp_->CheckGradients());
  m->nonfinite = std::isfinite(info.loss) && std::isfinite(info.aux_loss)
                     ? check.first_nonfinite
                     : "loss";
  const std::string& bad = m->nonfinite;
  if (!bad.empty()) {
    rep.skipped = true;
    ++state_.nonfinite_steps;
    if (lead_) std::fprintf(stderr, "%sfp8moe train: step %lld: non-finite %s%s; step skipped (%lld of "
                 "max_nonfinite_steps=%lld)\n", metrics_->tty() ? "\n" : "", static_cast<long long>(s + 1),
                 bad == "loss" ? "loss" : "gradient in ", bad == "loss" ? "" : bad.c_str(),
                 static_cast<long long>(state_.nonfinite_steps),
                 static_cast<long long>(c_.max_nonfinite_steps));
  } else {
    rep.grad_norm = check.norm;
    FP8MOE_RETURN_IF_ERROR(Update(s, rep.lr, rep.grad_norm, info.expert_load));
  }
  rep.step_time_s = Now() - t0;
  rep.comm_bytes = BytesSent() - sent0;
  rep.expert_gather_bytes = fsdp_->expert_gather_bytes() - expert0;
  rep.allocations = GetMemoryStats().allocations - allocs0;
  rep.threads = threads;
  m->gather_time_s = t_gathered - t0;
  m->compute_time_s = t_computed - t_gathered;
  m->nonfinite_steps = state_.nonfinite_steps;
  return rep;
}

Status Trainer::SumStepInfoOverRanks(ModelStepInfo* info) {
  if (F_ == 1) return OkStatus();
  // One collective (the counts are exact in double).
  std::vector<double> v = {info->loss * share_, info->aux_loss * share_,
                           static_cast<double>(info->dropless_reruns)};
  for (const auto& layer : info->expert_load) v.insert(v.end(), layer.begin(), layer.end());
  FP8MOE_ASSIGN_OR_RETURN(v, SumOverRanks(*comm_, v));
  info->loss = v[0] / static_cast<double>(F_);
  info->aux_loss = v[1] / static_cast<double>(F_);
  info->dropless_reruns = static_cast<int64_t>(v[2]);
  size_t i = 3;
  for (auto& layer : info->expert_load) {
    for (int32_t& x : layer) x = static_cast<int32_t>(v[i++]);
  }
  return OkStatus();
}

Status Trainer::Update(int64_t s, double lr, double norm,
                       const std::vector<std::vector<int32_t>>& load) {
  const double clip = c_.gradient_clipping_threshold > 0 && norm > c_.gradient_clipping_threshold
                          ? c_.gradient_clipping_threshold / norm
                          : 1.0;
  FP8MOE_RETURN_IF_ERROR(fsdp_->AdamW(*ctx_, c_, s + 1, lr, clip));
  // routed_bias: after AdamW, once per optimizer step, by the global batch's
  // loads (SumStepInfoOverRanks); a skipped step never gets here.
  if (mc_.moe.routed_bias && mc_.moe.routed_bias_update_rate > 0) {
    FP8MOE_RETURN_IF_ERROR(
        fsdp_->UpdateRoutedBias(load, mc_.moe.routed_bias_update_rate));
  }
  // Finite gradients can still give non-finite weights (a learning rate or
  // weight decay past float range, an epsilon that rounds to 0): stop
  // before such weights reach a checkpoint or the next step. Collective:
  // every rank checks its shard and all stop together.
  FP8MOE_ASSIGN_OR_RETURN(const std::string w, fsdp_->FirstNonFiniteMaster());
  if (w.empty()) return OkStatus();
  metrics_->EndLine();
  char lr_text[32];
  std::snprintf(lr_text, sizeof(lr_text), "%g", lr);
  return OutOfRange("stopping: the AdamW update of step " + std::to_string(s + 1) +
                    " made the weights of " + w + " non-finite (learning rate " + lr_text +
                    "); lower learning_rate or "
                    "adam_weight_decay, or raise adam_eps. The last checkpoint is "
                    "intact");
}

Result<std::vector<LayerFp8Health>> Trainer::Fp8HealthOfLayers() {
  // Weights: counted over the whole tensors (every ring rank's experts);
  // activations: rank 0's slice.
  std::vector<LayerFp8Health> health(static_cast<size_t>(mc_.num_layers));
  for (int64_t l = 0; l < mc_.num_layers; ++l) {
    LayerFp8Health& h = health[static_cast<size_t>(l)];
    const PreparedMoeWeights& pw = prepared_[static_cast<size_t>(l)];
    h.wi = pw.wi.health;
    h.wo = pw.wo.health;
    FP8MOE_RETURN_IF_ERROR(model_->ActivationHealth(*ctx_, l, prepared_, &h.wi_lhs, &h.wo_lhs));
  }
  return health;
}

// The mean over the eval batches of the global batch's mean loss: the mean
// over the ranks of per-rank means weighted by their shares, the same bits
// on every rank.
Result<double> Trainer::Evaluate() {
  FP8MOE_RETURN_IF_ERROR(Gather());
  double total = 0;
  for (int64_t i = 0; i < c_.eval_steps; ++i) {
    data_->EvalBatch(i, inputs_.data(), targets_.data());
    ModelStepInfo ei;
    FP8MOE_RETURN_IF_ERROR(
        model_->Step(*ctx_, params_, prepared_, my_inputs_, my_targets_, nullptr, &ei));
    std::vector<double> v = {ei.loss};
    for (double& x : v) x *= share_;
    FP8MOE_ASSIGN_OR_RETURN(std::vector<double> sums, SumOverRanks(*comm_, v));
    for (double& x : sums) x /= static_cast<double>(F_);
    total += sums[0];
  }
  return total / static_cast<double>(c_.eval_steps);
}

Status Trainer::Save(int64_t step) {
  state_.step = step;
  state_.global_batch = layout_.global_batch;
  state_.rng = ctx_->rng().state();
  state_.data_position = data_->Position();
  const std::string path = CheckpointPath(ckpt_dir_.string(), step);
  // Every rank gathers the tensors one at a time, in the file's order;
  // rank 0 writes them (a temporary name, then a rename: no partial
  // checkpoint is ever visible) and tells the others how it went, which
  // also holds them until the file is complete.
  Status s = SaveCheckpoint(
      path, c_, ckpt_layout_,
      [&](const CheckpointTensor& t, float* out) { return fsdp_->GatherTensor(t, out); }, state_,
      /*write=*/lead_);
  int64_t code = static_cast<int64_t>(s.code());
  FP8MOE_RETURN_IF_ERROR(comm_->AllReduce(&code, &code, 1, DType::kI64, ReduceOp::kMax));
  if (!lead_ && code != 0) {
    return Status(static_cast<StatusCode>(code),
                  "rank 0 could not save the checkpoint of step " + std::to_string(step) +
                      " (see its message)");
  }
  if (!s.ok()) {
    auto latest = LatestCheckpoint(ckpt_dir_.string());
    return Status(s.code(), "cannot save the checkpoint of step " + std::to_string(step) + ": " +
                                s.message() + "; the last complete checkpoint is " +
                                (latest ? "'" + *latest + "' (intact)" : "none") +
                                "; fix the cause (a full disk: free space) and run again to "
                                "resume");
  }
  if (lead_) PruneCheckpoints(ckpt_dir_.string(), 2);
  return OkStatus();
}

int64_t Trainer::BytesSent() const {
  int64_t b = comm_->bytes_sent();
  for (const auto* sub : {&ring_, &expert_group_}) {
    if (*sub) b += (*sub)->bytes_sent();
  }
  return b;
}

void Trainer::Summarize(int64_t completed) {
  sum_.steps = completed;
  sum_.final_eval_loss = last_eval_;
  for (double l : recent_losses_) sum_.final_loss += l / static_cast<double>(recent_losses_.size());
  sum_.mean_step_time_s = timed_ > 0 ? time_sum_ / static_cast<double>(timed_) : 0.0;
  sum_.tokens_per_s = sum_.mean_step_time_s > 0 ? static_cast<double>(N_) / sum_.mean_step_time_s : 0.0;
  sum_.nonfinite_steps = state_.nonfinite_steps;
  sum_.peak_bytes = GetMemoryStats().peak;
  sum_.allocations_per_step =
      timed_ > 0 ? static_cast<double>(allocs_after_first_) / static_cast<double>(timed_) : 0.0;
  sum_.threads_min = threads_min_;
  sum_.threads_max = threads_max_;
}

}  // namespace internal
}  // namespace fp8moe
