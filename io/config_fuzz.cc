// libFuzzer target for the YAML config + key=value parser with the MoE rules
// and the trainer's flags and rules; see io/FUZZING.md. Seeds:
// io/config_fuzz_corpus/make_corpus.py.
//
// Input: YAML text, then optional key=value overrides, separated by NUL
// bytes ("num_experts: 4\n\0num_experts_per_tok=2"). Everything goes through
// LoadConfigText against MoeConfigSchema(), then MoeConfigFrom (which runs
// ValidateMoeConfig); and again against TrainConfigSchema() (`fp8moe train`'s
// flags), then TrainConfigFrom and the run's memory plan. A contract break
// aborts:
//  - a Status of another code than invalid argument (or an empty message);
//  - a loaded config whose ToYaml() does not load back to the same values;
//  - a config MoeConfigFrom accepts that ValidateMoeConfig then refuses, or
//    a tile, expert count or ragged_buffer_factor past its documented bound;
//  - a training config TrainConfigFrom accepts with a model size past 2^31 - 1,
//    eval_steps past 10^6, or one ValidateModelConfig refuses; a memory plan
//    smaller than the model's f32 weights;
//  - and whatever the sanitizers catch.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/gmm.h"
#include "fp8moe/moe_config.h"
#include "fp8moe/train.h"

namespace {

[[noreturn]] void Fail(const std::string& what, const std::string& input) {
  std::fprintf(stderr, "config_fuzz: contract break: %s\ninput: %s\n", what.c_str(),
               input.c_str());
  std::abort();
}

void ExpectCleanError(const fp8moe::Status& s, const std::string& input) {
  if (s.code() != fp8moe::StatusCode::kInvalidArgument) {
    Fail("unexpected status " + s.ToString(), input);
  }
  if (s.message().empty()) Fail("an error without a message", input);
}

// The MoE layer's schema and rules.
void CheckMoe(const std::string& all, const std::string& yaml,
              const std::vector<std::string>& overrides) {
  using namespace fp8moe;
  static const ConfigSchema schema = MoeConfigSchema();

  auto config = LoadConfigText(schema, yaml, "fuzz.yml", overrides);
  if (!config.ok()) {
    ExpectCleanError(config.status(), all);
    return;
  }
  // What ToYaml writes loads back to the same values.
  const std::string dumped = config->ToYaml();
  auto again = LoadConfigText(schema, dumped, "dumped.yml", {});
  if (!again.ok()) Fail("ToYaml output does not load: " + again.status().ToString(), all);
  if (again->ToYaml() != dumped) Fail("ToYaml does not round-trip", all);

  auto moe = MoeConfigFrom(*config);
  if (!moe.ok()) {
    ExpectCleanError(moe.status(), all);
    return;
  }
  if (!ValidateMoeConfig(*moe).ok()) Fail("MoeConfigFrom accepted an invalid config", all);
  if (!(moe->ragged_buffer_factor <= kMaxRaggedBufferFactor) || moe->num_experts < 1 ||
      moe->num_experts > kMaxNumExperts) {
    Fail("a value past its bound was accepted", all);
  }
  for (const MoeGmmTiles* w : {&moe->wi_tiles, &moe->wo_tiles}) {
    for (const GmmTiles* t : {&w->fwd, &w->dlhs, &w->drhs}) {
      for (const auto* v : {&t->m, &t->k, &t->n}) {
        if (*v && (**v <= 0 || **v > kMaxGmmTile)) Fail("a tile past its bound was accepted", all);
      }
    }
  }
  (void)PlanMoeQuantization(*moe);
}

// The trainer's schema and rules (`fp8moe train`): the same text and overrides.
void CheckTrain(const std::string& all, const std::string& yaml,
                const std::vector<std::string>& overrides) {
  using namespace fp8moe;
  static const ConfigSchema schema = TrainConfigSchema();
  auto config = LoadConfigText(schema, yaml, "fuzz.yml", overrides);
  if (!config.ok()) {
    ExpectCleanError(config.status(), all);
    return;
  }
  auto train = TrainConfigFrom(*config);
  if (!train.ok()) {
    ExpectCleanError(train.status(), all);
    return;
  }
  const ModelConfig& m = train->model;
  if (!ValidateModelConfig(m).ok()) Fail("TrainConfigFrom accepted an invalid model", all);
  for (int64_t v : {m.vocab_size, m.emb_dim, m.num_layers, m.num_heads, m.head_dim, m.mlp_dim,
                    m.seq_len, m.batch}) {
    if (v < 1 || v > 2147483647) Fail("a model size past its bound was accepted", all);
  }
  if (train->eval_steps < 1 || train->eval_steps > 1000000 || train->steps < 1) {
    Fail("a step count past its bound was accepted", all);
  }
  const TrainMemoryPlan plan = PlanTrainMemory(*train);
  const uint64_t params = ModelParamCount(m);
  if (params == 0 || plan.total_bytes < params) Fail("a memory plan below the weights", all);
  (void)CheckTrainMemory(*train);  // a Status either way; must not crash
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string all(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t nul = all.find('\0', start);
    parts.push_back(all.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  CheckMoe(all, parts[0], overrides);
  CheckTrain(all, parts[0], overrides);
  return 0;
}
