#include "cli/op.h"

#include <cstdio>
#include <cstdlib>

namespace fp8moe::cli {

const std::vector<OpDef>& AllOps() {
  static const std::vector<OpDef> ops = [] {
    std::vector<OpDef> v;
    RegisterNumericsOps(&v);
    RegisterGmmOps(&v);
    RegisterMoeOps(&v);
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
  return InvalidArgument("op " + op + ": tensor '" + name + "' has dtype " +
                         std::string(DTypeName(t->dtype())) + "; expected " +
                         expected);
}

int RunOp(const std::string& name, const std::string& in_path,
          const std::string& out_path, const std::vector<std::string>& keys) {
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
    std::fprintf(stderr, "error: unknown op '%s'%s; ops: %s\n", name.c_str(),
                 close.empty() ? "" : ("; did you mean '" + close + "'?").c_str(),
                 list.c_str());
    return 2;
  }
  auto config = LoadConfig(op->keys, "", keys);
  if (!config.ok()) {
    std::fprintf(stderr, "error: op %s: %s\n", name.c_str(),
                 config.status().message().c_str());
    return 2;
  }
  auto in = ReadSafetensors(in_path);
  if (!in.ok()) {
    std::fprintf(stderr, "error: %s\n", in.status().ToString().c_str());
    return in.status().code() == StatusCode::kIoError ? 1 : 2;
  }
  SafetensorsFile out;
  const Status s = op->run(*in, *config, &out);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    const StatusCode c = s.code();
    return (c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
            c == StatusCode::kOutOfRange || c == StatusCode::kFailedPrecondition)
               ? 2
               : 1;
  }
  const Status w = WriteSafetensors(out_path, out);
  if (!w.ok()) {
    std::fprintf(stderr, "error: %s\n", w.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace fp8moe::cli
