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

Result<int64_t> MetaInt(const SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.metadata.find(key);
  if (it == f.metadata.end()) {
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
  std::string Hex() const {
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h_));
    return buf;
  }

 private:
  void Mix(uint64_t w) {
    h_ = (h_ ^ w) * 0x9E3779B97F4A7C15ull;
    h_ = (h_ << 29) | (h_ >> 35);
  }
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

std::string CheckpointChecksum(const SafetensorsFile& f) {
  Checksum c;
  std::map<std::string, std::string> meta(f.metadata.begin(), f.metadata.end());
  meta.erase("checksum");
  for (const auto& [k, v] : meta) {
    c.Add(k);
    c.Add(v);
  }
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for (const auto& [name, t] : f.tensors) tensors.emplace_back(name, &t);
  std::sort(tensors.begin(), tensors.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [name, t] : tensors) {
    c.Add(name);
    c.Add(std::string(DTypeName(t->dtype())) + " " + ShapeToString(t->shape()));
    c.Add(t->data(), t->num_bytes());
  }
  return c.Hex();
}

std::string ModelSignature(const ModelConfig& m) {
  return "V=" + std::to_string(m.vocab_size) + " D=" + std::to_string(m.emb_dim) +
         " L=" + std::to_string(m.num_layers) + " H=" + std::to_string(m.num_heads) +
         " hd=" + std::to_string(m.head_dim) + " F=" + std::to_string(m.mlp_dim) +
         " E=" + std::to_string(m.moe.num_experts) + " k=" + std::to_string(m.moe.num_experts_per_tok);
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld.safetensors", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
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

Status SaveCheckpoint(const std::string& path, const TrainConfig& config, const Config& raw,
                      const ModelParams& params, const ModelParams& adam_m,
                      const ModelParams& adam_v, const TrainState& state) {
  SafetensorsFile f;
  for (const auto& [prefix, set] : {std::pair{"params/", &params}, {"adam_m/", &adam_m},
                                    {"adam_v/", &adam_v}}) {
    for (const auto& [name, t] : set->Named()) {
      FP8MOE_ASSIGN_OR_RETURN(Tensor copy, Tensor::Create(t->dtype(), t->shape()));
      std::memcpy(copy.data(), t->data(), t->num_bytes());
      FP8MOE_RETURN_IF_ERROR(f.Add(prefix + name, std::move(copy)));
    }
  }
  f.metadata["fp8moe_checkpoint"] = "1";
  f.metadata["step"] = std::to_string(state.step);
  f.metadata["rng_state"] = JoinU64(state.rng.data(), state.rng.size());
  f.metadata["data_position"] = JoinU64(state.data_position.data(), state.data_position.size());
  f.metadata["nonfinite_steps"] = std::to_string(state.nonfinite_steps);
  f.metadata["model_signature"] = ModelSignature(config.model);
  f.metadata["quantization_mode"] = std::string(MoeQatModeName(PlanMoeQuantization(config.model.moe).mode));
  f.metadata["config"] = raw.ToYaml();
  f.metadata["checksum"] = CheckpointChecksum(f);
  return WriteSafetensors(path, f);
}

Status LoadCheckpoint(const std::string& path, const TrainConfig& config, ModelParams* params,
                      ModelParams* adam_m, ModelParams* adam_v, TrainState* state) {
  // Everything is checked into a scratch state first; *params, the moments
  // and *state change only once the whole file has passed.
  auto file = ReadSafetensors(path);
  if (!file.ok()) {
    return Status(file.status().code(),
                  "cannot resume from checkpoint: " + file.status().message() + "; " + kFixHint);
  }
  SafetensorsFile& f = *file;
  auto meta = [&](const std::string& key) -> std::string {
    auto it = f.metadata.find(key);
    return it == f.metadata.end() ? "?" : it->second;
  };
  if (f.metadata.count("fp8moe_checkpoint") == 0) {
    return DataLoss("'" + path + "' is not an fp8moe checkpoint (no fp8moe_checkpoint metadata); " +
                    kFixHint);
  }
  if (meta("fp8moe_checkpoint") != "1") {
    return DataLoss("checkpoint '" + path + "' has format version '" + meta("fp8moe_checkpoint") +
                    "', but this fp8moe reads version 1; " + kFixHint);
  }
  if (f.metadata.count("checksum") == 0) {
    return DataLoss("checkpoint '" + path + "' has no checksum in its metadata; " + kFixHint);
  }
  if (const std::string sum = CheckpointChecksum(f); sum != meta("checksum")) {
    return DataLoss("checkpoint '" + path + "' is corrupt: its contents have checksum " + sum +
                    " but the file records " + meta("checksum") +
                    " (a flipped bit, a partial copy or an edit); " + kFixHint);
  }
  const std::string sig = ModelSignature(config.model);
  if (meta("model_signature") != sig) {
    return FailedPrecondition("checkpoint '" + path + "' holds a model of shape " +
                              meta("model_signature") + " but this run's config has " + sig +
                              "; set the flags the checkpoint was trained with, or use another "
                              "run_name to start a new run");
  }
  const std::string mode(MoeQatModeName(PlanMoeQuantization(config.model.moe).mode));
  if (meta("quantization_mode") != mode) {
    return FailedPrecondition("checkpoint '" + path + "' was trained in QAT mode " +
                              meta("quantization_mode") + " but this run's config selects " +
                              mode +
                              "; set the QAT flags the checkpoint was trained with, or use "
                              "another run_name to start a new run");
  }
  TrainState s;
  FP8MOE_ASSIGN_OR_RETURN(s.step, MetaInt(f, "step", path));
  FP8MOE_ASSIGN_OR_RETURN(s.nonfinite_steps, MetaInt(f, "nonfinite_steps", path));
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
  std::vector<std::pair<Tensor*, const Tensor*>> copies;
  for (const auto& [prefix, set] : {std::pair{"params/", params}, {"adam_m/", adam_m},
                                    {"adam_v/", adam_v}}) {
    for (auto& [name, t] : set->Named()) {
      const Tensor* src = f.Find(prefix + name);
      if (src == nullptr) {
        return DataLoss("checkpoint '" + path + "' lacks tensor " + prefix + name + "; " +
                        kFixHint);
      }
      if (src->dtype() != DType::kF32 || src->shape() != t->shape()) {
        return DataLoss("checkpoint '" + path + "' holds tensor " + prefix + name + " as " +
                        std::string(DTypeName(src->dtype())) + " " +
                        ShapeToString(src->shape()) + " but this run needs f32 " +
                        ShapeToString(t->shape()) + "; " + kFixHint);
      }
      // The trainer never saves NaN or Inf (it skips non-finite steps).
      if (const NonFinite nf = FindNonFinite(src->view()); nf.count > 0) {
        return DataLoss("checkpoint '" + path + "' holds " + std::to_string(nf.count) +
                        " NaN or Inf values in " + prefix + name + "; " + kFixHint);
      }
      copies.emplace_back(t, src);
    }
  }
  if (f.tensors.size() != copies.size()) {
    return DataLoss("checkpoint '" + path + "' holds " + std::to_string(f.tensors.size()) +
                    " tensors but this model has " + std::to_string(copies.size()) + "; " +
                    kFixHint);
  }
  for (auto& [dst, src] : copies) std::memcpy(dst->data(), src->data(), dst->num_bytes());
  *state = std::move(s);
  return OkStatus();
}

}  // namespace fp8moe::internal
