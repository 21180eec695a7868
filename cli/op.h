// `fp8moe op NAME --in IN.safetensors --out OUT.safetensors [key=value ...]`:
// one operation on tensors from a file, a language-neutral surface for tests
// and other frameworks (docs/design.md §11). Each op declares the keys it accepts as a
// ConfigSchema, so unknown keys and bad values get the same checked,
// "did you mean" errors as the trainer's config.
#ifndef FP8MOE_CLI_OP_H_
#define FP8MOE_CLI_OP_H_

#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/quant.h"
#include "fp8moe/safetensors.h"

namespace fp8moe::cli {

// The work of an op whose request has passed every check: computes the
// outputs and adds them to `out`.
using OpWork = std::function<Status(SafetensorsFile* out)>;

// An op checks a request completely before it allocates or computes
// anything (issue 35): first the keys alone, then the tensors against them,
// and only a request that passed both gets its work.
struct OpDef {
  std::string name;
  std::string summary;  // one line for `fp8moe op --help`
  ConfigSchema keys;
  // What the keys say without the tensors (values that do not go together,
  // a key that does not apply to the mode): `fp8moe op` runs this before it
  // reads the input file. Null when the schema already says it all.
  std::function<Status(const Config& keys)> check_keys;
  // Every check that needs the tensors: names, dtypes, shapes and their
  // agreement, tensors the keys make unused or missing, and the memory plan
  // against the cap (PlanMemory). Allocates nothing; returns the work, which
  // reads `in` and `keys` (both outlive it).
  std::function<Result<OpWork>(const SafetensorsFile& in, const Config& keys)> prepare;
};

// Every op, in the order `fp8moe op --help` lists them. Each op's keys end
// with the keys every op has: check_finite.
const std::vector<OpDef>& AllOps();

// The command's exit code for a Status: 0 ok; 2 for a request that is wrong
// or cannot be served (invalid argument, not found, out of range, failed
// precondition, resource exhausted: too large for the memory cap or the
// machine, data loss: a malformed input file); 1 for I/O failures and bugs.
int ExitCodeOf(const Status& status);

// Everything `fp8moe op` does between reading --in and writing --out, on
// tensors in memory: finds op `name` (unknown: NotFound with "did you mean"),
// loads `keys` ("key=value") against its schema, checks the keys and then the
// tensors and the memory plan (OpDef::check_keys, prepare), with
// check_finite=true refuses non-finite inputs by name, and only then runs the
// op's work. The op fuzzer calls this.
Status RunOpOnTensors(const std::string& name, const SafetensorsFile& in,
                      const std::vector<std::string>& keys, SafetensorsFile* out);

// Reads `in_path`, RunOpOnTensors, writes `out_path` atomically; prints any
// error to stderr and returns the exit code (ExitCodeOf).
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

// The keys of a quantization inside an op: `calibration_key` (absmax or
// fixed,a,b; "calibration", "lhs_calibration", ...) and scale_arithmetic.
// `what` starts their help texts.
void AddCalibrationKeys(ConfigSchema* schema, const std::string& calibration_key,
                        const std::string& what);
// Those keys as a Calibration. Where nothing is quantized (`applies` false)
// setting either is an error ("op OP: KEY applies WHERE only") rather than
// silently ignored; a malformed calibration names its key.
Result<Calibration> ParseCalibrationKeys(const std::string& op, const Config& keys,
                                         const std::string& calibration_key, bool applies,
                                         const std::string& where);

// A tensor an op is about to allocate.
struct PlannedTensor {
  std::string name;  // e.g. "output 'out'" or "the BF16 copy of 'lhs'"
  DType dtype;
  Shape shape;
};
// Every planned shape must be valid (no negative dimension, no element or
// byte count past int64): the error names the op and the tensor. An op whose
// later checks compute with these shapes runs this first.
Status CheckPlannedShapes(const std::string& op, const std::vector<PlannedTensor>& tensors);
// The op's memory plan, checked before anything is allocated: every planned
// shape must be valid and all of them plus `scratch_bytes` must fit under the
// memory cap (memory.h). The error (ResourceExhausted, exit 2) names the op,
// the largest tensor, the total bytes and the cap.
Status PlanMemory(const std::string& op, const std::vector<PlannedTensor>& tensors,
                  uint64_t scratch_bytes = 0);
// a * b and a + b saturating at UINT64_MAX, for memory plans.
uint64_t SatMul(uint64_t a, uint64_t b);
uint64_t SatAdd(uint64_t a, uint64_t b);
// Bytes of a dtype and shape, saturating (0 for a negative dimension).
uint64_t PlannedBytes(DType dtype, const Shape& shape);

// Registration functions, one per file of ops.
void RegisterNumericsOps(std::vector<OpDef>* ops);
void RegisterGmmOps(std::vector<OpDef>* ops);
void RegisterMoeOps(std::vector<OpDef>* ops);

}  // namespace fp8moe::cli

#endif  // FP8MOE_CLI_OP_H_
