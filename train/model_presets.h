// The model presets of `model_name=NAME` (MaxText's flag): configs/models/
// NAME.yml, compiled into the library at build time (train/CMakeLists.txt
// writes model_presets_data.cc from the files), so the command needs no
// file beside it. LoadTrainConfig lays the preset under the user's settings.
#ifndef FP8MOE_TRAIN_MODEL_PRESETS_H_
#define FP8MOE_TRAIN_MODEL_PRESETS_H_

#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/status.h"

namespace fp8moe::internal {

// model_name's value that loads no preset (MaxText's default).
inline constexpr std::string_view kDefaultModelName = "default";

// One configs/models file: its name without .yml, and its text.
struct ModelPresetFile {
  const char* name;
  const char* yaml;
};
// The generated table, ended by {nullptr, nullptr}.
extern const ModelPresetFile kModelPresetFiles[];

// Every preset's name, sorted.
std::vector<std::string> ModelPresetNames();

// The text of preset `name`; for any other name an InvalidArgument that
// lists the presets and suggests the closest.
Result<std::string_view> ModelPresetYaml(std::string_view name);

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_MODEL_PRESETS_H_
