#include "cli/op.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>

#include "fp8moe/finite.h"
#include "fp8moe/memory.h"
#include "fp8moe/numerics.h"
#include "fp8moe/train.h"

namespace fp8moe::cli {

const std::vector<OpDef>& AllOps() {
  static const std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    RegisterNumericsOps(&v);
    RegisterGmmOps(&v);
    RegisterMoeOps(&v);
    for (OpDef& op : v) {
      AddKey(&op.keys, {"check_finite", FlagType::kBool, "false",
                        "refuse NaN or Inf in any floating-point input tensor (exit 2 "
                        "naming the tensor, the count and the first index)"});
    }
    return v;
  }();
  return ops;
}

void AddKey(ConfigSchema* schema, FlagSpec spec) {
  const std::string name = spec.name;
  const Status s = schema->Add(std::move(spec));
  if (!s.ok()) {
    std::fprintf(stderr, "internal error: op key '%s': %s\n", name.c_str(),
                 s.ToString().c_str());
    std::abort();
  }
}

void AddCalibrationKeys(ConfigSchema* schema, const std::string& calibration_key,
                        const std::string& what) {
  AddKey(schema, {calibration_key, FlagType::kString, "absmax",
                  what + ": absmax, or fixed,a,b for amax = max(|a|, |b|)"});
  AddKey(schema, {"scale_arithmetic", FlagType::kString, "exact_divide",
                  what + ": exact_divide (x / s, true f32 divisions, docs/design.md §3.2) or "
                  "xla_reciprocal (x * (1 / s), what qwix computes under jax.jit; tiny "
                  "scales floored at 1)",
                  {"exact_divide", "xla_reciprocal"}});
}

Result<Calibration> ParseCalibrationKeys(const std::string& op, const Config& keys,
                                         const std::string& calibration_key, bool applies,
                                         const std::string& where) {
  for (const std::string& k : {calibration_key, std::string("scale_arithmetic")}) {
    if (keys.IsSet(k) && !applies) {
      return InvalidArgument("op " + op + ": " + k + " applies " + where + " only");
    }
  }
  Result<Calibration> c = Calibration::Parse(keys.GetString(calibration_key));
  if (!c.ok()) {
    return InvalidArgument("op " + op + ": " + calibration_key + ": " + c.status().message());
  }
  FP8MOE_ASSIGN_OR_RETURN(c->arithmetic,
                          ParseScaleArithmetic(keys.GetString("scale_arithmetic")));
  return *c;
}

uint64_t SatMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    return std::numeric_limits<uint64_t>::max();
  }
  return a * b;
}

uint64_t SatAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                       : a + b;
}

uint64_t PlannedBytes(DType dtype, const Shape& shape) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n = SatMul(n, d < 0 ? 0 : static_cast<uint64_t>(d));
  return n;
}

Status CheckPlannedShapes(const std::string& op, const std::vector<PlannedTensor>& tensors) {
  for (const PlannedTensor& t : tensors) {
    // Shapes are checked as Tensor::Create will check them, but named here.
    if (const auto n = CheckedNumElements(t.shape, DTypeSize(t.dtype)); !n.ok()) {
      return Status(n.status().code(), "op " + op + ": " + t.name + ": " + n.status().message());
    }
  }
  return OkStatus();
}

Status PlanMemory(const std::string& op, const std::vector<PlannedTensor>& tensors,
                  uint64_t scratch_bytes) {
  FP8MOE_RETURN_IF_ERROR(CheckPlannedShapes(op, tensors));
  uint64_t total = scratch_bytes, largest_bytes = 0;
  const PlannedTensor* largest = nullptr;
  for (const PlannedTensor& t : tensors) {
    const uint64_t b = PlannedBytes(t.dtype, t.shape);
    total = SatAdd(total, b);
    if (largest == nullptr || b > largest_bytes) {
      largest = &t;
      largest_bytes = b;
    }
  }
  std::string what = "op " + op;
  if (largest != nullptr) {
    what += " (its largest tensor: " + largest->name + " " +
            std::string(DTypeName(largest->dtype)) + " " + ShapeToString(largest->shape) +
            ", " + FormatBytes(largest_bytes) + ")";
  }
  return CheckMemoryRequest(what, total);
}

Result<const Tensor*> GetInput(const std::string& op, const SafetensorsFile& in,
                               const std::string& name,
                               std::initializer_list<DType> dtypes) {
  std::string expected;
  for (DType d : dtypes) {
    if (!expected.empty()) expected += " or ";
    expected += DTypeName(d);
  }
  const Tensor* t = in.Find(name);
  if (t == nullptr) {
    std::string have;
    for (const auto& [n, unused] : in.tensors) have += (have.empty() ? "" : ", ") + n;
    return NotFound("op " + op + ": the input file has no tensor '" + name +
                    "' (" + expected + "); it has: " +
                    (have.empty() ? "no tensors" : have));
  }
  for (DType d : dtypes) {
    if (t->dtype() == d) return t;
  }
  std::string hint;
  const bool fnuz = std::any_of(dtypes.begin(), dtypes.end(), [](DType d) {
    return d == DType::kE4M3FNUZ || d == DType::kE5M2FNUZ;
  });
  if (t->dtype() == DType::kU8 && fnuz) {
    hint = " (safetensors has no fnuz dtype: fnuz codes are U8 with the metadata entry \"" +
           name + ".format\": \"e4m3fnuz\" or \"e5m2fnuz\")";
  }
  return InvalidArgument("op " + op + ": tensor '" + name + "' has dtype " +
                         std::string(DTypeName(t->dtype())) + "; expected " +
                         expected + hint);
}

int ExitCodeOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return 0;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kResourceExhausted:
    case StatusCode::kDataLoss:
      return 2;
    case StatusCode::kIoError:
    case StatusCode::kInternal:
      return 1;
  }
  return 1;
}

namespace {

// The op's keys from `keys`. A flag of the trainer that the op does not take
// is named as such: the generic "unknown key" would point at
// configs/base.yml, which lists it, or suggest a near name of another flag.
Result<Config> LoadOpConfig(const OpDef& op, const std::vector<std::string>& keys) {
  static const ConfigSchema train_schema = TrainConfigSchema();
  for (const std::string& kv : keys) {
    const std::string key = kv.substr(0, kv.find('='));
    if (op.keys.Find(key) == nullptr && train_schema.Find(key) != nullptr) {
      const bool moe = op.name.starts_with("moe_");
      return InvalidArgument(
          "'" + key + "' is a flag of fp8moe train that op " + op.name + " does not take (" +
          (moe ? "the MoE ops take the MoE layer's flags of configs/base.yml, from dtype on"
               : "it takes only its own keys") +
          "); drop it. `fp8moe op --help` lists each op's keys");
    }
  }
  return LoadConfig(op.keys, "", keys);
}

}  // namespace

Status RunOpOnTensors(const std::string& name, const SafetensorsFile& in,
                      const std::vector<std::string>& keys, SafetensorsFile* out) {
  const OpDef* op = nullptr;
  std::vector<std::string> names;
  for (const OpDef& o : AllOps()) {
    names.push_back(o.name);
    if (o.name == name) op = &o;
  }
  if (op == nullptr) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    const std::string close = SuggestClosest(name, names);
    return NotFound("unknown op '" + name + "'" +
                    (close.empty() ? "" : "; did you mean '" + close + "'?") +
                    "; ops: " + list);
  }
  auto config = LoadOpConfig(*op, keys);
  if (!config.ok()) {
    return Status(config.status().code(), "op " + name + ": " + config.status().message());
  }
  if (op->check_keys) FP8MOE_RETURN_IF_ERROR(op->check_keys(*config));
  // Every check before any work: the scan of check_finite reads every input
  // element, so it comes after the op's own checks, which read shapes.
  FP8MOE_ASSIGN_OR_RETURN(const OpWork work, op->prepare(in, *config));
  if (config->GetBool("check_finite")) {
    // U8 codes whose format a key names (decode's format=) are checked as
    // that format: U8 itself has no NaN.
    std::optional<DType> u8_as;
    if (op->keys.Find("format") != nullptr) {
      if (auto f = ParseFp8Format(config->GetString("format")); f.ok()) u8_as = Fp8FormatDType(*f);
    }
    for (const auto& [tensor_name, t] : in.tensors) {
      ConstTensorView v = t.view();
      if (v.dtype == DType::kU8 && u8_as) v.dtype = *u8_as;
      const Status s = CheckFinite(tensor_name, v);
      if (!s.ok()) {
        return InvalidArgument("op " + name + ": check_finite: " + s.message() +
                               "; fix the input or drop check_finite=true");
      }
    }
  }
  return work(out);
}

int RunOp(const std::string& name, const std::string& in_path,
          const std::string& out_path, const std::vector<std::string>& keys) {
  // An unknown op or a bad key (alone or with the op's other keys) is
  // reported before the input is read.
  const OpDef* op = nullptr;
  for (const OpDef& o : AllOps()) {
    if (o.name == name) op = &o;
  }
  SafetensorsFile in;
  if (op != nullptr) {
    auto c = LoadOpConfig(*op, keys);
    if (!c.ok()) {
      std::fprintf(stderr, "error: op %s: %s\n", name.c_str(), c.status().message().c_str());
      return 2;
    }
    if (op->check_keys) {
      if (const Status s = op->check_keys(*c); !s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
        return ExitCodeOf(s);
      }
    }
    auto read = ReadSafetensors(in_path);
    if (!read.ok()) {
      std::fprintf(stderr, "error: %s\n", read.status().ToString().c_str());
      return ExitCodeOf(read.status());
    }
    in = std::move(*read);
  }
  SafetensorsFile out;
  const Status s = RunOpOnTensors(name, in, keys, &out);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return ExitCodeOf(s);
  }
  const Status w = WriteSafetensors(out_path, out);
  if (!w.ok()) {
    std::fprintf(stderr, "error: %s\n", w.ToString().c_str());
    return ExitCodeOf(w);
  }
  return 0;
}

}  // namespace fp8moe::cli
