// The output projection (model/logits_block.h).
#include "model/logits_block.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "model/layers.h"

namespace fp8moe::internal {

namespace {

bool Normalized(const ModelConfig& c) {
  return c.logits_via_embedding && c.normalize_embedding_logits;
}

// Parameters (or gradients) made for the config: an lm_head exactly where
// the logits are not tied.
Status HasLmHead(const ModelConfig& c, const ModelParams& p, const char* what) {
  if (p.has_lm_head != c.logits_via_embedding) return OkStatus();
  return InvalidArgument(std::string("the ") + what + (p.has_lm_head ? " hold" : " lack") +
                         " an lm_head but the config has logits_via_embedding=" +
                         (c.logits_via_embedding ? "true" : "false") +
                         "; allocate them with AllocateParams of this config");
}

}  // namespace

Status AllocateLogits(const ModelConfig& c, LogitsBuffers* b) {
  if (!c.logits_via_embedding) return OkStatus();
  const int64_t N = c.batch * c.seq_len, V = c.vocab_size, D = c.emb_dim;
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&b->dembed, {V, D}));
  if (!Normalized(c)) return OkStatus();
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&b->raw, {N, V}));
  FP8MOE_RETURN_IF_ERROR(CreateZeroed(&b->row_scale, {N}));
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  float* r = b->row_scale.data_as<float>();
  for (int64_t i = 0; i < N; ++i) r[i] = s;
  return OkStatus();
}

Status LogitsForward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                     const ModelParams& p, const float* nf, LogitsBuffers* b, float* logits) {
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, V = c.vocab_size;
  FP8MOE_RETURN_IF_ERROR(HasLmHead(c, p, "parameters"));
  if (!c.logits_via_embedding) {
    return Linear(ctx, group, nf, p.lm_head.data_as<float>(), N, D, V, logits);
  }
  // nf @ embed^T: the dLHS GEMM of a [V, D] weight ([m, k] = [N, V] from
  // [N, D] @ [V, D]^T).
  const float* embed = p.embed.data_as<float>();
  if (!Normalized(c)) return LinearDx(ctx, group, nf, embed, N, V, D, logits);
  FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, nf, embed, N, V, D, b->raw.data_as<float>()));
  return ScaleToF32(ctx, b->raw.data_as<float>(), DType::kF32, N, V, group.as<int32_t>(), 1,
                    ScaleBy::kRow, b->row_scale.data_as<float>(), logits);
}

Status LogitsBackward(Context& ctx, const ModelConfig& c, const ConstTensorView& group,
                      const ModelParams& p, const float* nf, const float* dlogits,
                      LogitsBuffers* b, float* dnf, ModelParams* g) {
  const int64_t N = c.batch * c.seq_len, D = c.emb_dim, V = c.vocab_size;
  FP8MOE_RETURN_IF_ERROR(HasLmHead(c, *g, "gradients"));
  if (!c.logits_via_embedding) {
    FP8MOE_RETURN_IF_ERROR(LinearDx(ctx, group, dlogits, p.lm_head.data_as<float>(), N, D, V, dnf));
    return LinearDw(ctx, group, nf, dlogits, N, D, V, g->lm_head.data_as<float>());
  }
  const float* d = dlogits;
  if (Normalized(c)) {  // the gradient of the raw logits: dlogits / sqrt(D)
    FP8MOE_RETURN_IF_ERROR(ScaleToF32(ctx, dlogits, DType::kF32, N, V, group.as<int32_t>(), 1,
                                      ScaleBy::kRow, b->row_scale.data_as<float>(),
                                      b->raw.data_as<float>()));
    d = b->raw.data_as<float>();
  }
  // raw [N, V] = nf @ embed^T: dnf = d @ embed, dembed = d^T @ nf.
  FP8MOE_RETURN_IF_ERROR(Linear(ctx, group, d, p.embed.data_as<float>(), N, V, D, dnf));
  return LinearDw(ctx, group, d, nf, N, V, D, b->dembed.data_as<float>());
}

Status AddTiedEmbeddingGradient(Context& ctx, const ModelConfig& c, const LogitsBuffers& b,
                                float* dembed) {
  if (!c.logits_via_embedding) return OkStatus();
  return Add(ctx, dembed, b.dembed.data_as<float>(), c.vocab_size * c.emb_dim, dembed);
}

}  // namespace fp8moe::internal
