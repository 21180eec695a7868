#include "train/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "fp8moe/safetensors.h"

namespace fp8moe::internal {
namespace fs = std::filesystem;

namespace {

std::string JoinU64(const uint64_t* v, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

Result<std::vector<uint64_t>> SplitU64(const std::string& s, const std::string& what) {
  std::vector<uint64_t> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || errno != 0) {
      return DataLoss("checkpoint metadata '" + what + "' is malformed: '" + s + "'");
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
  FP8MOE_ASSIGN_OR_RETURN(auto v, SplitU64(it->second, key));
  if (v.size() != 1) return DataLoss("checkpoint metadata '" + key + "' is malformed");
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
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
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

}  // namespace

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
  return WriteSafetensors(path, f);
}

Status LoadCheckpoint(const std::string& path, const TrainConfig& config, ModelParams* params,
                      ModelParams* adam_m, ModelParams* adam_v, TrainState* state) {
  auto file = ReadSafetensors(path);
  if (!file.ok()) {
    return Status(file.status().code(), "cannot resume from checkpoint: " + file.status().message());
  }
  SafetensorsFile& f = *file;
  if (f.metadata.count("fp8moe_checkpoint") == 0) {
    return DataLoss("'" + path + "' is not an fp8moe checkpoint (no fp8moe_checkpoint metadata)");
  }
  const std::string sig = ModelSignature(config.model);
  const std::string have_sig = f.metadata.count("model_signature") ? f.metadata["model_signature"] : "?";
  if (have_sig != sig) {
    return FailedPrecondition("checkpoint '" + path + "' holds a model of shape " + have_sig +
                              " but this run's config has " + sig +
                              "; set the flags the checkpoint was trained with, or use another "
                              "run_name to start a new run");
  }
  const std::string mode(MoeQatModeName(PlanMoeQuantization(config.model.moe).mode));
  const std::string have_mode =
      f.metadata.count("quantization_mode") ? f.metadata["quantization_mode"] : "?";
  if (have_mode != mode) {
    return FailedPrecondition("checkpoint '" + path + "' was trained in QAT mode " + have_mode +
                              " but this run's config selects " + mode +
                              "; set the QAT flags the checkpoint was trained with, or use "
                              "another run_name to start a new run");
  }
  for (const auto& [prefix, set] : {std::pair{"params/", params}, {"adam_m/", adam_m},
                                    {"adam_v/", adam_v}}) {
    for (auto& [name, t] : set->Named()) {
      const Tensor* src = f.Find(prefix + name);
      if (src == nullptr || src->dtype() != DType::kF32 || src->shape() != t->shape()) {
        return DataLoss("checkpoint '" + path + "' lacks tensor " + prefix + name + " as F32 " +
                        ShapeToString(t->shape()));
      }
      std::memcpy(t->data(), src->data(), t->num_bytes());
    }
  }
  FP8MOE_ASSIGN_OR_RETURN(state->step, MetaInt(f, "step", path));
  FP8MOE_ASSIGN_OR_RETURN(state->nonfinite_steps, MetaInt(f, "nonfinite_steps", path));
  FP8MOE_ASSIGN_OR_RETURN(auto rng, SplitU64(f.metadata["rng_state"], "rng_state"));
  if (rng.size() != 4) return DataLoss("checkpoint '" + path + "' has a malformed rng_state");
  std::copy(rng.begin(), rng.end(), state->rng.begin());
  FP8MOE_ASSIGN_OR_RETURN(state->data_position,
                          SplitU64(f.metadata["data_position"], "data_position"));
  return OkStatus();
}

}  // namespace fp8moe::internal
