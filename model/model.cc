// The transformer's forward and backward (include/fp8moe/model.h).
#include "fp8moe/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "base/check.h"
#include "fp8moe/communicator.h"
#include "fp8moe/memory.h"
#include "model/attention_block.h"
#include "model/ffn_block.h"
#include "model/layers.h"
#include "model/logits_block.h"

namespace fp8moe {

using internal::Linear;
using internal::LinearDw;
using internal::LinearDx;

namespace {

// The attention_type, rope_type and MLA flags (attention_type=mla), appended
// to problems.
void ValidateMla(const ModelConfig& c, std::vector<std::string>* problems) {
  if (c.rope_type == "yarn") {
    // YaRN changes the model at any length (interpolated low frequencies,
    // a larger softmax scale), so plain RoPE is not a stand-in for it.
    problems->push_back("rope_type=yarn: YaRN RoPE scaling is not implemented yet; set "
                        "rope_type=default to train with plain RoPE instead (a different "
                        "model from YaRN's at any length; with a model_name preset that "
                        "sets yarn, add override_model_config=true)");
  } else if (c.rope_type != "default") {
    problems->push_back("rope_type=" + c.rope_type +
                        " is not implemented; set rope_type=default");
  }
  if (c.attention_type != "global" && c.attention_type != "mla") {
    problems->push_back("attention_type=" + c.attention_type +
                        " is not implemented; set attention_type=global or attention_type=mla");
  }
  if (!IsMla(c)) {
    // The MLA sizes are unread otherwise; MaxText still types them as
    // non-negative ints, and so does this.
    for (const auto& [v, flag] : {std::pair{c.q_lora_rank, "q_lora_rank"},
                                  {c.kv_lora_rank, "kv_lora_rank"},
                                  {c.qk_nope_head_dim, "qk_nope_head_dim"},
                                  {c.qk_rope_head_dim, "qk_rope_head_dim"},
                                  {c.v_head_dim, "v_head_dim"}}) {
      if (v < 0) {
        problems->push_back(std::string(flag) + "=" + std::to_string(v) +
                            " is negative; set it to a size >= 0 (read only by "
                            "attention_type=mla)");
      }
    }
    return;
  }
  auto positive = [&](int64_t v, const char* flag) {
    if (v < 1 || v > std::numeric_limits<int32_t>::max()) {
      problems->push_back(std::string(flag) + "=" + std::to_string(v) +
                          " must be in [1, 2^31) with attention_type=mla; set " + flag +
                          " to a positive size");
    }
  };
  positive(c.kv_lora_rank, "kv_lora_rank");
  positive(c.qk_nope_head_dim, "qk_nope_head_dim");
  positive(c.qk_rope_head_dim, "qk_rope_head_dim");
  positive(c.v_head_dim, "v_head_dim");
  if (c.q_lora_rank < 0 || c.q_lora_rank > std::numeric_limits<int32_t>::max()) {
    problems->push_back("q_lora_rank=" + std::to_string(c.q_lora_rank) +
                        " must be in [0, 2^31); set q_lora_rank=0 (a plain q projection) or "
                        "a positive rank");
  }
  if (c.qk_rope_head_dim >= 1 && c.qk_rope_head_dim % 2 != 0) {
    problems->push_back("qk_rope_head_dim=" + std::to_string(c.qk_rope_head_dim) +
                        " is odd, but RoPE rotates pairs; set qk_rope_head_dim=" +
                        std::to_string(c.qk_rope_head_dim + 1));
  }
  if (c.num_kv_heads != 0 && c.num_kv_heads != c.num_heads) {
    problems->push_back("base_num_kv_heads=" + std::to_string(c.num_kv_heads) +
                        " with attention_type=mla, whose up-projection gives every query head "
                        "its own key and value; set base_num_kv_heads=" +
                        std::to_string(c.num_heads) + " (base_num_query_heads) or 0");
  }
  if (c.use_qk_norm) {
    problems->push_back("use_qk_norm=true with attention_type=mla (MLA normalizes the "
                        "compressed q and kv instead); set use_qk_norm=false");
  }
  const __int128 qk = static_cast<__int128>(c.qk_nope_head_dim) + c.qk_rope_head_dim;
  if (problems->empty() &&
      (c.num_heads * (2 * qk + c.v_head_dim) > std::numeric_limits<int32_t>::max() ||
       c.num_heads * (static_cast<__int128>(c.qk_nope_head_dim) + c.v_head_dim) >
           std::numeric_limits<int32_t>::max() ||
       static_cast<__int128>(c.kv_lora_rank) + c.qk_rope_head_dim >
           std::numeric_limits<int32_t>::max())) {
    problems->push_back("the MLA widths (base_num_query_heads x (2 (qk_nope_head_dim + "
                        "qk_rope_head_dim) + v_head_dim), kv_lora_rank + qk_rope_head_dim) "
                        "exceed 2^31 - 1; lower the head count or the head dims");
  }
}

}  // namespace

Status ValidateModelConfig(const ModelConfig& c) {
  std::vector<std::string> problems;
  auto positive = [&](int64_t v, const char* flag) {
    if (v < 1) {
      problems.push_back(std::string(flag) + "=" + std::to_string(v) +
                         " must be at least 1; set " + flag + " to a positive size");
    }
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.emb_dim, "base_emb_dim");
  positive(c.num_layers, "base_num_decoder_layers");
  positive(c.num_heads, "base_num_query_heads");
  positive(c.head_dim, "head_dim");
  positive(c.mlp_dim, "base_moe_mlp_dim");
  positive(c.seq_len, "max_target_length");
  positive(c.batch, "per_device_batch_size");
  if (c.shared_experts < 0) {
    problems.push_back("shared_experts=" + std::to_string(c.shared_experts) +
                       " is negative; set shared_experts=0 (none) or a count of shared experts");
  }
  positive(c.base_mlp_dim, "base_mlp_dim");
  if (c.first_num_dense_layers < 0 || c.first_num_dense_layers > c.num_layers) {
    problems.push_back("first_num_dense_layers=" + std::to_string(c.first_num_dense_layers) +
                       " is outside [0, base_num_decoder_layers=" +
                       std::to_string(c.num_layers) +
                       "]; set it to the number of leading layers with a dense MLP");
  }
  if (c.head_dim >= 1 && c.head_dim % 2 != 0) {
    problems.push_back("head_dim=" + std::to_string(c.head_dim) +
                       " is odd, but RoPE rotates pairs of dimensions; set head_dim=" +
                       std::to_string(c.head_dim + 1));
  }
  if (!(c.rope_max_timescale > 1.0)) {
    problems.push_back("rope_max_timescale must be above 1; set rope_max_timescale=10000");
  }
  if (!(c.norm_eps > 0.0)) {
    problems.push_back("normalization_layer_epsilon must be positive; set it to 1e-6");
  }
  // Every size is an int32 somewhere (token ids, group sizes, row counts), so
  // each is bounded before any product of them is formed.
  const int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  auto bounded = [&](int64_t v, const char* flag) {
    if (v > kMaxDim) {
      problems.push_back(std::string(flag) + "=" + std::to_string(v) + " exceeds " +
                         std::to_string(kMaxDim) + " (sizes are int32 in the kernels); set " +
                         flag + " to at most " + std::to_string(kMaxDim));
    }
  };
  bounded(c.vocab_size, "vocab_size");
  bounded(c.emb_dim, "base_emb_dim");
  bounded(c.num_layers, "base_num_decoder_layers");
  bounded(c.num_heads, "base_num_query_heads");
  bounded(c.head_dim, "head_dim");
  bounded(c.num_kv_heads, "base_num_kv_heads");
  bounded(c.mlp_dim, "base_moe_mlp_dim");
  bounded(c.seq_len, "max_target_length");
  bounded(c.batch, "per_device_batch_size");
  bounded(c.shared_experts, "shared_experts");
  bounded(c.base_mlp_dim, "base_mlp_dim");
  // Sizes whose products would overflow the kernels' int32 group sizes. Only
  // once B and S are known to be below 2^31 (k below 2^63): the product then
  // fits in 128 bits.
  auto routed_pairs = [&] {
    return static_cast<__int128>(std::max<int64_t>(c.batch, 0)) *
           std::max<int64_t>(c.seq_len, 0) * std::max<int64_t>(c.moe.num_experts_per_tok, 0);
  };
  if (problems.empty() && routed_pairs() > (1 << 30)) {
    problems.push_back(
        "per_device_batch_size x max_target_length x num_experts_per_tok is more than 2^30 "
        "routed rows for one step (group sizes are int32); lower per_device_batch_size or "
        "max_target_length");
  }
  if (c.num_kv_heads < 0) {
    problems.push_back("base_num_kv_heads=" + std::to_string(c.num_kv_heads) +
                       " is negative; set it to a divisor of base_num_query_heads, or 0 for "
                       "base_num_query_heads (multi-head attention)");
  }
  if (problems.empty() && c.num_heads % KvHeads(c) != 0) {
    problems.push_back("base_num_query_heads=" + std::to_string(c.num_heads) +
                       " is not a multiple of base_num_kv_heads=" +
                       std::to_string(c.num_kv_heads) +
                       " (each kv head serves the same number of query heads); set "
                       "base_num_kv_heads to a divisor of base_num_query_heads");
  }
  if (problems.empty() &&
      (static_cast<__int128>(c.num_heads) + 2 * KvHeads(c)) * c.head_dim > kMaxDim) {
    problems.push_back("(base_num_query_heads + 2 x base_num_kv_heads) x head_dim exceeds " +
                       std::to_string(kMaxDim) +
                       " (the fused q|k|v width); lower the head counts or head_dim");
  }
  if (problems.empty() && 2 * c.mlp_dim > kMaxDim) {
    problems.push_back("2 x base_moe_mlp_dim exceeds " + std::to_string(kMaxDim) +
                       " (wi's fused gate|up width); lower base_moe_mlp_dim");
  }
  if (problems.empty() && 2 * c.shared_experts * c.mlp_dim > kMaxDim) {
    problems.push_back("2 x shared_experts x base_moe_mlp_dim exceeds " +
                       std::to_string(kMaxDim) +
                       " (shared_wi's fused gate|up width); lower shared_experts or "
                       "base_moe_mlp_dim");
  }
  if (problems.empty() && 2 * c.base_mlp_dim > kMaxDim) {
    problems.push_back("2 x base_mlp_dim exceeds " + std::to_string(kMaxDim) +
                       " (mlp_wi's fused gate|up width); lower base_mlp_dim");
  }
  ValidateMla(c, &problems);
  if (!problems.empty()) {
    std::string m = "invalid model configuration: " + problems[0];
    for (size_t i = 1; i < problems.size(); ++i) m += "; " + problems[i];
    return InvalidArgument(m);
  }
  FP8MOE_RETURN_IF_ERROR(ValidateMoeConfig(c.moe));
  // Every layer dense: the flags that only act on MoE layers would do
  // nothing, which is refused rather than ignored.
  if (c.first_num_dense_layers >= c.num_layers) {
    std::string moe_only;
    if (c.shared_experts > 0) moe_only += " shared_experts=" + std::to_string(c.shared_experts);
    if (c.moe.routed_bias) moe_only += " routed_bias=true";
    const MoeQatMode qat = PlanMoeQuantization(c.moe).mode;
    if (qat != MoeQatMode::kNone) {
      moe_only += std::string(" a QAT mode of the routed experts (") +
                  std::string(MoeQatModeName(qat)) +
                  ": fp8_moe_fake_quant, fp8_moe_native_fwd, fp8_moe_native_bwd_dlhs, "
                  "quantization)";
    }
    if (!moe_only.empty()) {
      return InvalidArgument(
          "invalid model configuration: first_num_dense_layers=" +
          std::to_string(c.first_num_dense_layers) + " makes every one of the " +
          std::to_string(c.num_layers) + " layers dense, but MoE-only flags are set:" + moe_only +
          "; lower first_num_dense_layers below base_num_decoder_layers, or unset them "
          "(shared_experts=0, routed_bias=false, fp8_moe_fake_quant=false fp8_fake_quant_hoist= "
          "fp8_moe_native_fwd=false fp8_moe_native_bwd_dlhs=false quantization=)");
    }
  }
  return OkStatus();
}

std::vector<std::pair<std::string, Tensor*>> ModelParams::Named() {
  std::vector<std::pair<std::string, Tensor*>> out;
  out.emplace_back("embed", &embed);
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerParams& L = layers[l];
    out.emplace_back(p + "attn_norm", &L.attn_norm);
    if (has_mla) {  // attention_type=mla: the MLA projections instead of wqkv
      if (has_q_lora) {
        out.emplace_back(p + "wq_a", &L.wq_a);
        out.emplace_back(p + "q_a_norm", &L.q_a_norm);
        out.emplace_back(p + "wq_b", &L.wq_b);
      } else {
        out.emplace_back(p + "wq", &L.wq);
      }
      out.emplace_back(p + "wkv_a", &L.wkv_a);
      out.emplace_back(p + "kv_a_norm", &L.kv_a_norm);
      out.emplace_back(p + "wkv_b", &L.wkv_b);
    } else {
      out.emplace_back(p + "wqkv", &L.wqkv);
    }
    out.emplace_back(p + "wo_attn", &L.wo_attn);
    if (has_qk_norm) {
      out.emplace_back(p + "q_norm", &L.q_norm);
      out.emplace_back(p + "k_norm", &L.k_norm);
    }
    out.emplace_back(p + "mlp_norm", &L.mlp_norm);
    if (L.dense) {
      out.emplace_back(p + "mlp_wi", &L.mlp_wi);
      out.emplace_back(p + "mlp_wo", &L.mlp_wo);
      continue;
    }
    out.emplace_back(p + "router", &L.router);
    if (has_router_bias) out.emplace_back(p + "router_bias", &L.router_bias);
    out.emplace_back(p + "wi", &L.wi);
    out.emplace_back(p + "wo", &L.wo);
    if (L.shared) {
      out.emplace_back(p + "shared_wi", &L.shared_wi);
      out.emplace_back(p + "shared_wo", &L.shared_wo);
    }
  }
  out.emplace_back("final_norm", &final_norm);
  if (has_lm_head) out.emplace_back("lm_head", &lm_head);
  return out;
}

std::vector<std::pair<std::string, const Tensor*>> ModelParams::Named() const {
  std::vector<std::pair<std::string, const Tensor*>> out;
  for (auto& [n, t] : const_cast<ModelParams*>(this)->Named()) out.emplace_back(n, t);
  return out;
}

ModelParams ModelParams::Layout(const ModelConfig& c) {
  ModelParams p;
  p.has_lm_head = !c.logits_via_embedding;
  p.has_qk_norm = c.use_qk_norm;
  p.has_router_bias = c.moe.routed_bias;
  p.has_mla = IsMla(c);
  p.has_q_lora = IsMla(c) && c.q_lora_rank > 0;
  p.layers.resize(static_cast<size_t>(std::max<int64_t>(c.num_layers, 0)));
  for (size_t l = 0; l < p.layers.size(); ++l) {
    p.layers[l].dense = IsDenseLayer(c, static_cast<int64_t>(l));
    p.layers[l].shared = !p.layers[l].dense && c.shared_experts > 0;
  }
  return p;
}

bool IsModelState(const std::string& name) { return name.ends_with(".router_bias"); }

void UpdateRoutedBias(const int32_t* load, int64_t experts, double rate, float* bias) {
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) total += load[e];
  const float step = static_cast<float>(rate);
  for (int64_t e = 0; e < experts; ++e) {
    // sign(total / E - load_e) = sign(total - E load_e), exact in integers.
    const int64_t above = total - experts * static_cast<int64_t>(load[e]);
    const float sign = above > 0 ? 1.0f : (above < 0 ? -1.0f : 0.0f);
    bias[e] += step * sign;
  }
}

uint64_t ModelParamCount(const ModelConfig& c) {
  // Sizes clamped to [0, 2^31] (validation refuses more): products of four
  // of them stay inside 128 bits; the total saturates at UINT64_MAX.
  using U = unsigned __int128;
  auto size = [](int64_t v) { return static_cast<U>(std::clamp<int64_t>(v, 0, int64_t{1} << 31)); };
  const U D = size(c.emb_dim), HD = size(c.num_heads) * size(c.head_dim),
          QKV = (size(c.num_heads) + 2 * size(KvHeads(c))) * size(c.head_dim),
          E = size(c.moe.num_experts), F = size(c.mlp_dim), V = size(c.vocab_size),
          L = size(c.num_layers), SF = size(c.shared_experts) * F,
          Ld = std::min(size(c.first_num_dense_layers), L), Fd = size(c.base_mlp_dim);
  const U qk_norm = c.use_qk_norm ? 2 * size(c.head_dim) : 0;
  U attention = 2 * D + D * QKV + HD * D + qk_norm;  // with the two norms' gains
  if (IsMla(c)) {  // the MLA projections and norms instead of wqkv; wo_attn [H vd, D]
    const U H = size(c.num_heads), ql = size(c.q_lora_rank), kvl = size(c.kv_lora_rank),
            nope = size(c.qk_nope_head_dim), r = size(c.qk_rope_head_dim),
            vd = size(c.v_head_dim), q = ql > 0 ? D * ql + ql + ql * H * (nope + r)
                                                : D * H * (nope + r);
    attention = 2 * D + q + D * (kvl + r) + kvl + kvl * H * (nope + vd) + H * vd * D;
  }
  const U router_bias = c.moe.routed_bias ? E : 0;
  const U layer =
      attention + D * E + router_bias + E * D * 2 * F + E * F * D + D * 2 * SF + SF * D;
  const U dense_layer = attention + D * 2 * Fd + Fd * D;
  const U total =
      (c.logits_via_embedding ? 1 : 2) * V * D + D + (L - Ld) * layer + Ld * dense_layer;
  return total > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                      : static_cast<uint64_t>(total);
}

std::vector<std::pair<std::string, Shape>> ParamShapes(const ModelConfig& c,
                                                       int64_t expert_rows) {
  const int64_t D = c.emb_dim, HD = c.num_heads * c.head_dim, E = c.moe.num_experts,
                F = c.mlp_dim, V = c.vocab_size;
  const int64_t rows = expert_rows < 0 ? E : expert_rows;
  const int64_t SF = c.shared_experts * F, Fd = c.base_mlp_dim;
  ModelParams skeleton = ModelParams::Layout(c);  // Named() gives the names and their order
  std::vector<std::pair<std::string, Shape>> out;
  for (const auto& [name, t] : skeleton.Named()) {
    const std::string leaf = name.substr(name.rfind('.') + 1);  // npos + 1 = 0
    Shape s;
    if (leaf == "embed") s = {V, D};
    if (leaf == "lm_head") s = {D, V};
    if (leaf == "attn_norm" || leaf == "mlp_norm" || leaf == "final_norm") s = {D};
    if (leaf == "wqkv") s = {D, (c.num_heads + 2 * KvHeads(c)) * c.head_dim};
    if (leaf == "wo_attn") s = {IsMla(c) ? c.num_heads * c.v_head_dim : HD, D};
    if (IsMla(c)) {  // attention_type=mla (LayerParams: each a Hugging Face tensor transposed)
      const int64_t H = c.num_heads, ql = c.q_lora_rank, kvl = c.kv_lora_rank,
                    qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (leaf == "wq") s = {D, H * qk};
      if (leaf == "wq_a") s = {D, ql};
      if (leaf == "q_a_norm") s = {ql};
      if (leaf == "wq_b") s = {ql, H * qk};
      if (leaf == "wkv_a") s = {D, kvl + c.qk_rope_head_dim};
      if (leaf == "kv_a_norm") s = {kvl};
      if (leaf == "wkv_b") s = {kvl, H * (c.qk_nope_head_dim + c.v_head_dim)};
    }
    if (leaf == "q_norm" || leaf == "k_norm") s = {c.head_dim};
    if (leaf == "router") s = {D, E};
    if (leaf == "router_bias") s = {E};
    if (leaf == "wi") s = {rows, D, 2 * F};
    if (leaf == "wo") s = {rows, F, D};
    if (leaf == "shared_wi") s = {D, 2 * SF};
    if (leaf == "shared_wo") s = {SF, D};
    if (leaf == "mlp_wi") s = {D, 2 * Fd};
    if (leaf == "mlp_wo") s = {Fd, D};
    FP8MOE_DCHECK(!s.empty());  // every tensor of Named() has its shape here
    out.emplace_back(name, std::move(s));
  }
  return out;
}

Result<ModelParams> AllocateParams(const ModelConfig& c, int64_t expert_rows) {
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(c));
  if (expert_rows > c.moe.num_experts) {
    return InvalidArgument("AllocateParams: " + std::to_string(expert_rows) +
                           " experts per layer, but the model has " +
                           std::to_string(c.moe.num_experts));
  }
  // The whole set is checked against the memory cap before the first tensor
  // (and the per-layer table) is allocated.
  using U = unsigned __int128;  // four validated sizes (< 2^31 each) fit
  const int64_t E = c.moe.num_experts, rows = expert_rows < 0 ? E : expert_rows;
  const U whole = ModelParamCount(c);
  const U left_out = static_cast<U>(c.num_layers - c.first_num_dense_layers) * 3 *
                     static_cast<U>(c.emb_dim) *
                     static_cast<U>(c.mlp_dim) * static_cast<U>(E - rows);
  const uint64_t count = static_cast<uint64_t>(whole > left_out ? whole - left_out : 0);
  FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest(
      "the model's f32 weights (" + std::to_string(count) + " parameters)",
      count > std::numeric_limits<uint64_t>::max() / 4 ? std::numeric_limits<uint64_t>::max()
                                                       : count * 4));
  const auto shapes = ParamShapes(c, rows);
  ModelParams p = ModelParams::Layout(c);
  const auto named = p.Named();
  for (size_t k = 0; k < named.size(); ++k) {
    FP8MOE_ASSIGN_OR_RETURN(*named[k].second, Tensor::Create(DType::kF32, shapes[k].second));
  }
  return p;
}

Status InitParams(const ModelConfig& c, uint64_t seed,
                  const std::function<void(size_t k, const float* data)>& sink) {
  const auto shapes = ParamShapes(c);
  size_t largest = 0;
  for (const auto& [name, shape] : shapes) largest = std::max(largest, NumElements(shape));
  FP8MOE_ASSIGN_OR_RETURN(Tensor buffer, Tensor::Create(DType::kF32, {static_cast<int64_t>(largest)}));
  float* d = buffer.data_as<float>();
  Rng rng(seed);
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto& [name, shape] = shapes[k];
    const size_t n = NumElements(shape);
    if (IsModelState(name)) {  // router_bias starts at 0 and draws nothing
      std::fill(d, d + n, 0.0f);
    } else if (shape.size() == 1) {  // norm gains
      std::fill(d, d + n, 1.0f);
    } else {
      // fan_in: the contraction dim (rows of [K, N]; K of [E, K, N]).
      const int64_t fan_in = shape.size() == 3 ? shape[1] : shape[0];
      const double sd = name == "embed" ? 1.0 : 1.0 / std::sqrt(static_cast<double>(fan_in));
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(rng.Normal() * sd);
    }
    sink(k, d);
  }
  return OkStatus();
}

Status InitParams(const ModelConfig& c, uint64_t seed, ModelParams* params) {
  const auto shapes = ParamShapes(c);
  const auto named = params->Named();
  for (size_t k = 0; k < named.size(); ++k) {
    if (k >= shapes.size() || named[k].second->dtype() != DType::kF32 ||
        named[k].second->shape() != shapes[k].second) {
      return InvalidArgument("InitParams needs every parameter whole (AllocateParams with every "
                             "expert); " + named[k].first + " is " +
                             ShapeToString(named[k].second->shape()));
    }
  }
  if (named.size() != shapes.size()) {
    return InvalidArgument("InitParams: the parameters do not have the config's layers");
  }
  return InitParams(c, seed, [&](size_t k, const float* data) {
    std::memcpy(named[k].second->data(), data, named[k].second->num_bytes());
  });
}

// ---- Buffers ----

struct Model::Buffers {
  bool ready = false;
  Tensor group;     // I32 [1] = B*S: the dense matmuls' single group
  internal::AttentionShared attention;
  struct Layer {
    Tensor x, x1, n2, inv2;
    internal::AttentionActivations attention;
    MoeWorkspace moe;
  };
  std::vector<Layer> layers;
  Tensor xf, nf, invf, logits, dlogits;
  internal::LogitsBuffers tied;  // logits_via_embedding's
  Tensor dx, dtmp, moe_y;
  std::vector<internal::DenseMlpState> ffn;  // per layer: the shared experts' activations
  internal::DenseMlpScratch ffn_scratch;
};

Model::Model(const ModelConfig& config) : config_(config), b_(std::make_unique<Buffers>()) {}
Model::~Model() = default;

namespace {

Status Allocate(const ModelConfig& c, Model::Buffers* b) {
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, V = c.vocab_size;
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->group, {1}, DType::kI32));
  b->group.data_as<int32_t>()[0] = static_cast<int32_t>(N);
  FP8MOE_RETURN_IF_ERROR(internal::AllocateAttention(c, &b->attention));
  b->layers.resize(static_cast<size_t>(c.num_layers));
  for (auto& L : b->layers) {
    FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&L.x, {N, D}));
    FP8MOE_RETURN_IF_ERROR(internal::AllocateAttention(c, &L.attention));
    FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&L.x1, {N, D}));
    FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&L.n2, {N, D}));
    FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&L.inv2, {N}));
  }
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->xf, {N, D}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->nf, {N, D}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->invf, {N}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->logits, {N, V}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->dlogits, {N, V}));
  FP8MOE_RETURN_IF_ERROR(internal::AllocateLogits(c, &b->tied));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->dx, {N, D}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->dtmp, {N, D}));
  FP8MOE_RETURN_IF_ERROR(internal::CreateZeroed(&b->moe_y, {N, D}));
  FP8MOE_RETURN_IF_ERROR(internal::AllocateFfn(c, &b->ffn, &b->ffn_scratch));
  b->ready = true;
  return OkStatus();
}

// This rank's experts of an expert tensor: rows [r E/P, (r+1) E/P) of a
// whole one [E, ...] for ring rank r of P, all of one that holds only those
// E/P rows, and for one that holds none (AllocateParams with 0) a view of the
// E/P rows' shape without data, for the prepare and the shape checks of a
// mode that never reads the master. T is const Tensor (a master: a read-only
// view) or Tensor (a gradient: a writable one).
template <class T>
auto ExpertRows(const ModelConfig& c, T& t, bool wo, const Communicator* ring) {
  const int64_t E = c.moe.num_experts, P = ring != nullptr ? ring->size() : 1, El = E / P;
  auto v = t.view();
  if (v.shape.empty()) return v;  // not a model's tensor: the layer's check names it
  if (v.shape[0] == 0) {
    v.data = nullptr;
    v.shape = wo ? Shape{El, c.mlp_dim, c.emb_dim} : Shape{El, c.emb_dim, 2 * c.mlp_dim};
    return v;
  }
  if (P <= 1 || v.shape[0] != E) return v;
  const int64_t row = static_cast<int64_t>(t.num_elements()) / E;
  v.data = t.template data_as<float>() + ring->rank() * El * row;
  v.shape[0] = El;
  return v;
}

// An error unless every layer's wi / wo hold experts (not AllocateParams
// with 0): what reads or writes them needs them.
Status NeedExperts(const ModelParams& p, const std::string& what, const std::string& why) {
  for (size_t l = 0; l < p.layers.size(); ++l) {
    if (p.layers[l].dense) continue;  // a dense MLP layer has no experts
    if (p.layers[l].wi.rank() == 3 && p.layers[l].wi.dim(0) > 0 && p.layers[l].wo.rank() == 3 &&
        p.layers[l].wo.dim(0) > 0) {
      continue;
    }
    return InvalidArgument("layer " + std::to_string(l) + "'s expert weights in the " + what +
                           " hold no experts (AllocateParams with 0), but " + why);
  }
  return OkStatus();
}

MoeWeights MasterOf(const ModelConfig& c, const LayerParams& L, const Communicator* ring) {
  MoeWeights w{L.router.view(), ExpertRows(c, L.wi, false, ring), ExpertRows(c, L.wo, true, ring)};
  if (c.moe.routed_bias) w.route_bias = L.router_bias.view();
  return w;
}

}  // namespace

Status Model::PrepareExperts(Context& ctx, const ModelParams& params,
                             std::vector<PreparedMoeWeights>* prepared,
                             ExpertWeightSource* source) {
  if (source == nullptr || MoeReadsF32Masters(config_.moe)) {
    FP8MOE_RETURN_IF_ERROR(NeedExperts(
        params, "parameters",
        source == nullptr ? "preparing them without an ExpertWeightSource reads them"
                          : "this MoE mode reads the f32 masters"));
  }
  if (prepared->size() != params.layers.size()) prepared->resize(params.layers.size());
  for (size_t l = 0; l < params.layers.size(); ++l) {
    if (IsDenseLayer(config_, static_cast<int64_t>(l))) continue;  // no experts to prepare
    Communicator* ring = ranks_.expert_ring;
    FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(
        ctx, config_.moe, ExpertRows(config_, params.layers[l].wi, false, ring),
        ExpertRows(config_, params.layers[l].wo, true, ring), &(*prepared)[l], source,
        static_cast<int64_t>(l)));
  }
  return OkStatus();
}

Status Model::Step(Context& ctx, const ModelParams& params,
                   const std::vector<PreparedMoeWeights>& prepared, const int32_t* inputs,
                   const int32_t* targets, ModelParams* grads, ModelStepInfo* info) {
  const ModelConfig& c = config_;
  if (!b_->ready) FP8MOE_RETURN_IF_ERROR(Allocate(c, b_.get()));
  Buffers& b = *b_;
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, V = c.vocab_size, L = c.num_layers;
  const int64_t ND = N * D;
  if (static_cast<int64_t>(params.layers.size()) != L ||
      static_cast<int64_t>(prepared.size()) != L ||
      (grads != nullptr && static_cast<int64_t>(grads->layers.size()) != L)) {
    return InvalidArgument("the parameters, gradients or prepared experts do not have " +
                           std::to_string(L) + " layers");
  }
  if (MoeReadsF32Masters(c.moe)) {
    FP8MOE_RETURN_IF_ERROR(NeedExperts(params, "parameters", "this MoE mode reads the f32 masters"));
  }
  if (grads != nullptr) {
    FP8MOE_RETURN_IF_ERROR(NeedExperts(*grads, "gradients", "the backward writes them"));
  }
  for (int64_t n = 0; n < N; ++n) {
    if (inputs[n] < 0 || inputs[n] >= V) {
      return InvalidArgument("input token " + std::to_string(inputs[n]) + " at position " +
                             std::to_string(n) + " is outside the vocabulary [0, " +
                             std::to_string(V) + "); raise vocab_size");
    }
  }
  const ConstTensorView group = b.group.view();
  info->aux_loss = 0;
  info->dropless_reruns = 0;
  info->expert_load.resize(static_cast<size_t>(L));

  // ---- Forward ----
  FP8MOE_RETURN_IF_ERROR(internal::EmbeddingGather(ctx, params.embed.data_as<float>(), inputs, N,
                                                    V, D, b.layers[0].x.data_as<float>()));
  for (int64_t l = 0; l < L; ++l) {
    const LayerParams& P = params.layers[static_cast<size_t>(l)];
    Buffers::Layer& A = b.layers[static_cast<size_t>(l)];
    FP8MOE_RETURN_IF_ERROR(internal::AttentionSublayerForward(
        ctx, c, group, &b.attention, P, A.x.data_as<float>(), &A.attention, A.x1.data_as<float>()));
    FP8MOE_RETURN_IF_ERROR(internal::RmsNormForward(ctx, A.x1.data_as<float>(),
                                                    P.mlp_norm.data_as<float>(), N, D,
                                                    static_cast<float>(c.norm_eps),
                                                    A.n2.data_as<float>(),
                                                    A.inv2.data_as<float>()));
    MoeStepInfo mi;
    MoeOptions mo;
    mo.ranks = ranks_;
    FP8MOE_RETURN_IF_ERROR(internal::FfnForward(
        ctx, c, mo, l, P, MasterOf(c, P, ranks_.expert_ring), prepared[static_cast<size_t>(l)],
        A.n2.view(), &A.moe, &b.ffn[static_cast<size_t>(l)], &b.ffn_scratch, b.moe_y.view(), &mi,
        &info->expert_load[static_cast<size_t>(l)]));
    info->aux_loss += mi.aux_loss;
    info->dropless_reruns += mi.stats.dropless_reruns;
    float* next = l + 1 < L ? b.layers[static_cast<size_t>(l + 1)].x.data_as<float>()
                            : b.xf.data_as<float>();
    FP8MOE_RETURN_IF_ERROR(internal::Add(ctx, A.x1.data_as<float>(), b.moe_y.data_as<float>(),
                                         ND, next));
  }
  FP8MOE_RETURN_IF_ERROR(internal::RmsNormForward(ctx, b.xf.data_as<float>(),
                                                  params.final_norm.data_as<float>(), N, D,
                                                  static_cast<float>(c.norm_eps),
                                                  b.nf.data_as<float>(), b.invf.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(internal::LogitsForward(ctx, c, group, params, b.nf.data_as<float>(),
                                                 &b.tied, b.logits.data_as<float>()));
  FP8MOE_ASSIGN_OR_RETURN(info->loss,
                          internal::CrossEntropy(ctx, b.logits.data_as<float>(), targets, N, V,
                                                 grads ? b.dlogits.data_as<float>() : nullptr));
  if (grads == nullptr) return OkStatus();

  // ---- Backward ----
  float* dx = b.dx.data_as<float>();
  float* dtmp = b.dtmp.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(internal::LogitsBackward(ctx, c, group, params, b.nf.data_as<float>(),
                                                  b.dlogits.data_as<float>(), &b.tied, dtmp,
                                                  grads));
  std::fill(dx, dx + ND, 0.0f);
  FP8MOE_RETURN_IF_ERROR(internal::RmsNormBackward(ctx, b.xf.data_as<float>(),
                                                   params.final_norm.data_as<float>(),
                                                   b.invf.data_as<float>(), dtmp, N, D, dx,
                                                   grads->final_norm.data_as<float>()));
  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerParams& P = params.layers[static_cast<size_t>(l)];
    LayerParams& G = grads->layers[static_cast<size_t>(l)];
    Buffers::Layer& A = b.layers[static_cast<size_t>(l)];
    // FFN (MoE + shared experts): dy = dx; its dx is the gradient of n2.
    const MoeGradientViews mg{b.dtmp.view(), G.router.view(),
                              ExpertRows(c, G.wi, false, ranks_.expert_ring),
                              ExpertRows(c, G.wo, true, ranks_.expert_ring)};
    MoeOptions mo;
    mo.ranks = ranks_;
    FP8MOE_RETURN_IF_ERROR(internal::FfnBackward(
        ctx, c, mo, l, P, MasterOf(c, P, ranks_.expert_ring), prepared[static_cast<size_t>(l)],
        A.n2.view(), &A.moe, b.ffn[static_cast<size_t>(l)], &b.ffn_scratch, b.dx.view(), mg, &G));
    FP8MOE_RETURN_IF_ERROR(internal::RmsNormBackward(ctx, A.x1.data_as<float>(),
                                                     P.mlp_norm.data_as<float>(),
                                                     A.inv2.data_as<float>(), dtmp, N, D, dx,
                                                     G.mlp_norm.data_as<float>()));
    // The attention sublayer: dx is now the gradient of x1.
    FP8MOE_RETURN_IF_ERROR(internal::AttentionSublayerBackward(
        ctx, c, group, &b.attention, P, A.x.data_as<float>(), A.attention, &G, dx, dtmp));
  }
  FP8MOE_RETURN_IF_ERROR(
      internal::EmbeddingScatterAdd(ctx, dx, inputs, N, V, D, grads->embed.data_as<float>()));
  return internal::AddTiedEmbeddingGradient(ctx, c, b.tied, grads->embed.data_as<float>());
}

Status Model::ActivationHealth(Context& ctx, int64_t layer,
                               const std::vector<PreparedMoeWeights>& prepared, Fp8Health* wi_lhs,
                               Fp8Health* wo_lhs) {
  if (layer < 0 || layer >= config_.num_layers || !b_->ready) {
    return InvalidArgument("no activations of layer " + std::to_string(layer));
  }
  if (IsDenseLayer(config_, layer)) {  // a dense MLP: nothing quantized
    *wi_lhs = {};
    *wo_lhs = {};
    return OkStatus();
  }
  return MoeActivationHealth(ctx, config_.moe, prepared[static_cast<size_t>(layer)],
                             &b_->layers[static_cast<size_t>(layer)].moe, wi_lhs, wo_lhs);
}

}  // namespace fp8moe
