// The attention sublayer (model/attention_block.h).
#include "model/attention_block.h"

#include <cstdint>
#include <utility>

#include "model/layers.h"

namespace fp8moe::internal {

namespace {

Status Create(Tensor* t, Shape s) {
  FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Create(DType::kF32, std::move(s)));
  return OkStatus();
}

// The fused q | k | v width (H + 2 Hkv) hd.
int64_t QkvWidth(const ModelConfig& c) { return (c.num_heads + 2 * KvHeads(c)) * c.head_dim; }

}  // namespace

Status AllocateAttention(const ModelConfig& c, AttentionShared* shared) {
  const int64_t N = c.batch * c.seq_len, S = c.seq_len;
  FP8MOE_RETURN_IF_ERROR(Create(&shared->cos, {S, c.head_dim / 2}));
  FP8MOE_RETURN_IF_ERROR(Create(&shared->sin, {S, c.head_dim / 2}));
  RopeTables(S, c.head_dim, c.rope_max_timescale, shared->cos.data_as<float>(),
             shared->sin.data_as<float>());
  FP8MOE_RETURN_IF_ERROR(Create(&shared->dqkv, {N, QkvWidth(c)}));
  return Create(&shared->dattn, {N, c.num_heads * c.head_dim});
}

Status AllocateAttention(const ModelConfig& c, AttentionActivations* a) {
  const int64_t N = c.batch * c.seq_len, S = c.seq_len;
  FP8MOE_RETURN_IF_ERROR(Create(&a->n1, {N, c.emb_dim}));
  FP8MOE_RETURN_IF_ERROR(Create(&a->inv1, {N}));
  FP8MOE_RETURN_IF_ERROR(Create(&a->qkv, {N, QkvWidth(c)}));
  FP8MOE_RETURN_IF_ERROR(Create(&a->probs, {c.batch, c.num_heads, S, S}));
  return Create(&a->attn, {N, c.num_heads * c.head_dim});
}

Status AttentionSublayerForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                                const AttentionShared& shared, const LayerParams& p,
                                const float* x, AttentionActivations* a, float* x1) {
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim;
  float* qkv = a->qkv.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, x, p.attn_norm.data_as<float>(), N, D,
                                        static_cast<float>(c.norm_eps), a->n1.data_as<float>(),
                                        a->inv1.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, a->n1.data_as<float>(), p.wqkv.data_as<float>(), N, D,
                                QkvWidth(c), qkv));
  FP8MOE_RETURN_IF_ERROR(RopeApply(ctx, qkv, B, S, H, Hkv, hd, shared.cos.data_as<float>(),
                                   shared.sin.data_as<float>(), /*inverse=*/false));
  FP8MOE_RETURN_IF_ERROR(AttentionForward(ctx, qkv, B, S, H, Hkv, hd, a->probs.data_as<float>(),
                                          a->attn.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, a->attn.data_as<float>(), p.wo_attn.data_as<float>(),
                                N, H * hd, D, x1));
  return Add(ctx, x1, x, N * D, x1);
}

Status AttentionSublayerBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                                 AttentionShared* shared, const LayerParams& p, const float* x,
                                 const AttentionActivations& a, LayerParams* g, float* dx,
                                 float* dtmp) {
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim, HD = H * hd;
  float* dqkv = shared->dqkv.data_as<float>();
  float* dattn = shared->dattn.data_as<float>();
  // Output projection: dx is the gradient of x1 (and, through the residual,
  // already of x).
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dx, p.wo_attn.data_as<float>(), N, HD, D, dattn));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.attn.data_as<float>(), dx, N, HD, D,
                                  g->wo_attn.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(AttentionBackward(ctx, a.qkv.data_as<float>(), a.probs.data_as<float>(),
                                           dattn, B, S, H, Hkv, hd, dqkv));
  FP8MOE_RETURN_IF_ERROR(RopeApply(ctx, dqkv, B, S, H, Hkv, hd, shared->cos.data_as<float>(),
                                   shared->sin.data_as<float>(), /*inverse=*/true));
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dqkv, p.wqkv.data_as<float>(), N, D, QkvWidth(c),
                                  dtmp));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.n1.data_as<float>(), dqkv, N, D, QkvWidth(c),
                                  g->wqkv.data_as<float>()));
  return RmsNormBackward(ctx, x, p.attn_norm.data_as<float>(), a.inv1.data_as<float>(), dtmp, N,
                         D, dx, g->attn_norm.data_as<float>());
}

}  // namespace fp8moe::internal
