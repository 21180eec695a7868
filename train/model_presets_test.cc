// model_name presets (train/model_presets.h, LoadTrainConfig): every preset
// file loads and validates, a preset's flag changes only with
// override_model_config, the resolved config is a config file for the same
// run, and a full-size preset is refused by the memory plan before anything
// is allocated.
#include "train/model_presets.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_util.h"
#include "fp8moe/config.h"
#include "fp8moe/memory.h"
#include "fp8moe/train.h"
#include "train/train_test_util.h"

namespace fp8moe {
namespace {

using internal::ModelPresetNames;
using internal::ModelPresetYaml;

// The flags preset `name` sets, in the schema's order.
std::vector<std::string> PresetKeys(const std::string& name) {
  auto text = ModelPresetYaml(name);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  auto c = LoadConfigText(TrainConfigSchema(), std::string(*text), name, {});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  std::vector<std::string> keys;
  const ConfigSchema schema = TrainConfigSchema();
  for (const FlagSpec& f : schema.flags()) {
    if (c->IsSet(f.name)) keys.push_back(f.name);
  }
  return keys;
}

TEST(ModelPresets, EveryPresetLoadsAndValidates) {
  const std::vector<std::string> names = ModelPresetNames();
  ASSERT_FALSE(names.empty()) << "no configs/models/*.yml compiled in";
  for (const std::string& name : names) {
    auto c = LoadTrainConfig("", {"model_name=" + name});
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
    EXPECT_EQ(c->model_name, name);
    const std::vector<std::string> keys = PresetKeys(name);
    EXPECT_FALSE(keys.empty()) << name;
    for (const std::string& k : keys) {
      EXPECT_NE(k, "model_name") << name;
      EXPECT_NE(k, "override_model_config") << name;
    }
  }
}

TEST(ModelPresets, AnUnknownNameListsThePresetsAndTheClosest) {
  auto c = LoadTrainConfig("", {"model_name=no-such-model"});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("model_name=no-such-model is not a model preset"),
            std::string::npos) << c.status().message();
  for (const std::string& name : ModelPresetNames()) {
    EXPECT_NE(c.status().message().find(name), std::string::npos) << c.status().message();
  }
  const std::string first = ModelPresetNames().front();
  auto typo = LoadTrainConfig("", {"model_name=" + first.substr(0, first.size() - 1)});
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("did you mean model_name=" + first + "?"),
            std::string::npos) << typo.status().message();
}

TEST(ModelPresets, APresetFlagChangesOnlyWithOverrideModelConfig) {
  for (const std::string& name : ModelPresetNames()) {
    const std::string key = PresetKeys(name).front();
    auto preset = LoadTrainConfig("", {"model_name=" + name});
    ASSERT_TRUE(preset.ok()) << preset.status().ToString();
    // Every preset's first key is a positive integer flag of the model's shape.
    auto yaml = TrainConfigYaml(*preset);
    ASSERT_TRUE(yaml.ok());
    auto resolved = LoadConfigText(TrainConfigSchema(), *yaml, "resolved", {});
    ASSERT_TRUE(resolved.ok());
    const int64_t value = resolved->GetInt(key);
    const std::string other = key + "=" + std::to_string(value * 2);
    auto refused = LoadTrainConfig("", {"model_name=" + name, other});
    ASSERT_FALSE(refused.ok()) << name << " " << other;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("model_name=" + name + " sets " + key + " to " +
                                              std::to_string(value)),
              std::string::npos) << refused.status().message();
    EXPECT_NE(refused.status().message().find("override_model_config=true"), std::string::npos);
    // The same value is no change; with the override the user's value wins.
    EXPECT_TRUE(LoadTrainConfig("", {"model_name=" + name,
                                     key + "=" + std::to_string(value)}).ok());
    auto changed = LoadTrainConfig("", {"model_name=" + name, "override_model_config=true",
                                        other});
    if (!changed.ok()) {  // doubling may break a rule of the shape: then that rule speaks
      EXPECT_EQ(changed.status().message().find("model_name="), std::string::npos)
          << changed.status().message();
      continue;
    }
    auto changed_yaml = TrainConfigYaml(*changed);
    ASSERT_TRUE(changed_yaml.ok());
    auto back = LoadConfigText(TrainConfigSchema(), *changed_yaml, "changed", {});
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->GetInt(key), value * 2);
  }
}

TEST(ModelPresets, AConfigFileIsHeldToThePresetToo) {
  const std::string name = ModelPresetNames().front();
  const std::string key = PresetKeys(name).front();
  fs::create_directories(TestDir());
  const std::string path = TestDir() + "/preset_conflict.yml";
  {
    std::ofstream(path) << "model_name: " << name << "\n" << key << ": 3\n";
  }
  auto c = LoadTrainConfig(path, {});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("sets " + key), std::string::npos) << c.status().message();
  // With the override the file's value passes the preset's check (3 may
  // still break a rule of the shape, which then speaks for itself).
  auto overridden = LoadTrainConfig(path, {"override_model_config=true"});
  if (!overridden.ok()) {
    EXPECT_EQ(overridden.status().message().find("model_name="), std::string::npos)
        << overridden.status().message();
  }
}

TEST(ModelPresets, TheResolvedConfigIsAConfigFileForTheSameRun) {
  for (const std::string& name : ModelPresetNames()) {
    auto c = LoadTrainConfig("", {"model_name=" + name, "steps=7"});
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto yaml = TrainConfigYaml(*c);
    ASSERT_TRUE(yaml.ok());
    fs::create_directories(TestDir());
    const std::string path = TestDir() + "/resolved_" + name + ".yml";
    {
      std::ofstream(path) << *yaml;
    }
    auto again = LoadTrainConfig(path, {});
    ASSERT_TRUE(again.ok()) << name << ": " << again.status().ToString();
    auto yaml_again = TrainConfigYaml(*again);
    ASSERT_TRUE(yaml_again.ok());
    EXPECT_EQ(*yaml_again, *yaml) << name;
  }
}

TEST(ModelPresets, AFullSizePresetIsRefusedByTheMemoryPlanBeforeAllocating) {
  test::CapGuard guard;
  SetMemoryCap(uint64_t{16} << 30, "test");
  for (const std::string name : {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek3-671b"}) {
    ResetMemoryPeak();
    const int64_t before = GetMemoryStats().in_use;
    auto s = RunTiny({"model_name=" + name, "base_output_directory=" + TestDir(),
                      "run_name=full_" + name}, {}, true);
    ASSERT_FALSE(s.ok()) << name;
    EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
    EXPECT_NE(s.status().message().find("memory cap is 17179869184 bytes"), std::string::npos)
        << s.status().message();
    EXPECT_EQ(GetMemoryStats().peak, before) << name;  // nothing was allocated
    EXPECT_FALSE(fs::exists(TestDir() + "/full_" + name)) << name;
  }
}

}  // namespace
}  // namespace fp8moe
