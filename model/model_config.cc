// The model's flags (ModelConfigFlags in include/fp8moe/model.h): MaxText's
// names for the shape of the decoder, bound to ModelConfig's fields.
#include "fp8moe/flag_table.h"
#include "fp8moe/model.h"

namespace fp8moe {

const FlagTable<ModelConfig>& ModelConfigFlags() {
  static const FlagTable<ModelConfig>* const table = [] {
    using M = ModelConfig;
    auto* t = new FlagTable<ModelConfig>;
    t->Int("vocab_size", &M::vocab_size, "Vocabulary size V (256: byte tokens).");
    t->Int("base_emb_dim", &M::emb_dim, "Model width D.");
    t->Int("base_num_decoder_layers", &M::num_layers, "Decoder layers L.");
    t->Int("base_num_query_heads", &M::num_heads, "Attention heads H.");
    t->Int("head_dim", &M::head_dim, "Width of one attention head (even: RoPE pairs).");
    t->Int("base_moe_mlp_dim", &M::mlp_dim,
           "Hidden width F of each SwiGLU expert (wi is [E, D, 2F], wo [E, F, D]).");
    t->Int("max_target_length", &M::seq_len, "Sequence length S of a training example.");
    t->Float("rope_max_timescale", &M::rope_max_timescale,
             "RoPE: the rotation of dimension pair i at position p is p / "
             "rope_max_timescale^(2i / head_dim).");
    t->Float("normalization_layer_epsilon", &M::norm_eps,
             "RMSNorm epsilon under the square root.");
    // The FFN variants (docs/design.md "FFN variants").
    t->Int("shared_experts", &M::shared_experts,
           "Always-active SwiGLU experts of width base_moe_mlp_dim beside the routed ones "
           "(DeepSeek-V3: 1), fused as one MLP of width shared_experts x base_moe_mlp_dim "
           "(shared_wi [D, 2 S F], shared_wo [S F, D]) on the MoE layer's input, its output "
           "added to the routed output; run in dtype, never quantized. 0: none (MaxText's "
           "base.yml has 1, read only by its DeepSeek decoder; 0 keeps this default model "
           "unchanged). Range [0, 2^31).");
    t->Int("first_num_dense_layers", &M::first_num_dense_layers,
           "Leading decoder layers with a dense SwiGLU MLP of width base_mlp_dim instead of "
           "MoE (DeepSeek-V3: 3): no router, experts or shared experts there (mlp_wi "
           "[D, 2 base_mlp_dim], mlp_wo [base_mlp_dim, D]); run in dtype, never quantized. "
           "Range [0, base_num_decoder_layers]; all layers dense only with the MoE-only flags "
           "(shared_experts, the QAT modes) unset.");
    t->Int("base_mlp_dim", &M::base_mlp_dim,
           "Hidden width of the dense layers' MLP (first_num_dense_layers; MaxText's default "
           "7168, scaled down here like the other sizes). Range [1, 2^30).");
    // Attention (docs/design.md 5.1)
    t->Int("base_num_kv_heads", &M::num_kv_heads,
           "Key/value heads Hkv (grouped-query attention; 1: multi-query; 0: "
           "base_num_query_heads, multi-head). base_num_query_heads must be a multiple of it; "
           "query head h reads kv head h / (base_num_query_heads / Hkv).");
    t->Bool("logits_via_embedding", &M::logits_via_embedding,
            "Tied embedding: the logits are the final norm's output times the embedding "
            "table's transpose (no lm_head tensor; embed's gradient gets both uses).");
    t->Bool("normalize_embedding_logits", &M::normalize_embedding_logits,
            "With logits_via_embedding: divide the logits by sqrt(base_emb_dim), as MaxText "
            "does; a Hugging Face tie_word_embeddings model needs false.");
    t->Bool("use_qk_norm", &M::use_qk_norm,
            "RMSNorm over head_dim of every query and key head before RoPE (Qwen3), with "
            "gains q_norm and k_norm [head_dim] per layer and normalization_layer_epsilon.");
    // Multi-head latent attention (docs/design.md "Multi-head latent attention").
    t->String("attention_type", &M::attention_type,
              "global: the attention of head_dim and base_num_kv_heads above; mla: DeepSeek's "
              "multi-head latent attention (the q_lora_rank, kv_lora_rank, qk_*_head_dim, "
              "v_head_dim flags; head_dim unused). MaxText's other types are refused.");
    t->Int("q_lora_rank", &M::q_lora_rank,
           "mla: rank of the compressed query (wq_a [D, q_lora_rank], q_a_norm, wq_b); 0: a "
           "plain projection wq [D, H (qk_nope_head_dim + qk_rope_head_dim)]. Range [0, 2^31).");
    t->Int("kv_lora_rank", &M::kv_lora_rank,
           "mla: rank of the compressed key/value latent (wkv_a [D, kv_lora_rank + "
           "qk_rope_head_dim], kv_a_norm, wkv_b). Range [1, 2^31).");
    t->Int("qk_nope_head_dim", &M::qk_nope_head_dim,
           "mla: query/key columns of a head without RoPE. Range [1, 2^31).");
    t->Int("qk_rope_head_dim", &M::qk_rope_head_dim,
           "mla: rotated query columns of a head, and the width of the one rotated key all "
           "heads share. Even, range [2, 2^31).");
    t->Int("v_head_dim", &M::v_head_dim,
           "mla: value columns of a head (wo_attn [H v_head_dim, D]). Range [1, 2^31).");
    t->Bool("rope_interleave", &M::rope_interleave,
            "mla: RoPE rotates pairs (2i, 2i+1) of the rope columns (DeepSeek's layout, Hugging "
            "Face's rope_interleave); false: pairs (i, i + qk_rope_head_dim/2). Unread by "
            "attention_type=global (halves), as in MaxText's default RoPE.");
    t->String("rope_type", &M::rope_type,
              "RoPE frequencies: default (rope_max_timescale). MaxText's yarn and llama3.1 are "
              "not implemented yet and refused.");
    return t;
  }();
  return *table;
}

}  // namespace fp8moe
