// libFuzzer target for the YAML config + key=value parser with the MoE rules;
// see io/FUZZING.md. Seeds: io/config_fuzz_corpus/make_corpus.py.
//
// Input: YAML text, then optional key=value overrides, separated by NUL
// bytes ("num_experts: 4\n\0num_experts_per_tok=2"). Everything goes through
// LoadConfigText against MoeConfigSchema(), then MoeConfigFrom (which runs
// ValidateMoeConfig). A contract break aborts:
//  - a Status of another code than invalid argument (or an empty message);
//  - a loaded config whose ToYaml() does not load back to the same values;
//  - a config MoeConfigFrom accepts that ValidateMoeConfig then refuses, or
//    a tile, expert count or ragged_buffer_factor past its documented bound;
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8moe;
  const std::string all(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t nul = all.find('\0', start);
    parts.push_back(all.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::string yaml = parts[0];
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  static const ConfigSchema schema = MoeConfigSchema();

  auto config = LoadConfigText(schema, yaml, "fuzz.yml", overrides);
  if (!config.ok()) {
    ExpectCleanError(config.status(), all);
    return 0;
  }
  // What ToYaml writes loads back to the same values.
  const std::string dumped = config->ToYaml();
  auto again = LoadConfigText(schema, dumped, "dumped.yml", {});
  if (!again.ok()) Fail("ToYaml output does not load: " + again.status().ToString(), all);
  if (again->ToYaml() != dumped) Fail("ToYaml does not round-trip", all);

  auto moe = MoeConfigFrom(*config);
  if (!moe.ok()) {
    ExpectCleanError(moe.status(), all);
    return 0;
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
  return 0;
}
