// `fp8moe op NAME --in IN.safetensors --out OUT.safetensors [key=value ...]`:
// one operation on tensors from a file, a language-neutral surface for tests
// and other frameworks (DESIGN 6). Each op declares the keys it accepts as a
// ConfigSchema, so unknown keys and bad values get the same checked,
// "did you mean" errors as the trainer's config.
#ifndef FP8MOE_CLI_OP_H_
#define FP8MOE_CLI_OP_H_

#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/safetensors.h"

namespace fp8moe::cli {

struct OpDef {
  std::string name;
  std::string summary;  // one line for `fp8moe op --help`
  ConfigSchema keys;
  // Reads inputs from `in`, adds outputs to `out`.
  std::function<Status(const SafetensorsFile& in, const Config& keys,
                       SafetensorsFile* out)>
      run;
};

// Every op, in the order `fp8moe op --help` lists them.
const std::vector<OpDef>& AllOps();

// Runs op `name`; returns the process exit code (0 ok, 2 for a bad request:
// unknown op or key, missing or mistyped tensor; 1 for anything else) after
// printing any error to stderr.
int RunOp(const std::string& name, const std::string& in_path,
          const std::string& out_path, const std::vector<std::string>& keys);

// ---- Helpers for op implementations ----

// The input tensor `name`, checked against the accepted dtypes; the error
// names the op, the tensor and what was expected.
Result<const Tensor*> GetInput(const std::string& op, const SafetensorsFile& in,
                               const std::string& name,
                               std::initializer_list<DType> dtypes);
// Adds a string flag with fixed choices to a schema (aborts on a bad spec:
// schemas are built from literals).
void AddKey(ConfigSchema* schema, FlagSpec spec);

// Registration functions, one per file of ops.
void RegisterNumericsOps(std::vector<OpDef>* ops);
void RegisterGmmOps(std::vector<OpDef>* ops);
void RegisterMoeOps(std::vector<OpDef>* ops);

}  // namespace fp8moe::cli

#endif  // FP8MOE_CLI_OP_H_
