// Checkpoints of a run (internal to train/): safetensors files holding the
// weights ("params/<name>"), the AdamW moments ("adam_m/<name>",
// "adam_v/<name>") and, in __metadata__, the step, the RNG state, the data
// position, the non-finite step count, the model signature, the QAT mode and
// the whole config as YAML. Written atomically (io/safetensors): a crash
// leaves either the old file set or the new one, never a torn file.
#ifndef FP8MOE_TRAIN_CHECKPOINT_H_
#define FP8MOE_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/train.h"

namespace fp8moe::internal {

struct TrainState {
  int64_t step = 0;  // completed steps
  Rng::State rng{};
  std::vector<uint64_t> data_position;
  int64_t nonfinite_steps = 0;
};

// "V=256 D=64 L=2 H=4 hd=16 F=128 E=4 k=2": what the weights' shapes depend on.
std::string ModelSignature(const ModelConfig& model);

// <dir>/step_NNNNNNNN.safetensors
std::string CheckpointPath(const std::string& dir, int64_t step);

// The newest checkpoint in `dir` (by step in the name), if any. Removes the
// temporary files a killed save left behind.
std::optional<std::string> LatestCheckpoint(const std::string& dir);

Status SaveCheckpoint(const std::string& path, const TrainConfig& config, const Config& raw,
                      const ModelParams& params, const ModelParams& adam_m,
                      const ModelParams& adam_v, const TrainState& state);

// Loads into tensors of the config's shapes. A checkpoint of another model
// shape or QAT mode is a FailedPrecondition naming both; a malformed one
// DataLoss.
Status LoadCheckpoint(const std::string& path, const TrainConfig& config, ModelParams* params,
                      ModelParams* adam_m, ModelParams* adam_v, TrainState* state);

// Removes all but the newest `keep` checkpoints of `dir`.
void PruneCheckpoints(const std::string& dir, int keep);

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_CHECKPOINT_H_
