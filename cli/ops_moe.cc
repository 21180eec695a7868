// Ops on the MoE layer: moe_forward and moe_backward. Their keys are the MoE
// and QAT flags of configs/base.yml (MoeConfigSchema), checked and validated
// exactly as the trainer checks them.
#include <string>

#include "cli/op.h"
#include "fp8moe/moe.h"
#include "fp8moe/moe_config.h"

namespace fp8moe::cli {
namespace {

struct MoeInputs {
  const Tensor* x;
  MoeWeights w;
};

Result<MoeInputs> Inputs(const std::string& op, const SafetensorsFile& in) {
  MoeInputs m;
  FP8MOE_ASSIGN_OR_RETURN(m.x, GetInput(op, in, "x", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* router, GetInput(op, in, "router", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* wi, GetInput(op, in, "wi", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* wo, GetInput(op, in, "wo", {DType::kF32}));
  m.w = {router->view(), wi->view(), wo->view()};
  return m;
}

Status Prefixed(const std::string& op, Status s) {
  if (s.ok()) return s;
  return Status(s.code(), "op " + op + ": " + s.message());
}

Result<MoeConfig> ConfigOf(const std::string& op, const Config& keys) {
  auto c = MoeConfigFrom(keys);
  if (!c.ok()) return Prefixed(op, c.status());
  return c;
}

// Moves y and group_sizes out of the forward result into the output file.
Status AddForwardOutputs(MoeForwardResult* f, SafetensorsFile* out) {
  FP8MOE_RETURN_IF_ERROR(out->Add("y", std::move(f->y)));
  FP8MOE_RETURN_IF_ERROR(out->Add("group_sizes", std::move(f->group_sizes)));
  FP8MOE_ASSIGN_OR_RETURN(Tensor aux, Tensor::Create(DType::kF32, {1}));
  aux.data_as<float>()[0] = f->aux_loss;
  return out->Add("aux_loss", std::move(aux));
}

Status Forward(const SafetensorsFile& in, const Config& keys, SafetensorsFile* out) {
  FP8MOE_ASSIGN_OR_RETURN(const MoeConfig cfg, ConfigOf("moe_forward", keys));
  FP8MOE_ASSIGN_OR_RETURN(MoeInputs m, Inputs("moe_forward", in));
  auto f = MoeForward(cfg, m.x->view(), m.w);
  if (!f.ok()) return Prefixed("moe_forward", f.status());
  return AddForwardOutputs(&*f, out);
}

Status Backward(const SafetensorsFile& in, const Config& keys, SafetensorsFile* out) {
  FP8MOE_ASSIGN_OR_RETURN(const MoeConfig cfg, ConfigOf("moe_backward", keys));
  FP8MOE_ASSIGN_OR_RETURN(MoeInputs m, Inputs("moe_backward", in));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* dy, GetInput("moe_backward", in, "dy", {DType::kF32}));
  auto f = MoeForward(cfg, m.x->view(), m.w);
  if (!f.ok()) return Prefixed("moe_backward", f.status());
  auto g = MoeBackward(cfg, m.x->view(), m.w, *f, dy->view());
  if (!g.ok()) return Prefixed("moe_backward", g.status());
  FP8MOE_RETURN_IF_ERROR(AddForwardOutputs(&*f, out));
  FP8MOE_RETURN_IF_ERROR(out->Add("dx", std::move(g->dx)));
  FP8MOE_RETURN_IF_ERROR(out->Add("drouter", std::move(g->drouter)));
  FP8MOE_RETURN_IF_ERROR(out->Add("dwi", std::move(g->dwi)));
  return out->Add("dwo", std::move(g->dwo));
}

}  // namespace

void RegisterMoeOps(std::vector<OpDef>* ops) {
  ops->push_back({"moe_forward",
                  "x [T,D], router [D,E], wi [E,D,2F], wo [E,F,D] -> y, group_sizes, aux_loss",
                  MoeConfigSchema(), Forward});
  ops->push_back({"moe_backward",
                  "moe_forward's inputs + dy [T,D] -> its outputs + dx, drouter, dwi, dwo",
                  MoeConfigSchema(), Backward});
}

}  // namespace fp8moe::cli
