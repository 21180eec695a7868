// Checkpoints of a run (internal to train/): safetensors files holding the
// weights ("params/<name>"), the AdamW moments ("adam_m/<name>",
// "adam_v/<name>") and, in __metadata__, the step, the RNG state, the data
// position, the non-finite step count, the model signature, the QAT mode and
// the whole config as YAML. Written atomically (io/safetensors): a crash
// leaves either the old file set or the new one, never a torn file. Saved
// and loaded one tensor at a time (SafetensorsWriter / SafetensorsReader):
// a run holds one tensor of a checkpoint, never a whole set, so the FSDP
// shards can be written and resumed without any rank holding the model's
// moments whole.
#ifndef FP8MOE_TRAIN_CHECKPOINT_H_
#define FP8MOE_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/context.h"
#include "fp8moe/model.h"
#include "fp8moe/safetensors.h"
#include "fp8moe/train.h"

namespace fp8moe::internal {

struct TrainState {
  int64_t step = 0;  // completed steps
  Rng::State rng{};
  std::vector<uint64_t> data_position;
  int64_t nonfinite_steps = 0;
  std::string config_yaml;  // the run's whole config when it was saved
  // global_batch_size_to_train_on; 0 in a checkpoint written before
  // per_device_batch_size meant the sequences of one rank (MaxText's meaning),
  // when it was the global batch.
  int64_t global_batch = 0;
  uint64_t checksum = 0;    // the file's checksum (CheckpointChecksum), when loaded
};

// One setting that differs between a checkpoint's config and a resuming
// run's: the flag and its two values as text.
using ConfigChange = TrainSummary::ConfigChange;

// The flags of `now` whose values differ from those in `saved_yaml` (a
// checkpoint's "config" metadata), in TrainConfigFlags() order, leaving out
// the bookkeeping flags the table marks ResumeNeutral (run and output names,
// checkpoint, log and eval periods, the rank layout, tiles, token chunks,
// remat, per_device_batch_size: none of them changes what is trained by
// itself); then global_batch_size_to_train_on when `saved_global` (0: a
// checkpoint of the old meaning, whose global batch LoadCheckpoint has found
// equal) differs from `now_global`.
// The flags are empty when `saved_yaml` does not parse with this version's
// schema.
std::vector<ConfigChange> ConfigChangesOnResume(const std::string& saved_yaml,
                                                int64_t saved_global, const TrainConfig& now,
                                                int64_t now_global);

// "V=256 D=64 L=2 H=4 hd=16 F=128 E=4 k=2": what the weights' shapes depend on;
// then the attention flags that differ from multi-head attention with an
// lm_head, by name (" base_num_kv_heads=2 logits_via_embedding=true").
std::string ModelSignature(const ModelConfig& model);

// The checksum SaveCheckpoint records in the metadata ("checksum") and
// LoadCheckpoint verifies: every metadata entry but itself and every tensor's
// name, dtype, shape and bytes. 16 hex digits.
std::string CheckpointChecksum(const SafetensorsFile& file);

// <dir>/step_NNNNNNNN.safetensors
std::string CheckpointPath(const std::string& dir, int64_t step);
// The step in a CheckpointPath's file name, or -1 for another name.
int64_t CheckpointStep(const std::string& path);

// The newest checkpoint in `dir` (by step in the name), if any. Removes the
// temporary files a killed save left behind.
std::optional<std::string> LatestCheckpoint(const std::string& dir);

// The three f32 sets a checkpoint holds, each shaped like the parameters.
enum class CheckpointSet { kParams, kAdamM, kAdamV };

// One tensor of a checkpoint: its set, its index in ModelParams::Named()
// order, its name in the file ("params/layers.0.wi") and its shape.
struct CheckpointTensor {
  CheckpointSet set = CheckpointSet::kParams;
  size_t index = 0;
  std::string name;
  Shape shape;
  size_t num_elements() const { return NumElements(shape); }
};

// Every tensor of a checkpoint of the parameters `shapes` (ParamShapes:
// names and whole shapes in Named() order; state (IsModelState) without AdamW
// moments), in the file's order: sorted by
// name, the checksum's order, so a save hashes the data as it writes it.
std::vector<CheckpointTensor> CheckpointLayout(
    const std::vector<std::pair<std::string, Shape>>& shapes);

// Fills `out` with tensor t's whole f32 data (t.num_elements() floats).
using CheckpointSource = std::function<Status(const CheckpointTensor& t, float* out)>;

// Writes the checkpoint of `layout` (CheckpointLayout's) to `path`, asking
// `source` for each of its tensors in turn, into one
// buffer of the largest tensor. `source` is called for every tensor, in
// that order, whatever happens to the file (a failed write is reported
// after the last call and leaves `path` as it was), and with write = false
// nothing is written at all: the other ranks of a job run this too, so
// their gathers match the writing rank's.
// The metadata's "config" is TrainConfigYaml(config), and
// "global_batch_size_to_train_on" state.global_batch.
Status SaveCheckpoint(const std::string& path, const TrainConfig& config,
                      const std::vector<CheckpointTensor>& layout,
                      const CheckpointSource& source,
                      const TrainState& state, bool write = true);

// Receives tensor t's whole f32 data (t.num_elements() floats).
using CheckpointSink = std::function<void(const CheckpointTensor& t, const float* data)>;

// Checks the checkpoint at `path` whole — metadata, checksum, the config's
// tensor names and shapes, finite values — reading one tensor at a time, and
// only then hands `sink` every tensor of `layout` (a second
// read) and fills *state. A checkpoint of another model shape or QAT mode
// is a FailedPrecondition naming both; a malformed one DataLoss; either
// changes nothing. A checkpoint without global_batch_size_to_train_on was
// written when per_device_batch_size meant the global batch: it resumes only
// where this run's global batch (`run`, CheckTrainLayout's) is that number,
// else a FailedPrecondition says which per_device_batch_size continues it.
// A read error in the second pass (the file changed or the disk failed after
// it was checked) is returned after `sink` may have received some tensors.
Status LoadCheckpoint(const std::string& path, const TrainConfig& config,
                      const TrainLayout& run, const std::vector<CheckpointTensor>& layout,
                      const CheckpointSink& sink, TrainState* state);

// Removes all but the newest `keep` checkpoints of `dir`.
void PruneCheckpoints(const std::string& dir, int keep);

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_CHECKPOINT_H_
