#include "train/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>

#include "base/number_text.h"
#include "fp8moe/finite.h"
#include "fp8moe/safetensors.h"

namespace fp8moe::internal {
namespace fs = std::filesystem;

namespace {

// What a user can do about a checkpoint that cannot be read.
constexpr const char* kFixHint =
    "restore the file, or move it away to resume from the checkpoint before it (or use another "
    "run_name to start a new run)";

std::string JoinU64(const uint64_t* v, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

Result<std::vector<uint64_t>> SplitU64(const std::string& s, const std::string& what,
                                       const std::string& path) {
  std::vector<uint64_t> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(part.c_str(), &end, 10);
    // Digits only: strtoull alone would take "-1", " 7" and "+7".
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    if (!digits || *end != '\0' || errno != 0) {
      return DataLoss("checkpoint '" + path + "' has a malformed '" + what +
                      "' in its metadata: '" + s + "'; " + kFixHint);
    }
    out.push_back(v);
  }
  return out;
}

using Metadata = std::map<std::string, std::string>;

Result<int64_t> MetaInt(const Metadata& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    return DataLoss("checkpoint '" + path + "' has no '" + key + "' in its metadata");
  }
  FP8MOE_ASSIGN_OR_RETURN(auto v, SplitU64(it->second, key, path));
  if (v.size() != 1 || v[0] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return DataLoss("checkpoint '" + path + "' has a malformed '" + key + "' in its metadata: '" +
                    it->second + "'");
  }
  return static_cast<int64_t>(v[0]);
}

// Step of a "step_NNNNNNNN.safetensors" name, or -1.
int64_t StepOf(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return -1;
  const std::string suffix = ".safetensors";
  if (name.size() <= 5 + suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits = name.substr(5, name.size() - 5 - suffix.size());
  // At most 18 digits: any such number fits in int64 (std::stoll would
  // throw on a longer one).
  if (digits.empty() || digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::strtoll(digits.c_str(), nullptr, 10);
}

std::vector<std::pair<int64_t, std::string>> Checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t step = StepOf(name);
    if (step >= 0) out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A 64-bit checksum of a checkpoint's contents: every metadata entry but the
// checksum itself (sorted by key) and every tensor's name, dtype, shape and
// bytes (sorted by name). Not cryptographic: it catches bit flips, torn
// copies and hand edits, 8 bytes at a time (xor, multiply, rotate).
class Checksum {
 public:
  void Add(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      Mix(w);
    }
    uint64_t tail = 0;
    if (n > i) std::memcpy(&tail, p + i, n - i);
    Mix(tail ^ (static_cast<uint64_t>(n - i) << 56));
    Mix(static_cast<uint64_t>(n));  // lengths delimit the fields
  }
  void Add(const std::string& s) { Add(s.data(), s.size()); }
  std::string Hex() const { return Hex64(h_); }

 private:
  void Mix(uint64_t w) {
    h_ = (h_ ^ w) * 0x9E3779B97F4A7C15ull;
    h_ = (h_ << 29) | (h_ >> 35);
  }
  uint64_t h_ = 0xcbf29ce484222325ull;
};

// The checksum's start: every metadata entry but "checksum", by key.
Checksum ChecksumOfMetadata(const Metadata& metadata) {
  Checksum c;
  for (const auto& [k, v] : metadata) {
    if (k == "checksum") continue;
    c.Add(k);
    c.Add(v);
  }
  return c;
}

// Then each tensor, in name order.
void AddTensor(Checksum* c, const std::string& name, DType dtype, const Shape& shape,
               const void* data, size_t bytes) {
  c->Add(name);
  c->Add(std::string(DTypeName(dtype)) + " " + ShapeToString(shape));
  c->Add(data, bytes);
}

// A checkpoint without global_batch_size_to_train_on (`config_yaml` its
// config) was written when per_device_batch_size meant the global batch: it
// continues only with the same global batch, which on N ranks is now
// per_device_batch_size = its value / N.
Status CheckOldBatchMeaning(const std::string& path, const std::string& config_yaml,
                            const TrainConfig& config, const TrainLayout& run) {
  auto saved = LoadConfigText(TrainConfigSchema(), config_yaml, path + " (its config)", {});
  if (!saved.ok()) {
    return DataLoss("checkpoint '" + path + "' records no global_batch_size_to_train_on and " +
                    "its config does not load: " + saved.status().message() + "; " + kFixHint);
  }
  const double old = saved->GetFloat("per_device_batch_size");
  if (old == static_cast<double>(run.global_batch)) return OkStatus();
  const std::string n = std::to_string(run.ranks) + (run.ranks == 1 ? " rank" : " ranks");
  return FailedPrecondition(
      "checkpoint '" + path + "' was written when per_device_batch_size meant the global " +
      "batch (per_device_batch_size=" + ShortestDecimal(old) + " there: " + ShortestDecimal(old) +
      " sequences a step); it now counts the sequences of each rank, as in MaxText, so "
      "per_device_batch_size=" + ShortestDecimal(config.per_device_batch_size) + " on " + n +
      " is a global batch (global_batch_size_to_train_on) of " +
      std::to_string(run.global_batch) + ": resume with per_device_batch_size=" +
      ShortestDecimal(old / run.ranks) + " (" + ShortestDecimal(old) + " / " + n +
      ") to continue it, or use another run_name to start a new run");
}

// The global_batch_size_to_train_on a checkpoint records, or 0 for one of the
// old meaning that this run (`run`) may continue (CheckOldBatchMeaning).
Result<int64_t> GlobalBatchOf(const std::string& path, const Metadata& metadata,
                              const TrainConfig& config, const TrainLayout& run) {
  const auto it = metadata.find("global_batch_size_to_train_on");
  if (it == metadata.end()) {
    const auto yaml = metadata.find("config");
    FP8MOE_RETURN_IF_ERROR(CheckOldBatchMeaning(
        path, yaml == metadata.end() ? std::string() : yaml->second, config, run));
    return int64_t{0};
  }
  FP8MOE_ASSIGN_OR_RETURN(const int64_t g,
                          MetaInt(metadata, "global_batch_size_to_train_on", path));
  if (g < 1) {
    return DataLoss("checkpoint '" + path + "' records global_batch_size_to_train_on=" +
                    it->second + "; " + kFixHint);
  }
  return g;
}

// The placeholder a streamed save writes before the data is hashed: the
// width of Checksum::Hex, so the header keeps its length.
constexpr const char* kChecksumPlaceholder = "0000000000000000";

}  // namespace

std::string CheckpointChecksum(const SafetensorsFile& f) {
  Checksum c = ChecksumOfMetadata(f.metadata);
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for (const auto& [name, t] : f.tensors) tensors.emplace_back(name, &t);
  std::sort(tensors.begin(), tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [name, t] : tensors) AddTensor(&c, name, t->dtype(), t->shape(), t->data(), t->num_bytes());
  return c.Hex();
}

std::vector<CheckpointTensor> CheckpointLayout(
    const std::vector<std::pair<std::string, Shape>>& shapes) {
  std::vector<CheckpointTensor> out;
  for (const auto& [set, prefix] : {std::pair{CheckpointSet::kParams, "params/"},
                                    {CheckpointSet::kAdamM, "adam_m/"},
                                    {CheckpointSet::kAdamV, "adam_v/"}}) {
    for (size_t k = 0; k < shapes.size(); ++k) {
      // State (router_bias) has no AdamW moments: its weights alone.
      if (set != CheckpointSet::kParams && IsModelState(shapes[k].first)) continue;
      out.push_back({set, k, prefix + shapes[k].first, shapes[k].second});
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

namespace {
// The attention architecture flags that differ from multi-head attention
// with an lm_head, by flag name (so that the resume's refusal names the
// flag; the default model's signature is what it was before them).
std::string AttentionSignature(const ModelConfig& m) {
  std::string s;
  if (KvHeads(m) != m.num_heads) s += " base_num_kv_heads=" + std::to_string(KvHeads(m));
  if (m.use_qk_norm) s += " use_qk_norm=true";
  if (IsMla(m)) {  // every MLA flag by name: each changes the tensors or the scores
    s += " attention_type=mla q_lora_rank=" + std::to_string(m.q_lora_rank) +
         " kv_lora_rank=" + std::to_string(m.kv_lora_rank) +
         " qk_nope_head_dim=" + std::to_string(m.qk_nope_head_dim) +
         " qk_rope_head_dim=" + std::to_string(m.qk_rope_head_dim) +
         " v_head_dim=" + std::to_string(m.v_head_dim) +
         " rope_interleave=" + (m.rope_interleave ? "true" : "false");
  }
  if (m.logits_via_embedding) {
    s += " logits_via_embedding=true";
    if (!m.normalize_embedding_logits) s += " normalize_embedding_logits=false";
  }
  return s;
}
}  // namespace

std::string ModelSignature(const ModelConfig& m) {
  return "V=" + std::to_string(m.vocab_size) + " D=" + std::to_string(m.emb_dim) +
         " L=" + std::to_string(m.num_layers) + " H=" + std::to_string(m.num_heads) +
         " hd=" + std::to_string(m.head_dim) + " F=" + std::to_string(m.mlp_dim) +
         " E=" + std::to_string(m.moe.num_experts) + " k=" + std::to_string(m.moe.num_experts_per_tok) +
         AttentionSignature(m) +
         // The FFN variants, named only when set: the default model's
         // signature (and so its existing checkpoints) is unchanged.
         (m.shared_experts != 0 ? " shared_experts=" + std::to_string(m.shared_experts) : "") +
         (m.first_num_dense_layers != 0
              ? " first_num_dense_layers=" + std::to_string(m.first_num_dense_layers) +
                    " base_mlp_dim=" + std::to_string(m.base_mlp_dim)
              : "") +
         // routed_bias adds the router_bias state (a resume across it is
         // refused naming the flag).
         (m.moe.routed_bias ? " routed_bias=true" : "");
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld.safetensors", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

int64_t CheckpointStep(const std::string& path) {
  return StepOf(fs::path(path).filename().string());
}

std::optional<std::string> LatestCheckpoint(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    // Leftovers of a save that was killed before its rename.
    if (e.path().filename().string().find(".safetensors.tmp.") != std::string::npos) {
      fs::remove(e.path(), ec);
    }
  }
  auto all = Checkpoints(dir);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

void PruneCheckpoints(const std::string& dir, int keep) {
  auto all = Checkpoints(dir);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove(all[i].second, ec);
}

Status SaveCheckpoint(const std::string& path, const TrainConfig& config,
                      const std::vector<CheckpointTensor>& layout,
                      const CheckpointSource& source, const TrainState& state, bool write) {
  // The checksum is streamed in name order: a layout in any other order
  // would record a checksum that no load could match.
  if (!std::is_sorted(layout.begin(), layout.end(),
                      [](const auto& a, const auto& b) { return a.name < b.name; })) {
    return Internal("SaveCheckpoint needs CheckpointLayout's order (tensors sorted by name)");
  }
  size_t largest = 0;
  for (const CheckpointTensor& t : layout) largest = std::max(largest, t.num_elements());
  FP8MOE_ASSIGN_OR_RETURN(Tensor buffer,
                          Tensor::Create(DType::kF32, {static_cast<int64_t>(largest)}));
  float* data = buffer.data_as<float>();
  Metadata meta;
  meta["fp8moe_checkpoint"] = "1";
  meta["step"] = std::to_string(state.step);
  meta["rng_state"] = JoinU64(state.rng.data(), state.rng.size());
  meta["data_position"] = JoinU64(state.data_position.data(), state.data_position.size());
  meta["nonfinite_steps"] = std::to_string(state.nonfinite_steps);
  meta["model_signature"] = ModelSignature(config.model);
  meta["quantization_mode"] = std::string(MoeQatModeName(PlanMoeQuantization(config.model.moe).mode));
  FP8MOE_ASSIGN_OR_RETURN(meta["config"], TrainConfigYaml(config));
  // Also the mark of per_device_batch_size's meaning (LoadCheckpoint).
  meta["global_batch_size_to_train_on"] = std::to_string(state.global_batch);
  Checksum sum = ChecksumOfMetadata(meta);
  meta["checksum"] = kChecksumPlaceholder;

  std::unique_ptr<SafetensorsWriter> writer;
  Status error;
  if (write) {
    std::vector<SafetensorsEntry> entries;
    for (const CheckpointTensor& t : layout) entries.push_back({t.name, DType::kF32, t.shape});
    auto w = SafetensorsWriter::Create(path, std::move(entries), meta);
    if (w.ok()) {
      writer = std::move(*w);
    } else {
      error = w.status();
    }
  }
  for (const CheckpointTensor& t : layout) {
    FP8MOE_RETURN_IF_ERROR(source(t, data));
    if (writer == nullptr || !error.ok()) continue;
    const size_t bytes = t.num_elements() * sizeof(float);
    AddTensor(&sum, t.name, DType::kF32, t.shape, data, bytes);
    error = writer->Write(data, bytes);
  }
  if (writer == nullptr || !error.ok()) return error;
  meta["checksum"] = sum.Hex();
  return writer->Finish(meta);
}

namespace {

// A metadata value, or "?" where the file has none (for messages).
std::string MetaText(const Metadata& metadata, const std::string& key) {
  auto it = metadata.find(key);
  return it == metadata.end() ? "?" : it->second;
}

// An fp8moe checkpoint of format version 1 that records its checksum.
Status CheckFormat(const std::string& path, const Metadata& metadata) {
  if (metadata.count("fp8moe_checkpoint") == 0) {
    return DataLoss("'" + path + "' is not an fp8moe checkpoint (no fp8moe_checkpoint metadata); " +
                    kFixHint);
  }
  if (MetaText(metadata, "fp8moe_checkpoint") != "1") {
    return DataLoss("checkpoint '" + path + "' has format version '" +
                    MetaText(metadata, "fp8moe_checkpoint") +
                    "', but this fp8moe reads version 1; " + kFixHint);
  }
  if (metadata.count("checksum") == 0) {
    return DataLoss("checkpoint '" + path + "' has no checksum in its metadata; " + kFixHint);
  }
  return OkStatus();
}

// What the first pass over a checkpoint's tensors found: a buffer of its
// largest tensor (for the second pass) and the first of the layout's
// tensors that holds NaN or Inf, with its count.
struct ContentCheck {
  Tensor buffer;  // u8 [largest tensor's bytes]
  std::string first_nonfinite;
  int64_t nonfinite = 0;
};

// First pass: every tensor of the file, by name, through the checksum (an
// error when it differs from the recorded one); the layout's tensors also
// through the finiteness check.
Result<ContentCheck> CheckContents(const std::string& path, const SafetensorsReader& reader,
                                   const std::vector<CheckpointTensor>& layout) {
  const Metadata& metadata = reader.metadata();
  std::map<std::string, const CheckpointTensor*> wanted;
  for (const CheckpointTensor& t : layout) wanted[t.name] = &t;
  std::vector<const SafetensorsEntry*> entries;
  uint64_t largest = 0;
  for (const SafetensorsEntry& e : reader.entries()) {
    entries.push_back(&e);
    largest = std::max(largest, e.num_bytes());
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto* a, const auto* b) { return a->name < b->name; });
  ContentCheck out;
  FP8MOE_ASSIGN_OR_RETURN(out.buffer, Tensor::Create(DType::kU8, {static_cast<int64_t>(largest)}));
  Checksum sum = ChecksumOfMetadata(metadata);
  for (const SafetensorsEntry* e : entries) {
    if (Status r = reader.Read(e->name, out.buffer.data()); !r.ok()) {
      return Status(r.code(), "cannot resume from checkpoint: " + r.message() + "; " + kFixHint);
    }
    AddTensor(&sum, e->name, e->dtype, e->shape, out.buffer.data(), e->num_bytes());
    auto it = wanted.find(e->name);
    if (out.first_nonfinite.empty() && it != wanted.end() && e->dtype == DType::kF32 &&
        e->shape == it->second->shape) {
      // The trainer never saves NaN or Inf (it skips non-finite steps).
      out.nonfinite =
          FindNonFinite(ConstTensorView{out.buffer.data(), DType::kF32, e->shape}).count;
      if (out.nonfinite > 0) out.first_nonfinite = e->name;
    }
  }
  if (const std::string hex = sum.Hex(); hex != MetaText(metadata, "checksum")) {
    return DataLoss("checkpoint '" + path + "' is corrupt: its contents have checksum " + hex +
                    " but the file records " + MetaText(metadata, "checksum") +
                    " (a flipped bit, a partial copy or an edit); " + kFixHint);
  }
  return out;
}

// The checkpoint's model shape and QAT mode (with the hand-crafted scheme)
// are the config's.
Status CheckModelAndMode(const std::string& path, const Metadata& metadata,
                         const TrainConfig& config) {
  const std::string sig = ModelSignature(config.model);
  if (MetaText(metadata, "model_signature") != sig) {
    return FailedPrecondition("checkpoint '" + path + "' holds a model of shape " +
                              MetaText(metadata, "model_signature") +
                              " but this run's config has " + sig +
                              "; set the flags the checkpoint was trained with, or use another "
                              "run_name to start a new run");
  }
  const MoeQatMode qat = PlanMoeQuantization(config.model.moe).mode;
  const std::string mode(MoeQatModeName(qat));
  if (MetaText(metadata, "quantization_mode") != mode) {
    return FailedPrecondition("checkpoint '" + path + "' was trained in QAT mode " +
                              MetaText(metadata, "quantization_mode") +
                              " but this run's config selects " + mode +
                              "; set the QAT flags the checkpoint was trained with, or use "
                              "another run_name to start a new run");
  }
  // The hand-crafted schemes (int8, fp8, nanoo_fp8) share one mode name.
  if (qat == MoeQatMode::kHandCrafted) {
    auto saved = LoadConfigText(TrainConfigSchema(), MetaText(metadata, "config"),
                                path + " (its config)", {});
    const std::string now(MoeQuantizationName(config.model.moe.quantization));
    if (saved.ok() && saved->GetString("quantization") != now) {
      return FailedPrecondition("checkpoint '" + path + "' was trained with quantization=" +
                                saved->GetString("quantization") + " but this run's config has "
                                "quantization=" + now +
                                "; set the QAT flags the checkpoint was trained with, or use "
                                "another run_name to start a new run");
    }
  }
  return OkStatus();
}

// The run state the metadata records, checked: the step matches the file
// name and is within the config's steps, the skipped steps within the
// steps, the RNG state well formed.
Result<TrainState> ReadTrainState(const std::string& path, const Metadata& metadata,
                                  const TrainConfig& config, const TrainLayout& run) {
  auto meta = [&](const std::string& key) { return MetaText(metadata, key); };
  TrainState s;
  FP8MOE_ASSIGN_OR_RETURN(s.global_batch, GlobalBatchOf(path, metadata, config, run));
  FP8MOE_ASSIGN_OR_RETURN(s.step, MetaInt(metadata, "step", path));
  FP8MOE_ASSIGN_OR_RETURN(s.nonfinite_steps, MetaInt(metadata, "nonfinite_steps", path));
  const int64_t named_step = StepOf(fs::path(path).filename().string());
  if (s.step < 1 || (named_step >= 0 && s.step != named_step)) {
    return DataLoss("checkpoint '" + path + "' records step " + meta("step") +
                    ", which does not match its file name; " + kFixHint);
  }
  if (s.step > config.steps) {
    return FailedPrecondition("checkpoint '" + path + "' is at step " + std::to_string(s.step) +
                              ", past this run's steps=" + std::to_string(config.steps) +
                              "; set steps to at least " + std::to_string(s.step) +
                              " to continue it, or use another run_name to start a new run");
  }
  if (s.nonfinite_steps > s.step) {
    return DataLoss("checkpoint '" + path + "' records " + meta("nonfinite_steps") +
                    " skipped steps in " + meta("step") + " steps; " + kFixHint);
  }
  FP8MOE_ASSIGN_OR_RETURN(auto rng, SplitU64(meta("rng_state"), "rng_state", path));
  if (rng.size() != 4 || std::all_of(rng.begin(), rng.end(), [](uint64_t v) { return v == 0; })) {
    return DataLoss("checkpoint '" + path + "' has a malformed rng_state (four numbers, not all "
                    "zero); " + kFixHint);
  }
  std::copy(rng.begin(), rng.end(), s.rng.begin());
  FP8MOE_ASSIGN_OR_RETURN(s.data_position, SplitU64(meta("data_position"), "data_position", path));
  s.config_yaml = meta("config");
  s.checksum = std::strtoull(meta("checksum").c_str(), nullptr, 16);
  return s;
}

// The file holds exactly the layout's tensors, each f32 of its shape and
// finite (`contents`: the first pass's finding).
Status CheckTensors(const std::string& path, const SafetensorsReader& reader,
                    const std::vector<CheckpointTensor>& layout, const ContentCheck& contents) {
  for (const CheckpointTensor& t : layout) {
    const SafetensorsEntry* e = reader.Find(t.name);
    if (e == nullptr) {
      return DataLoss("checkpoint '" + path + "' lacks tensor " + t.name + "; " + kFixHint);
    }
    if (e->dtype != DType::kF32 || e->shape != t.shape) {
      return DataLoss("checkpoint '" + path + "' holds tensor " + t.name + " as " +
                      std::string(DTypeName(e->dtype)) + " " + ShapeToString(e->shape) +
                      " but this run needs f32 " + ShapeToString(t.shape) + "; " + kFixHint);
    }
  }
  if (!contents.first_nonfinite.empty()) {
    return DataLoss("checkpoint '" + path + "' holds " + std::to_string(contents.nonfinite) +
                    " NaN or Inf values in " + contents.first_nonfinite + "; " + kFixHint);
  }
  if (reader.entries().size() != layout.size()) {
    return DataLoss("checkpoint '" + path + "' holds " + std::to_string(reader.entries().size()) +
                    " tensors but this model has " + std::to_string(layout.size()) + "; " +
                    kFixHint);
  }
  return OkStatus();
}

}  // namespace

Status LoadCheckpoint(const std::string& path, const TrainConfig& config,
                      const TrainLayout& run, const std::vector<CheckpointTensor>& layout,
                      const CheckpointSink& sink, TrainState* state) {
  // Everything is checked before `sink` sees a tensor or *state changes.
  auto opened = SafetensorsReader::Open(path);
  if (!opened.ok()) {
    return Status(opened.status().code(),
                  "cannot resume from checkpoint: " + opened.status().message() + "; " + kFixHint);
  }
  const SafetensorsReader& reader = **opened;
  FP8MOE_RETURN_IF_ERROR(CheckFormat(path, reader.metadata()));
  FP8MOE_ASSIGN_OR_RETURN(ContentCheck contents, CheckContents(path, reader, layout));
  FP8MOE_RETURN_IF_ERROR(CheckModelAndMode(path, reader.metadata(), config));
  FP8MOE_ASSIGN_OR_RETURN(TrainState s, ReadTrainState(path, reader.metadata(), config, run));
  FP8MOE_RETURN_IF_ERROR(CheckTensors(path, reader, layout, contents));
  // Second pass: the checked file, tensor by tensor.
  for (const CheckpointTensor& t : layout) {
    FP8MOE_RETURN_IF_ERROR(reader.Read(t.name, contents.buffer.data()));
    sink(t, contents.buffer.data_as<float>());
  }
  *state = std::move(s);
  return OkStatus();
}

namespace {

// A flag's value as text, in the form a `key=value` override takes.
std::string ValueText(const Config& c, const FlagSpec& f) {
  switch (f.type) {
    case FlagType::kBool: return c.GetBool(f.name) ? "true" : "false";
    case FlagType::kInt: return std::to_string(c.GetInt(f.name));
    case FlagType::kFloat: return ShortestDecimal(c.GetFloat(f.name));
    case FlagType::kString: return c.GetString(f.name);
  }
  return {};
}

}  // namespace

std::vector<ConfigChange> ConfigChangesOnResume(const std::string& saved_yaml,
                                                int64_t saved_global, const TrainConfig& now,
                                                int64_t now_global) {
  std::vector<ConfigChange> out;
  const FlagTable<TrainConfig>& table = TrainConfigFlags();
  auto saved = LoadConfigText(table.Schema(), saved_yaml, "the checkpoint's config", {});
  auto current = table.ToConfig(now);
  if (saved.ok() && current.ok()) {
    for (const FlagRow<TrainConfig>& row : table.rows()) {
      if (row.resume_neutral) continue;
      std::string a = ValueText(*saved, row.spec), b = ValueText(*current, row.spec);
      if (a != b) out.push_back({row.spec.name, std::move(a), std::move(b)});
    }
  }
  // What per_device_batch_size (resume-neutral) and the ranks make: the
  // same flag on another rank count trains another global batch. (A
  // checkpoint of the old meaning records none; LoadCheckpoint found its
  // global batch equal.)
  if (saved_global != 0 && saved_global != now_global) {
    out.push_back({"global_batch_size_to_train_on", std::to_string(saved_global),
                   std::to_string(now_global)});
  }
  return out;
}

}  // namespace fp8moe::internal
