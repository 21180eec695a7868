// The routed-expert MoE layer (docs/design.md §5) with every QAT mode of §4:
// router, top-k, permute into a ragged buffer, wi GMM + SwiGLU, wo GMM,
// unpermute and weighted combine; forward and backward.
//
// Semantics (the reference twin in moe/reference/ follows them literally):
//  x [T, D] f32, router Wr [D, E], wi [E, D, 2F] (gate | up), wo [E, F, D]:
//  f32 master weights.
//  1. logits[t, e] = sum_d x[t, d] Wr[d, e] (f32 accumulation).
//  2. top-k per token: the k largest logits (ties: the lower expert index),
//     slot j = j-th largest; weights w[t, j] = softmax over the k selected
//     logits (f32); norm_topk_prob divides them by their sum once more.
//     routed_score_func=sigmoid chooses by s = sigmoid(logit) instead (within
//     the topk_routing_group groups of the largest top-2 sums when
//     n_routing_groups is set) and weighs by the selected s (norm_topk_prob:
//     over their sum + 1e-20); routed_scaling_factor multiplies every weight
//     (kernels/ops.h RouteScoring, docs/moe.md "Routing functions").
//  3. The T*k (token, slot) pairs sorted stably by expert (pair p = t*k + j
//     keeps its order within an expert); group_sizes[e] = pairs of e.
//  4. The ragged buffer has B rows: T*k when ragged_buffer_factor <= 0
//     (dropless), else ceil(factor * T * k) (balanced size on one rank). If
//     the routing needs more rows than B the step reruns with the dropless
//     buffer and MoeStats::dropless_reruns counts it. Rows past T*k are tail
//     rows: never read. x_sorted[i] = act(x[t(i)]) where act rounds to bf16
//     when dtype = bfloat16.
//  5. h = x_sorted @ wi' per group [B, 2F]; a = silu(h[:, :F]) * h[:, F:]
//     (activation dtype); y_sorted = a @ wo' per group [B, D] (activation
//     dtype). wi', wo': the weights as the QAT mode presents them (below).
//  6. y[t] = sum_j w[t, j] * f32(y_sorted[row of pair (t, j)])  (f32).
//  7. aux = load_balance_loss_weight * E * sum_e f_e * p_e with
//     f_e = group_sizes[e] / (T*k) (no gradient) and p_e = mean over tokens of
//     softmax over all E logits.
//  Backward: gradients of L = sum(y * dy) + aux with respect to x, Wr, wi, wo.
//  Weight gradients reach the f32 master weights straight through the
//  quantizer (STE); with a fixed,a,b weight calibration they are zeroed where
//  |w| > max(|a|, |b|).
//
// QAT modes (MoeQuantPlan):
//  none          wi', wo' = the master weights in `dtype` (bf16 rounded, or
//                f32); every GMM in that dtype.
//  fake QAT      weights quantized per output channel to e4m3fn codes
//                (weight calibration), dequantized to a BF16 copy; all GMMs
//                bf16 (GmmMode::kFakeQat forward, BF16-copy dLHS).
//  native fwd    forward GMMs kNativeFp8 on the codes (activation quantized
//                per row inside, moe_lhs_quant_block_size); dLHS from the BF16
//                copy; dW bf16.
//  native dlhs   + dLHS straight from the codes (bit-identical to the above).
//  fp8_full      forward kNativeFp8 with the act calibration; backward:
//                dLHS = deq(q_bwd(g * s_w, per row)) @ f32(q_w)^T,
//                dW = f32(q_a)^T @ deq(q_bwd(g * s_a, per channel)), per group
//                (dense) or per group m-tile (moe_bwd_inkernel_quant).
//  hand-crafted  int8 / fp8 / nanoo_fp8: forward kInt8 or kNativeFp8 (e4m3fn,
//                e4m3fnuz) on weights quantized per channel; backward bf16
//                from the dequantized weights.
//
// Inputs (x, dy, the master weights, the prepared weights' views) are
// ConstTensorViews; outputs (y, the gradients) are TensorViews, written.
#ifndef FP8MOE_MOE_H_
#define FP8MOE_MOE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/moe_config.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {

class Communicator;  // fp8moe/communicator.h

// The f32 master weights of one layer.
struct MoeWeights {
  ConstTensorView router;  // [D, E]
  ConstTensorView wi;      // [E, D, 2F]
  ConstTensorView wo;      // [E, F, D]
  // Optional (routed_bias): the choice bias [E] F32 added to the sigmoid
  // scores for the top-k and group choice only, never to the weights
  // (RouteScoring::bias); empty (the default): none. Needs
  // routed_score_func=sigmoid. No gradient: it is state the trainer moves.
  ConstTensorView route_bias = {};
};

// What one GMM of the layer was handed (for tests and logging).
struct MoeGmmCall {
  std::string name;  // "wi_fwd", "wo_fwd", "wo_dlhs", "wo_drhs", "wi_dlhs", "wi_drhs"
  GmmMode mode;
  std::optional<QuantDType> lhs_quant;  // how the lhs is quantized, if at all
  std::optional<QuantDType> rhs_quant;  // how the weight is quantized, if at all
};

// The ranks a layer call shares its work with: the one channel through which
// the MoE layer reaches the job's communicators (docs/distributed.md). Both
// null (or of one rank): one process with the whole batch and every expert.
struct MoeRanks {
  // Data parallelism (FSDP): the ranks whose batches make up the step's
  // batch. The layer sums its routed counts over them (one int64
  // all-reduce of E + 1 values, exact), so the load-balancing loss uses the
  // whole batch's expert fractions f_e, as one process with the whole batch
  // would (forward; the backward reuses them). Every rank of it calls the
  // layer together.
  Communicator* batch = nullptr;
  // Expert parallelism (the ring of experts; docs/distributed.md): the P
  // ranks of the expert ring, each with its own tokens x [T, D] (the same T
  // on every rank) and the E / P experts [r E/P, (r+1) E/P) of ring rank r
  // (wi [E/P, D, 2F], wo [E/P, F, D]; the router is whole). Dispatch
  // all-gathers the tokens (activation dtype) and their routing over the
  // ring, combine reduce-scatters the f32 partial outputs; the backward
  // mirrors it. The ragged buffer is ragged_buffer_factor x the balanced
  // share T*k per rank, its overflow decided by the whole ring. drouter is
  // this rank's share (sum it over the ring). Every rank of the ring calls
  // the layer together. Null or one rank: the single-rank layer. The
  // backward must be given the same ring.
  Communicator* expert_ring = nullptr;
};

struct MoeOptions {
  // Called before every GMM of the layer.
  std::function<void(const MoeGmmCall&)> on_gmm;
  // Tests: fill the buffer's tail rows with NaN before the GMMs run.
  bool poison_tail_rows = false;
  // The ranks of this call (above); the default: one process.
  MoeRanks ranks;
};

struct MoeStats {
  int64_t buffer_rows = 0;      // rows of the ragged buffer used
  int64_t valid_rows = 0;       // T * k (on an expert ring: this rank's local pairs)
  int64_t dropless_reruns = 0;  // 1 when the static buffer overflowed (on a
                                // ring: any rank's; all of them rerun)
};

// FP8 health of one quantized tensor, both fractions of all its values: those
// whose code sits at the format's largest magnitude (saturated), and those
// that are non-zero but got code zero (flushed). With absmax scaling each
// scaling group's largest value lands at the max, so saturated has a floor
// of (scaling groups) / (values), e.g. 1/K per channel; clipping (a fixed
// calibration) shows as values above that floor.
struct Fp8Health {
  double saturated = 0;
  double flushed = 0;
  int64_t values = 0;  // values counted; 0: the tensor is not quantized
};

// The integer counts behind an Fp8Health (they add up over the shards of a
// tensor, exactly).
struct Fp8HealthCounts {
  int64_t saturated = 0, flushed = 0, values = 0;
  Fp8Health Fractions() const;
};
// Counts of codes q [n] quantized from x [n]: codes at the format's largest
// magnitude, and zero codes of non-zero values (on the Context's backend).
Result<Fp8HealthCounts> CountFp8Health(Context& ctx, const uint8_t* codes, const float* x,
                                       int64_t n, QuantDType dtype);

// One expert weight as the QAT mode hands it to the GMMs.
struct PreparedExpertWeight {
  ConstTensorView view;  // what the GMMs read: the f32 master, a bf16 copy or codes
  Tensor owned;         // the bf16 copy or the codes [E, K, N]
  Tensor scale;         // [E, N] per-channel scale of the codes
  Tensor dlhs_copy;     // int8 schemes: bf16(dequantized weight) for the dLHS
  Tensor unit_scale;    // fp8_full: [E, N] ones (its dLHS folds s_w into g)
  bool codes = false;
  QuantDType quant = QuantDType::kE4M3FN;
  Fp8Health health;     // of the codes (when codes)
};

// The expert weights of one layer prepared for one step: quantized once to
// codes + per-channel scales (the QAT modes) or rounded to the activation
// dtype. This is where the FP8 weight all-gather ("gather8") plugs in: a
// distributed trainer quantizes its shard and gathers the codes into here.
// Reused step to step: after the first step Prepare allocates nothing.
struct PreparedMoeWeights {
  MoeQuantPlan plan;
  DType act = DType::kBF16;  // the activation dtype of the layer's buffers
  Shape wi_shape, wo_shape;  // of the masters they came from
  PreparedExpertWeight wi, wo;
};

// Quantizes (or copies) the master wi [E, D, 2F] and wo [E, F, D] as the
// config's QAT mode wants them, into `prepared` (its buffers are reused when
// the shapes match). The config must have passed ValidateMoeConfig.
Status PrepareMoeWeights(Context& ctx, const MoeConfig& config, const ConstTensorView& wi,
                         const ConstTensorView& wo, PreparedMoeWeights* prepared);

// Where the prepared expert weights come from when the master is not whole in
// this process (FSDP: each rank holds a flat shard and gathers; train/). Each
// call must give on every rank the bits the single-process preparation gives
// on the whole master [E, K, N].
class ExpertWeightSource {
 public:
  virtual ~ExpertWeightSource() = default;
  // Quantized modes: codes [E, K, N] and per-channel scale [E, N] as
  // QuantizeChannels of the whole master, and the codes' health (counted
  // over the whole tensor, on ctx's backend). `wo`: false for wi.
  virtual Status Quantize(Context& ctx, int64_t layer, bool wo, const Shape& shape,
                          QuantDType dtype, const Calibration& calib, uint8_t* codes,
                          float* scale, Fp8Health* health) = 0;
  // Unquantized modes with bf16 activations: the master rounded to bf16.
  virtual Status RoundToBf16(int64_t layer, bool wo, const Shape& shape, uint16_t* out) = 0;
};

// As above, but the codes or the bf16 copy come from `source` (layer
// `layer`); wi and wo give only the shapes, and in the f32 mode (no QAT,
// dtype=float32) the weights the GMMs read, which the caller must have made
// whole. With a fixed weight calibration the backward reads the masters too.
Status PrepareMoeWeights(Context& ctx, const MoeConfig& config, const ConstTensorView& wi,
                         const ConstTensorView& wo, PreparedMoeWeights* prepared,
                         ExpertWeightSource* source, int64_t layer);

// The layer's intermediate buffers (routing, ragged buffers, saved
// activations), owned by the caller and reused from step to step so a
// steady-state step allocates nothing. One workspace per layer: the backward
// reads what the forward of the same workspace saved.
class MoeWorkspace {
 public:
  MoeWorkspace();
  ~MoeWorkspace();
  MoeWorkspace(MoeWorkspace&&) noexcept;
  MoeWorkspace& operator=(MoeWorkspace&&) noexcept;

  // After a forward: this rank's (token, slot) pairs per expert, I32 [E] (a
  // view into the workspace; all E experts, also on an expert ring).
  ConstTensorView group_sizes() const;

  struct State;  // moe_layer.cc
  State& state() { return *state_; }
  const State& state() const { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

struct MoeStepInfo {
  float aux_loss = 0;
  MoeStats stats;
};

// Gradient outputs, owned by the caller and overwritten (not accumulated):
// dx [T, D], drouter [D, E], dwi [E, D, 2F], dwo [E, F, D], all F32.
struct MoeGradientViews {
  TensorView dx, drouter, dwi, dwo;
};

// The layer's forward into y [T, D] F32 (caller-owned). `master` gives the
// router and the shapes; the expert GMMs read `prepared`, which must come
// from PrepareMoeWeights with the same config and these masters.
Status MoeForward(Context& ctx, const MoeConfig& config, const ConstTensorView& x,
                  const MoeWeights& master, const PreparedMoeWeights& prepared,
                  MoeWorkspace* workspace, const TensorView& y, MoeStepInfo* info,
                  const MoeOptions& options = {});

// Gradients of sum(y * dy) + aux_loss into `grads`, after MoeForward ran on
// the same workspace with the same inputs. The masters give the straight-
// through mask of fixed weight calibration.
Status MoeBackward(Context& ctx, const MoeConfig& config, const ConstTensorView& x,
                   const MoeWeights& master, const PreparedMoeWeights& prepared,
                   MoeWorkspace* workspace, const ConstTensorView& dy,
                   const MoeGradientViews& grads, const MoeOptions& options = {});

// FP8 health of the activations the forward GMMs quantize (x_sorted for wi,
// a for wo), recomputed from the workspace after a forward the way the
// kernels quantize them. values = 0 where the mode quantizes no activation.
Status MoeActivationHealth(Context& ctx, const MoeConfig& config,
                           const PreparedMoeWeights& prepared, MoeWorkspace* workspace,
                           Fp8Health* wi_lhs, Fp8Health* wo_lhs);

// ---- One-call convenience API (tests, fp8moe op, the Python package) ----
// Each call prepares the weights and allocates a workspace of its own; a
// training loop uses the functions above instead.

// Everything the backward needs; produced by MoeForward.
struct MoeSaved;

struct MoeForwardResult {
  Tensor y;            // [T, D] f32
  Tensor group_sizes;  // [E] i32
  float aux_loss = 0;
  MoeStats stats;
  std::shared_ptr<MoeSaved> saved;
};

struct MoeGradients {
  Tensor dx;       // [T, D]
  Tensor drouter;  // [D, E]
  Tensor dwi;      // [E, D, 2F]
  Tensor dwo;      // [E, F, D]
};

// Runs the layer. The config must have passed ValidateMoeConfig; shapes are
// checked here (x [T, D] f32, weights as MoeWeights, E = num_experts).
Result<MoeForwardResult> MoeForward(const MoeConfig& config, const ConstTensorView& x,
                                    const MoeWeights& w, const MoeOptions& options = {});

// Gradients of sum(y * dy) + aux_loss; dy [T, D] f32. `fwd` must come from
// MoeForward with the same config, x and weights.
Result<MoeGradients> MoeBackward(const MoeConfig& config, const ConstTensorView& x,
                                 const MoeWeights& w, const MoeForwardResult& fwd,
                                 const ConstTensorView& dy, const MoeOptions& options = {});

namespace reference {
// Dense per-token twin of the layer: the same semantics with plain loops and
// double accumulation; the quantized modes use the same quantizers.
struct MoeReferenceResult {
  Tensor y;            // [T, D]
  Tensor group_sizes;  // [E]
  double aux_loss = 0;
  // sum(y * dy) + aux_loss from the unrounded (double) y, smooth in the
  // inputs for finite differences; aux_loss alone when dy is null.
  double loss = 0;
  Tensor dx, drouter, dwi, dwo;  // when dy is given
};
Result<MoeReferenceResult> MoeLayer(const MoeConfig& config, const ConstTensorView& x,
                                    const MoeWeights& w, const ConstTensorView* dy);
}  // namespace reference

}  // namespace fp8moe

#endif  // FP8MOE_MOE_H_
