// Configuration of the MoE layer and its quantization-aware training
// (docs/design.md §4, §5): the typed MoeConfig, its flag table (each flag's
// MaxText name, type, doc and choices bound to its field; the defaults are
// the struct's), the layer's rules (ValidateMoeConfig, apart from the table),
// and the pure mapping from a config to the dtypes the expert GMMs are handed
// (docs/design.md §4.1).
//
// Every invalid combination is an error whose message names the flag(s) and
// the fix; nothing falls back silently. MoeConfigSchema()'s defaults are the
// layer's own (bf16, no QAT, 8 experts); configs/base.yml is the trainer's
// schema, whose MoE flags are these with the trainer's defaults (native FP8
// QAT, 4 experts). docs/config.md explains the modes and the rules.
#ifndef FP8MOE_MOE_CONFIG_H_
#define FP8MOE_MOE_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "fp8moe/config.h"
#include "fp8moe/dtype.h"
#include "fp8moe/flag_table.h"
#include "fp8moe/gmm.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"

namespace fp8moe {

// Bounds ValidateMoeConfig enforces beyond the rules of docs/design.md §4.2: the sorted
// buffer's factor (so ceil(factor * T * k) stays a row count), the expert
// count (expert indices and group sizes are int32), the token chunks, and
// every tile flag at most kMaxGmmTile (gmm.h).
inline constexpr double kMaxRaggedBufferFactor = 1024.0;
inline constexpr int64_t kMaxNumExperts = 2147483647;
inline constexpr int64_t kMaxMoeTokenChunks = 65536;

struct MoeConfig;

// The MoE and QAT flags bound to MoeConfig's fields, in base.yml's order
// and sections (flag_table.h). The trainer nests it in its own table.
const FlagTable<MoeConfig>& MoeConfigFlags();

// MoeConfigFlags().Schema(): each flag with its MaxText name, type, the
// default of MoeConfig{}, a doc line and (for enums) its choices.
ConfigSchema MoeConfigSchema();

// Adds the flags of MoeConfigSchema() to `schema` in the same order, so a
// larger schema can hold them. Fails if a name is taken.
Status AddMoeConfigFlags(ConfigSchema* schema);

// The `quantization` flag: a hand-crafted scheme or the fp8_full recipe.
enum class MoeQuantization : uint8_t {
  kNone,
  kInt8,
  kFp8,
  kNanooFp8,
  kFp8Full
};

// The flag's spelling: "", "int8", "fp8", "nanoo_fp8", "fp8_full".
std::string_view MoeQuantizationName(MoeQuantization quantization);

// The `remat_policy` flag: what the backward recomputes.
enum class MoeRematPolicy : uint8_t {
  kFull,        // "full": x_sorted is recomputed (gathered again) in backward
  kMoeXSorted,  // "moe_x_sorted": x_sorted is saved by the forward
};

// The `routed_score_func` flag: the router's score of each expert.
enum class RoutedScoreFunc : uint8_t {
  kSoftmax,  // "" or "softmax": top-k of the logits, softmax over the k
  kSigmoid,  // "sigmoid": sigmoid(logit), DeepSeek-V3's
};

// The `fp8_fake_quant_hoist` flag: where fake QAT's weight quantization runs.
enum class Fp8FakeQuantHoist : uint8_t {
  kNone,     // "": no hoisting
  kGather8,  // "gather8": quantize once per step, gather the FP8 codes
};

// Tiles of one expert weight's three GMMs. GmmTiles' m/k/n are unset for a
// flag at -1 (chosen per shape). The w{i,o}_tile_{pass}_{dim} flags map as:
//   wi [E, D, 2F]  fwd:  m = batch_seq, k = embed_dim,  n = mlp_dim
//                  dlhs: m = batch_seq, k = mlp_dim (reduction),
//                        n = embed_dim (output columns)
//                  drhs: m = batch_seq (reduction rows),
//                        k = embed_dim (output rows), n = mlp_dim
//   wo [E, F, D]   the same with embed_dim and mlp_dim swapped:
//                  fwd:  m = batch_seq, k = mlp_dim,   n = embed_dim
//                  dlhs: m = batch_seq, k = embed_dim, n = mlp_dim
//                  drhs: m = batch_seq, k = mlp_dim,   n = embed_dim
struct MoeGmmTiles {
  GmmTiles fwd, dlhs, drhs;
};

// Typed MoE / QAT configuration; field names are the flag names. These
// initializers are the flags' defaults (MoeConfigSchema reads them).
struct MoeConfig {
  // Activation and GMM operand type in unquantized mode: kBF16 or kF32.
  DType dtype = DType::kBF16;
  int64_t num_experts = 8;
  int64_t num_experts_per_tok = 2;
  bool norm_topk_prob = false;
  double load_balance_loss_weight = 0.01;

  bool sparse_matmul = true;           // must be true (validated)
  double capacity_factor = -1.0;       // must be -1 (validated)
  double ragged_buffer_factor = -1.0;  // <= 0 dropless, > 0 x balanced size

  MoeQuantization quantization = MoeQuantization::kNone;
  bool use_qwix_quantization = false;  // "recipe mode"
  Calibration weight_quantization_calibration_method = {};
  Calibration act_quantization_calibration_method = {};
  Calibration bwd_quantization_calibration_method = {};
  QuantDType bwd_quantization_dtype = QuantDType::kE5M2;  // or kE4M3FN
  bool moe_bwd_inkernel_quant = false;

  bool fp8_moe_fake_quant = false;
  Fp8FakeQuantHoist fp8_fake_quant_hoist = Fp8FakeQuantHoist::kNone;
  bool fp8_moe_native_fwd = false;
  bool fp8_moe_native_bwd_dlhs = false;
  int64_t moe_lhs_quant_block_size = 0;  // 0, 128 or 512

  int64_t ici_tensor_parallelism = 1;
  MoeRematPolicy remat_policy = MoeRematPolicy::kFull;
  // The experts see each token quantized once over its D to e4m3fn with an
  // f32 scale (act calibration) and dequantized: on an expert ring the
  // dispatch all-gathers these codes + scales instead of the activations
  // (GatherQuantizedTokens); on one rank the same round trip, so a run gives
  // the same model on any rank count. The router reads x unquantized; the
  // backward passes straight through the quantizer.
  bool moe_quantize_token_all_gather = false;
  // The layer runs its T tokens in this many chunks (numpy.array_split:
  // the first T % C chunks hold one token more), each through dispatch,
  // expert GMMs and combine; on an expert ring the next chunk's dispatch
  // (its all-gathers) runs on a helper thread while this chunk's GMMs run.
  // Routing is of all T tokens (the aux loss and its fractions do not
  // change); y, dx and drouter are the bits of one chunk on one rank and on
  // a ring of 2; dwi and dwo are the chunks' sums, added in chunk order.
  // At most T (a layer call with fewer tokens is an error).
  int64_t num_moe_token_chunks = 1;

  MoeGmmTiles wi_tiles = {};  // wi_tile_{fwd,dlhs,drhs}_*
  MoeGmmTiles wo_tiles = {};  // wo_tile_{fwd,dlhs,drhs}_*

  // The routing functions of DeepSeek-V3 and Qwen3-MoE (MaxText's names and
  // defaults; kernels/ops.h RouteScoring has the arithmetic). Group-limited
  // routing is of sigmoid scores; -1 turns it off.
  RoutedScoreFunc routed_score_func = RoutedScoreFunc::kSoftmax;
  double routed_scaling_factor = 1.0;
  int64_t n_routing_groups = -1;
  int64_t topk_routing_group = -1;
  // DeepSeek-V3's auxiliary-loss-free balancing (MaxText's names and
  // defaults): a per-expert bias on the sigmoid scores for the choice only,
  // moved after each optimizer step by routed_bias_update_rate x
  // sign(mean load - load) (ModelParams' router_bias, UpdateRoutedBias).
  bool routed_bias = false;
  double routed_bias_update_rate = 0.0;
};

// Converts `c` (which must hold every flag of MoeConfigSchema(), e.g. from
// LoadConfig) to a MoeConfig through MoeConfigFlags() and validates it with
// ValidateMoeConfig.
Result<MoeConfig> MoeConfigFrom(const Config& c);

// Checks every rule of docs/design.md §4.2 and the value ranges. All violations are
// reported in one InvalidArgument, each naming the flag(s) and the fix.
Status ValidateMoeConfig(const MoeConfig& config);

// The QAT mode of the routed-expert GMMs (docs/design.md §4).
enum class MoeQatMode : uint8_t {
  kNone,           // GMMs in `dtype`
  kFakeQat,        // fp8_moe_fake_quant: BF16 copy of the FP8 weight
  kNativeFwd,      // + fp8_moe_native_fwd: FP8 x FP8 forward
  kNativeFwdDlhs,  // + fp8_moe_native_bwd_dlhs: dLHS from the codes too
  kRecipeFp8Full,  // quantization=fp8_full, use_qwix_quantization=true
  kHandCrafted,    // quantization=int8|fp8|nanoo_fp8, recipe mode off
};

// "none", "fake_qat", "native_fwd", "native_fwd_dlhs", "fp8_full",
// "hand_crafted".
std::string_view MoeQatModeName(MoeQatMode mode);

// The quantize dtypes a GMM's operands are handed; nullopt = unquantized.
struct GmmQuantDtypes {
  std::optional<QuantDType> lhs, rhs;
  bool operator==(const GmmQuantDtypes&) const = default;
};

// What the layer hands the expert GMMs in one QAT mode.
struct MoeQuantPlan {
  MoeQatMode mode = MoeQatMode::kNone;
  // What the forward GMMs (wi and wo) are handed. Fake QAT: rhs holds
  // e4m3fn codes, lhs stays unquantized (BF16).
  GmmQuantDtypes fwd;
  // The gradient's quantize dtype in the backward GMMs; fp8_full only.
  std::optional<QuantDType> bwd_dtype;
  // fp8_full with moe_bwd_inkernel_quant: dW operands quantized per
  // (group m-tile, channel) inside the TGMM.
  bool inkernel_bwd = false;
  bool operator==(const MoeQuantPlan&) const = default;
};

// The plan of `config`, which should have passed ValidateMoeConfig:
//   use_qwix_quantization=false: int8 -> int8, fp8 -> e4m3fn,
//     nanoo_fp8 -> e4m3fnuz (lhs and rhs, kHandCrafted); "" -> kNone or
//     fake / native QAT from the fp8_moe_* flags (rhs e4m3fn codes; lhs
//     e4m3fn for native forward, unquantized for fake QAT).
//   use_qwix_quantization=true: fp8_full -> kRecipeFp8Full (lhs and rhs
//     e4m3fn, bwd_dtype from bwd_quantization_dtype); any other scheme
//     leaves the GMMs unquantized (kNone).
MoeQuantPlan PlanMoeQuantization(const MoeConfig& config);

// Whether the layer reads the f32 expert masters during a step: the f32 mode
// (no QAT, dtype=float32: the GMMs read them) and any QAT mode with a fixed
// weight calibration (its straight-through mask reads them). Otherwise the
// GMMs read only the prepared codes or bf16 copies.
bool MoeReadsF32Masters(const MoeConfig& config);

}  // namespace fp8moe

#endif  // FP8MOE_MOE_CONFIG_H_
