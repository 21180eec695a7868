// A tiny decoder-only MoE transformer (docs/design.md §1, §5): token embedding; L
// layers of (RMSNorm, causal grouped-query attention with RoPE, residual,
// RMSNorm, MoE FFN with SwiGLU experts, residual); final RMSNorm; LM head;
// mean cross-entropy plus the MoE load-balancing losses. The LM head may be
// the embedding's transpose (logits_via_embedding). Forward and full
// backward. Attention, norms and the dense matmuls run in f32 (the dense
// matmuls on the library's f32 GMM with one group); the routed-expert GMMs
// run in the MoE config's QAT mode. The FFN variants (docs/design.md §5.1:
// shared experts, dense first layers) are SwiGLU MLPs on the GMM with one
// group in the configured dtype, never quantized.
//
// model/reference/ holds float64 twins of every piece, which the tests
// compare with and take finite differences of.
#ifndef FP8MOE_MODEL_H_
#define FP8MOE_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fp8moe/context.h"
#include "fp8moe/moe.h"
#include "fp8moe/moe_config.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {

// The initializers of the fields a flag sets are the flags' defaults
// (ModelConfigFlags reads them).
struct ModelConfig {
  int64_t vocab_size = 256;    // V
  int64_t emb_dim = 64;        // D (base_emb_dim)
  int64_t num_layers = 2;      // L (base_num_decoder_layers)
  int64_t num_heads = 4;       // H (base_num_query_heads)
  int64_t head_dim = 16;       // hd (even: RoPE rotates pairs)
  // Attention (docs/design.md 5.1)
  int64_t num_kv_heads = 0;    // Hkv (base_num_kv_heads); 0: H (KvHeads)
  bool logits_via_embedding = false;       // tied: logits = nf @ embed^T, no lm_head
  bool normalize_embedding_logits = true;  // tied logits / sqrt(D) (MaxText's)
  bool use_qk_norm = false;    // RMSNorm over hd of each q and k head, before RoPE
  int64_t mlp_dim = 128;       // F (base_moe_mlp_dim)
  int64_t seq_len = 64;        // S (max_target_length)
  int64_t batch = 16;          // B: the sequences of one Step (per_device_batch_size)
  double rope_max_timescale = 10000.0;
  double norm_eps = 1e-6;      // normalization_layer_epsilon
  MoeConfig moe;
  // The FFN variants (docs/design.md §5.1): always-active shared experts
  // beside the routed ones, and dense first layers.
  int64_t shared_experts = 0;          // S: shared SwiGLU experts of width F per MoE layer
  int64_t first_num_dense_layers = 0;  // layers [0, this) have a dense MLP instead of MoE
  int64_t base_mlp_dim = 128;          // Fd: the dense MLP's hidden width
  // Multi-head latent attention (attention_type=mla, DeepSeek-V2/V3;
  // docs/design.md "Multi-head latent attention"). The sizes are read only
  // under mla (as in MaxText), head_dim and base_num_kv_heads not then.
  std::string attention_type = "global";  // global (the attention above) or mla
  int64_t q_lora_rank = 0;        // ql: 0, a plain q projection wq
  int64_t kv_lora_rank = 512;     // kvl: the compressed kv latent
  int64_t qk_nope_head_dim = 128;  // nope: q and k columns without RoPE per head
  int64_t qk_rope_head_dim = 64;   // r: rotated columns per q head and the shared k_rope
  int64_t v_head_dim = 128;        // vd: value columns per head
  bool rope_interleave = true;     // mla: RoPE pairs (2i, 2i+1) (DeepSeek); false: halves
  std::string rope_type = "default";  // default only (yarn, llama3.1 refused)
};

// Whether the attention sublayer is multi-head latent attention.
inline bool IsMla(const ModelConfig& c) { return c.attention_type == "mla"; }

// Whether layer l has the dense MLP (first_num_dense_layers) instead of MoE.
inline bool IsDenseLayer(const ModelConfig& c, int64_t l) { return l < c.first_num_dense_layers; }
// The kv heads Hkv of grouped-query attention: num_kv_heads, or H where it is
// 0 (the default: multi-head attention, so that setting base_num_query_heads
// alone keeps meaning multi-head attention).
inline int64_t KvHeads(const ModelConfig& c) {
  return c.num_kv_heads > 0 ? c.num_kv_heads : c.num_heads;
}

// The shape flags (vocab_size, base_emb_dim, ..., max_target_length, the
// RoPE and norm constants) bound to ModelConfig's fields; batch has its
// flag in the trainer's table and moe its own (MoeConfigFlags).
const FlagTable<ModelConfig>& ModelConfigFlags();

// Checks the shape flags (positive sizes, an even head_dim, E and k within
// the MoE rules); the message names the flag and the fix.
Status ValidateModelConfig(const ModelConfig& config);

// The f32 master weights of one decoder layer.
struct LayerParams {
  Tensor attn_norm;  // [D]
  Tensor wqkv;       // [D, (H + 2*Hkv)*hd]: q | k | v heads' columns
  Tensor wo_attn;    // [H*hd, D]
  Tensor q_norm;     // [hd] gain of every q head's RMSNorm (use_qk_norm only)
  Tensor k_norm;     // [hd] gain of every k head's RMSNorm (use_qk_norm only)
  // Multi-head latent attention (attention_type=mla; ModelParams::has_mla):
  // these in Named() instead of wqkv, and wo_attn is [H vd, D]. qk = nope +
  // r; each is a Hugging Face DeepSeek-V3 tensor transposed.
  Tensor wq;         // [D, H qk] q_proj (q_lora_rank 0): per head nope | rope
  Tensor wq_a;       // [D, ql] q_a_proj (q_lora_rank > 0)
  Tensor q_a_norm;   // [ql] q_a_layernorm
  Tensor wq_b;       // [ql, H qk] q_b_proj: per head nope | rope
  Tensor wkv_a;      // [D, kvl + r] kv_a_proj_with_mqa: latent | the shared k_rope
  Tensor kv_a_norm;  // [kvl] kv_a_layernorm
  Tensor wkv_b;      // [kvl, H (nope + vd)] kv_b_proj: per head k_nope | v
  Tensor mlp_norm;   // [D]
  Tensor router;     // [D, E]
  // routed_bias (DeepSeek-V3's auxiliary-loss-free balancing): the choice
  // bias [E] of the sigmoid scores (Hugging Face mlp.gate.e_score_correction_bias).
  // State, not a trained weight (IsModelState): it starts at 0, moves only by
  // the trainer's UpdateRoutedBias after each step and is never touched by
  // AdamW, weight decay, clipping or the gradient norm; its gradient tensor
  // exists with its shape but is never written or read. In Named() only on the
  // MoE layers of a routed_bias model (ModelParams::has_router_bias).
  Tensor router_bias;  // [E]
  Tensor wi;         // [E, D, 2F]
  Tensor wo;         // [E, F, D]
  // The shared experts, fused into one SwiGLU MLP of width S*F in wi's
  // gate | up layout; in Named() (and so in checkpoints) only when `shared`
  // (shared_experts S > 0; ModelParams::Layout sets it).
  bool shared = false;
  Tensor shared_wi;  // [D, 2*S*F]: the S experts' gates | their ups
  Tensor shared_wo;  // [S*F, D]
  // A dense layer (IsDenseLayer): a SwiGLU MLP of width Fd in wi's layout
  // and no router, wi, wo or shared experts (left empty, not in Named()).
  bool dense = false;
  Tensor mlp_wi;  // [D, 2*Fd]: gate | up
  Tensor mlp_wo;  // [Fd, D]
};

// All weights of the model (or, with the same shapes, their gradients or an
// optimizer moment).
struct ModelParams {
  Tensor embed;  // [V, D]
  std::vector<LayerParams> layers;
  Tensor final_norm;  // [D]
  Tensor lm_head;     // [D, V]; none (not in Named()) with logits_via_embedding
  bool has_lm_head = true;  // false: logits_via_embedding (AllocateParams sets it)
  bool has_qk_norm = false;  // the layers' q_norm / k_norm exist (use_qk_norm)
  bool has_router_bias = false;  // the MoE layers' router_bias exists (routed_bias)
  bool has_mla = false;      // attention_type=mla: the MLA tensors instead of wqkv
  bool has_q_lora = false;   // mla with q_lora_rank > 0: wq_a, q_a_norm, wq_b instead of wq

  // Every tensor with its checkpoint name ("embed", "layers.0.wqkv", ...),
  // in a fixed order.
  std::vector<std::pair<std::string, Tensor*>> Named();
  std::vector<std::pair<std::string, const Tensor*>> Named() const;

  // L layers, each marked with the optional tensors the config gives it
  // (none allocated): what Named() lists. AllocateParams starts from it.
  static ModelParams Layout(const ModelConfig& config);
};

// Whether the tensor of Named() called `name` is state rather than a trained
// weight (a layer's router_bias): AdamW, weight decay, gradient clipping, the
// gradient norm and the non-finite gradient check skip it, it is replicated
// on every rank (not FSDP-sharded) and checkpointed without AdamW moments.
bool IsModelState(const std::string& name);

// Moves one MoE layer's router_bias [E] after an optimizer step by
// rate x sign(mean load - load_e) (MaxText layers/moe.py
// calculate_load_balance_updates; the sign of 0 is 0), in f32:
// bias_e += float(rate) x sign. load [E]: the pairs routed to each expert over
// the global batch (ModelStepInfo::expert_load summed over the ranks); the
// mean is compared exactly (E x load_e against the sum, in integers), so an
// expert at the mean stays where it is.
void UpdateRoutedBias(const int32_t* load, int64_t experts, double rate, float* bias);

// Parameters of the model (every tensor of ModelParams), saturating at
// UINT64_MAX for configs that fail ValidateModelConfig.
uint64_t ModelParamCount(const ModelConfig& config);

// Every parameter's name and shape, in ModelParams::Named() order; the
// expert weights wi / wo with `expert_rows` experts (-1: all E).
std::vector<std::pair<std::string, Shape>> ParamShapes(const ModelConfig& config,
                                                       int64_t expert_rows = -1);

// Tensors of ParamShapes(config, expert_rows), uninitialized. expert_rows:
// -1 or E, every expert; E/P, the experts of one ring rank (expert
// parallelism); 0, none (the shapes alone, for a run whose experts reach the
// GMMs only through an ExpertWeightSource). Model reads each of these. The
// set is checked against the memory cap (CheckMemoryRequest) before
// anything is allocated.
Result<ModelParams> AllocateParams(const ModelConfig& config, int64_t expert_rows = -1);
// Normal(0, 1/sqrt(fan_in)) matrices (embedding: Normal(0, 1)), norm gains 1,
// drawn from Rng(seed) in Named() order.
Status InitParams(const ModelConfig& config, uint64_t seed, ModelParams* params);
// The same values one tensor at a time, never the whole set: `sink` gets
// parameter k (Named() order, its whole ParamShapes(config) shape) in turn.
Status InitParams(const ModelConfig& config, uint64_t seed,
                  const std::function<void(size_t k, const float* data)>& sink);

// Per-step results of the model.
struct ModelStepInfo {
  double loss = 0;      // mean cross-entropy over the B*S targets
  double aux_loss = 0;  // sum of the layers' load-balancing losses
  // Per layer: tokens routed to each expert ([L][E]) and the MoE stats.
  std::vector<std::vector<int32_t>> expert_load;
  int64_t dropless_reruns = 0;
};

// Runs the model. Owns the activations and every intermediate buffer, reused
// step to step (a steady-state step allocates nothing); the expert weights
// arrive prepared (PrepareMoeWeights per layer, once per step, by the owner
// of the weights).
class Model {
 public:
  explicit Model(const ModelConfig& config);
  ~Model();
  const ModelConfig& config() const { return config_; }

  // Prepares every layer's expert weights for this step into *prepared
  // (resized to L).
  // With a source (FSDP), the codes or bf16 copies come from it and params'
  // wi / wo may hold no experts (the f32 mode reads them).
  Status PrepareExperts(Context& ctx, const ModelParams& params,
                        std::vector<PreparedMoeWeights>* prepared,
                        ExpertWeightSource* source = nullptr);

  // Forward on tokens: inputs and targets are I32 [B, S] (values in [0, V)).
  // With grads non-null the backward runs too and writes the gradient of
  // loss + aux_loss into *grads (overwritten; same shapes as params).
  Status Step(Context& ctx, const ModelParams& params,
              const std::vector<PreparedMoeWeights>& prepared, const int32_t* inputs,
              const int32_t* targets, ModelParams* grads, ModelStepInfo* info);

  // FP8 health of layer l's quantized activations after a Step.
  Status ActivationHealth(Context& ctx, int64_t layer,
                          const std::vector<PreparedMoeWeights>& prepared, Fp8Health* wi_lhs,
                          Fp8Health* wo_lhs);

  // The ranks every MoE layer shares its work with (MoeRanks, the layer's one
  // channel to the communicators; the default: one process). batch: the
  // ranks whose batches make up the step's batch (the layers sum their
  // routed counts over them). expert_ring: the MoE layers run on this ring
  // of P ranks and read, prepare and write the gradients of only the
  // experts [r E/P, (r+1) E/P) of ring rank r. The wi / wo tensors of the
  // parameters and gradients may hold all E experts (those rows are used,
  // the others neither read nor written) or only these E/P (AllocateParams);
  // parameters prepared through a source may hold none.
  void SetRanks(const MoeRanks& ranks) { ranks_ = ranks; }

  struct Buffers;

 private:
  MoeRanks ranks_;
  ModelConfig config_;
  std::unique_ptr<Buffers> b_;
};

namespace reference {
// The model's loss in float64 with plain loops (f32 weights and the
// unquantized MoE of dtype=float32): mean cross-entropy + the aux losses.
// *routing (optional) receives every layer's chosen experts, so a finite
// difference can tell when a perturbation flipped a top-k choice.
Result<double> ModelLoss(const ModelConfig& config, const ModelParams& params,
                         const int32_t* inputs, const int32_t* targets,
                         std::vector<int32_t>* routing = nullptr);
}  // namespace reference

}  // namespace fp8moe

#endif  // FP8MOE_MODEL_H_
