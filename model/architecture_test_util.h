// Issue 36's three architectures at tiny shapes, every knob of each at once,
// as MaxText flags: the rows that model_test checks against finite
// differences of the float64 twin (and for thread-count and QAT-mode
// independence) and that train_dist_test trains on N ranks against one.
#ifndef FP8MOE_MODEL_ARCHITECTURE_TEST_UTIL_H_
#define FP8MOE_MODEL_ARCHITECTURE_TEST_UTIL_H_

#include <string>
#include <vector>

namespace fp8moe::test {

struct Architecture {
  std::string name;
  // ModelConfigFlags' flags (attention and FFN knobs), over the caller's
  // tiny shape: every row keeps the caller's base_emb_dim, base_moe_mlp_dim,
  // vocab_size and max_target_length.
  std::vector<std::string> model_flags;
  // MoeConfigFlags' flags (the experts and their routing), after the
  // caller's QAT mode.
  std::vector<std::string> moe_flags;
};

// Mixtral: grouped-query attention (2 query heads per kv head), softmax
// top-2 of 4 experts. Qwen3-MoE: grouped-query attention with qk norms, hd
// independent of D, softmax top-3 of 8 experts renormalised over the 3.
// DeepSeek-V3 without MLA: sigmoid scores, 4 groups of 2 experts with 2 kept
// (a group flip changes the experts), top-3 renormalised and scaled by 2.5,
// one shared expert, a dense first layer, tied logits (the row that
// covers logits_via_embedding), and routed_bias's choice bias moved by
// 0.01 a step (a trainer's update; the model reads the bias alone).
// DeepSeek-V3: the same FFN with multi-head latent attention (compressed q,
// qk_nope_head_dim != qk_rope_head_dim as in the real model, so their column
// offsets cannot be mixed up unseen, v_head_dim below qk, interleaved RoPE:
// the default) and an untied LM head.
inline const std::vector<Architecture>& Architectures() {
  static const std::vector<Architecture> rows = {
      {"mixtral",
       {"base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=4"},
       {"num_experts=4", "num_experts_per_tok=2"}},
      {"qwen3-moe",
       {"base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=6", "use_qk_norm=true"},
       {"num_experts=8", "num_experts_per_tok=3", "norm_topk_prob=true"}},
      {"deepseek3 without MLA",
       {"base_num_query_heads=2", "head_dim=4", "base_num_decoder_layers=3",
        "first_num_dense_layers=1", "base_mlp_dim=10", "shared_experts=1",
        "logits_via_embedding=true"},
       {"num_experts=8", "num_experts_per_tok=3", "routed_score_func=sigmoid",
        "n_routing_groups=4", "topk_routing_group=2", "routed_scaling_factor=2.5",
        "norm_topk_prob=true", "routed_bias=true", "routed_bias_update_rate=0.01"}},
      {"deepseek3",
       {"base_num_query_heads=2", "base_num_decoder_layers=3", "first_num_dense_layers=1",
        "base_mlp_dim=10", "shared_experts=1", "attention_type=mla", "q_lora_rank=6",
        "kv_lora_rank=5", "qk_nope_head_dim=6", "qk_rope_head_dim=4", "v_head_dim=3"},
       {"num_experts=8", "num_experts_per_tok=3", "routed_score_func=sigmoid",
        "n_routing_groups=4", "topk_routing_group=2", "routed_scaling_factor=2.5",
        "norm_topk_prob=true", "routed_bias=true", "routed_bias_update_rate=0.01"}},
  };
  return rows;
}

}  // namespace fp8moe::test

#endif  // FP8MOE_MODEL_ARCHITECTURE_TEST_UTIL_H_
