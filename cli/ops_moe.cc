// Ops on the MoE layer: moe_forward and moe_backward. Their keys are the MoE
// and QAT flags of configs/base.yml (MoeConfigSchema), checked and validated
// exactly as the trainer checks them.
#include <cmath>
#include <limits>
#include <string>

#include "cli/op.h"
#include "fp8moe/moe.h"
#include "fp8moe/moe_config.h"
#include "moe/moe_checks.h"

namespace fp8moe::cli {
namespace {

// A checked call of the layer: the config and the input tensors.
struct MoeRequest {
  MoeConfig cfg;
  const Tensor* x = nullptr;
  MoeWeights w;
  const Tensor* dy = nullptr;  // moe_backward
};

uint64_t U64(int64_t v) { return v > 0 ? static_cast<uint64_t>(v) : 0; }

Status Prefixed(const std::string& op, Status s) {
  if (s.ok()) return s;
  return Status(s.code(), "op " + op + ": " + s.message());
}

Result<MoeConfig> ConfigOf(const std::string& op, const Config& keys) {
  auto c = MoeConfigFrom(keys);
  if (!c.ok()) return Prefixed(op, c.status());
  return c;
}

// The layer's memory, estimated from the checked input shapes before it
// runs: the router logits and routing tables, the sorted buffers (x_sorted,
// h, a, y_sorted and, backward, their gradients), the weights as the QAT mode
// presents them, and the outputs. The layer counts rows in int32 group sizes,
// so T * k beyond int32 is refused here too, with the reason.
Status PlanMoe(const std::string& op, const MoeRequest& r, bool backward) {
  const MoeConfig& cfg = r.cfg;
  const Tensor* x = r.x;
  const ConstTensorView& wi = r.w.wi;
  const int64_t t = x->dim(0), d = x->dim(1), e = wi.shape[0], f2 = wi.shape[2];
  const int64_t k = cfg.num_experts_per_tok;
  const int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (k > 0 && t > kInt32Max / k) {
    return InvalidArgument("op " + op + ": x has " + std::to_string(t) +
                           " tokens; with num_experts_per_tok=" + std::to_string(k) +
                           " that is more than 2147483647 routed rows, and the layer counts "
                           "rows in int32 group sizes; split the batch");
  }
  const uint64_t pairs = SatMul(U64(t), U64(k));
  uint64_t rows = pairs;
  if (cfg.ragged_buffer_factor > 0) {  // validated <= kMaxRaggedBufferFactor
    const double r = std::ceil(cfg.ragged_buffer_factor * static_cast<double>(pairs));
    rows = std::max<uint64_t>(pairs, r >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(r));
  }
  const bool f32 = cfg.dtype == DType::kF32 && PlanMoeQuantization(cfg).mode == MoeQatMode::kNone;
  const DType act = f32 ? DType::kF32 : DType::kBF16;
  const int64_t rows_i = rows > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                             ? std::numeric_limits<int64_t>::max()
                             : static_cast<int64_t>(rows);
  std::vector<PlannedTensor> plan = {
      {"the router logits", DType::kF32, {t, e}},
      {"the sorted tokens x_sorted", act, {rows_i, d}},
      {"the wi pre-activation h", act, {rows_i, f2}},
      {"the SwiGLU output a", act, {rows_i, f2 / 2}},
      {"the expert outputs y_sorted", act, {rows_i, d}},
      {"output 'y'", DType::kF32, {t, d}},
  };
  if (backward) {
    plan.push_back({"the sorted gradient dy_sorted", act, {rows_i, d}});
    plan.push_back({"the gradient dh", act, {rows_i, f2}});
    plan.push_back({"the gradient dx_sorted", DType::kF32, {rows_i, d}});
    plan.push_back({"output 'dx'", DType::kF32, {t, d}});
    plan.push_back({"output 'dwi'", DType::kF32, wi.shape});
    plan.push_back({"output 'dwo'", DType::kF32, r.w.wo.shape});
  }
  // Routing tables (expert, weights f32 and f64, row maps: 32 bytes per
  // pair, probs 8 per logit) and up to three copies of each weight (bf16
  // copy or codes, the fake-QAT dequantized copy, backward f32 copies), 6
  // bytes per element.
  uint64_t scratch = SatAdd(SatMul(32, pairs), SatMul(8, SatMul(U64(t), U64(e))));
  const uint64_t weights = SatMul(2, PlannedBytes(DType::kF32, wi.shape));  // wi + wo
  scratch = SatAdd(scratch, SatMul(backward ? 3 : 2, weights));
  return PlanMemory(op, plan, scratch);
}

// Moves y and group_sizes out of the forward result into the output file.
Status AddForwardOutputs(MoeForwardResult* f, SafetensorsFile* out) {
  FP8MOE_RETURN_IF_ERROR(out->Add("y", std::move(f->y)));
  FP8MOE_RETURN_IF_ERROR(out->Add("group_sizes", std::move(f->group_sizes)));
  FP8MOE_ASSIGN_OR_RETURN(Tensor aux, Tensor::Create(DType::kF32, {1}));
  aux.data_as<float>()[0] = f->aux_loss;
  return out->Add("aux_loss", std::move(aux));
}

// The keys, then the tensors (names and dtypes here, shapes and their
// agreement by the layer's own checks), then the memory plan: all before the
// layer runs (issue 35: dy's shape was checked after the whole forward).
Result<MoeRequest> CheckRequest(const std::string& op, const SafetensorsFile& in,
                                const Config& keys, bool backward) {
  MoeRequest r;
  FP8MOE_ASSIGN_OR_RETURN(r.cfg, ConfigOf(op, keys));
  FP8MOE_ASSIGN_OR_RETURN(r.x, GetInput(op, in, "x", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* router, GetInput(op, in, "router", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* wi, GetInput(op, in, "wi", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* wo, GetInput(op, in, "wo", {DType::kF32}));
  r.w = {router->view(), wi->view(), wo->view()};
  if (backward) {
    FP8MOE_ASSIGN_OR_RETURN(r.dy, GetInput(op, in, "dy", {DType::kF32}));
  }
  const ConstTensorView dy = backward ? r.dy->view() : ConstTensorView{};
  FP8MOE_RETURN_IF_ERROR(Prefixed(
      op, internal::CheckMoeCall(r.cfg, r.x->view(), r.w, backward ? &dy : nullptr)));
  FP8MOE_RETURN_IF_ERROR(PlanMoe(op, r, backward));
  return r;
}

Result<OpWork> Forward(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(const MoeRequest r, CheckRequest("moe_forward", in, keys, false));
  return OpWork([r](SafetensorsFile* out) -> Status {
    auto f = MoeForward(r.cfg, r.x->view(), r.w);
    if (!f.ok()) return Prefixed("moe_forward", f.status());
    return AddForwardOutputs(&*f, out);
  });
}

Result<OpWork> Backward(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(const MoeRequest r, CheckRequest("moe_backward", in, keys, true));
  return OpWork([r](SafetensorsFile* out) -> Status {
    auto f = MoeForward(r.cfg, r.x->view(), r.w);
    if (!f.ok()) return Prefixed("moe_backward", f.status());
    auto g = MoeBackward(r.cfg, r.x->view(), r.w, *f, r.dy->view());
    if (!g.ok()) return Prefixed("moe_backward", g.status());
    FP8MOE_RETURN_IF_ERROR(AddForwardOutputs(&*f, out));
    FP8MOE_RETURN_IF_ERROR(out->Add("dx", std::move(g->dx)));
    FP8MOE_RETURN_IF_ERROR(out->Add("drouter", std::move(g->drouter)));
    FP8MOE_RETURN_IF_ERROR(out->Add("dwi", std::move(g->dwi)));
    return out->Add("dwo", std::move(g->dwo));
  });
}

}  // namespace

void RegisterMoeOps(std::vector<OpDef>* ops) {
  ops->push_back({"moe_forward",
                  "x [T,D], router [D,E], wi [E,D,2F], wo [E,F,D] -> y, group_sizes, aux_loss",
                  MoeConfigSchema(),
                  // The flags alone: a bad combination is refused before the input is read.
                  [](const Config& keys) { return ConfigOf("moe_forward", keys).status(); },
                  Forward});
  ops->push_back({"moe_backward",
                  "moe_forward's inputs + dy [T,D] -> its outputs + dx, drouter, dwi, dwo",
                  MoeConfigSchema(),
                  [](const Config& keys) { return ConfigOf("moe_backward", keys).status(); },
                  Backward});
}

}  // namespace fp8moe::cli
