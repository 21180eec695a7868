#include "fp8moe/moe_config.h"

#include "base/number_text.h"
#include "fp8moe/flag_table.h"

#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe {
namespace {

// ---- The tile flags ----

// One w{i,o}_tile_{pass}_{dim} flag and the GmmTiles member it sets. The
// mapping is the one documented at MoeGmmTiles.
struct TileFlag {
  const char* name;
  MoeGmmTiles MoeConfig::*weight;
  GmmTiles MoeGmmTiles::*pass;
  std::optional<int64_t> GmmTiles::*axis;
  const char* doc;
};

using C = MoeConfig;
using P = MoeGmmTiles;
using T = GmmTiles;

// In flag order: wi then wo, fwd / dlhs / drhs, batch_seq / embed_dim /
// mlp_dim. The docs name the GMM (M rows of the sorted buffer, D = embed
// dim, F = MoE MLP dim, wi fused to 2F columns) and the role of the tile.
constexpr std::array<TileFlag, 18> kTileFlags = {{
    {"wi_tile_fwd_batch_seq", &C::wi_tiles, &P::fwd, &T::m,
     "wi forward GMM (x_sorted [M, D] x wi -> [M, 2F]): rows per tile (m)."},
    {"wi_tile_fwd_embed_dim", &C::wi_tiles, &P::fwd, &T::k,
     "wi forward GMM: reduction block over D (k; even)."},
    {"wi_tile_fwd_mlp_dim", &C::wi_tiles, &P::fwd, &T::n,
     "wi forward GMM: output columns over 2F (n)."},
    {"wi_tile_dlhs_batch_seq", &C::wi_tiles, &P::dlhs, &T::m,
     "wi dLHS GMM (dh [M, 2F] x wi^T -> dx_sorted [M, D]): rows per tile (m)."},
    {"wi_tile_dlhs_embed_dim", &C::wi_tiles, &P::dlhs, &T::n,
     "wi dLHS GMM: output columns over D (n)."},
    {"wi_tile_dlhs_mlp_dim", &C::wi_tiles, &P::dlhs, &T::k,
     "wi dLHS GMM: reduction block over 2F (k; even)."},
    {"wi_tile_drhs_batch_seq", &C::wi_tiles, &P::drhs, &T::m,
     "wi weight-gradient TGMM (x_sorted^T x dh -> dwi): reduction rows per "
     "block (m; also the in-kernel quantization tile)."},
    {"wi_tile_drhs_embed_dim", &C::wi_tiles, &P::drhs, &T::k,
     "wi weight-gradient TGMM: output rows over D (k; even)."},
    {"wi_tile_drhs_mlp_dim", &C::wi_tiles, &P::drhs, &T::n,
     "wi weight-gradient TGMM: output columns over 2F (n)."},
    {"wo_tile_fwd_batch_seq", &C::wo_tiles, &P::fwd, &T::m,
     "wo forward GMM (a [M, F] x wo -> [M, D]): rows per tile (m)."},
    {"wo_tile_fwd_embed_dim", &C::wo_tiles, &P::fwd, &T::n,
     "wo forward GMM: output columns over D (n)."},
    {"wo_tile_fwd_mlp_dim", &C::wo_tiles, &P::fwd, &T::k,
     "wo forward GMM: reduction block over F (k; even)."},
    {"wo_tile_dlhs_batch_seq", &C::wo_tiles, &P::dlhs, &T::m,
     "wo dLHS GMM (dy [M, D] x wo^T -> da [M, F]): rows per tile (m)."},
    {"wo_tile_dlhs_embed_dim", &C::wo_tiles, &P::dlhs, &T::k,
     "wo dLHS GMM: reduction block over D (k; even)."},
    {"wo_tile_dlhs_mlp_dim", &C::wo_tiles, &P::dlhs, &T::n,
     "wo dLHS GMM: output columns over F (n)."},
    {"wo_tile_drhs_batch_seq", &C::wo_tiles, &P::drhs, &T::m,
     "wo weight-gradient TGMM (a^T x dy -> dwo): reduction rows per block "
     "(m; also the in-kernel quantization tile)."},
    {"wo_tile_drhs_embed_dim", &C::wo_tiles, &P::drhs, &T::n,
     "wo weight-gradient TGMM: output columns over D (n)."},
    {"wo_tile_drhs_mlp_dim", &C::wo_tiles, &P::drhs, &T::k,
     "wo weight-gradient TGMM: output rows over F (k; even)."},
}};

std::optional<int64_t>& TileField(MoeConfig& c, const TileFlag& f) {
  return c.*f.weight.*f.pass.*f.axis;
}
const std::optional<int64_t>& TileField(const MoeConfig& c, const TileFlag& f) {
  return c.*f.weight.*f.pass.*f.axis;
}

// ---- The flag table ----

// A calibration as its flag writes it: "absmax" or "fixed,a,b" with the
// shortest decimals that read back to the same floats (Calibration::ToString
// rounds to 6 digits).
std::string CalibrationText(const Calibration& c) {
  if (c.kind == Calibration::Kind::kAbsMax) return "absmax";
  return "fixed," + internal::ShortestFloatDecimal(c.lo) + "," +
         internal::ShortestFloatDecimal(c.hi);
}

// The row of a calibration flag: "absmax" or "fixed,a,b".
void AddCalibration(FlagTable<MoeConfig>& t, const char* name, Calibration MoeConfig::*field,
                    const char* doc) {
  FlagSpec spec;
  spec.name = name;
  spec.type = FlagType::kString;
  spec.doc = doc;
  const std::string n = name;
  t.Custom(
      std::move(spec),
      [n, field](const Config& c, MoeConfig& m) -> std::string {
        const std::string& text = c.GetString(n);
        Result<Calibration> calib = Calibration::Parse(text);
        if (calib.ok()) {
          m.*field = *calib;
          return "";
        }
        return n + "='" + text + "': " + calib.status().message() + "; set " + n +
               "=absmax or e.g. " + n + "=fixed,-224,224";
      },
      [field](const MoeConfig& m) { return CalibrationText(m.*field); });
}

FlagTable<MoeConfig> MakeMoeFlags() {
  FlagTable<MoeConfig> t;
  t.Section("MoE layer: shape and routing");
  t.Enum("dtype", &C::dtype,
         "Activation and GMM operand type in unquantized mode: bfloat16, or "
         "float32 for exact checks.",
         {{"bfloat16", DType::kBF16}, {"float32", DType::kF32}});
  t.Int("num_experts", &C::num_experts, "Number of routed experts E (at least 1).");
  t.Int("num_experts_per_tok", &C::num_experts_per_tok,
        "Experts each token is routed to (top-k), from 1 to num_experts.");
  t.Bool("norm_topk_prob", &C::norm_topk_prob,
         "Renormalize each token's k routing weights to sum to 1.");
  t.Float("load_balance_loss_weight", &C::load_balance_loss_weight,
          "Weight of the load-balancing auxiliary loss; 0 turns it off.");
  t.Section("Dispatch and buffers");
  t.Bool("sparse_matmul", &C::sparse_matmul,
         "Run the experts as ragged grouped matmuls; the only path fp8moe "
         "implements, so false is an error.");
  t.Float("capacity_factor", &C::capacity_factor,
          "MaxText's dense-path capacity; accepted for compatibility but must "
          "stay -1 (ragged_buffer_factor sizes the sparse buffer).");
  t.Float("ragged_buffer_factor", &C::ragged_buffer_factor,
          "Sorted-token buffer: <= 0 dropless (tokens x k rows); > 0 factor x "
          "the balanced size, overflowing steps rerun dropless.");
  t.Section("Quantization schemes and the fp8_full recipe");
  t.Enum("quantization", &C::quantization,
         "Expert GMM quantization: \"\" none; int8, fp8 (e4m3fn), nanoo_fp8 "
         "(e4m3fnuz) hand-crafted; fp8_full the recipe (recipe mode only).",
         {{"", MoeQuantization::kNone},
          {"int8", MoeQuantization::kInt8},
          {"fp8", MoeQuantization::kFp8},
          {"nanoo_fp8", MoeQuantization::kNanooFp8},
          {"fp8_full", MoeQuantization::kFp8Full}});
  t.Bool("use_qwix_quantization", &C::use_qwix_quantization,
         "Recipe mode (MaxText's name): fp8_full runs its recipe, any other "
         "quantization leaves the expert GMMs unquantized.");
  AddCalibration(t, "weight_quantization_calibration_method",
                 &C::weight_quantization_calibration_method,
                 "Weight amax: absmax (per expert and channel) or fixed,a,b (amax = "
                 "max(|a|, |b|); the STE zeroes gradients outside).");
  AddCalibration(t, "act_quantization_calibration_method",
                 &C::act_quantization_calibration_method,
                 "Activation amax: absmax (per row) or fixed,a,b (amax = max(|a|, "
                 "|b|)).");
  AddCalibration(t, "bwd_quantization_calibration_method",
                 &C::bwd_quantization_calibration_method,
                 "Gradient amax in the fp8_full backward: absmax or fixed,a,b; only "
                 "fp8_full reads it.");
  t.Enum("bwd_quantization_dtype", &C::bwd_quantization_dtype,
         "FP8 format of the gradient in the fp8_full backward GMMs: e5m2 or "
         "e4m3 (e4m3fn); only fp8_full reads it.",
         {{"e5m2", QuantDType::kE5M2}, {"e4m3", QuantDType::kE4M3FN}});
  t.Bool("moe_bwd_inkernel_quant", &C::moe_bwd_inkernel_quant,
         "fp8_full: quantize the weight-gradient operands inside the TGMM, per "
         "(group m-tile, channel) over valid rows only.");
  t.Section("Fake and native QAT (quantization must stay \"\")");
  t.Bool("fp8_moe_fake_quant", &C::fp8_moe_fake_quant,
         "Fake QAT: expert weights become FP8 codes + per-channel scales, "
         "dequantized to a BF16 copy for BF16 GMMs.");
  t.Enum("fp8_fake_quant_hoist", &C::fp8_fake_quant_hoist,
         "gather8: quantize the weights once per step and all-gather the FP8 "
         "codes; \"\" none. Needs fp8_moe_fake_quant.",
         {{"", Fp8FakeQuantHoist::kNone}, {"gather8", Fp8FakeQuantHoist::kGather8}});
  t.Bool("fp8_moe_native_fwd", &C::fp8_moe_native_fwd,
         "Forward GMMs run FP8 x FP8 from the codes, activations quantized in "
         "the kernel; needs fake quant, gather8, an unsplit K.");
  t.Bool("fp8_moe_native_bwd_dlhs", &C::fp8_moe_native_bwd_dlhs,
         "Backward dLHS reads the codes, dequantizing tile by tile (no BF16 "
         "weight copy); needs fp8_moe_native_fwd.");
  t.Int("moe_lhs_quant_block_size", &C::moe_lhs_quant_block_size,
        "Native forward activation scale: 0 one per row over the full K; 128 "
        "or 512 one per K-block.");
  t.Section("Parallelism and memory");
  // Bookkeeping for a resumed run: none of these changes what is trained
  // (the layout gives the same model; remat and chunks the same step).
  t.Int("ici_tensor_parallelism", &C::ici_tensor_parallelism,
        "Tensor-parallel split of the contraction dims (D for wi, F for wo); "
        "fp8moe has none, so it must be 1.")
      .ResumeNeutral();
  t.Enum("remat_policy", &C::remat_policy,
         "full: recompute x_sorted in the backward; moe_x_sorted: save it from "
         "the forward.",
         {{"full", MoeRematPolicy::kFull}, {"moe_x_sorted", MoeRematPolicy::kMoeXSorted}})
      .ResumeNeutral();
  t.Bool("moe_quantize_token_all_gather", &C::moe_quantize_token_all_gather,
         "The experts' tokens go through one e4m3fn quantization per token (f32 "
         "scale): the ring of experts all-gathers the codes + scales, about half "
         "the bytes of bf16; on one rank the same round trip. The router reads "
         "the unquantized tokens.");
  t.Int("num_moe_token_chunks", &C::num_moe_token_chunks,
        "The layer runs its T tokens in this many chunks (numpy.array_split's "
        "rule), each through dispatch, expert GMMs and combine; on the ring of "
        "experts the next chunk's all-gather runs while this chunk's GMMs do. "
        "Routing, the aux loss and the forward output do not change; the "
        "expert weight gradients are summed chunk by chunk.")
      .ResumeNeutral();
  t.Section(
      "Grouped-matmul tiles: -1 = chosen per shape, else a positive size (k tiles\neven). Any "
      "valid tile gives the same bits. M = rows of the sorted buffer,\nD = embed dim, F = MoE "
      "MLP dim; wi is fused to 2F columns (gate | up).");
  // Tiles give the same bits (docs/kernels.md), the in-kernel quantization
  // tile aside, which moe_bwd_inkernel_quant's users set on purpose.
  for (const TileFlag& f : kTileFlags) {
    t.OptionalInt(f.name, [f](auto& c) -> auto& { return TileField(c, f); },
                  std::string(f.doc) + " -1 = chosen per shape.")
        .ResumeNeutral();
  }
  t.Section("Routing functions (DeepSeek-V3, Qwen3-MoE)");
  t.Enum("routed_score_func", &C::routed_score_func,
         "Router score per expert: \"\" or softmax, the top-k logits then a softmax "
         "over the k; sigmoid, sigmoid(logit) (DeepSeek-V3), the weights the "
         "selected scores (norm_topk_prob: over their sum + 1e-20).",
         {{"", RoutedScoreFunc::kSoftmax},
          {"softmax", RoutedScoreFunc::kSoftmax},
          {"sigmoid", RoutedScoreFunc::kSigmoid}});
  t.Float("routed_scaling_factor", &C::routed_scaling_factor,
          "Multiplies every routing weight (after norm_topk_prob); a finite "
          "positive number, 1 leaves them as they are.");
  t.Int("n_routing_groups", &C::n_routing_groups,
        "Group-limited routing (sigmoid scores): the experts in this many equal "
        "groups of at least 2; each token keeps the topk_routing_group groups of "
        "the largest top-2 score sums and picks its experts there. -1: off.");
  t.Int("topk_routing_group", &C::topk_routing_group,
        "Groups each token keeps, 1 to n_routing_groups, holding at least "
        "num_experts_per_tok experts; -1 with n_routing_groups=-1.");
  t.Section("Auxiliary-loss-free balancing (DeepSeek-V3)");
  t.Bool("routed_bias", &C::routed_bias,
         "Auxiliary-loss-free balancing (DeepSeek-V3; needs routed_score_func=sigmoid): a "
         "per-expert bias [E] per MoE layer (state, starting at 0) added to the scores for "
         "the top-k and group choice only, never to the weights.");
  t.Float("routed_bias_update_rate", &C::routed_bias_update_rate,
          "With routed_bias: after each step every bias moves by this rate x sign(mean load - "
          "its expert's load) over the global batch; 0 (the default) keeps it fixed.");
  return t;
}


// ---- Messages ----

std::string Num(int64_t v) { return std::to_string(v); }

// Shortest text that reads back as `v`: 1.25, -1, 0.01.
std::string Num(double v) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

std::string QuantizationFlag(MoeQuantization q) {
  const std::string_view name = MoeQuantizationName(q);
  return name.empty() ? "quantization=''" : "quantization=" + std::string(name);
}

std::string Join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

// All of `problems` in one error, so a user fixes them in one go.
Status Report(const std::vector<std::string>& problems) {
  if (problems.empty()) return OkStatus();
  if (problems.size() == 1) {
    return InvalidArgument("invalid MoE configuration: " + problems[0]);
  }
  return InvalidArgument("invalid MoE configuration (" +
                         std::to_string(problems.size()) + " problems):\n  - " +
                         Join(problems, "\n  - "));
}

// Appends the problems of one rule group to `out`. Split up only to keep
// each function readable; the order is the order of the report.
void CheckShape(const MoeConfig& c, std::vector<std::string>* out) {
  if (c.dtype != DType::kBF16 && c.dtype != DType::kF32) {
    out->push_back("dtype=" + std::string(DTypeName(c.dtype)) +
                   " is not supported; set dtype=bfloat16 or dtype=float32");
  }
  if (c.num_experts < 1) {
    out->push_back("num_experts=" + Num(c.num_experts) +
                   " must be at least 1; set num_experts to a positive count");
  }
  if (c.num_experts > kMaxNumExperts) {
    out->push_back("num_experts=" + Num(c.num_experts) + " exceeds " + Num(kMaxNumExperts) +
                   " (expert indices and group sizes are int32); set num_experts to at "
                   "most " + Num(kMaxNumExperts));
  }
  if (c.num_experts_per_tok < 1) {
    out->push_back("num_experts_per_tok=" + Num(c.num_experts_per_tok) +
                   " must be at least 1; set num_experts_per_tok=1 or more");
  } else if (c.num_experts >= 1 && c.num_experts_per_tok > c.num_experts) {
    out->push_back("num_experts_per_tok=" + Num(c.num_experts_per_tok) +
                   " exceeds num_experts=" + Num(c.num_experts) +
                   " (a token cannot pick more experts than exist); set "
                   "num_experts_per_tok=" +
                   Num(c.num_experts) + " or lower, or raise num_experts");
  }
  if (c.load_balance_loss_weight < 0) {
    out->push_back(
        "load_balance_loss_weight=" + Num(c.load_balance_loss_weight) +
        " is negative and would reward imbalanced routing; set "
        "load_balance_loss_weight=0 (off) or a positive weight");
  }
}

void CheckRoutingFunctions(const MoeConfig& c, std::vector<std::string>* out) {
  const bool sigmoid = c.routed_score_func == RoutedScoreFunc::kSigmoid;
  if (!std::isfinite(c.routed_scaling_factor) || !(c.routed_scaling_factor > 0)) {
    out->push_back("routed_scaling_factor=" + Num(c.routed_scaling_factor) +
                   " must be a finite positive number; set routed_scaling_factor=1 (off) "
                   "or e.g. 2.5 (DeepSeek-V3)");
  }
  if (c.n_routing_groups == -1) {
    if (c.topk_routing_group != -1) {
      out->push_back("topk_routing_group=" + Num(c.topk_routing_group) +
                     " without n_routing_groups; set n_routing_groups to the number of "
                     "groups or drop topk_routing_group");
    }
    return;
  }
  if (!sigmoid) {
    out->push_back("n_routing_groups=" + Num(c.n_routing_groups) +
                   " ranks groups by their sigmoid scores, but routed_score_func is "
                   "softmax; set routed_score_func=sigmoid or n_routing_groups=-1");
  }
  const int64_t e = c.num_experts, g = c.n_routing_groups;
  if (g < 1 || e % g != 0 || e / g < 2) {
    out->push_back("n_routing_groups=" + Num(g) + " must divide num_experts=" + Num(e) +
                   " into groups of at least 2 experts (a group's score is its top-2 "
                   "sum); set n_routing_groups to such a divisor or -1 (off)");
    return;
  }
  if (c.topk_routing_group < 1 || c.topk_routing_group > g) {
    out->push_back("topk_routing_group=" + Num(c.topk_routing_group) + " is outside [1, " +
                   Num(g) + "] (n_routing_groups=" + Num(g) +
                   "); set topk_routing_group to the groups each token keeps");
  } else if (c.topk_routing_group * (e / g) < c.num_experts_per_tok) {
    out->push_back("topk_routing_group=" + Num(c.topk_routing_group) + " x " + Num(e / g) +
                   " experts per group (num_experts=" + Num(e) + ", n_routing_groups=" +
                   Num(g) + ") is less than num_experts_per_tok=" +
                   Num(c.num_experts_per_tok) +
                   "; raise topk_routing_group or lower num_experts_per_tok");
  }
}

// routed_bias and its update rate (MaxText: both off by default, enabled as
// a pair).
void CheckRoutedBias(const MoeConfig& c, std::vector<std::string>* out) {
  const double rate = c.routed_bias_update_rate;
  if (!std::isfinite(rate) || rate < 0) {
    out->push_back("routed_bias_update_rate=" + Num(rate) +
                   " must be a finite number >= 0; set routed_bias_update_rate=0.001 "
                   "(DeepSeek-V3) or 0 (the bias stays fixed)");
  } else if (rate != 0 && (static_cast<float>(rate) == 0 ||
                           !std::isfinite(static_cast<float>(rate)))) {
    // The bias moves in f32 (UpdateRoutedBias): a rate that rounds to 0
    // would never move it, one past f32's range would make it inf.
    out->push_back("routed_bias_update_rate=" + Num(rate) +
                   " is outside float32's range (the bias moves in float32: about 1.4e-45 to "
                   "3.4e38); set routed_bias_update_rate=0.001 (DeepSeek-V3)");
  } else if (rate != 0 && !c.routed_bias) {
    out->push_back("routed_bias_update_rate=" + Num(rate) +
                   " is set but routed_bias=false, so there is no bias to update; set "
                   "routed_bias=true or drop routed_bias_update_rate");
  }
  if (c.routed_bias && c.routed_score_func != RoutedScoreFunc::kSigmoid) {
    out->push_back("routed_bias=true biases the sigmoid scores, but routed_score_func is "
                   "softmax; set routed_score_func=sigmoid or routed_bias=false");
  }
}

void CheckDispatch(const MoeConfig& c, std::vector<std::string>* out) {
  if (!c.sparse_matmul) {
    out->push_back(
        "sparse_matmul=false selects MaxText's dense (capacity-based) MoE "
        "path, which fp8moe does not implement; set sparse_matmul=true");
  }
  if (c.capacity_factor != -1.0) {
    out->push_back(
        "capacity_factor=" + Num(c.capacity_factor) +
        " has no effect: capacity_factor sizes MaxText's dense path, and "
        "fp8moe's sparse buffer is sized by ragged_buffer_factor; set "
        "ragged_buffer_factor=" +
        Num(c.capacity_factor) +
        " instead and drop capacity_factor (or set "
        "capacity_factor=-1)");
  }
  // Bounded so ceil(factor * T * k) stays a row count: 1e18 would ask for
  // exabytes and 1e300 is past the range of int64 (undefined to convert).
  if (!(c.ragged_buffer_factor <= kMaxRaggedBufferFactor)) {
    out->push_back("ragged_buffer_factor=" + Num(c.ragged_buffer_factor) +
                   " is larger than " + Num(kMaxRaggedBufferFactor) +
                   ": a factor > 0 sizes the sorted buffer as factor x the T*k "
                   "routed rows, so 1 already holds every row and more only adds "
                   "unused ones; set ragged_buffer_factor to at most " +
                   Num(kMaxRaggedBufferFactor) + ", or <= 0 for dropless");
  }
  if (c.num_moe_token_chunks < 1 || c.num_moe_token_chunks > kMaxMoeTokenChunks) {
    out->push_back("num_moe_token_chunks=" + Num(c.num_moe_token_chunks) +
                   " is outside [1, " + Num(kMaxMoeTokenChunks) +
                   "]; set num_moe_token_chunks=1 (no chunks) or a count of chunks "
                   "no larger than the tokens of a layer call");
  }
  if (c.ici_tensor_parallelism < 1) {
    out->push_back("ici_tensor_parallelism=" + Num(c.ici_tensor_parallelism) +
                   " must be at least 1; set ici_tensor_parallelism=1");
  } else if (c.ici_tensor_parallelism > 1) {
    // Accepting it would run unsplit anyway: a silent fallback.
    out->push_back("ici_tensor_parallelism=" + Num(c.ici_tensor_parallelism) +
                   ": fp8moe has no tensor parallelism (it runs data and "
                   "expert parallel); set ici_tensor_parallelism=1");
  }
}

void CheckQuantization(const MoeConfig& c, std::vector<std::string>* out) {
  const bool fp8_full = c.quantization == MoeQuantization::kFp8Full;
  if (fp8_full && !c.use_qwix_quantization) {
    out->push_back(
        "quantization=fp8_full is a recipe and runs only in recipe mode; set "
        "use_qwix_quantization=true");
  }
  if (c.moe_bwd_inkernel_quant && !fp8_full) {
    out->push_back(
        "moe_bwd_inkernel_quant=true quantizes the fp8_full "
        "recipe's weight-gradient operands, but " +
        QuantizationFlag(c.quantization) +
        "; set quantization=fp8_full or drop "
        "moe_bwd_inkernel_quant");
  }
  if (c.moe_bwd_inkernel_quant && !c.use_qwix_quantization) {
    out->push_back(
        "moe_bwd_inkernel_quant=true requires recipe mode; set "
        "use_qwix_quantization=true (with quantization=fp8_full) or drop "
        "moe_bwd_inkernel_quant");
  }
  if (c.bwd_quantization_dtype != QuantDType::kE5M2 &&
      c.bwd_quantization_dtype != QuantDType::kE4M3FN) {
    out->push_back("bwd_quantization_dtype=" +
                   std::string(QuantDTypeName(c.bwd_quantization_dtype)) +
                   " is not supported; set bwd_quantization_dtype=e5m2 or "
                   "bwd_quantization_dtype=e4m3");
  } else if (c.bwd_quantization_dtype != QuantDType::kE5M2 && !fp8_full) {
    // Values other than the default would be ignored outside fp8_full.
    out->push_back(
        "bwd_quantization_dtype=e4m3 is read only by the fp8_full "
        "recipe, but " +
        QuantizationFlag(c.quantization) +
        "; drop bwd_quantization_dtype or set quantization=fp8_full "
        "use_qwix_quantization=true");
  }
  if (c.bwd_quantization_calibration_method.kind !=
          Calibration::Kind::kAbsMax &&
      !fp8_full) {
    out->push_back("bwd_quantization_calibration_method=" +
                   c.bwd_quantization_calibration_method.ToString() +
                   " is read only by the fp8_full recipe, but " +
                   QuantizationFlag(c.quantization) +
                   "; drop bwd_quantization_calibration_method or set "
                   "quantization=fp8_full use_qwix_quantization=true");
  }
  const std::pair<const char*, const Calibration*> calibrations[] = {
      {"weight_quantization_calibration_method",
       &c.weight_quantization_calibration_method},
      {"act_quantization_calibration_method",
       &c.act_quantization_calibration_method},
      {"bwd_quantization_calibration_method",
       &c.bwd_quantization_calibration_method},
  };
  for (const auto& [name, calib] : calibrations) {
    if (calib->kind != Calibration::Kind::kFixed) continue;
    const float amax = calib->FixedAmax();
    if (!std::isfinite(calib->lo) || !std::isfinite(calib->hi) || !(amax > 0)) {
      out->push_back(std::string(name) + "=" + calib->ToString() +
                     " has no finite non-zero range; set " + name +
                     "=absmax or fixed,a,b with finite a, b not both 0");
    }
  }
}

void CheckQat(const MoeConfig& c, std::vector<std::string>* out) {
  const bool gather8 = c.fp8_fake_quant_hoist == Fp8FakeQuantHoist::kGather8;
  if (c.fp8_moe_native_fwd) {
    if (!c.fp8_moe_fake_quant) {
      out->push_back(
          "fp8_moe_native_fwd=true requires fp8_moe_fake_quant=true (the "
          "native forward reads the FP8 weight codes fake QAT makes); set "
          "fp8_moe_fake_quant=true or drop fp8_moe_native_fwd");
    }
    if (!gather8) {
      out->push_back(
          "fp8_moe_native_fwd=true requires fp8_fake_quant_hoist=gather8 (it "
          "reads the codes quantized once per step and gathered as FP8); set "
          "fp8_fake_quant_hoist=gather8 or drop fp8_moe_native_fwd");
    }
    if (!c.sparse_matmul) {
      out->push_back(
          "fp8_moe_native_fwd=true requires sparse_matmul=true; set "
          "sparse_matmul=true");
    }
    if (c.ici_tensor_parallelism != 1) {
      out->push_back(
          "fp8_moe_native_fwd=true requires an unsplit contraction dim (the "
          "activation scale spans the whole K: D for wi, F for wo), but "
          "ici_tensor_parallelism=" +
          Num(c.ici_tensor_parallelism) +
          " splits it; set ici_tensor_parallelism=1 or drop "
          "fp8_moe_native_fwd");
    }
  }
  if (c.fp8_moe_native_bwd_dlhs && !c.fp8_moe_native_fwd) {
    out->push_back(
        "fp8_moe_native_bwd_dlhs=true requires fp8_moe_native_fwd=true; set "
        "fp8_moe_native_fwd=true (with its requirements) or drop "
        "fp8_moe_native_bwd_dlhs");
  }
  if (gather8 && !c.fp8_moe_fake_quant) {
    out->push_back(
        "fp8_fake_quant_hoist=gather8 without fp8_moe_fake_quant=true has "
        "nothing to hoist; set fp8_moe_fake_quant=true or drop "
        "fp8_fake_quant_hoist");
  }

  // Fake QAT and the native flags built on it claim the expert GMMs, as does
  // any quantization scheme: the two cannot both run.
  std::vector<std::string> set, names;  // "flag=true" and "flag"
  for (const auto& [on, name] :
       {std::pair{c.fp8_moe_fake_quant, "fp8_moe_fake_quant"},
        std::pair{c.fp8_moe_native_fwd, "fp8_moe_native_fwd"},
        std::pair{c.fp8_moe_native_bwd_dlhs, "fp8_moe_native_bwd_dlhs"}}) {
    if (!on) continue;
    set.push_back(std::string(name) + "=true");
    names.push_back(name);
  }
  if (!set.empty()) {
    if (c.quantization != MoeQuantization::kNone) {
      out->push_back(Join(set, ", ") + " and " +
                     QuantizationFlag(c.quantization) +
                     " both claim the expert GMMs; drop one: set "
                     "quantization='' to keep fake/native QAT, or drop " +
                     Join(names, ", ") + " to keep the scheme");
    } else if (c.use_qwix_quantization) {
      // Recipe mode never runs the fake-QAT path (MaxText raises for a
      // Qwix-intercepted native call), so the flags would be ignored.
      out->push_back(Join(set, ", ") +
                     " with use_qwix_quantization=true: recipe mode does not "
                     "run fake or native QAT; set use_qwix_quantization=false "
                     "or drop " +
                     Join(names, ", "));
    }
  }

  const int64_t bs = c.moe_lhs_quant_block_size;
  if (bs != 0 && bs != 128 && bs != 512) {
    out->push_back("moe_lhs_quant_block_size=" + Num(bs) +
                   " is not supported; set moe_lhs_quant_block_size=0 (one "
                   "scale per row over the full K), 128 or 512");
  } else if (bs != 0 && !c.fp8_moe_native_fwd) {
    out->push_back("moe_lhs_quant_block_size=" + Num(bs) +
                   " only applies to the native forward's activation "
                   "quantization; set fp8_moe_native_fwd=true or drop "
                   "moe_lhs_quant_block_size");
  }
}

void CheckTiles(const MoeConfig& c, std::vector<std::string>* out) {
  for (const TileFlag& f : kTileFlags) {
    const std::optional<int64_t>& v = TileField(c, f);
    if (!v) continue;
    const std::string name = f.name;
    if (*v <= 0) {
      out->push_back(name + "=" + Num(*v) + " is not a tile size; set " + name +
                     "=-1 (chosen per shape) or a positive size");
    } else if (*v > kMaxGmmTile) {
      // The GMMs refuse such tiles too (gmm.h); say so at load time, before
      // any tile arithmetic could overflow.
      out->push_back(name + "=" + Num(*v) + " exceeds the largest tile, " +
                     Num(kMaxGmmTile) + " (2^20); a tile as large as its dimension "
                     "already covers it whole, so set " + name + " to at most " +
                     Num(kMaxGmmTile) + " or -1");
    } else if (f.axis == &GmmTiles::k && *v % 2 != 0) {
      // The GMM would refuse it on the first step; say so at load time.
      out->push_back(
          name + "=" + Num(*v) +
          " is odd, but it is a k tile and the kernels reduce k in "
          "pairs; set " +
          name + "=" +
          Num(*v == std::numeric_limits<int64_t>::max() ? *v - 1 : *v + 1) +
          " (even) or -1");
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------

const FlagTable<MoeConfig>& MoeConfigFlags() {
  static const FlagTable<MoeConfig>* const table = new FlagTable<MoeConfig>(MakeMoeFlags());
  return *table;
}

Status AddMoeConfigFlags(ConfigSchema* schema) { return MoeConfigFlags().AddTo(schema); }

ConfigSchema MoeConfigSchema() { return MoeConfigFlags().Schema(); }

std::string_view MoeQuantizationName(MoeQuantization quantization) {
  switch (quantization) {
    case MoeQuantization::kNone:
      return "";
    case MoeQuantization::kInt8:
      return "int8";
    case MoeQuantization::kFp8:
      return "fp8";
    case MoeQuantization::kNanooFp8:
      return "nanoo_fp8";
    case MoeQuantization::kFp8Full:
      return "fp8_full";
  }
  return "?";
}

std::string_view MoeQatModeName(MoeQatMode mode) {
  switch (mode) {
    case MoeQatMode::kNone:
      return "none";
    case MoeQatMode::kFakeQat:
      return "fake_qat";
    case MoeQatMode::kNativeFwd:
      return "native_fwd";
    case MoeQatMode::kNativeFwdDlhs:
      return "native_fwd_dlhs";
    case MoeQatMode::kRecipeFp8Full:
      return "fp8_full";
    case MoeQatMode::kHandCrafted:
      return "hand_crafted";
  }
  return "?";
}

Result<MoeConfig> MoeConfigFrom(const Config& c) {
  MoeConfig m;
  // The schema's choices already restrict the enum strings; the table's
  // problems matter only for a Config of a schema that declares the names
  // alone (and for calibrations, whose form no choice list states).
  FP8MOE_RETURN_IF_ERROR(Report(MoeConfigFlags().Read(c, &m)));
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(m));
  return m;
}

Status ValidateMoeConfig(const MoeConfig& config) {
  std::vector<std::string> problems;
  CheckShape(config, &problems);
  CheckRoutingFunctions(config, &problems);
  CheckRoutedBias(config, &problems);
  CheckDispatch(config, &problems);
  CheckQuantization(config, &problems);
  CheckQat(config, &problems);
  CheckTiles(config, &problems);
  return Report(problems);
}

MoeQuantPlan PlanMoeQuantization(const MoeConfig& config) {
  MoeQuantPlan plan;
  const auto both = [](QuantDType d) { return GmmQuantDtypes{d, d}; };
  if (config.use_qwix_quantization) {
    // Recipe mode: only fp8_full declares a GMM rule (docs/design.md
    // §4.1); every other scheme leaves the GMMs unquantized.
    if (config.quantization == MoeQuantization::kFp8Full) {
      plan.mode = MoeQatMode::kRecipeFp8Full;
      plan.fwd = both(QuantDType::kE4M3FN);
      plan.bwd_dtype = config.bwd_quantization_dtype;
      plan.inkernel_bwd = config.moe_bwd_inkernel_quant;
    }
    return plan;
  }
  // Hand-crafted rule: every scheme names its forward dtype (behaviour 1).
  switch (config.quantization) {
    case MoeQuantization::kInt8:
      plan.mode = MoeQatMode::kHandCrafted;
      plan.fwd = both(QuantDType::kInt8);
      return plan;
    case MoeQuantization::kFp8:
      plan.mode = MoeQatMode::kHandCrafted;
      plan.fwd = both(QuantDType::kE4M3FN);
      return plan;
    case MoeQuantization::kNanooFp8:
      plan.mode = MoeQatMode::kHandCrafted;
      plan.fwd = both(QuantDType::kE4M3FNUZ);
      return plan;
    case MoeQuantization::kFp8Full:
      // A recipe with no hand-crafted rule (ValidateMoeConfig rejects it).
      return plan;
    case MoeQuantization::kNone:
      break;
  }
  if (config.fp8_moe_native_fwd) {
    plan.mode = config.fp8_moe_native_bwd_dlhs ? MoeQatMode::kNativeFwdDlhs
                                               : MoeQatMode::kNativeFwd;
    plan.fwd = both(QuantDType::kE4M3FN);
  } else if (config.fp8_moe_fake_quant) {
    plan.mode = MoeQatMode::kFakeQat;
    plan.fwd.rhs = QuantDType::kE4M3FN;  // codes, dequantized to a BF16 copy
  }
  return plan;
}

bool MoeReadsF32Masters(const MoeConfig& config) {
  const MoeQuantPlan plan = PlanMoeQuantization(config);
  if (plan.mode == MoeQatMode::kNone) return config.dtype == DType::kF32;
  return config.weight_quantization_calibration_method.kind == Calibration::Kind::kFixed;
}

}  // namespace fp8moe
