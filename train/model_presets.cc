#include "train/model_presets.h"

#include <algorithm>

#include "fp8moe/config.h"

namespace fp8moe::internal {

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const ModelPresetFile* f = kModelPresetFiles; f->name != nullptr; ++f) {
    names.emplace_back(f->name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<std::string_view> ModelPresetYaml(std::string_view name) {
  for (const ModelPresetFile* f = kModelPresetFiles; f->name != nullptr; ++f) {
    if (name == f->name) return std::string_view(f->yaml);
  }
  const std::vector<std::string> names = ModelPresetNames();
  std::string list = std::string(kDefaultModelName);
  for (const std::string& n : names) list += ", " + n;
  const std::string near = SuggestClosest(name, names);
  return InvalidArgument("model_name=" + std::string(name) + " is not a model preset" +
                         (near.empty() ? "." : "; did you mean model_name=" + near + "?") +
                         " The presets (configs/models/NAME.yml): " + list);
}

}  // namespace fp8moe::internal
