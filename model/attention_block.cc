// The attention sublayer (model/attention_block.h).
#include "model/attention_block.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "model/layers.h"

namespace fp8moe::internal {

namespace {

// The fused q | k | v width (H + 2 Hkv) hd.
int64_t QkvWidth(const ModelConfig& c) { return (c.num_heads + 2 * KvHeads(c)) * c.head_dim; }

// use_qk_norm's buffers and the two row maps between the token-major head
// rows (token n's head c at n (H + 2 Hkv) + c) and the head-major ones
// (q rows n H + h, then k rows N H + n Hkv + g, then v rows).
Status AllocateQkNorm(const ModelConfig& c, AttentionShared* s) {
  const int64_t N = c.batch * c.seq_len, H = c.num_heads, Hkv = KvHeads(c), R = H + 2 * Hkv;
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->raw, {N, QkvWidth(c)}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->head_rows, {N * R, c.head_dim}));
  FP8MOE_ASSIGN_OR_RETURN(s->to_head_major, Tensor::Create(DType::kI64, {N * R}));
  FP8MOE_ASSIGN_OR_RETURN(s->to_token_major, Tensor::Create(DType::kI64, {N * R}));
  int64_t* head_major = s->to_head_major.data_as<int64_t>();
  int64_t* token_major = s->to_token_major.data_as<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t col = 0; col < R; ++col) {
      const int64_t i = col < H         ? n * H + col
                        : col < H + Hkv ? N * H + n * Hkv + (col - H)
                                        : N * (H + Hkv) + n * Hkv + (col - H - Hkv);
      head_major[i] = n * R + col;
      token_major[n * R + col] = i;
    }
  }
  return OkStatus();
}

// qkv [N, (H + 2 Hkv) hd] = raw with every q head RMSNorm(q) * q_norm and
// every k head RMSNorm(k) * k_norm.
Status QkNormForward(Context& ctx, const ModelConfig& c, AttentionShared* s,
                     const LayerParams& p, AttentionActivations* a, float* qkv) {
  const int64_t N = c.batch * c.seq_len, H = c.num_heads, Hkv = KvHeads(c), hd = c.head_dim,
                R = H + 2 * Hkv, qk = N * (H + Hkv);
  const float eps = static_cast<float>(c.norm_eps);
  const int64_t* head_major = s->to_head_major.data_as<int64_t>();
  float* rows = s->head_rows.data_as<float>();
  float* in = a->qk_in.data_as<float>();
  float* inv = a->qk_inv.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(PermuteRows(ctx, s->raw.data(), DType::kF32, N * R, hd, 1, head_major,
                                     qk, in, DType::kF32));
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, in, p.q_norm.data_as<float>(), N * H, hd, eps, rows,
                                        inv));
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, in + N * H * hd, p.k_norm.data_as<float>(), N * Hkv,
                                        hd, eps, rows + N * H * hd, inv + N * H));
  FP8MOE_RETURN_IF_ERROR(PermuteRows(ctx, s->raw.data(), DType::kF32, N * R, hd, 1,
                                     head_major + qk, N * Hkv, rows + qk * hd, DType::kF32));
  return PermuteRows(ctx, rows, DType::kF32, N * R, hd, 1, s->to_token_major.data_as<int64_t>(),
                     N * R, qkv, DType::kF32);
}

// The backward of QkNormForward: s->raw [N, (H + 2 Hkv) hd] = the gradient of
// raw from dqkv (the gradient of qkv); g's q_norm and k_norm overwritten.
Status QkNormBackward(Context& ctx, const ModelConfig& c, AttentionShared* s,
                      const LayerParams& p, const AttentionActivations& a, const float* dqkv,
                      LayerParams* g) {
  const int64_t N = c.batch * c.seq_len, H = c.num_heads, Hkv = KvHeads(c), hd = c.head_dim,
                R = H + 2 * Hkv, qk = N * (H + Hkv);
  const int64_t* head_major = s->to_head_major.data_as<int64_t>();
  float* rows = s->head_rows.data_as<float>();  // the gradients of the head-major rows
  float* dy = s->raw.data_as<float>();          // scratch until the last permute
  const float* in = a.qk_in.data_as<float>();
  const float* inv = a.qk_inv.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(PermuteRows(ctx, dqkv, DType::kF32, N * R, hd, 1, head_major, qk, dy,
                                     DType::kF32));
  std::fill(rows, rows + qk * hd, 0.0f);  // RmsNormBackward adds to dx
  FP8MOE_RETURN_IF_ERROR(RmsNormBackward(ctx, in, p.q_norm.data_as<float>(), inv, dy, N * H, hd,
                                         rows, g->q_norm.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(RmsNormBackward(ctx, in + N * H * hd, p.k_norm.data_as<float>(),
                                         inv + N * H, dy + N * H * hd, N * Hkv, hd,
                                         rows + N * H * hd, g->k_norm.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(PermuteRows(ctx, dqkv, DType::kF32, N * R, hd, 1, head_major + qk,
                                     N * Hkv, rows + qk * hd, DType::kF32));
  return PermuteRows(ctx, rows, DType::kF32, N * R, hd, 1, s->to_token_major.data_as<int64_t>(),
                     N * R, s->raw.data_as<float>(), DType::kF32);
}

// InvalidArgument unless p holds attention_type=global's tensors of c
// (ParamShapes): wqkv [D, (H + 2 Hkv) hd], wo_attn [H hd, D] and, with
// use_qk_norm, q_norm and k_norm [hd]. The mirror of mla_block.cc's
// CheckMlaParams: MLA-layout weights (no wqkv) are named here instead of
// failing in a matmul's generic shape check.
Status CheckGlobalParams(const ModelConfig& c, const LayerParams& p, const char* what) {
  const int64_t D = c.emb_dim, hd = c.head_dim;
  const Shape norm = c.use_qk_norm ? Shape{hd} : Shape{};
  const std::pair<const Tensor*, Shape> want[] = {{&p.wqkv, {D, QkvWidth(c)}},
                                                  {&p.wo_attn, {c.num_heads * hd, D}},
                                                  {&p.q_norm, norm},
                                                  {&p.k_norm, norm}};
  for (const auto& [t, shape] : want) {
    if (shape.empty() || t->shape() == shape) continue;
    return InvalidArgument(std::string("the ") + what + " do not hold attention_type=global's " +
                           "tensors of this config (wqkv, wo_attn" +
                           (c.use_qk_norm ? ", q_norm, k_norm" : "") + "; a tensor is " +
                           ShapeToString(t->shape()) + ", not " + ShapeToString(shape) +
                           "); allocate them with AllocateParams of this config");
  }
  return OkStatus();
}

}  // namespace

Status AllocateAttention(const ModelConfig& c, AttentionShared* shared) {
  if (IsMla(c)) return AllocateMla(c, &shared->mla);
  const int64_t N = c.batch * c.seq_len, S = c.seq_len;
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&shared->cos, {S, c.head_dim / 2}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&shared->sin, {S, c.head_dim / 2}));
  RopeTables(S, c.head_dim, c.rope_max_timescale, shared->cos.data_as<float>(),
             shared->sin.data_as<float>());
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&shared->dqkv, {N, QkvWidth(c)}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&shared->dattn, {N, c.num_heads * c.head_dim}));
  return c.use_qk_norm ? AllocateQkNorm(c, shared) : OkStatus();
}

Status AllocateAttention(const ModelConfig& c, AttentionActivations* a) {
  if (IsMla(c)) return AllocateMla(c, &a->mla);
  const int64_t N = c.batch * c.seq_len, S = c.seq_len;
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->n1, {N, c.emb_dim}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->inv1, {N}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->qkv, {N, QkvWidth(c)}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->probs, {c.batch, c.num_heads, S, S}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->attn, {N, c.num_heads * c.head_dim}));
  if (!c.use_qk_norm) return OkStatus();
  const int64_t qk = N * (c.num_heads + KvHeads(c));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->qk_in, {qk, c.head_dim}));
  return CreateZeroed(&a->qk_inv, {qk});
}

Status AttentionSublayerForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                                AttentionShared* shared, const LayerParams& p, const float* x,
                                AttentionActivations* a, float* x1) {
  if (IsMla(c)) return MlaSublayerForward(ctx, c, group, &shared->mla, p, x, &a->mla, x1);
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim;
  FP8MOE_RETURN_IF_ERROR(CheckGlobalParams(c, p, "parameters"));
  float* qkv = a->qkv.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, x, p.attn_norm.data_as<float>(), N, D,
                                        static_cast<float>(c.norm_eps), a->n1.data_as<float>(),
                                        a->inv1.data_as<float>()));
  float* projected = c.use_qk_norm ? shared->raw.data_as<float>() : qkv;
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, a->n1.data_as<float>(), p.wqkv.data_as<float>(), N, D,
                                QkvWidth(c), projected));
  if (c.use_qk_norm) FP8MOE_RETURN_IF_ERROR(QkNormForward(ctx, c, shared, p, a, qkv));
  FP8MOE_RETURN_IF_ERROR(RopeApply(ctx, qkv, B, S, H, Hkv, hd, shared->cos.data_as<float>(),
                                   shared->sin.data_as<float>(), /*inverse=*/false));
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
  if (IsMla(c)) {
    return MlaSublayerBackward(ctx, c, group, &shared->mla, p, x, a.mla, g, dx, dtmp);
  }
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim, HD = H * hd;
  FP8MOE_RETURN_IF_ERROR(CheckGlobalParams(c, *g, "gradients"));
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
  // The gradient of the projection's output: dqkv, or through the qk norms.
  const float* dprojected = dqkv;
  if (c.use_qk_norm) {
    FP8MOE_RETURN_IF_ERROR(QkNormBackward(ctx, c, shared, p, a, dqkv, g));
    dprojected = shared->raw.data_as<float>();
  }
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dprojected, p.wqkv.data_as<float>(), N, D,
                                  QkvWidth(c), dtmp));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.n1.data_as<float>(), dprojected, N, D,
                                  QkvWidth(c), g->wqkv.data_as<float>()));
  return RmsNormBackward(ctx, x, p.attn_norm.data_as<float>(), a.inv1.data_as<float>(), dtmp, N,
                         D, dx, g->attn_norm.data_as<float>());
}

}  // namespace fp8moe::internal
