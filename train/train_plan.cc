// The memory plan of a training run (CheckTrainMemory in fp8moe/train.h):
// every buffer the run holds at its peak, summed from the config before
// anything is allocated, so a model too large for the memory cap is refused
// up front with the bytes it needs instead of failing mid-allocation.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>

#include "fp8moe/memory.h"
#include "fp8moe/train.h"

namespace fp8moe {
namespace {

using U = unsigned __int128;

// A size clamped to [0, 2^31]: validation refuses anything larger, and the
// clamp keeps every product of four sizes (times a small constant) inside
// 128 bits even for a config that has not been validated yet.
U Pos(int64_t v) { return static_cast<U>(std::clamp<int64_t>(v, 0, int64_t{1} << 31)); }

uint64_t Saturate(U v) {
  return v > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                  : static_cast<uint64_t>(v);
}

// The attention sublayer's share of the plan (model/attention_block.h,
// model/mla_block.h) for Nl tokens of sequence length S.
struct AttentionPlan {
  U largest;       // elements of its largest parameter tensor
  U layer_bytes;   // kept per layer for the backward
  U global_bytes;  // shared by the layers
};
AttentionPlan PlanAttention(const ModelConfig& m, U Nl, U S) {
  const U D = Pos(m.emb_dim), H = Pos(m.num_heads), hd = Pos(m.head_dim), Hkv = Pos(KvHeads(m)),
          HD = H * hd, QKV = (H + 2 * Hkv) * hd;  // q | k | v heads
  if (IsMla(m)) {
    // attention_type=mla: its projections instead of wqkv; per layer and
    // token it keeps qkv [2 H qk + H vd], q_a and q_a_n [ql], latent and
    // latent_n [kvl], two 1/rms, attn [H vd]; the layers share per token
    // q [H qk], kv_a [kvl + r], kv_b [H (nope + vd)], dqkv [2 H qk + H vd],
    // dattn [H vd], two [kvl], two [ql], dn1 [D], and the RoPE tables
    // [S, r/2] twice.
    const U ql = Pos(m.q_lora_rank), kvl = Pos(m.kv_lora_rank), nope = Pos(m.qk_nope_head_dim),
            rope = Pos(m.qk_rope_head_dim), vd = Pos(m.v_head_dim), qk = nope + rope;
    const U largest = std::max({D * H * qk, ql * H * qk, D * (kvl + rope),
                                kvl * H * (nope + vd), H * vd * D});
    const U kept = 2 * H * qk + H * vd + 2 * ql + 2 * kvl + 2 + H * vd;
    const U shared = Nl * (H * qk + kvl + rope + H * (nope + vd) + 2 * H * qk + H * vd +
                           H * vd + 2 * kvl + 2 * ql + D) + S * rope;
    return {largest, 4 * Nl * kept, 4 * shared};
  }
  // Global attention keeps qkv [N, (H + 2 Hkv) hd] and attn [N, H hd] per
  // layer; use_qk_norm also the q and k heads before their norm and their
  // 1/rms per layer, and shares the projection, its head-major rows and two
  // I64 row maps.
  const U heads_qk = H + Hkv, heads_all = heads_qk + Hkv;
  const U qk_norm_layer = m.use_qk_norm ? 4 * (Nl * heads_qk * hd + Nl * heads_qk) : 0;
  const U qk_norm_global = m.use_qk_norm ? 4 * 2 * Nl * QKV + 16 * Nl * heads_all : 0;
  return {D * QKV, qk_norm_layer + 4 * Nl * (QKV + HD),
          4 * (Nl * QKV + Nl * HD + S * hd) + qk_norm_global};
}

}  // namespace

TrainMemoryPlan PlanTrainMemory(const TrainConfig& c, int64_t fsdp, int64_t expert) {
  // Every size is at most 2^31 (Pos) and each product below has at most four
  // such factors, so 128-bit arithmetic cannot overflow.
  const ModelConfig& m = c.model;
  // The global batch per_device_batch_size x ranks (CheckTrainLayout), and
  // at most ceil(per_device_batch_size) = m.batch sequences on a rank.
  const U Pe = std::max<U>(Pos(expert), 1), ranks = std::max<U>(Pos(fsdp), 1) * Pe;
  const double global_batch =
      std::ceil(c.per_device_batch_size * static_cast<double>(ranks) - 1e-6);
  const U B = Pos(global_batch < 9e18 ? static_cast<int64_t>(std::max(global_batch, 0.0))
                                 : std::numeric_limits<int64_t>::max()),
          S = Pos(m.seq_len), N = B * S, D = Pos(m.emb_dim),
          H = Pos(m.num_heads), V = Pos(m.vocab_size), F = Pos(m.mlp_dim), E = Pos(m.moe.num_experts), L = Pos(m.num_layers),
          k = Pos(m.moe.num_experts_per_tok);
  TrainMemoryPlan plan;
  // f32 sets of the parameters (train/trainer.cc, train/fsdp.h):
  // - the weights the model reads: the dense ones whole, and the experts
  //   only where the layer reads f32 masters, then this ring rank's E/P;
  // - this rank's gradient: the dense tensors and its E/P experts;
  // - the FSDP shards of master, m, v and gradient: 1/ranks of the dense
  //   unit and of every expert tensor (each rounded up: +1 per unit);
  // - the staging of the dense unit's gathers;
  // - the one-tensor buffer the initial weights, a save or a resume stream
  //   through (the largest tensor).
  const U params = ModelParamCount(m);
  const U expert_layer = E * D * 2 * F + E * F * D;
  // first_num_dense_layers have no experts (their MLP is a dense tensor).
  const U Ld = std::min(Pos(m.first_num_dense_layers), L), Fd = Pos(m.base_mlp_dim);
  const U experts = (L - Ld) * expert_layer;
  const U dense = params - std::min(params, experts);
  const U local_experts = experts / Pe;
  const U SF = Pos(m.shared_experts) * F;  // the shared experts' fused width
  const AttentionPlan attention = PlanAttention(m, std::min(Pos(m.batch), B) * S, S);  // Nl tokens
  const U largest = std::max({V * D, attention.largest, E * D * 2 * F, D * E,
                              D * 2 * SF, Ld > 0 ? D * 2 * Fd : 0});
  // routed_bias's router_bias [E] per MoE layer: in `dense` (params and
  // gradient), and its FSDP unit replicated whole on every rank, not 1/ranks.
  const U bias_state = m.moe.routed_bias ? (L - Ld) * E : 0;
  const U shards = 4 * (dense / ranks + experts / ranks + 2 * L + 1 +
                       (bias_state > 0 ? bias_state + 1 : 0));
  const U f32_experts = MoeReadsF32Masters(m.moe) ? local_experts : 0;
  plan.weights_bytes =
      Saturate(4 * ((dense + f32_experts) + (dense + local_experts) + shards + dense + largest));
  // The expert weights as the QAT mode presents them to the GMMs (codes, a
  // BF16 copy, scales: at most 4 bytes an element, every layer, this ring
  // rank's experts), and the f32 copies one layer's backward makes (8 bytes
  // an element, one layer).
  plan.expert_bytes = Saturate((4 * experts + 8 * expert_layer) / Pe);
  // Activations kept for the backward, per layer: x, n1, x1, n2 [N, D];
  // inv1, inv2 [N]; qkv [N, (H + 2 Hkv) hd]; attention probabilities [B, H, S, S];
  // attn [N, HD]; the MoE layer's router logits [N, E], routing tables (24
  // bytes a routed pair) and sorted buffers x_sorted, h, a, y_sorted, and
  // its backward's buffers, which every layer's workspace keeps from step
  // to step (dy_sorted, dh [rows, D + 2F] in the activation dtype, dx_sorted
  // [rows, D] f32, dlogits [N, E], the pairs' weight gradients). Then the
  // final norm, logits and their gradient, the model's backward buffers and
  // the token ids.
  //
  // Per rank: each of the ranks runs its slice of the batch, at most Bl
  // sequences (Nl tokens; train/trainer.cc); the MoE layer of a ring rank
  // works on the Pe slices its ring gathers (Ng tokens, all of whose pairs
  // may route to this rank's experts) and keeps the ring's buffers
  // (moe_workspace.h: the gathered tokens, the partial outputs and their
  // gradients, f32, and the codes of a quantized gather: at most 28 bytes a
  // gathered token and model dimension; the gathered routing, 24 bytes a
  // pair). One rank: Nl = Ng = N.
  const U Bl = std::min(Pos(m.batch), B), Nl = Bl * S, Ng = std::min(N, Pe * Nl);
  const U pairs = Ng * k;
  U rows = pairs;
  if (m.moe.ragged_buffer_factor > 0) {  // validated <= kMaxRaggedBufferFactor
    rows = std::max<U>(pairs, static_cast<U>(std::ceil(m.moe.ragged_buffer_factor *
                                                        static_cast<double>(pairs))));
  }
  const MoeQuantPlan qp = PlanMoeQuantization(m.moe);
  const bool f32 = m.moe.dtype == DType::kF32 && qp.mode == MoeQatMode::kNone;
  const U act = f32 ? 4 : 2;
  const U ring = Pe > 1 ? 28 * Ng * D + 24 * pairs : 0;
  // Also kept per layer: fp8_full's backward operands (moe_stages.cc: the
  // scaled gradient in f32 and as codes [rows, max(2F, D)], the activation
  // likewise [rows, max(D, F)], row scales), and where the forward GMMs
  // quantize activations, their FP8 health at log steps (moe_prepare.cc:
  // f32, codes and block scales of [rows, max(D, F)]).
  const U C = std::max(D, F), G = std::max(2 * F, D);
  const U recipe = qp.mode == MoeQatMode::kRecipeFp8Full ? rows * (5 * G + 5 * C + 8) : 0;
  const U health = qp.fwd.lhs.has_value() ? rows * (5 * C + 4 * (C / 128 + 1)) : 0;
  // Tied logits keep the embedding's part of its gradient and, normalized,
  // the raw logits and a row scale (model/logits_block.h).
  const U tied_global =
      !m.logits_via_embedding ? 0
      : 4 * (V * D + (m.normalize_embedding_logits ? Nl * V + Nl : 0));
  const U per_layer = attention.layer_bytes +
                      4 * (4 * Nl * D + 2 * Nl + Bl * H * S * S + Nl * E) +
                      24 * pairs + act * rows * (D + 2 * F + F + D) + ring +
                      act * rows * (D + 2 * F) + 4 * rows * D + 4 * (Nl * E + pairs) + recipe +
                      health;
  // The token ids of the whole global batch (every rank reads it).
  const U global =
      4 * (5 * Nl * D + Nl + 2 * Nl * V) + attention.global_bytes + 8 * N + tied_global;
  // The dense MLPs (model/ffn_block.h: the shared experts, width SF, of an
  // MoE layer, a dense layer's, width Fd), per layer: h [N, 2W] and a [N, W]
  // in the activation dtype, and in bfloat16 the bf16 copies of the input
  // [N, D] and of the two weights; once: the output and input gradient
  // [N, D] f32, dh [N, 2W] and dy [N, D] in the activation dtype. A dense
  // layer is counted with an MoE layer's buffers too (an upper bound: its
  // workspace stays empty).
  const U dense_act = m.moe.dtype == DType::kF32 ? 4 : 2;
  auto mlp = [&](U W) {
    return W == 0 ? 0 : dense_act * 3 * Nl * W + (dense_act == 2 ? 2 * (Nl * D + 3 * D * W) : 0);
  };
  const U widest = Ld > 0 ? std::max(SF, Fd) : SF;
  const U mlp_once = widest == 0 ? 0 : 8 * Nl * D + dense_act * Nl * (2 * widest + D);
  plan.activation_bytes =
      Saturate(L * per_layer + (L - Ld) * mlp(SF) + Ld * mlp(Fd) + global + mlp_once);
  // The data: the synthetic corpus's transition tables (doubles), or the
  // whole text file, or the whole token file and its window order (8 bytes
  // a window of max_target_length ids of at least 2 bytes each).
  if (c.data.type == "text" || c.data.type == "tokens") {
    std::error_code ec;
    const auto size = std::filesystem::file_size(c.data.path, ec);
    const U file = ec ? 0 : static_cast<U>(size);
    plan.data_bytes =
        Saturate(c.data.type == "text" ? file : file + 4 * file / std::max<U>(S, 1));
  } else {
    const U M = Pos(c.data.num_sources), A = Pos(c.data.alphabet_size);
    plan.data_bytes = Saturate(8 * (M * A * A + M * A + 3 * A));
  }
  // The kernels' scratch (Context's arena: tiles, quantized operand blocks,
  // per-thread buffers) and what the estimate above leaves out: measured at
  // 100-170 KiB on the tiny shapes of train_robustness_test and 2% of the
  // plan on larger ones, so 1 MiB plus a quarter of the step's buffers.
  plan.scratch_bytes = Saturate((static_cast<U>(1) << 20) +
                                (static_cast<U>(plan.expert_bytes) + plan.activation_bytes) / 4);
  plan.total_bytes = Saturate(static_cast<U>(plan.weights_bytes) + plan.expert_bytes +
                              plan.activation_bytes + plan.data_bytes + plan.scratch_bytes);
  return plan;
}

Status CheckTrainMemory(const TrainConfig& c, int64_t fsdp, int64_t expert) {
  const TrainMemoryPlan p = PlanTrainMemory(c, fsdp, expert);
  const int64_t ranks = std::max<int64_t>(fsdp, 1) * std::max<int64_t>(expert, 1);
  return CheckMemoryRequest(
      "this training run (model " + std::to_string(ModelParamCount(c.model)) + " parameters" +
          (ranks > 1 ? "; each of " + std::to_string(ranks) + " ranks holds" : "") + ": weights, gradients, master and AdamW shards and the checkpoint buffer " +
          FormatBytes(p.weights_bytes) + "; expert weights for the GMMs " +
          FormatBytes(p.expert_bytes) + "; activations of " +
          (ranks > 1 ? "this rank's " : std::string()) +
          "per_device_batch_size x max_target_length tokens " + FormatBytes(p.activation_bytes) + "; data " +
          FormatBytes(p.data_bytes) + "; kernel scratch " +
          FormatBytes(p.scratch_bytes) + ")",
      p.total_bytes);
}

}  // namespace fp8moe
