// The MoE layer's forward and backward on the grouped matmul kernels, in
// every QAT mode (include/fp8moe/moe.h has the semantics; the plain-loop twin
// is moe/reference/moe_reference.cc): the composition of the stages in
// moe/moe_stages.cc (route, dispatch, expert GMMs, combine, and the mirrored
// backward). Weights arrive prepared once per step (moe/moe_prepare.cc);
// every intermediate buffer lives in the caller's MoeWorkspace, so a
// steady-state step allocates nothing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <mutex>
#include <vector>

#include "base/default_context.h"
#include "fp8moe/communicator.h"
#include "fp8moe/moe.h"
#include "moe/moe_checks.h"
#include "moe/moe_chunks.h"
#include "moe/moe_stages.h"
#include "moe/moe_workspace.h"

namespace fp8moe {

using State = MoeWorkspace::State;

namespace {

Status Need(bool ok, const std::string& what) {
  return ok ? OkStatus() : InvalidArgument(what);
}

// Experts per rank: E, or E / P on an expert ring of P ranks.
Result<int64_t> LocalExperts(const MoeConfig& cfg, const MoeOptions& o) {
  const int64_t E = cfg.num_experts;
  if (o.ranks.expert_ring == nullptr || o.ranks.expert_ring->size() == 1) return E;
  const int64_t P = o.ranks.expert_ring->size();
  if (E % P != 0) {
    return InvalidArgument("num_experts=" + std::to_string(E) +
                           " does not divide over an expert ring of " + std::to_string(P) +
                           " ranks (ici_expert_parallelism); make num_experts a multiple of " +
                           std::to_string(P));
  }
  return E / P;
}

// Shapes: x [T, D], router [D, E], wi [El, D, 2F], wo [El, F, D], all F32,
// El = the experts this rank holds.
Status CheckShapes(const MoeConfig& cfg, const ConstTensorView& x, const MoeWeights& w,
                   const MoeOptions& opt) {
  FP8MOE_ASSIGN_OR_RETURN(const int64_t El, LocalExperts(cfg, opt));
  auto f32 = [](const ConstTensorView& t) { return t.dtype == DType::kF32; };
  FP8MOE_RETURN_IF_ERROR(Need(x.rank() == 2 && f32(x), "x must be F32 [T, D]; got " +
                                                           std::string(DTypeName(x.dtype)) + " " +
                                                           ShapeToString(x.shape)));
  const int64_t D = x.shape[1];
  FP8MOE_RETURN_IF_ERROR(Need(w.router.rank() == 2 && f32(w.router) && w.router.shape[0] == D,
                              "router must be F32 [D, E] with D = " + std::to_string(D) +
                                  "; got " + ShapeToString(w.router.shape)));
  const int64_t E = w.router.shape[1];
  FP8MOE_RETURN_IF_ERROR(Need(E == cfg.num_experts,
                              "router has " + std::to_string(E) + " experts but num_experts = " +
                                  std::to_string(cfg.num_experts)));
  FP8MOE_RETURN_IF_ERROR(Need(cfg.num_experts_per_tok >= 1 && cfg.num_experts_per_tok <= E,
                              "num_experts_per_tok must be in [1, num_experts]"));
  FP8MOE_RETURN_IF_ERROR(Need(w.wi.rank() == 3 && f32(w.wi) && w.wi.shape[0] == El &&
                                  w.wi.shape[1] == D && w.wi.shape[2] % 2 == 0 && w.wi.shape[2] > 0,
                              "wi must be F32 [E, D, 2F] = [" + std::to_string(El) + ", " +
                                  std::to_string(D) + ", 2F] (the experts this rank holds); got " +
                                  ShapeToString(w.wi.shape)));
  if (w.route_bias.data != nullptr || !w.route_bias.shape.empty()) {
    FP8MOE_RETURN_IF_ERROR(Need(
        w.route_bias.data != nullptr && f32(w.route_bias) && w.route_bias.shape == Shape{E},
        "route_bias must be F32 [E] = [" + std::to_string(E) + "]; got " +
            ShapeToString(w.route_bias.shape)));
    FP8MOE_RETURN_IF_ERROR(Need(cfg.routed_score_func == RoutedScoreFunc::kSigmoid,
                                "a route_bias (routed_bias) biases the sigmoid scores; set "
                                "routed_score_func=sigmoid"));
  }
  const int64_t F = w.wi.shape[2] / 2;
  FP8MOE_RETURN_IF_ERROR(Need(w.wo.rank() == 3 && f32(w.wo) && w.wo.shape == Shape{El, F, D},
                              "wo must be F32 [E, F, D] = " + ShapeToString({El, F, D}) +
                                  "; got " + ShapeToString(w.wo.shape)));
  return OkStatus();
}

// The prepared weights must be those of this config and these masters.
Status CheckPrepared(const MoeConfig& cfg, const MoeWeights& w, const PreparedMoeWeights& p) {
  if (!(p.plan == PlanMoeQuantization(cfg))) {
    return InvalidArgument("the prepared expert weights were made for QAT mode " +
                           std::string(MoeQatModeName(p.plan.mode)) + " but the config runs " +
                           std::string(MoeQatModeName(PlanMoeQuantization(cfg).mode)) +
                           "; call PrepareMoeWeights with this config");
  }
  if (p.wi_shape != w.wi.shape || p.wo_shape != w.wo.shape) {
    return InvalidArgument("the prepared expert weights have shapes " +
                           ShapeToString(p.wi_shape) + " and " + ShapeToString(p.wo_shape) +
                           " but the masters " + ShapeToString(w.wi.shape) + " and " +
                           ShapeToString(w.wo.shape) + "; call PrepareMoeWeights on these masters");
  }
  return OkStatus();
}

Status CheckF32(const ConstTensorView& t, const Shape& shape, const char* name) {
  if (t.dtype == DType::kF32 && t.shape == shape && (t.data != nullptr || t.num_elements() == 0)) {
    return OkStatus();
  }
  return InvalidArgument(std::string(name) + " must be F32 " + ShapeToString(shape) + "; got " +
                         std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape));
}

// On an expert ring every rank must stop together: a check that fails on one
// rank only, or x shapes that differ between ranks, would otherwise leave
// the others waiting in the ring's first collective until its timeout. One
// small all-reduce (max of {failed, T, -T, D, -D}) after the local checks
// turns either into an error on every rank. Off a ring: the local status.
Status AgreeOnRing(const MoeOptions& o, const Status& local, const ConstTensorView& x) {
  if (o.ranks.expert_ring == nullptr || o.ranks.expert_ring->size() <= 1) return local;
  const bool shaped = x.rank() == 2;
  const int64_t T = shaped ? x.shape[0] : -1, D = shaped ? x.shape[1] : -1;
  int64_t v[5] = {local.ok() ? 0 : 1, T, -T, D, -D};
  FP8MOE_RETURN_IF_ERROR(o.ranks.expert_ring->AllReduce(v, v, 5, DType::kI64, ReduceOp::kMax));
  if (!local.ok()) return local;
  if (v[0] != 0) {
    return InvalidArgument("another rank of the expert ring refused its input (its own error "
                           "says why); every rank of the ring stops");
  }
  if (v[1] != -v[2] || v[3] != -v[4]) {
    return InvalidArgument("the ranks of the expert ring give x of different shapes (T in [" +
                           std::to_string(-v[2]) + ", " + std::to_string(v[1]) + "], D in [" +
                           std::to_string(-v[4]) + ", " + std::to_string(v[3]) +
                           "]); every rank must give x [T, D] with the same T and D");
  }
  return OkStatus();
}

// num_moe_token_chunks: at most one chunk per token.
Status CheckChunks(const MoeConfig& cfg, const ConstTensorView& x) {
  if (cfg.num_moe_token_chunks <= 1 || x.shape[0] >= cfg.num_moe_token_chunks) return OkStatus();
  return InvalidArgument("num_moe_token_chunks=" + std::to_string(cfg.num_moe_token_chunks) +
                         " exceeds the " + std::to_string(x.shape[0]) +
                         " tokens of this layer call; set num_moe_token_chunks to at most " +
                         std::to_string(std::max<int64_t>(x.shape[0], 1)) +
                         " (or 1: no chunks)");
}

}  // namespace

namespace internal {

Status CheckMoeCall(const MoeConfig& cfg, const ConstTensorView& x, const MoeWeights& w,
                    const ConstTensorView* dy, const MoeOptions& options) {
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
  FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w, options));
  FP8MOE_RETURN_IF_ERROR(CheckChunks(cfg, x));
  return dy != nullptr ? CheckF32(*dy, x.shape, "dy") : OkStatus();
}

}  // namespace internal

Status MoeForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x, const MoeWeights& w,
                  const PreparedMoeWeights& prepared, MoeWorkspace* workspace, const TensorView& y,
                  MoeStepInfo* info, const MoeOptions& options) {
  const Status checked = [&]() -> Status {
    FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(cfg));
    FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w, options));
    FP8MOE_RETURN_IF_ERROR(CheckPrepared(cfg, w, prepared));
    FP8MOE_RETURN_IF_ERROR(CheckChunks(cfg, x));
    return CheckF32(y, x.shape, "y");
  }();
  FP8MOE_RETURN_IF_ERROR(AgreeOnRing(options, checked, x));
  State& s = workspace->state();
  s.forward_done = false;
  s.T = x.shape[0];
  s.D = x.shape[1];
  s.E = cfg.num_experts;
  s.k = cfg.num_experts_per_tok;
  s.F = w.wi.shape[2] / 2;
  s.plan = prepared.plan;
  s.act = prepared.act;
  s.ring = options.ranks.expert_ring;
  s.P = s.ring != nullptr ? s.ring->size() : 1;
  s.ring_index = s.ring != nullptr ? s.ring->rank() : 0;
  s.route_bias = w.route_bias.data != nullptr ? w.route_bias.as<float>() : nullptr;
  MoeStepInfo out;
  if (cfg.num_moe_token_chunks > 1) {
    FP8MOE_RETURN_IF_ERROR(
        internal::ChunkedForward(ctx, cfg, x, w.router, prepared, options, s, y, &out));
  } else {
    s.chunks.clear();
    FP8MOE_RETURN_IF_ERROR(
        internal::RouteForward(ctx, cfg, x, w.router, options, s, &out.aux_loss));
    FP8MOE_RETURN_IF_ERROR(internal::DispatchForward(ctx, cfg, x, options, s, &out.stats));
    FP8MOE_RETURN_IF_ERROR(internal::ExpertsForward(ctx, cfg, prepared, options, s));
    FP8MOE_RETURN_IF_ERROR(internal::CombineForward(ctx, s, y));
  }
  s.forward_done = true;
  if (MetricsSink* sink = ctx.metrics()) {
    sink->Record("moe/aux_loss", out.aux_loss);
    sink->Record("moe/dropless_reruns", static_cast<double>(out.stats.dropless_reruns));
  }
  if (info != nullptr) *info = out;
  return OkStatus();
}

Status MoeBackward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                   const MoeWeights& w, const PreparedMoeWeights& prepared, MoeWorkspace* workspace,
                   const ConstTensorView& dy, const MoeGradientViews& grads,
                   const MoeOptions& options) {
  State& s = workspace->state();
  const Status checked = [&]() -> Status {
    if (!s.forward_done) {
      return FailedPrecondition("MoeBackward needs a MoeForward on the same workspace first");
    }
    if (options.ranks.expert_ring != s.ring) {
      return InvalidArgument("MoeBackward must run on the expert ring its MoeForward ran on");
    }
    const int64_t chunks = std::max<int64_t>(static_cast<int64_t>(s.chunks.size()), 1);
    if (cfg.num_moe_token_chunks != chunks) {
      return InvalidArgument("MoeBackward got num_moe_token_chunks=" +
                             std::to_string(cfg.num_moe_token_chunks) + " but its MoeForward ran " +
                             std::to_string(chunks) + " chunks; use the forward's config");
    }
    FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w, options));
    FP8MOE_RETURN_IF_ERROR(CheckPrepared(cfg, w, prepared));
    if (x.shape != Shape{s.T, s.D}) {
      return InvalidArgument("x has shape " + ShapeToString(x.shape) +
                             " but the forward ran on " + ShapeToString({s.T, s.D}));
    }
    FP8MOE_RETURN_IF_ERROR(CheckF32(dy, x.shape, "dy"));
    FP8MOE_RETURN_IF_ERROR(CheckF32(grads.dx, x.shape, "dx"));
    FP8MOE_RETURN_IF_ERROR(CheckF32(grads.drouter, w.router.shape, "drouter"));
    FP8MOE_RETURN_IF_ERROR(CheckF32(grads.dwi, w.wi.shape, "dwi"));
    return CheckF32(grads.dwo, w.wo.shape, "dwo");
  }();
  FP8MOE_RETURN_IF_ERROR(AgreeOnRing(options, checked, x));
  if (!s.chunks.empty()) {
    return internal::ChunkedBackward(ctx, cfg, x, w, prepared, options, s, dy, grads);
  }
  FP8MOE_RETURN_IF_ERROR(internal::CombineBackwardStage(ctx, options, s, dy));
  FP8MOE_RETURN_IF_ERROR(
      internal::ExpertsBackward(ctx, cfg, x, w, prepared, options, s, grads.dwi, grads.dwo));
  FP8MOE_RETURN_IF_ERROR(
      internal::RouteBackwardStage(ctx, cfg, x, w.router, s, grads.drouter, grads.dx));
  return internal::DispatchBackward(ctx, s, grads.dx);
}

// ---- The one-call API ----

// The context a one-call API call runs on: the process-wide default, held
// under its mutex; but on an expert ring of P > 1 ranks a context of the
// call's own, since ranks that share a process (thread ranks) would hold
// that mutex across the ring's collectives and wait for each other forever.
class CallContext {
 public:
  explicit CallContext(const MoeOptions& o)
      : lock_(internal::DefaultContextMutex(), std::defer_lock) {
    if (o.ranks.expert_ring != nullptr && o.ranks.expert_ring->size() > 1) {
      own_.emplace();
    } else {
      lock_.lock();
    }
  }
  Context& get() { return own_ ? *own_ : DefaultContext(); }

 private:
  std::unique_lock<std::recursive_mutex> lock_;
  std::optional<Context> own_;
};

struct MoeSaved {
  PreparedMoeWeights prepared;
  MoeWorkspace workspace;
};

Result<MoeForwardResult> MoeForward(const MoeConfig& cfg, const ConstTensorView& x,
                                    const MoeWeights& w, const MoeOptions& options) {
  CallContext call(options);
  Context& ctx = call.get();
  auto saved = std::make_shared<MoeSaved>();
  MoeForwardResult out;
  // What fails before the layer's own checks still joins the ring's
  // agreement (AgreeOnRing), so that no other rank waits for this one.
  const Status before = [&]() -> Status {
    FP8MOE_RETURN_IF_ERROR(internal::CheckMoeCall(cfg, x, w, nullptr, options));
    FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, w.wi, w.wo, &saved->prepared));
    FP8MOE_ASSIGN_OR_RETURN(out.y, Tensor::Create(DType::kF32, x.shape));
    return OkStatus();
  }();
  if (!before.ok()) return AgreeOnRing(options, before, x);
  MoeStepInfo info;
  FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, cfg, x, w, saved->prepared, &saved->workspace,
                                    out.y.view(), &info, options));
  const ConstTensorView gs = saved->workspace.group_sizes();
  FP8MOE_ASSIGN_OR_RETURN(out.group_sizes, Tensor::Create(DType::kI32, gs.shape));
  std::memcpy(out.group_sizes.data(), gs.data, gs.num_bytes());
  out.aux_loss = info.aux_loss;
  out.stats = info.stats;
  out.saved = std::move(saved);
  return out;
}

Result<MoeGradients> MoeBackward(const MoeConfig& cfg, const ConstTensorView& x,
                                 const MoeWeights& w, const MoeForwardResult& fwd,
                                 const ConstTensorView& dy, const MoeOptions& options) {
  MoeGradients g;
  const Status before = [&]() -> Status {
    if (fwd.saved == nullptr) return InvalidArgument("MoeBackward needs the result of MoeForward");
    FP8MOE_RETURN_IF_ERROR(CheckShapes(cfg, x, w, options));
    FP8MOE_ASSIGN_OR_RETURN(g.dx, Tensor::Create(DType::kF32, x.shape));
    FP8MOE_ASSIGN_OR_RETURN(g.drouter, Tensor::Create(DType::kF32, w.router.shape));
    FP8MOE_ASSIGN_OR_RETURN(g.dwi, Tensor::Create(DType::kF32, w.wi.shape));
    FP8MOE_ASSIGN_OR_RETURN(g.dwo, Tensor::Create(DType::kF32, w.wo.shape));
    return OkStatus();
  }();
  if (!before.ok()) return AgreeOnRing(options, before, x);
  MoeGradientViews views{g.dx.view(), g.drouter.view(), g.dwi.view(), g.dwo.view()};
  CallContext call(options);
  FP8MOE_RETURN_IF_ERROR(MoeBackward(call.get(), cfg, x, w, fwd.saved->prepared,
                                     &fwd.saved->workspace, dy, views, options));
  return g;
}

}  // namespace fp8moe
