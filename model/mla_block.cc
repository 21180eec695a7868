// Multi-head latent attention (model/mla_block.h).
#include "model/mla_block.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "model/layers.h"

namespace fp8moe::internal {

namespace {

// The sizes of a config's MLA.
struct Dims {
  int64_t B, S, N, D, H, ql, kvl, nope, r, vd, qk;
  explicit Dims(const ModelConfig& c)
      : B(c.batch), S(c.seq_len), N(c.batch * c.seq_len), D(c.emb_dim), H(c.num_heads),
        ql(c.q_lora_rank), kvl(c.kv_lora_rank), nope(c.qk_nope_head_dim),
        r(c.qk_rope_head_dim), vd(c.v_head_dim), qk(c.qk_nope_head_dim + c.qk_rope_head_dim) {}
  int64_t qkv() const { return 2 * H * qk + H * vd; }  // the fused q | k | v width
  int64_t kv_a() const { return kvl + r; }         // latent | k_rope
  int64_t kv_b() const { return H * (nope + vd); }  // per head k_nope | v
};

// shared->q [N, H qk] = the q projection of a->n1.
Status QueryForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                    MlaShared* s, const LayerParams& p, MlaActivations* a) {
  const Dims d(c);
  const float* n1 = a->n1.data_as<float>();
  float* q = s->q.data_as<float>();
  if (d.ql == 0) return Linear(ctx, group, n1, p.wq.data_as<float>(), d.N, d.D, d.H * d.qk, q);
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, n1, p.wq_a.data_as<float>(), d.N, d.D, d.ql,
                                a->q_a.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, a->q_a.data_as<float>(),
                                        p.q_a_norm.data_as<float>(), d.N, d.ql,
                                        static_cast<float>(c.norm_eps), a->q_a_n.data_as<float>(),
                                        a->q_a_inv.data_as<float>()));
  return Linear(ctx, group, a->q_a_n.data_as<float>(), p.wq_b.data_as<float>(), d.N, d.ql,
                d.H * d.qk, q);
}

// a->qkv [N, 2 H qk + H vd] = q | k | v heads from shared->q, kv_a and
// kv_b: key head h is k_nope_h | k_rope, value head h v_h.
Status AssembleHeads(Context& ctx, const Dims& d, MlaShared* s, MlaActivations* a) {
  float* qkv = a->qkv.data_as<float>();
  const int64_t W = d.qkv(), Hqk = d.H * d.qk;
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, s->q.data_as<float>(), d.N, Hqk, 0, 0, 1, Hqk, qkv, W,
                                     0, 0, false));
  const float* kv_b = s->kv_b.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, kv_b, d.N, d.kv_b(), 0, d.nope + d.vd, d.H, d.nope, qkv,
                                     W, Hqk, d.qk, false));
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, s->kv_a.data_as<float>(), d.N, d.kv_a(), d.kvl, 0, d.H,
                                     d.r, qkv, W, Hqk + d.nope, d.qk, false));
  return CopyColumns(ctx, kv_b, d.N, d.kv_b(), d.nope, d.nope + d.vd, d.H, d.vd, qkv, W, 2 * Hqk,
                     d.vd, false);
}

// The backward of AssembleHeads: shared->q, kv_b and kv_a's k_rope columns
// = the gradients of what AssembleHeads read, from shared->dqkv (k_rope's:
// the sum over the heads, in head order).
Status AssembleHeadsBackward(Context& ctx, const Dims& d, MlaShared* s) {
  const float* dqkv = s->dqkv.data_as<float>();
  const int64_t W = d.qkv(), Hqk = d.H * d.qk;
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, dqkv, d.N, W, 0, 0, 1, Hqk, s->q.data_as<float>(), Hqk,
                                     0, 0, false));
  float* dkv_b = s->kv_b.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, dqkv, d.N, W, Hqk, d.qk, d.H, d.nope, dkv_b, d.kv_b(), 0,
                                     d.nope + d.vd, false));
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, dqkv, d.N, W, 2 * Hqk, d.vd, d.H, d.vd, dkv_b, d.kv_b(),
                                     d.nope, d.nope + d.vd, false));
  float* dkv_a = s->kv_a.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, dqkv, d.N, W, Hqk + d.nope, 0, 1, d.r, dkv_a, d.kv_a(),
                                     d.kvl, 0, false));
  return CopyColumns(ctx, dqkv, d.N, W, Hqk + d.qk + d.nope, d.qk, d.H - 1, d.r, dkv_a, d.kv_a(),
                     d.kvl, 0, true);
}

// The q path's backward from shared->q (the gradient of q): shared->dn1
// [N, D] = its part of the gradient of n1; g's wq, or wq_a, q_a_norm and
// wq_b, overwritten.
Status QueryBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                     MlaShared* s, const LayerParams& p, const MlaActivations& a,
                     LayerParams* g) {
  const Dims d(c);
  const float* n1 = a.n1.data_as<float>();
  const float* dq = s->q.data_as<float>();
  float* dn1 = s->dn1.data_as<float>();
  if (d.ql == 0) {
    FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dq, p.wq.data_as<float>(), d.N, d.D, d.H * d.qk,
                                    dn1));
    return LinearDw(ctx, group, n1, dq, d.N, d.D, d.H * d.qk, g->wq.data_as<float>());
  }
  float* dq_a_n = s->dq_a_n.data_as<float>();
  float* dq_a = s->dq_a.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dq, p.wq_b.data_as<float>(), d.N, d.ql, d.H * d.qk,
                                  dq_a_n));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.q_a_n.data_as<float>(), dq, d.N, d.ql, d.H * d.qk,
                                  g->wq_b.data_as<float>()));
  std::fill(dq_a, dq_a + d.N * d.ql, 0.0f);  // RmsNormBackward adds to dx
  FP8MOE_RETURN_IF_ERROR(RmsNormBackward(ctx, a.q_a.data_as<float>(), p.q_a_norm.data_as<float>(),
                                         a.q_a_inv.data_as<float>(), dq_a_n, d.N, d.ql, dq_a,
                                         g->q_a_norm.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dq_a, p.wq_a.data_as<float>(), d.N, d.D, d.ql, dn1));
  return LinearDw(ctx, group, n1, dq_a, d.N, d.D, d.ql, g->wq_a.data_as<float>());
}

// The kv path's backward from shared->kv_b (the gradient of kv_b) and
// kv_a's k_rope columns: dn1 [N, D] = its part of the gradient of n1; g's
// wkv_b, kv_a_norm and wkv_a overwritten.
Status KeyValueBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                        MlaShared* s, const LayerParams& p, const MlaActivations& a,
                        LayerParams* g, float* dn1) {
  const Dims d(c);
  const float* dkv_b = s->kv_b.data_as<float>();
  float* dkv_a = s->kv_a.data_as<float>();
  float* dlatent = s->dlatent.data_as<float>();
  float* dlatent_in = s->dlatent_in.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dkv_b, p.wkv_b.data_as<float>(), d.N, d.kvl,
                                  d.kv_b(), dlatent));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.latent_n.data_as<float>(), dkv_b, d.N, d.kvl,
                                  d.kv_b(), g->wkv_b.data_as<float>()));
  std::fill(dlatent_in, dlatent_in + d.N * d.kvl, 0.0f);  // RmsNormBackward adds to dx
  FP8MOE_RETURN_IF_ERROR(RmsNormBackward(ctx, a.latent.data_as<float>(),
                                         p.kv_a_norm.data_as<float>(),
                                         a.latent_inv.data_as<float>(), dlatent, d.N, d.kvl,
                                         dlatent_in, g->kv_a_norm.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, dlatent_in, d.N, d.kvl, 0, 0, 1, d.kvl, dkv_a, d.kv_a(),
                                     0, 0, false));
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dkv_a, p.wkv_a.data_as<float>(), d.N, d.D,
                                  d.kv_a(), dn1));
  return LinearDw(ctx, group, a.n1.data_as<float>(), dkv_a, d.N, d.D, d.kv_a(),
                  g->wkv_a.data_as<float>());
}

// InvalidArgument unless p holds the MLA tensors of c (ParamShapes): weights
// of another attention layout would be read out of bounds.
Status CheckMlaParams(const ModelConfig& c, const LayerParams& p, const char* what) {
  const Dims d(c);
  const std::pair<const Tensor*, Shape> want[] = {
      {&p.wkv_a, {d.D, d.kv_a()}},         {&p.kv_a_norm, {d.kvl}},
      {&p.wkv_b, {d.kvl, d.kv_b()}},       {&p.wo_attn, {d.H * d.vd, d.D}},
      {d.ql > 0 ? &p.wq_b : &p.wq, d.ql > 0 ? Shape{d.ql, d.H * d.qk} : Shape{d.D, d.H * d.qk}},
      {&p.wq_a, d.ql > 0 ? Shape{d.D, d.ql} : Shape{}},
      {&p.q_a_norm, d.ql > 0 ? Shape{d.ql} : Shape{}}};
  for (const auto& [t, shape] : want) {
    if (shape.empty() || t->shape() == shape) continue;
    return InvalidArgument(std::string("the ") + what + " do not hold attention_type=mla's " +
                           "tensors of this config (a tensor is " + ShapeToString(t->shape()) +
                           ", not " + ShapeToString(shape) +
                           "); allocate them with AllocateParams of this config");
  }
  return OkStatus();
}

}  // namespace

Status AllocateMla(const ModelConfig& c, MlaShared* s) {
  const Dims d(c);
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->cos, {d.S, d.r / 2}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->sin, {d.S, d.r / 2}));
  RopeTables(d.S, d.r, c.rope_max_timescale, s->cos.data_as<float>(), s->sin.data_as<float>());
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->q, {d.N, d.H * d.qk}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->kv_a, {d.N, d.kv_a()}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->kv_b, {d.N, d.kv_b()}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dqkv, {d.N, d.qkv()}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dattn, {d.N, d.H * d.vd}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dlatent, {d.N, d.kvl}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dlatent_in, {d.N, d.kvl}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dq_a_n, {d.N, d.ql}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&s->dq_a, {d.N, d.ql}));
  return CreateZeroed(&s->dn1, {d.N, d.D});
}

Status AllocateMla(const ModelConfig& c, MlaActivations* a) {
  const Dims d(c);
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->n1, {d.N, d.D}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->inv1, {d.N}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->q_a, {d.N, d.ql}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->q_a_inv, {d.ql > 0 ? d.N : 0}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->q_a_n, {d.N, d.ql}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->latent, {d.N, d.kvl}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->latent_inv, {d.N}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->latent_n, {d.N, d.kvl}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->qkv, {d.N, d.qkv()}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&a->probs, {d.B, d.H, d.S, d.S}));
  return CreateZeroed(&a->attn, {d.N, d.H * d.vd});
}

Status MlaSublayerForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                          MlaShared* s, const LayerParams& p, const float* x, MlaActivations* a,
                          float* x1) {
  const Dims d(c);
  FP8MOE_RETURN_IF_ERROR(CheckMlaParams(c, p, "parameters"));
  const float eps = static_cast<float>(c.norm_eps);
  float* n1 = a->n1.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, x, p.attn_norm.data_as<float>(), d.N, d.D, eps, n1,
                                        a->inv1.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(QueryForward(ctx, c, group, s, p, a));
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, n1, p.wkv_a.data_as<float>(), d.N, d.D, d.kv_a(),
                                s->kv_a.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(CopyColumns(ctx, s->kv_a.data_as<float>(), d.N, d.kv_a(), 0, 0, 1, d.kvl,
                                     a->latent.data_as<float>(), d.kvl, 0, 0, false));
  FP8MOE_RETURN_IF_ERROR(RmsNormForward(ctx, a->latent.data_as<float>(),
                                        p.kv_a_norm.data_as<float>(), d.N, d.kvl, eps,
                                        a->latent_n.data_as<float>(),
                                        a->latent_inv.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, a->latent_n.data_as<float>(),
                                p.wkv_b.data_as<float>(), d.N, d.kvl, d.kv_b(),
                                s->kv_b.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(AssembleHeads(ctx, d, s, a));
  float* qkv = a->qkv.data_as<float>();
  FP8MOE_RETURN_IF_ERROR(RopeApply(ctx, qkv, d.B, d.S, d.H, d.H, d.qk, s->cos.data_as<float>(),
                                   s->sin.data_as<float>(), /*inverse=*/false, d.r,
                                   c.rope_interleave, d.vd));
  FP8MOE_RETURN_IF_ERROR(AttentionForward(ctx, qkv, d.B, d.S, d.H, d.H, d.qk,
                                          a->probs.data_as<float>(), a->attn.data_as<float>(),
                                          d.vd));
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, a->attn.data_as<float>(), p.wo_attn.data_as<float>(),
                                d.N, d.H * d.vd, d.D, x1));
  return Add(ctx, x1, x, d.N * d.D, x1);
}

Status MlaSublayerBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                           MlaShared* s, const LayerParams& p, const float* x,
                           const MlaActivations& a, LayerParams* g, float* dx, float* dtmp) {
  const Dims d(c);
  FP8MOE_RETURN_IF_ERROR(CheckMlaParams(c, *g, "gradients"));
  const int64_t HV = d.H * d.vd;
  float* dattn = s->dattn.data_as<float>();
  // Output projection: dx is the gradient of x1 (and, through the residual,
  // already of x).
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dx, p.wo_attn.data_as<float>(), d.N, HV, d.D,
                                  dattn));
  FP8MOE_RETURN_IF_ERROR(LinearDw(ctx, group, a.attn.data_as<float>(), dx, d.N, HV, d.D,
                                  g->wo_attn.data_as<float>()));
  FP8MOE_RETURN_IF_ERROR(AttentionBackward(ctx, a.qkv.data_as<float>(), a.probs.data_as<float>(),
                                           dattn, d.B, d.S, d.H, d.H, d.qk,
                                           s->dqkv.data_as<float>(), d.vd));
  FP8MOE_RETURN_IF_ERROR(RopeApply(ctx, s->dqkv.data_as<float>(), d.B, d.S, d.H, d.H, d.qk,
                                   s->cos.data_as<float>(), s->sin.data_as<float>(),
                                   /*inverse=*/true, d.r, c.rope_interleave, d.vd));
  FP8MOE_RETURN_IF_ERROR(AssembleHeadsBackward(ctx, d, s));
  FP8MOE_RETURN_IF_ERROR(KeyValueBackward(ctx, c, group, s, p, a, g, dtmp));
  FP8MOE_RETURN_IF_ERROR(QueryBackward(ctx, c, group, s, p, a, g));
  FP8MOE_RETURN_IF_ERROR(Add(ctx, dtmp, s->dn1.data_as<float>(), d.N * d.D, dtmp));
  return RmsNormBackward(ctx, x, p.attn_norm.data_as<float>(), a.inv1.data_as<float>(), dtmp,
                         d.N, d.D, dx, g->attn_norm.data_as<float>());
}

}  // namespace fp8moe::internal
