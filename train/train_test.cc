// The trainer on tiny shapes: the schedule, configs/base.yml against the
// schema, bit-identical resumption, refusing a checkpoint of another model
// or mode, and stopping after max_nonfinite_steps non-finite steps.
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/number_text.h"
#include "fp8moe/flag_table.h"
#include "fp8moe/safetensors.h"
#include "fp8moe/train.h"
#include "train/checkpoint.h"
#include "train/fsdp.h"
#include "train/optimizer.h"
#include "train/train_test_util.h"

namespace fp8moe {
namespace {

TEST(Train, ScheduleWarmsUpThenDecaysToTheFinalFraction) {
  TrainConfig c;
  c.steps = 100;
  c.learning_rate = 1.0;
  c.warmup_steps_fraction = 0.1;
  c.cosine_learning_rate_final_fraction = 0.1;
  EXPECT_DOUBLE_EQ(LearningRate(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(c, 10), 1.0);
  EXPECT_NEAR(LearningRate(c, 99), 0.1, 1e-12);
  EXPECT_NEAR(LearningRate(c, 10 + 89 / 2.0), 0.55, 0.02);
  for (int s = 11; s < 100; ++s) EXPECT_LT(LearningRate(c, s), LearningRate(c, s - 1));
}

// AdamW and clipping against the formulas in double, two steps.
TEST(Train, AdamWMatchesTheFormulaInDouble) {
  auto raw = LoadConfig(TrainConfigSchema(), "", Tiny("adam"));
  ASSERT_TRUE(raw.ok());
  auto cfg = TrainConfigFrom(*raw);
  ASSERT_TRUE(cfg.ok());
  TrainConfig c = *cfg;
  c.adam_weight_decay = 0.1;
  auto p = AllocateParams(c.model), g = AllocateParams(c.model), m = AllocateParams(c.model),
       v = AllocateParams(c.model);
  ASSERT_TRUE(p.ok() && g.ok() && m.ok() && v.ok());
  ASSERT_TRUE(InitParams(c.model, 3, &*p).ok());
  ASSERT_TRUE(InitParams(c.model, 4, &*g).ok());
  std::vector<std::vector<double>> P, M, V;
  for (ModelParams* s : {&*m, &*v}) {
    for (auto& [n, t] : s->Named()) std::memset(t->data(), 0, t->num_bytes());
  }
  double norm2 = 0;
  for (auto& [n, t] : p->Named()) P.emplace_back(t->data_as<float>(), t->data_as<float>() + t->num_elements());
  for (auto& [n, t] : g->Named()) {
    for (size_t i = 0; i < t->num_elements(); ++i) norm2 += double(t->data_as<float>()[i]) * t->data_as<float>()[i];
    M.emplace_back(t->num_elements(), 0.0);
    V.emplace_back(t->num_elements(), 0.0);
  }
  EXPECT_NEAR(internal::GlobalNorm(*g), std::sqrt(norm2), 1e-9 * std::sqrt(norm2));
  Context ctx;
  const double scale = 0.5, lr = 0.01;
  for (int t = 1; t <= 2; ++t) {
    ASSERT_TRUE(internal::AdamWUpdate(ctx, c, t, lr, scale, *g, &*p, &*m, &*v).ok());
    auto gn = g->Named();
    auto pn = p->Named();
    for (size_t k = 0; k < gn.size(); ++k) {
      const double wd = pn[k].second->rank() >= 2 ? c.adam_weight_decay : 0.0;
      for (size_t i = 0; i < P[k].size(); ++i) {
        const double gi = gn[k].second->data_as<float>()[i] * scale;
        M[k][i] = c.adam_b1 * M[k][i] + (1 - c.adam_b1) * gi;
        V[k][i] = c.adam_b2 * V[k][i] + (1 - c.adam_b2) * gi * gi;
        const double mh = M[k][i] / (1 - std::pow(c.adam_b1, t));
        const double vh = V[k][i] / (1 - std::pow(c.adam_b2, t));
        P[k][i] -= lr * (mh / (std::sqrt(vh) + c.adam_eps) + wd * P[k][i]);
        ASSERT_NEAR(pn[k].second->data_as<float>()[i], P[k][i], 1e-6 * std::max(1.0, std::fabs(P[k][i])))
            << pn[k].first << "[" << i << "] step " << t;
      }
    }
  }
}

TEST(Train, BaseYamlIsTheSchemaWrittenOut) {
  const std::string path = std::string(FP8MOE_SOURCE_DIR) + "/configs/base.yml";
  EXPECT_EQ(Bytes(path), BaseConfigYaml())
      << "configs/base.yml differs from the schema; regenerate it with "
         "build/release/cli/fp8moe train --print-base-config > configs/base.yml";
  const ConfigSchema schema = TrainConfigSchema();
  auto loaded = LoadConfig(schema, path, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  int keys = 0;
  std::istringstream in(Bytes(path));
  std::string line, previous;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#') {
      ++keys;
      EXPECT_EQ(previous.rfind("# ", 0), 0u) << line << " has no comment above it";
      EXPECT_TRUE(loaded->IsSet(line.substr(0, line.find(':'))));
    }
    previous = line;
  }
  EXPECT_EQ(keys, static_cast<int>(schema.flags().size()));
  auto cfg = TrainConfigFrom(*loaded);
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  // `fp8moe train` trains in native FP8 QAT by default.
  EXPECT_EQ(PlanMoeQuantization(cfg->model.moe).mode, MoeQatMode::kNativeFwdDlhs);
}

// Values of flag `f` other than its default, for the round trip below: the
// other bool, a larger number, the other choices; for a string without
// choices a plain word and a calibration's form (the calibrations refuse the
// word).
std::vector<std::string> OtherValues(const FlagSpec& f) {
  switch (f.type) {
    case FlagType::kBool:
      return {f.default_value == "true" ? "false" : "true"};
    case FlagType::kInt:
      return {std::to_string(std::stoll(f.default_value) + 3)};
    case FlagType::kFloat:
      return {internal::ShortestDecimal(std::stod(f.default_value) * 1.5 + 0.1)};
    case FlagType::kString: {
      if (f.choices.empty()) return {"alt_value", "fixed,-3.5,7.25"};
      std::vector<std::string> out;
      for (const std::string& c : f.choices) {
        if (c != f.default_value) out.push_back(c);
      }
      return out;
    }
  }
  return {};
}

// Every flag of `fp8moe train`, set to a value other than its default, reads
// into its field and back out: the config's YAML (what checkpoints store and
// the ranks fingerprint) loads back to the same value and the same YAML. A
// flag added to the table is covered here without a line of its own.
TEST(TrainConfigTable, EveryFlagRoundTripsThroughTheConfigsYaml) {
  const FlagTable<TrainConfig>& table = TrainConfigFlags();
  const ConfigSchema schema = TrainConfigSchema();
  ASSERT_EQ(schema.flags().size(), table.rows().size());
  const Config defaults(schema);
  for (const FlagSpec& f : schema.flags()) {
    SCOPED_TRACE(f.name);
    bool covered = false;
    for (const std::string& value : OtherValues(f)) {
      Config c(schema);
      ASSERT_TRUE(c.Set(f.name, value).ok()) << value;
      ASSERT_NE(c.ValueYaml(f.name), defaults.ValueYaml(f.name)) << value;
      TrainConfig t;
      (void)table.Read(c, &t);  // a value out of its range still sets the field
      auto written = table.ToConfig(t);
      ASSERT_TRUE(written.ok()) << written.status().ToString();
      if (written->ValueYaml(f.name) != c.ValueYaml(f.name)) continue;  // refused: next value
      covered = true;
      auto yaml = TrainConfigYaml(t);
      ASSERT_TRUE(yaml.ok()) << yaml.status().ToString();
      auto back = LoadConfigText(schema, *yaml, "the config's yaml", {});
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      EXPECT_EQ(back->ValueYaml(f.name), c.ValueYaml(f.name));
      TrainConfig r;
      (void)table.Read(*back, &r);
      EXPECT_EQ(*TrainConfigYaml(r), *yaml);
      break;
    }
    EXPECT_TRUE(covered) << "no other value of " << f.name << " read into its field and back";
  }
  // The defaults: TrainConfig{} is what the schema's defaults convert to.
  auto d = TrainConfigFrom(defaults);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(*TrainConfigYaml(*d), *TrainConfigYaml(TrainConfig{}));
  EXPECT_EQ(*TrainConfigYaml(*d), defaults.ToYaml());
}

// The flags a resumed run may change without a warning: the bookkeeping ones
// (names, periods, the rank layout, tiles, token chunks, remat), the preset
// choice (model_name, override_model_config: the flags they set are compared
// themselves), and per_device_batch_size, whose global batch the resume
// compares instead.
TEST(TrainConfigTable, BookkeepingFlagsAreTheResumeNeutralRows) {
  std::vector<std::string> neutral;
  for (const auto& row : TrainConfigFlags().rows()) {
    if (row.resume_neutral && row.spec.name.find("_tile_") == std::string::npos) {
      neutral.push_back(row.spec.name);
    }
    if (row.spec.name.find("_tile_") != std::string::npos) {
      EXPECT_TRUE(row.resume_neutral) << row.spec.name;
    }
  }
  EXPECT_EQ(neutral, (std::vector<std::string>{
                         "run_name", "base_output_directory", "enable_checkpointing",
                         "checkpoint_period", "log_period", "model_name",
                         "override_model_config", "per_device_batch_size",
                         "eval_interval", "eval_steps",
                         "ici_fsdp_parallelism", "ici_expert_parallelism",
                         "ici_tensor_parallelism", "remat_policy", "num_moe_token_chunks"}));
}

// Each flag's range, from the table, in the messages the trainer always gave.
TEST(TrainConfigTable, RangesReadAsTheTrainersMessages) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"steps=0", "invalid training configuration: steps=0 must be at least 1"},
      {"learning_rate=0", "invalid training configuration: learning_rate must be positive"},
      {"adam_b1=1", "invalid training configuration: adam_b1 must be in [0, 1)"},
      {"warmup_steps_fraction=2",
       "invalid training configuration: warmup_steps_fraction must be in [0, 1]"},
      {"adam_eps=1e-40",
       "invalid training configuration: adam_eps must be at least 1.2e-38 (the smallest normal "
       "float32; the AdamW update runs in float32)"},
      {"gradient_clipping_threshold=-1",
       "invalid training configuration: gradient_clipping_threshold must not be negative (0 "
       "turns clipping off)"},
      {"data_shuffle_seed=-1",
       "invalid training configuration: data_shuffle_seed must not be negative"},
      {"checkpoint_period=-1",
       "invalid training configuration: checkpoint_period must not be negative (0: only at "
       "the end)"},
      {"eval_steps=0",
       "invalid training configuration: eval_steps=0 must be in [1, 1000000] (batches per "
       "evaluation)"},
      {"log_period=0", "invalid training configuration: log_period must be at least 1"},
      {"eval_split_fraction=1",
       "invalid training configuration: eval_split_fraction=1 must be between 0 and 1 "
       "(exclusive): the share of the data held out for eval"},
  };
  for (const auto& [flag, message] : cases) {
    auto c = LoadTrainConfig("", {flag});
    ASSERT_FALSE(c.ok()) << flag;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(c.status().message(), message);
  }
}

TEST(Train, LossFallsAndTheRunDirectoryIsComplete) {
  std::vector<std::string> f = Tiny("falls");
  f.push_back("steps=40");
  f.push_back("learning_rate=0.01");
  std::vector<double> losses;
  TrainOptions o;
  o.on_step = [&](const StepReport& r) { losses.push_back(r.loss); };
  auto s = RunTiny(f, o, /*fresh=*/true);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(losses.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += losses[i], last += losses[35 + i];
  EXPECT_LT(last, first - 5 * 0.3);  // at least 0.3 nats lower
  ASSERT_TRUE(s->entropy_floor.has_value());
  EXPECT_GT(*s->final_eval_loss, *s->entropy_floor);
  EXPECT_EQ(s->quantization_mode, "native_fwd_dlhs");
  EXPECT_EQ(s->allocations_per_step, 0.0);
  const fs::path dir = fs::path(s->run_dir);
  EXPECT_TRUE(fs::exists(dir / "summary.json"));
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "step_00000040.safetensors"));
  std::ifstream m(dir / "metrics.jsonl");
  std::string line;
  int lines = 0, with_eval = 0, with_health = 0;
  while (std::getline(m, line)) {
    ++lines;
    with_eval += line.find("\"eval_loss\"") != std::string::npos;
    with_health += line.find("\"fp8_health\"") != std::string::npos;
  }
  EXPECT_EQ(lines, 40);
  EXPECT_EQ(with_eval, 7);     // every 6 steps and the last
  EXPECT_EQ(with_health, 14);  // every 3 steps and the last
}

TEST(Train, ResumingGivesTheBitsOfAnUninterruptedRun) {
  for (const char* mode :
       {"fp8_moe_native_bwd_dlhs=true", "fp8_moe_fake_quant=false", "shared_experts=1",
        "routed_bias=true"}) {
    SCOPED_TRACE(mode);
    std::vector<std::string> a = Tiny("whole");
    std::vector<std::string> b = Tiny("pieces");
    if (std::string(mode) == "shared_experts=1") {  // the FFN variants' tensors resume too
      for (auto* f : {&a, &b}) {
        f->insert(f->end(), {"shared_experts=1", "first_num_dense_layers=1", "base_mlp_dim=24"});
      }
    }
    if (std::string(mode) == "routed_bias=true") {  // the bias state resumes too
      for (auto* f : {&a, &b}) {
        f->insert(f->end(), {"routed_score_func=sigmoid", "routed_bias=true",
                             "routed_bias_update_rate=0.01"});
      }
    }
    if (std::string(mode) == "fp8_moe_fake_quant=false") {
      for (auto* f : {&a, &b}) {
        f->insert(f->end(), {"fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=",
                             "fp8_moe_native_fwd=false", "fp8_moe_native_bwd_dlhs=false"});
      }
    }
    auto whole = RunTiny(a, {}, true);
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    TrainOptions stop;
    stop.stop_after_steps = 6;  // checkpoint at 4; step 5 and 6 are lost
    ASSERT_TRUE(RunTiny(b, stop, true).ok());
    stop.stop_after_steps = 1;  // resumes at 4, runs 5
    ASSERT_TRUE(RunTiny(b, stop).ok());
    auto rest = RunTiny(b);
    ASSERT_TRUE(rest.ok()) << rest.status().ToString();
    EXPECT_EQ(rest->resumed_from, 4);
    EXPECT_EQ(rest->steps, 12);
    auto fa = ReadSafetensors(whole->run_dir + "/checkpoints/step_00000012.safetensors");
    auto fb = ReadSafetensors(rest->run_dir + "/checkpoints/step_00000012.safetensors");
    ASSERT_TRUE(fa.ok() && fb.ok());
    ASSERT_EQ(fa->tensors.size(), fb->tensors.size());
    for (size_t i = 0; i < fa->tensors.size(); ++i) {
      const Tensor& x = fa->tensors[i].second;
      const Tensor& y = fb->tensors[i].second;
      ASSERT_EQ(x.num_bytes(), y.num_bytes());
      EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.num_bytes())) << fa->tensors[i].first;
    }
    EXPECT_EQ(*whole->final_eval_loss, *rest->final_eval_loss);
    if (std::string(mode) == "routed_bias=true") {
      // The bias is in the file (without AdamW moments) and has moved.
      bool found = false;
      for (const auto& [name, t] : fa->tensors) {
        EXPECT_EQ(name.find("adam_m/layers.0.router_bias"), std::string::npos);
        EXPECT_EQ(name.find("adam_v/layers.0.router_bias"), std::string::npos);
        if (name != "params/layers.0.router_bias") continue;
        found = true;
        double moved = 0;
        for (size_t i = 0; i < t.num_elements(); ++i) moved += std::fabs(t.data_as<float>()[i]);
        EXPECT_GT(moved, 0);
      }
      EXPECT_TRUE(found);
    }
  }
}

TEST(Train, RefusesACheckpointOfAnotherModelOrMode) {
  ASSERT_TRUE(RunTiny(Tiny("other"), {}, true).ok());
  std::vector<std::string> f = Tiny("other");
  f.push_back("base_moe_mlp_dim=24");
  auto s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("F=16"), std::string::npos) << s.status().message();
  f = Tiny("other");
  f.push_back("fp8_moe_native_bwd_dlhs=false");
  s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("QAT mode native_fwd_dlhs"), std::string::npos)
      << s.status().message();
  // routed_bias adds state: a checkpoint without it is refused with it, and
  // one with it without it, the flag named either way.
  const std::vector<std::string> bias = {"routed_score_func=sigmoid", "routed_bias=true"};
  f = Tiny("other");
  f.insert(f.end(), bias.begin(), bias.end());
  s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("routed_bias=true"), std::string::npos)
      << s.status().message();
  f = Tiny("other_bias");
  f.insert(f.end(), bias.begin(), bias.end());
  ASSERT_TRUE(RunTiny(f, {}, true).ok());
  f.pop_back();  // routed_bias=false
  s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("routed_bias=true"), std::string::npos)
      << s.status().message();
}

// global_batch_size_to_train_on: in the summary and in every checkpoint; a
// checkpoint that records a global batch below one sequence is malformed.
TEST(Train, TheGlobalBatchIsRecordedAndChecked) {
  auto s = RunTiny(Tiny("global"), {}, true);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->global_batch_size_to_train_on, 4);
  const std::string path = s->run_dir + "/checkpoints/step_00000012.safetensors";
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->metadata["global_batch_size_to_train_on"], "4");
  f->metadata["global_batch_size_to_train_on"] = "0";
  f->metadata.erase("checksum");
  f->metadata["checksum"] = internal::CheckpointChecksum(*f);
  ASSERT_TRUE(WriteSafetensors(path, *f).ok());
  std::vector<std::string> more = Tiny("global");
  more.push_back("steps=14");
  auto r = RunTiny(more);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("records global_batch_size_to_train_on=0"),
            std::string::npos)
      << r.status().message();
}

TEST(Train, StopsAfterMaxNonfiniteSteps) {
  std::vector<std::string> f = Tiny("nonfinite");
  // A rate this large throws the weights to ~1e30 on the first update, so
  // every later loss overflows.
  f.insert(f.end(), {"learning_rate=1e30", "warmup_steps_fraction=0", "max_nonfinite_steps=3",
                     "gradient_clipping_threshold=0"});
  int skipped = 0;
  TrainOptions o;
  o.on_step = [&](const StepReport& r) { skipped += r.skipped; };
  auto s = RunTiny(f, o, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.status().message().find("max_nonfinite_steps=3"), std::string::npos)
      << s.status().message();
  EXPECT_EQ(skipped, 3);
}

// routed_bias's state in the FSDP state of one rank: replicated, never
// reduced, normed, checked for non-finite gradients, clipped or moved by
// AdamW (a gradient fed into its tensor changes nothing), moved only by
// UpdateRoutedBias, and checkpointed without moments.
TEST(Train, RoutedBiasIsStateThatOnlyTheLoadsMove) {
  std::vector<std::string> f = Tiny("bias_state");
  f.insert(f.end(), {"routed_score_func=sigmoid", "routed_bias=true",
                     "routed_bias_update_rate=0.25", "adam_weight_decay=0.1"});
  auto cfg = LoadTrainConfig("", f);
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  const ModelConfig& mc = cfg->model;
  const int64_t E = mc.moe.num_experts;
  const auto shapes = ParamShapes(mc);
  auto comm = MakeSingleRankCommunicator();
  auto fsdp = internal::FsdpState::Create(*comm, shapes);
  ASSERT_TRUE(fsdp.ok()) << fsdp.status().ToString();
  ASSERT_TRUE(InitParams(mc, 5, [&](size_t k, const float* whole) {
                (*fsdp)->LoadTensor({internal::CheckpointSet::kParams, k, shapes[k].first,
                                     shapes[k].second}, whole);
              }).ok());
  // Gradients of 1 everywhere but the bias's, which gets a NaN and 1e6s: a
  // step that read them would be skipped, clipped or moved.
  auto grads = AllocateParams(mc);
  ASSERT_TRUE(grads.ok());
  double elements = 0;
  for (auto& [name, t] : grads->Named()) {
    const bool state = IsModelState(name);
    std::fill(t->data_as<float>(), t->data_as<float>() + t->num_elements(), state ? 1e6f : 1.0f);
    if (state) t->data_as<float>()[1] = NAN;
    if (!state) elements += static_cast<double>(t->num_elements());
  }
  ASSERT_TRUE((*fsdp)->ReduceGradients(*grads).ok());
  auto check = (*fsdp)->CheckGradients();
  ASSERT_TRUE(check.ok());
  EXPECT_EQ(check->first_nonfinite, "");
  EXPECT_DOUBLE_EQ(check->norm, std::sqrt(elements));
  Context ctx;
  ASSERT_TRUE((*fsdp)->AdamW(ctx, *cfg, 1, 0.5, 1.0).ok());
  auto params = AllocateParams(mc);
  ASSERT_TRUE(params.ok());
  ASSERT_TRUE((*fsdp)->GatherParams(&*params, /*skip_experts=*/false).ok());
  int biases = 0;
  for (auto& [name, t] : params->Named()) {
    if (!IsModelState(name)) continue;
    ++biases;
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(t->data_as<float>()[e], 0.0f) << name;
  }
  EXPECT_EQ(biases, mc.num_layers);
  // The loads move it: rate x sign(mean - load), per layer.
  std::vector<std::vector<int32_t>> load(static_cast<size_t>(mc.num_layers));
  for (auto& l : load) l.assign(static_cast<size_t>(E), 8);
  load[0][0] = 10;
  load[0][1] = 6;  // layer 0: mean 8, expert 0 over, 1 under, the rest on it
  load[1][3] = 0;
  load[1][2] = 16;  // layer 1: mean 8
  ASSERT_TRUE((*fsdp)->UpdateRoutedBias(load, 0.25).ok());
  const auto bias = (*fsdp)->RouterBias(mc.num_layers);
  ASSERT_EQ(bias.size(), 2u);
  std::vector<float> want0(static_cast<size_t>(E), 0.0f), want1(static_cast<size_t>(E), 0.0f);
  want0[0] = -0.25f;
  want0[1] = 0.25f;
  want1[3] = 0.25f;
  want1[2] = -0.25f;
  EXPECT_EQ(bias[0], want0);
  EXPECT_EQ(bias[1], want1);
  // The checkpoint holds the bias's weights alone, and GatherTensor gives them.
  const auto layout = internal::CheckpointLayout(shapes);
  int in_file = 0;
  for (const auto& t : layout) {
    if (!IsModelState(t.name.substr(t.name.find('/') + 1))) continue;
    ++in_file;
    EXPECT_EQ(t.set, internal::CheckpointSet::kParams) << t.name;
    std::vector<float> out(t.num_elements());
    ASSERT_TRUE((*fsdp)->GatherTensor(t, out.data()).ok());
    EXPECT_EQ(out, t.name == "params/layers.0.router_bias" ? want0 : want1);
  }
  EXPECT_EQ(in_file, 2);
}

// The update runs once per optimizer step after AdamW, from the step's
// global loads, and never on a skipped step: with log_period=1 every
// metrics.jsonl line has the bias after that step, and each line's bias is
// the one before it moved by the line's own expert_load (logged as fractions
// of the pairs, so the sign compares with 1 / E).
TEST(Train, RoutedBiasMovesAfterEachStepByItsLoadsAndNotOnASkippedStep) {
  for (const bool skip : {false, true}) {
    SCOPED_TRACE(skip ? "skipped steps" : "finite steps");
    std::vector<std::string> f = Tiny(skip ? "bias_skip" : "bias_steps");
    f.insert(f.end(), {"routed_score_func=sigmoid", "routed_bias=true",
                       "routed_bias_update_rate=0.125", "log_period=1", "steps=6",
                       "load_balance_loss_weight=0"});
    if (skip) {  // as StopsAfterMaxNonfiniteSteps: step 1 finite, then skipped
      f.insert(f.end(), {"learning_rate=1e30", "warmup_steps_fraction=0",
                         "max_nonfinite_steps=4", "gradient_clipping_threshold=0"});
    }
    auto s = RunTiny(f, {}, true);
    ASSERT_EQ(s.ok(), !skip) << s.status().ToString();
    if (!skip) {
      EXPECT_EQ(s->allocations_per_step, 0.0);  // the update allocates nothing
    }
    std::ifstream in(TestDir() + "/" + (skip ? "bias_skip" : "bias_steps") + "/metrics.jsonl");
    std::string line;
    std::vector<std::vector<float>> before(2, std::vector<float>(4, 0.0f));  // E = 4
    int lines = 0, skipped = 0;
    while (std::getline(in, line)) {
      ++lines;
      const nlohmann::json j = nlohmann::json::parse(line);
      ASSERT_TRUE(j.contains("router_bias")) << line;
      const auto bias = j["router_bias"].get<std::vector<std::vector<float>>>();
      const auto load = j["expert_load"].get<std::vector<std::vector<double>>>();
      ASSERT_EQ(bias.size(), 2u);
      const bool was_skipped = j["loss"].is_null();
      skipped += was_skipped;
      for (size_t l = 0; l < 2; ++l) {
        ASSERT_EQ(bias[l].size(), 4u);
        for (size_t e = 0; e < 4; ++e) {
          const double d = 0.25 - load[l][e];  // mean fraction 1/E - this one's
          const float sign = was_skipped ? 0.0f : (d > 0 ? 1.0f : (d < 0 ? -1.0f : 0.0f));
          EXPECT_EQ(bias[l][e], before[l][e] + 0.125f * sign)
              << "step " << j["step"] << " layer " << l << " expert " << e;
        }
      }
      before = bias;
    }
    EXPECT_EQ(lines, skip ? 5 : 6);
    EXPECT_EQ(skipped, skip ? 4 : 0);
  }
}

TEST(Train, BadFlagsAreClearErrors) {
  auto raw = LoadConfig(TrainConfigSchema(), "", {"stpes=10"});
  ASSERT_FALSE(raw.ok());
  EXPECT_NE(raw.status().message().find("did you mean 'steps'"), std::string::npos)
      << raw.status().message();
  std::vector<std::string> f = Tiny("bad");
  f.push_back("quantization=fp8");  // with the default native QAT flags
  auto s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("both claim the expert GMMs"), std::string::npos);
  f = Tiny("bad");
  f.push_back("head_dim=7");
  s = RunTiny(f);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("head_dim=7"), std::string::npos);
}

}  // namespace
}  // namespace fp8moe
