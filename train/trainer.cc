// The training loop (include/fp8moe/train.h).
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

namespace fp8moe {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The largest global batch: its sequences are indices of int32 tensors.
constexpr int64_t kMaxGlobalBatch = 2147483647;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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

// Writes `text` to `path` atomically (temporary file + rename).
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

// An exclusive flock on <run_dir>/train.lock, held until destruction.
class RunLock {
 public:
  RunLock() = default;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status Acquire(const fs::path& path) {
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

 private:
  int fd_ = -1;
};

// Multiplies every gradient of `grads` by `factor`.
void ScaleGradients(ModelParams* grads, float factor) {
  for (auto& [name, t] : grads->Named()) {
    float* d = t->data_as<float>();
    for (size_t i = 0; i < t->num_elements(); ++i) d[i] *= factor;
  }
}

json HealthJson(const Fp8Health& h) {
  return {{"saturated", h.saturated}, {"flushed", h.flushed}, {"values", h.values}};
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
                           const TrainOptions& opt_in) {
  std::unique_ptr<Communicator> own_comm;
  Communicator* comm = opt_in.comm;
  if (comm == nullptr) {
    own_comm = MakeSingleRankCommunicator();
    comm = own_comm.get();
  }
  if (layout.ranks != comm->size() || layout.sequences < 1) {
    return Internal("Train was given a layout of " + std::to_string(layout.ranks) +
                    " ranks for a job of " + std::to_string(comm->size()) +
                    "; pass the layout CheckTrainLayout gave for this config and communicator");
  }
  const ParallelLayout& mesh = layout.mesh;
  const int F = comm->size();  // ranks that split the batch: all of them
  const bool lead = comm->rank() == 0;  // writes files and prints
  TrainOptions opt = opt_in;
  if (!lead) opt.quiet = true;
  // Expert parallelism: the expert ring (the P consecutive ranks of one
  // fsdp_index) and the group of the F ranks that hold the same experts.
  std::unique_ptr<Communicator> ring, expert_group;
  if (mesh.expert > 1) {
    FP8MOE_ASSIGN_OR_RETURN(ring, comm->Split(mesh.fsdp_index, mesh.expert_index));
    FP8MOE_ASSIGN_OR_RETURN(expert_group, comm->Split(mesh.expert_index, mesh.fsdp_index));
  }
  // This rank's model runs its share of the sequences; the data reader the
  // whole global batch.
  ModelConfig mc = c.model;
  mc.batch = layout.global_batch;
  ModelConfig local_mc = c.model;
  local_mc.batch = layout.sequences;
  // The whole run's memory against the cap, before a directory is created or
  // a byte allocated.
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(mc));
  FP8MOE_RETURN_IF_ERROR(CheckTrainMemory(c, mesh.fsdp, mesh.expert));
  TrainSummary sum;
  sum.memory_plan_bytes =
      static_cast<int64_t>(std::min<uint64_t>(PlanTrainMemory(c, mesh.fsdp, mesh.expert).total_bytes,
                                              std::numeric_limits<int64_t>::max()));
  sum.quantization_mode = std::string(MoeQatModeName(PlanMoeQuantization(mc.moe).mode));
  if (PlanMoeQuantization(mc.moe).mode == MoeQatMode::kHandCrafted) {
    sum.quantization_mode += " " + std::string(MoeQuantizationName(mc.moe.quantization));
  }
  const fs::path run_dir = fs::path(c.base_output_directory) / c.run_name;
  const fs::path ckpt_dir = run_dir / "checkpoints";
  sum.run_dir = run_dir.string();
  // The config as it is saved (checkpoints, summary.json): CheckTrainLayout
  // wrote it already, so this cannot fail here.
  const Result<std::string> config_yaml = TrainConfigYaml(c);
  FP8MOE_RETURN_IF_ERROR(config_yaml.status());
  // The data first: a run refused for its dataset leaves no directory behind.
  // The dataset's flags are the table's; its shape is the model's and the
  // global batch.
  DataConfig dc = c.data;
  dc.seq_len = mc.seq_len;
  dc.vocab_size = mc.vocab_size;
  dc.batch = mc.batch;
  FP8MOE_ASSIGN_OR_RETURN(std::unique_ptr<Dataset> data, OpenDataset(dc));
  sum.entropy_floor = data->EntropyFloor();
  sum.global_batch_size_to_train_on = layout.global_batch;

  std::error_code ec;
  fs::create_directories(c.enable_checkpointing ? ckpt_dir : run_dir, ec);
  if (ec) {
    return IoError("cannot create the run directory '" + run_dir.string() + "': " + ec.message() +
                   "; set base_output_directory to a writable directory");
  }
  // One process per run directory: two trainers resuming the same run would
  // both append to metrics.jsonl (every step twice) and race on the
  // checkpoints. The lock dies with the process, SIGKILL included. Under
  // mpirun the writing rank (0) holds it for the job.
  RunLock lock;
  // Rank 0 takes the lock and then chooses what every rank resumes from, and
  // tells the others in one all-reduce. No other rank touches the run
  // directory before that: LatestCheckpoint removes the temporary files of a
  // killed save, and a refused second job's rank 1 removed the first job's
  // save in progress. And ranks that list different files (no shared
  // filesystem) cannot resume from different checkpoints.
  std::optional<std::string> latest;
  {
    Status lead_status;
    int64_t choice[2] = {std::numeric_limits<int64_t>::min(),
                         std::numeric_limits<int64_t>::min()};  // {status code, step or -1}
    if (lead) {
      lead_status = lock.Acquire(run_dir / "train.lock");
      std::optional<std::string> newest;
      if (lead_status.ok()) newest = internal::LatestCheckpoint(ckpt_dir.string());
      // Without checkpointing the run starts at step 0 and rewrites
      // metrics.jsonl; over a run that has checkpoints that would lose its
      // history, and a later resume would mix the two runs' metrics.
      if (lead_status.ok() && !c.enable_checkpointing && newest) {
        lead_status = FailedPrecondition(
            "run directory '" + run_dir.string() + "' holds checkpoints (the newest '" + *newest +
            "') but enable_checkpointing=false would train it again from step 0 over its "
            "metrics; resume it with enable_checkpointing=true, or use another run_name");
      }
      if (c.enable_checkpointing) latest = newest;
      choice[0] = static_cast<int64_t>(lead_status.code());
      choice[1] = latest ? internal::CheckpointStep(*latest) : -1;
    }
    FP8MOE_RETURN_IF_ERROR(comm->AllReduce(choice, choice, 2, DType::kI64, ReduceOp::kMax));
    if (!lead_status.ok()) return lead_status;
    if (choice[0] != 0) {
      return Status(static_cast<StatusCode>(choice[0]),
                    "rank 0 refused the run directory '" + run_dir.string() + "' (see its message)");
    }
    if (!lead && choice[1] >= 0) latest = internal::CheckpointPath(ckpt_dir.string(), choice[1]);
  }

  ContextOptions co;
  co.seed = c.data.seed;
  Context ctx(co);
  // The masters and the AdamW moments live only in the FSDP shards, and no
  // rank ever holds a whole set of them: the initial weights are drawn a
  // tensor at a time (InitParams' sink) and sliced, a checkpoint is read into
  // the shards a tensor at a time (resharding is slicing: whatever rank count
  // wrote it) and saved the same way.
  const std::vector<std::pair<std::string, Shape>> shapes = ParamShapes(mc);
  const std::vector<internal::CheckpointTensor> ckpt_layout = internal::CheckpointLayout(shapes);
  FP8MOE_ASSIGN_OR_RETURN(std::unique_ptr<internal::FsdpState> fsdp,
                          internal::FsdpState::Create(*comm, shapes, expert_group.get(),
                                                      ring.get()));
  auto to_master = [&](size_t k, const float* whole) {
    fsdp->LoadTensor({internal::CheckpointSet::kParams, k, shapes[k].first, shapes[k].second},
                     whole);
  };

  internal::TrainState state;
  if (!latest) {
    FP8MOE_RETURN_IF_ERROR(InitParams(mc, c.init_weights_seed, to_master));
  } else {
    const Status loaded = internal::LoadCheckpoint(
        *latest, c, layout, ckpt_layout,
        [&](const internal::CheckpointTensor& t, const float* whole) { fsdp->LoadTensor(t, whole); },
        &state);
    FP8MOE_RETURN_IF_ERROR(AgreeOnCheckpoint(*comm, *latest, loaded, state.checksum));
    if (Status st = data->SetPosition(state.data_position); !st.ok()) {
      return DataLoss("checkpoint '" + *latest + "' has a data_position this dataset cannot "
                      "use: " + st.message() + "; resume with the dataset flags it was "
                      "trained with, or use another run_name to start a new run");
    }
    ctx.rng().set_state(state.rng);
    sum.resumed_from = state.step;
    sum.resume_changes = internal::ConfigChangesOnResume(state.config_yaml, state.global_batch, c,
                                                         layout.global_batch);
  }
  // params: the weights the model reads, gathered each step; grads: this
  // rank's gradient. The expert weights reach the GMMs as gathered codes
  // (gather8) or bf16 copies, never in f32, except in the f32 mode (the GMMs
  // read the master) and with a fixed weight calibration (its
  // straight-through mask reads the master). So params hold f32 experts only
  // in those modes, and then only this ring rank's E/P; the gradients hold
  // this ring rank's E/P experts.
  const bool f32_experts = MoeReadsF32Masters(mc.moe);
  const int64_t local_experts = mc.moe.num_experts / (ring ? ring->size() : 1);
  FP8MOE_ASSIGN_OR_RETURN(ModelParams params,
                          AllocateParams(mc, f32_experts ? local_experts : 0));
  FP8MOE_ASSIGN_OR_RETURN(ModelParams grads, AllocateParams(mc, local_experts));
  // A finished run is not trained again: its summary stands.
  if (state.step >= c.steps && fs::exists(run_dir / "summary.json")) {
    std::ifstream in(run_dir / "summary.json");
    json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.contains("final_eval_loss") && j["final_eval_loss"].is_number()) {
      sum.steps = state.step;
      sum.final_eval_loss = j["final_eval_loss"].get<double>();
      if (j.contains("final_loss") && j["final_loss"].is_number()) sum.final_loss = j["final_loss"].get<double>();
      if (j.contains("mean_step_time_s")) sum.mean_step_time_s = j["mean_step_time_s"].get<double>();
      if (j.contains("tokens_per_s")) sum.tokens_per_s = j["tokens_per_s"].get<double>();
      sum.nonfinite_steps = state.nonfinite_steps;
      if (!opt.quiet) {
        std::printf("fp8moe train: %s already finished at step %lld (raise steps= to train "
                    "further, or use another run_name)\n  final eval loss  %.4f\n",
                    run_dir.string().c_str(), static_cast<long long>(state.step),
                    *sum.final_eval_loss);
        if (sum.entropy_floor) {
          std::printf("  entropy floor    %.4f  (eval loss - floor = %.4f nats)\n",
                      *sum.entropy_floor, *sum.final_eval_loss - *sum.entropy_floor);
        }
      }
      return sum;
    }
  }
  const std::string metrics_path = (run_dir / "metrics.jsonl").string();
  std::FILE* metrics = nullptr;
  if (lead) {
    if (sum.resumed_from > 0) {
      FP8MOE_RETURN_IF_ERROR(TrimMetrics(metrics_path, state.step));
    }
    metrics = std::fopen(metrics_path.c_str(), sum.resumed_from > 0 ? "a" : "w");
    if (metrics == nullptr) return IoError("cannot open '" + metrics_path + "' for writing");
  }
  struct Closer {
    std::FILE* f;
    ~Closer() {
      if (f != nullptr) std::fclose(f);
    }
  } closer{metrics};

  const bool tty = !opt.quiet && ::isatty(::fileno(stderr)) != 0;
  if (!opt.quiet) {
    std::printf("fp8moe train: %s\n  model %s, S=%lld, B=%lld; QAT mode %s\n  data %s\n"
                "  global_batch_size_to_train_on %lld (per_device_batch_size=%s x %d rank%s)\n",
                run_dir.string().c_str(), internal::ModelSignature(mc).c_str(),
                static_cast<long long>(mc.seq_len), static_cast<long long>(mc.batch),
                sum.quantization_mode.c_str(), data->Describe().c_str(),
                static_cast<long long>(layout.global_batch),
                internal::ShortestDecimal(c.per_device_batch_size).c_str(), F, F == 1 ? "" : "s");
    if (sum.entropy_floor) std::printf("  entropy floor %.4f nats/token\n", *sum.entropy_floor);
    if (sum.resumed_from > 0) {
      std::printf("  resumed from step %lld\n", static_cast<long long>(sum.resumed_from));
    }
    std::fflush(stdout);
  }
  if (lead && !sum.resume_changes.empty()) {
    // Not an error (a longer schedule or a lower learning rate is a normal
    // continuation), but no longer the run the checkpoint began.
    std::fprintf(stderr, "warning: resuming %s with %zu setting%s changed since its checkpoint "
                 "was saved:\n", run_dir.string().c_str(), sum.resume_changes.size(),
                 sum.resume_changes.size() == 1 ? "" : "s");
    for (const auto& ch : sum.resume_changes) {
      std::fprintf(stderr, "  %s: %s -> %s%s\n", ch.key.c_str(), ch.saved.c_str(), ch.now.c_str(),
                   ch.key == "steps" ? " (the learning-rate schedule follows the new steps)" : "");
    }
    std::fflush(stderr);
  }

  Model model(local_mc);
  // Every rank shares the batch (the load-balancing loss over the global
  // batch, as one rank computes it); the ring of experts, if any.
  model.SetRanks({comm, ring.get()});
  std::vector<PreparedMoeWeights> prepared;
  const int64_t N = mc.batch * mc.seq_len;  // tokens of the global batch
  std::vector<int32_t> inputs(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  // This rank's slice of the global batch (SplitGlobalBatch): consecutive
  // sequences after those of the ranks before it (rank i of the job is
  // fsdp_index * P + expert_index).
  const size_t slice = static_cast<size_t>(layout.first_sequence * mc.seq_len);
  // A rank's means are over its own sequences; the global batch's mean is
  // sum_r (sequences_r / G) mean_r, i.e. the mean over the ranks of
  // share * mean_r. With equal shares share is exactly 1 and changes no bit.
  const double share = static_cast<double>(layout.sequences) * static_cast<double>(F) /
                       static_cast<double>(layout.global_batch);
  const int32_t* my_inputs = inputs.data() + slice;
  const int32_t* my_targets = targets.data() + slice;
  ExpertWeightSource* expert_source = f32_experts ? nullptr : fsdp.get();
  // Gathers the weights for a forward and prepares the experts.
  auto gather = [&]() -> Status {
    FP8MOE_RETURN_IF_ERROR(fsdp->GatherParams(&params, /*skip_experts=*/!f32_experts));
    return model.PrepareExperts(ctx, params, &prepared, expert_source);
  };
  ModelStepInfo info;
  ResetMemoryPeak();
  const double t_start = Now();
  double time_sum = 0;
  int64_t timed = 0, allocs_after_first = 0, ran = 0;
  std::vector<double> recent_losses;
  std::optional<double> last_eval;

  // The mean over the ranks of per-rank means weighted by their shares: the
  // global batch's mean, the same bits on every rank.
  auto global_mean = [&](std::vector<double> v) -> Result<std::vector<double>> {
    for (double& x : v) x *= share;
    FP8MOE_ASSIGN_OR_RETURN(std::vector<double> s, internal::SumOverRanks(*comm, v));
    for (double& x : s) x /= static_cast<double>(F);
    return s;
  };
  auto evaluate = [&]() -> Result<double> {
    FP8MOE_RETURN_IF_ERROR(gather());
    double total = 0;
    for (int64_t i = 0; i < c.eval_steps; ++i) {
      data->EvalBatch(i, inputs.data(), targets.data());
      ModelStepInfo ei;
      FP8MOE_RETURN_IF_ERROR(
          model.Step(ctx, params, prepared, my_inputs, my_targets, nullptr, &ei));
      FP8MOE_ASSIGN_OR_RETURN(std::vector<double> m, global_mean({ei.loss}));
      total += m[0];
    }
    return total / static_cast<double>(c.eval_steps);
  };
  auto save = [&](int64_t step) -> Status {
    state.step = step;
    state.global_batch = layout.global_batch;
    state.rng = ctx.rng().state();
    state.data_position = data->Position();
    const std::string path = internal::CheckpointPath(ckpt_dir.string(), step);
    // Every rank gathers the tensors one at a time, in the file's order;
    // rank 0 writes them (a temporary name, then a rename: no partial
    // checkpoint is ever visible) and tells the others how it went, which
    // also holds them until the file is complete.
    Status s = internal::SaveCheckpoint(
        path, c, ckpt_layout,
        [&](const internal::CheckpointTensor& t, float* out) {
          return fsdp->GatherTensor(t, out);
        },
        state, /*write=*/lead);
    int64_t code = static_cast<int64_t>(s.code());
    FP8MOE_RETURN_IF_ERROR(comm->AllReduce(&code, &code, 1, DType::kI64, ReduceOp::kMax));
    if (!lead && code != 0) {
      return Status(static_cast<StatusCode>(code),
                    "rank 0 could not save the checkpoint of step " + std::to_string(step) +
                        " (see its message)");
    }
    if (!s.ok()) {
      auto latest = internal::LatestCheckpoint(ckpt_dir.string());
      return Status(s.code(), "cannot save the checkpoint of step " + std::to_string(step) +
                                  ": " + s.message() + "; the last complete checkpoint is " +
                                  (latest ? "'" + *latest + "' (intact)" : "none") +
                                  "; fix the cause (a full disk: free space) and run again to "
                                  "resume");
    }
    if (lead) internal::PruneCheckpoints(ckpt_dir.string(), 2);
    return OkStatus();
  };

  // Bytes this rank sent on the job's communicator and, with expert
  // parallelism, on the expert ring and the expert FSDP group.
  auto bytes_sent = [&]() {
    int64_t b = comm->bytes_sent();
    for (const auto* sub : {&ring, &expert_group}) {
      if (*sub) b += (*sub)->bytes_sent();
    }
    return b;
  };
  int64_t completed = state.step;
  // threads_follow_load: the team shrinks while other processes keep cores
  // busy and grows back when they stop (see base/core_share.h).
  // The job's ranks start at an equal share of the cores (they may all be
  // on this machine; where they are not, the first window grows the team).
  internal::CoreShare core_share(omp_get_max_threads(), 0.5, comm->size());
  struct RestoreThreads {  // the caller's OpenMP thread count, however Train returns
    int n = omp_get_max_threads();
    ~RestoreThreads() { omp_set_num_threads(n); }
  } restore_threads;
  int threads_min = 0, threads_max = 0;
  for (int64_t s = state.step; s < c.steps; ++s) {
    completed = s + 1;
    if (opt.threads_follow_load) omp_set_num_threads(core_share.Update());
    const int threads = omp_get_max_threads();
    threads_min = threads_min == 0 ? threads : std::min(threads_min, threads);
    threads_max = std::max(threads_max, threads);
    const int64_t allocs0 = GetMemoryStats().allocations;
    const int64_t sent0 = bytes_sent(), expert0 = fsdp->expert_gather_bytes();
    const double t0 = Now();
    data->NextTrainBatch(inputs.data(), targets.data());
    const bool last = s + 1 == c.steps;
    const bool log_step = (s + 1) % c.log_period == 0 || last;
    fsdp->set_count_health(log_step);
    FP8MOE_RETURN_IF_ERROR(gather());
    const double t_gathered = Now();
    FP8MOE_RETURN_IF_ERROR(
        model.Step(ctx, params, prepared, my_inputs, my_targets, &grads, &info));
    const double t_computed = Now();
    // Losses, router loads and reruns of the global batch, in one
    // collective (the counts are exact in double).
    if (F > 1) {
      std::vector<double> v = {info.loss * share, info.aux_loss * share,
                               static_cast<double>(info.dropless_reruns)};
      for (const auto& layer : info.expert_load) v.insert(v.end(), layer.begin(), layer.end());
      FP8MOE_ASSIGN_OR_RETURN(v, internal::SumOverRanks(*comm, v));
      info.loss = v[0] / static_cast<double>(F);
      info.aux_loss = v[1] / static_cast<double>(F);
      info.dropless_reruns = static_cast<int64_t>(v[2]);
      size_t i = 3;
      for (auto& layer : info.expert_load) {
        for (int32_t& x : layer) x = static_cast<int32_t>(v[i++]);
      }
    }
    // ReduceGradients averages the ranks' gradients: weighted by the shares,
    // that is the gradient of the global batch's mean loss.
    if (share != 1.0) ScaleGradients(&grads, static_cast<float>(share));
    FP8MOE_RETURN_IF_ERROR(fsdp->ReduceGradients(grads));
    StepReport rep;
    rep.step = s + 1;
    rep.loss = info.loss;
    rep.lr = LearningRate(c, s);
    FP8MOE_ASSIGN_OR_RETURN(const internal::FsdpState::GradientCheck check,
                            fsdp->CheckGradients());
    std::string bad = std::isfinite(info.loss) && std::isfinite(info.aux_loss)
                          ? check.first_nonfinite
                          : "loss";
    if (!bad.empty()) {
      rep.skipped = true;
      ++state.nonfinite_steps;
      if (lead) std::fprintf(stderr, "%sfp8moe train: step %lld: non-finite %s%s; step skipped (%lld of "
                   "max_nonfinite_steps=%lld)\n", tty ? "\n" : "", static_cast<long long>(s + 1),
                   bad == "loss" ? "loss" : "gradient in ", bad == "loss" ? "" : bad.c_str(),
                   static_cast<long long>(state.nonfinite_steps),
                   static_cast<long long>(c.max_nonfinite_steps));
    } else {
      rep.grad_norm = check.norm;
      const double clip = c.gradient_clipping_threshold > 0 && rep.grad_norm > c.gradient_clipping_threshold
                              ? c.gradient_clipping_threshold / rep.grad_norm
                              : 1.0;
      FP8MOE_RETURN_IF_ERROR(fsdp->AdamW(ctx, c, s + 1, rep.lr, clip));
      // Finite gradients can still give non-finite weights (a learning rate or
      // weight decay past float range, an epsilon that rounds to 0): stop
      // before such weights reach a checkpoint or the next step. Collective:
      // every rank checks its shard and all stop together.
      FP8MOE_ASSIGN_OR_RETURN(const std::string w, fsdp->FirstNonFiniteMaster());
      if (!w.empty()) {
        if (tty) std::fprintf(stderr, "\n");
        char lr[32];
        std::snprintf(lr, sizeof(lr), "%g", rep.lr);
        return OutOfRange("stopping: the AdamW update of step " + std::to_string(s + 1) +
                          " made the weights of " + w + " non-finite (learning rate " + lr +
                          "); lower learning_rate or "
                          "adam_weight_decay, or raise adam_eps. The last checkpoint is "
                          "intact");
      }
    }
    rep.step_time_s = Now() - t0;
    rep.comm_bytes = bytes_sent() - sent0;
    rep.expert_gather_bytes = fsdp->expert_gather_bytes() - expert0;
    rep.allocations = GetMemoryStats().allocations - allocs0;
    rep.threads = threads;
    if (ran > 0) {
      time_sum += rep.step_time_s;
      allocs_after_first += rep.allocations;
      ++timed;
    }
    ++ran;

    json j = {{"step", s + 1},
              {"loss", rep.skipped ? json(nullptr) : json(info.loss)},
              {"aux_loss", info.aux_loss},
              {"lr", rep.lr},
              {"grad_norm", rep.grad_norm},
              {"step_time_s", rep.step_time_s},
              {"tokens_per_s", static_cast<double>(N) / rep.step_time_s},
              {"dropless_reruns", info.dropless_reruns},
              {"dropped_tokens", 0},
              {"threads", threads},
              {"nonfinite_steps", state.nonfinite_steps}};
    if (comm->size() > 1) {
      j["comm_bytes"] = rep.comm_bytes;  // rank 0's
      // Rank 0's time in the weight gathers (with the experts' quantization)
      // and in forward + backward (with the MoE layers' count all-reduces);
      // the rest of step_time_s is the gradient reduce-scatter and the update.
      j["gather_time_s"] = t_gathered - t0;
      j["compute_time_s"] = t_computed - t_gathered;
      j["expert_gather_bytes"] = rep.expert_gather_bytes;
    }
    json load = json::array();
    for (const auto& layer : info.expert_load) {
      json l = json::array();
      const double pairs = static_cast<double>(N * mc.moe.num_experts_per_tok);
      for (int32_t cnt : layer) l.push_back(static_cast<double>(cnt) / pairs);
      load.push_back(l);
    }
    j["expert_load"] = load;
    if (lead && log_step) {
      // Weights: counted over the whole tensors (every ring rank's experts);
      // activations: rank 0's slice.
      json health = json::object();
      for (int64_t l = 0; l < mc.num_layers; ++l) {
        const std::string p = "layers." + std::to_string(l) + ".";
        const PreparedMoeWeights& pw = prepared[static_cast<size_t>(l)];
        if (pw.wi.health.values > 0) health[p + "wi"] = HealthJson(pw.wi.health);
        if (pw.wo.health.values > 0) health[p + "wo"] = HealthJson(pw.wo.health);
        Fp8Health hx, ha;
        FP8MOE_RETURN_IF_ERROR(model.ActivationHealth(ctx, l, prepared, &hx, &ha));
        if (hx.values > 0) health[p + "wi_lhs"] = HealthJson(hx);
        if (ha.values > 0) health[p + "wo_lhs"] = HealthJson(ha);
      }
      j["fp8_health"] = health;
    }
    if ((c.eval_interval > 0 && (s + 1) % c.eval_interval == 0) || last) {
      FP8MOE_ASSIGN_OR_RETURN(const double e, evaluate());
      rep.eval_loss = e;
      last_eval = e;
      j["eval_loss"] = e;
    }
    const std::string line = j.dump() + "\n";
    if (lead && (std::fputs(line.c_str(), metrics) < 0 || std::fflush(metrics) != 0)) {
      return IoError("cannot append to '" + metrics_path + "' (disk full?)");
    }
    if (!rep.skipped) {
      recent_losses.push_back(info.loss);
      if (recent_losses.size() > static_cast<size_t>(c.log_period)) {
        recent_losses.erase(recent_losses.begin());
      }
    }
    if (opt.on_step) opt.on_step(rep);

    // Progress: a live line on a terminal, a log line every log_period steps otherwise.
    if (!opt.quiet) {
      const double elapsed = Now() - t_start;
      const double eta = elapsed / static_cast<double>(ran) * static_cast<double>(c.steps - s - 1);
      char buf[256];
      std::snprintf(buf, sizeof(buf), "step %lld/%lld  loss %.4f%s  lr %.2e  %s tok/s  ETA %s",
                    static_cast<long long>(s + 1), static_cast<long long>(c.steps), info.loss,
                    last_eval ? ("  eval " + std::to_string(*last_eval).substr(0, 6)).c_str() : "",
                    rep.lr, Rate(static_cast<double>(N) / rep.step_time_s).c_str(),
                    Duration(eta).c_str());
      if (tty) {
        std::fprintf(stderr, "\r%s\033[K", buf);
      } else if ((s + 1) % c.log_period == 0 || last) {
        std::printf("%s\n", buf);
        std::fflush(stdout);
      }
    }
    if (state.nonfinite_steps > 0 && state.nonfinite_steps >= c.max_nonfinite_steps &&
        rep.skipped) {
      if (tty) std::fprintf(stderr, "\n");
      return OutOfRange("stopping: " + std::to_string(state.nonfinite_steps) +
                        " steps had a non-finite loss or gradient (the last: " + bad +
                        ", step " + std::to_string(s + 1) + "); max_nonfinite_steps=" +
                        std::to_string(c.max_nonfinite_steps) +
                        ". Lower learning_rate or set gradient_clipping_threshold");
    }
    if (c.enable_checkpointing &&
        ((c.checkpoint_period > 0 && (s + 1) % c.checkpoint_period == 0) || last)) {
      FP8MOE_RETURN_IF_ERROR(save(s + 1));
    }
    if (opt.stop_after_steps > 0 && ran >= opt.stop_after_steps) break;
  }
  if (tty) std::fprintf(stderr, "\n");
  if (!last_eval) {  // a finished run resumed, or stopped early
    FP8MOE_ASSIGN_OR_RETURN(last_eval, evaluate());
  }
  sum.steps = completed;
  sum.final_eval_loss = last_eval;
  for (double l : recent_losses) sum.final_loss += l / static_cast<double>(recent_losses.size());
  sum.mean_step_time_s = timed > 0 ? time_sum / static_cast<double>(timed) : 0.0;
  sum.tokens_per_s = sum.mean_step_time_s > 0 ? static_cast<double>(N) / sum.mean_step_time_s : 0.0;
  sum.nonfinite_steps = state.nonfinite_steps;
  sum.peak_bytes = GetMemoryStats().peak;
  sum.allocations_per_step =
      timed > 0 ? static_cast<double>(allocs_after_first) / static_cast<double>(timed) : 0.0;
  sum.threads_min = threads_min;
  sum.threads_max = threads_max;

  json sj = {{"steps", sum.steps},
             {"global_batch_size_to_train_on", sum.global_batch_size_to_train_on},
             {"resumed_from", sum.resumed_from},
             {"final_loss", recent_losses.empty() ? json(nullptr) : json(sum.final_loss)},
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
             {"resume_changes", [&] {
                json a = json::array();
                for (const auto& ch : sum.resume_changes) {
                  a.push_back({{"key", ch.key}, {"saved", ch.saved}, {"now", ch.now}});
                }
                return a;
              }()},
             {"wall_time_s", Now() - t_start},
             {"config", *config_yaml}};
  if (lead) {
    FP8MOE_RETURN_IF_ERROR(
        WriteTextAtomically((run_dir / "summary.json").string(), sj.dump(2) + "\n"));
  }

  if (!opt.quiet) {
    std::printf("\nfp8moe train: done, %s\n", run_dir.string().c_str());
    std::printf("  steps            %lld%s\n", static_cast<long long>(sum.steps),
                sum.resumed_from > 0
                    ? (" (resumed from " + std::to_string(sum.resumed_from) + ")").c_str()
                    : "");
    if (!recent_losses.empty()) {
      std::printf("  final loss       %.4f  (train, mean of the last %zu steps)\n", sum.final_loss,
                  recent_losses.size());
    }
    std::printf("  final eval loss  %.4f\n", *sum.final_eval_loss);
    if (sum.entropy_floor) {
      std::printf("  entropy floor    %.4f  (eval loss - floor = %.4f nats)\n", *sum.entropy_floor,
                  *sum.final_eval_loss - *sum.entropy_floor);
    }
    std::printf("  QAT mode         %s\n", sum.quantization_mode.c_str());
    std::printf("  step time        %.4f s mean, %s tokens/s\n", sum.mean_step_time_s,
                Rate(sum.tokens_per_s).c_str());
    std::printf("  wall time        %s\n", Duration(Now() - t_start).c_str());
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
  return sum;
}

}  // namespace fp8moe
