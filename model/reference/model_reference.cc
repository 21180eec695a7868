// Float64 reference of the model and its pieces (plain loops).
#include <algorithm>
#include <cmath>
#include <vector>

#include "fp8moe/model.h"
#include "model/reference/layers_reference.h"
#include "moe/reference/routing_reference.h"

namespace fp8moe::reference {

void RmsNorm(const double* x, const double* g, int64_t rows, int64_t d, double eps, double* y) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[r * d + i] * x[r * d + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = x[r * d + i] * inv * g[i];
  }
}

void Rope(double* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd,
          double max_timescale) {
  const int64_t half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  for (int64_t r = 0; r < batch * seq; ++r) {
    const double p = static_cast<double>(r % seq);
    for (int64_t h = 0; h < heads + kv_heads; ++h) {  // the q heads, then the k heads
      double* v = qkv + r * width + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double angle =
            p / std::pow(max_timescale, 2.0 * static_cast<double>(i) / static_cast<double>(hd));
        const double a = v[i], b = v[i + half];
        v[i] = a * std::cos(angle) - b * std::sin(angle);
        v[i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
  }
}

void Attention(const double* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
               int64_t hd, double* out) {
  const int64_t width = (heads + 2 * kv_heads) * hd, hw = heads * hd, group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> s(static_cast<size_t>(seq));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kcol = hw + (h / group) * hd, vcol = kcol + kv_heads * hd;
      for (int64_t i = 0; i < seq; ++i) {
        const double* q = qkv + (b * seq + i) * width + h * hd;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k = qkv + (b * seq + j) * width + kcol;
          double dot = 0;
          for (int64_t t = 0; t < hd; ++t) dot += q[t] * k[t];
          s[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[static_cast<size_t>(j)] - mx);
        double* o = out + (b * seq + i) * hw + h * hd;
        for (int64_t t = 0; t < hd; ++t) o[t] = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(s[static_cast<size_t>(j)] - mx) / sum;
          const double* v = qkv + (b * seq + j) * width + vcol;
          for (int64_t t = 0; t < hd; ++t) o[t] += p * v[t];
        }
      }
    }
  }
}

double CrossEntropy(const double* logits, const int32_t* targets, int64_t rows, int64_t v) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* l = logits + r * v;
    double mx = l[0];
    for (int64_t i = 1; i < v; ++i) mx = std::max(mx, l[i]);
    double sum = 0;
    for (int64_t i = 0; i < v; ++i) sum += std::exp(l[i] - mx);
    total += mx + std::log(sum) - l[targets[r]];
  }
  return total / static_cast<double>(rows);
}

// bias [E] (routed_bias's router_bias) or null: the choice bias.
double MoeFfn(const double* x, int64_t tokens, int64_t d, const float* router,
              const float* bias, const float* wi, const float* wo, int64_t experts, int64_t k,
              int64_t f, const MoeConfig& moe, double lb_weight, double* y,
              std::vector<int32_t>* routing) {
  std::vector<double> logits(static_cast<size_t>(experts)), h(static_cast<size_t>(2 * f)),
      a(static_cast<size_t>(f)), p_mean(static_cast<size_t>(experts), 0.0);
  std::vector<int64_t> count(static_cast<size_t>(experts), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const double* xt = x + t * d;
    for (int64_t e = 0; e < experts; ++e) {
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += xt[i] * router[i * experts + e];
      logits[static_cast<size_t>(e)] = s;
    }
    // Softmax over all experts (aux loss).
    const double mx = *std::max_element(logits.begin(), logits.end());
    double all = 0;
    for (double l : logits) all += std::exp(l - mx);
    for (int64_t e = 0; e < experts; ++e) {
      p_mean[static_cast<size_t>(e)] += std::exp(logits[static_cast<size_t>(e)] - mx) / all;
    }
    // Top-k and weights: the MoE reference's routing (routing_reference.h).
    const TokenRoute route = RouteToken(moe, logits.data(), bias, experts);
    const std::vector<int64_t>& chosen = route.expert;
    const std::vector<double>& w = route.weight;
    for (int64_t e : chosen) {
      routing->push_back(static_cast<int32_t>(e));
      ++count[static_cast<size_t>(e)];
    }
    double* yt = y + t * d;
    for (int64_t i = 0; i < d; ++i) yt[i] = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = chosen[static_cast<size_t>(j)];
      const float* wie = wi + e * d * 2 * f;
      const float* woe = wo + e * f * d;
      for (int64_t n = 0; n < 2 * f; ++n) {
        double s = 0;
        for (int64_t i = 0; i < d; ++i) s += xt[i] * wie[i * 2 * f + n];
        h[static_cast<size_t>(n)] = s;
      }
      for (int64_t n = 0; n < f; ++n) {
        const double g = h[static_cast<size_t>(n)];
        a[static_cast<size_t>(n)] = g / (1.0 + std::exp(-g)) * h[static_cast<size_t>(f + n)];
      }
      for (int64_t i = 0; i < d; ++i) {
        double s = 0;
        for (int64_t n = 0; n < f; ++n) s += a[static_cast<size_t>(n)] * woe[n * d + i];
        yt[i] += w[static_cast<size_t>(j)] * s;
      }
    }
  }
  double aux = 0;
  for (int64_t e = 0; e < experts; ++e) {
    aux += static_cast<double>(count[static_cast<size_t>(e)]) / static_cast<double>(tokens * k) *
           (p_mean[static_cast<size_t>(e)] / static_cast<double>(tokens));
  }
  return lb_weight * static_cast<double>(experts) * aux;
}

void AddSwiGluMlp(const double* x, int64_t rows, int64_t d, const float* wi, const float* wo,
                  int64_t w, double* y) {
  std::vector<double> a(static_cast<size_t>(w));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < w; ++n) {
      double g = 0, u = 0;
      for (int64_t i = 0; i < d; ++i) {
        g += x[r * d + i] * wi[i * 2 * w + n];
        u += x[r * d + i] * wi[i * 2 * w + w + n];
      }
      a[static_cast<size_t>(n)] = g / (1.0 + std::exp(-g)) * u;
    }
    for (int64_t i = 0; i < d; ++i) {
      double s = 0;
      for (int64_t n = 0; n < w; ++n) s += a[static_cast<size_t>(n)] * wo[n * d + i];
      y[r * d + i] += s;
    }
  }
}

namespace {
std::vector<double> ToDouble(const Tensor& t) {
  const float* d = t.data_as<float>();
  return std::vector<double>(d, d + t.num_elements());
}

// out [m, n] = x [m, k] @ w [k, n] (w f32).
void MatMul(const double* x, const float* w, int64_t m, int64_t k, int64_t n, double* out) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double s = 0;
      for (int64_t i = 0; i < k; ++i) s += x[r * k + i] * w[i * n + c];
      out[r * n + c] = s;
    }
  }
}
// The global attention sublayer (model/attention_block.h) in double: proj
// [N, D] from n [N, D]; qkv [N, (H + 2 Hkv) hd] and attn [N, H hd] scratch.
void GlobalAttention(const ModelConfig& c, const LayerParams& P, const double* n, double* qkv,
                     double* attn, double* proj) {
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim, HD = H * hd, QKV = (H + 2 * Hkv) * hd;
  MatMul(n, P.wqkv.data_as<float>(), N, D, QKV, qkv);
  if (c.use_qk_norm) {  // every q head with q_norm, every k head with k_norm, in place
    const std::vector<double> gq = ToDouble(P.q_norm), gk = ToDouble(P.k_norm);
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t h = 0; h < H + Hkv; ++h) {
        double* head = qkv + r * QKV + h * hd;
        RmsNorm(head, h < H ? gq.data() : gk.data(), 1, hd, c.norm_eps, head);
      }
    }
  }
  Rope(qkv, B, S, H, Hkv, hd, c.rope_max_timescale);
  Attention(qkv, B, S, H, Hkv, hd, attn);
  MatMul(attn, P.wo_attn.data_as<float>(), N, HD, D, proj);
}

// Multi-head latent attention (model/mla_block.h) in double: proj [N, D] =
// the sublayer's output before the residual, from n [N, D] (the normed
// input). Written from the formulas, not from the fast path's fused buffer:
// the per-head keys k_nope_h | k_rope and values v_h are read in place.
void MlaAttention(const ModelConfig& c, const LayerParams& P, const double* n, double* proj) {
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                ql = c.q_lora_rank, kvl = c.kv_lora_rank, nope = c.qk_nope_head_dim,
                r = c.qk_rope_head_dim, vd = c.v_head_dim, qk = nope + r, KB = nope + vd;
  std::vector<double> q(static_cast<size_t>(N * H * qk)), kv_a(static_cast<size_t>(N * (kvl + r))),
      latent(static_cast<size_t>(N * kvl)), kv_b(static_cast<size_t>(N * H * KB));
  if (ql == 0) {
    MatMul(n, P.wq.data_as<float>(), N, D, H * qk, q.data());
  } else {
    std::vector<double> qa(static_cast<size_t>(N * ql));
    MatMul(n, P.wq_a.data_as<float>(), N, D, ql, qa.data());
    RmsNorm(qa.data(), ToDouble(P.q_a_norm).data(), N, ql, c.norm_eps, qa.data());
    MatMul(qa.data(), P.wq_b.data_as<float>(), N, ql, H * qk, q.data());
  }
  MatMul(n, P.wkv_a.data_as<float>(), N, D, kvl + r, kv_a.data());
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t i = 0; i < kvl; ++i) latent[t * kvl + i] = kv_a[t * (kvl + r) + i];
  }
  RmsNorm(latent.data(), ToDouble(P.kv_a_norm).data(), N, kvl, c.norm_eps, latent.data());
  MatMul(latent.data(), P.wkv_b.data_as<float>(), N, kvl, H * KB, kv_b.data());
  // RoPE of one rope part v [r] at position p: pair i is (2i, 2i+1)
  // interleaved, else (i, i + r/2); angle p / timescale^(2i / r).
  auto rotate = [&](double* v, int64_t p) {
    for (int64_t i = 0; i < r / 2; ++i) {
      const double angle = static_cast<double>(p) /
                           std::pow(c.rope_max_timescale, 2.0 * static_cast<double>(i) /
                                                              static_cast<double>(r));
      double& a = v[c.rope_interleave ? 2 * i : i];
      double& b = v[c.rope_interleave ? 2 * i + 1 : i + r / 2];
      const double a0 = a, b0 = b;
      a = a0 * std::cos(angle) - b0 * std::sin(angle);
      b = b0 * std::cos(angle) + a0 * std::sin(angle);
    }
  };
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t h = 0; h < H; ++h) rotate(&q[(t * H + h) * qk + nope], t % S);
    rotate(&kv_a[t * (kvl + r) + kvl], t % S);  // the one k_rope of every head
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  std::vector<double> attn(static_cast<size_t>(N * H * vd), 0.0), s(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < S; ++i) {
        const double* qi = &q[((b * S + i) * H + h) * qk];
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* k_nope = &kv_b[((b * S + j) * H + h) * KB];
          const double* k_rope = &kv_a[(b * S + j) * (kvl + r) + kvl];
          double dot = 0;
          for (int64_t t = 0; t < nope; ++t) dot += qi[t] * k_nope[t];
          for (int64_t t = 0; t < r; ++t) dot += qi[nope + t] * k_rope[t];
          s[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[static_cast<size_t>(j)] - mx);
        double* o = &attn[((b * S + i) * H + h) * vd];
        for (int64_t j = 0; j <= i; ++j) {
          const double w = std::exp(s[static_cast<size_t>(j)] - mx) / sum;
          const double* v = &kv_b[((b * S + j) * H + h) * KB + nope];
          for (int64_t t = 0; t < vd; ++t) o[t] += w * v[t];
        }
      }
    }
  }
  MatMul(attn.data(), P.wo_attn.data_as<float>(), N, H * vd, D, proj);
}

}  // namespace

Result<double> ModelLoss(const ModelConfig& c, const ModelParams& params, const int32_t* inputs,
                         const int32_t* targets, std::vector<int32_t>* routing) {
  FP8MOE_RETURN_IF_ERROR(ValidateModelConfig(c));
  const int64_t B = c.batch, S = c.seq_len, N = B * S, D = c.emb_dim, H = c.num_heads,
                Hkv = KvHeads(c), hd = c.head_dim, HD = H * hd, QKV = (H + 2 * Hkv) * hd,
                V = c.vocab_size, F = c.mlp_dim;
  std::vector<int32_t> local;
  std::vector<int32_t>* route = routing != nullptr ? routing : &local;
  route->clear();
  std::vector<double> x(static_cast<size_t>(N * D)), n(static_cast<size_t>(N * D)),
      qkv(static_cast<size_t>(N * QKV)), attn(static_cast<size_t>(N * HD)),
      proj(static_cast<size_t>(N * D)), y(static_cast<size_t>(N * D));
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t i = 0; i < D; ++i) x[static_cast<size_t>(t * D + i)] = params.embed.data_as<float>()[inputs[t] * D + i];
  }
  double aux = 0;
  for (const LayerParams& P : params.layers) {
    RmsNorm(x.data(), ToDouble(P.attn_norm).data(), N, D, c.norm_eps, n.data());
    if (IsMla(c)) {
      MlaAttention(c, P, n.data(), proj.data());
    } else {
      GlobalAttention(c, P, n.data(), qkv.data(), attn.data(), proj.data());
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    RmsNorm(x.data(), ToDouble(P.mlp_norm).data(), N, D, c.norm_eps, n.data());
    if (P.dense) {  // first_num_dense_layers: the dense MLP instead of MoE
      std::fill(y.begin(), y.end(), 0.0);
      AddSwiGluMlp(n.data(), N, D, P.mlp_wi.data_as<float>(), P.mlp_wo.data_as<float>(),
                   c.base_mlp_dim, y.data());
      for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
      continue;
    }
    const float* bias = params.has_router_bias ? P.router_bias.data_as<float>() : nullptr;
    aux += MoeFfn(n.data(), N, D, P.router.data_as<float>(), bias, P.wi.data_as<float>(),
                  P.wo.data_as<float>(), c.moe.num_experts, c.moe.num_experts_per_tok, F,
                  c.moe, c.moe.load_balance_loss_weight, y.data(), route);
    if (P.shared) {
      AddSwiGluMlp(n.data(), N, D, P.shared_wi.data_as<float>(), P.shared_wo.data_as<float>(),
                   c.shared_experts * F, y.data());
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }
  RmsNorm(x.data(), ToDouble(params.final_norm).data(), N, D, c.norm_eps, n.data());
  std::vector<double> logits(static_cast<size_t>(N * V));
  if (c.logits_via_embedding) {  // tied: n @ embed^T, / sqrt(D) where normalized
    const double scale = c.normalize_embedding_logits ? std::sqrt(static_cast<double>(D)) : 1.0;
    const float* e = params.embed.data_as<float>();
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t v = 0; v < V; ++v) {
        double s = 0;
        for (int64_t i = 0; i < D; ++i) s += n[static_cast<size_t>(r * D + i)] * e[v * D + i];
        logits[static_cast<size_t>(r * V + v)] = s / scale;
      }
    }
  } else {
    MatMul(n.data(), params.lm_head.data_as<float>(), N, D, V, logits.data());
  }
  return CrossEntropy(logits.data(), targets, N, V) + aux;
}

}  // namespace fp8moe::reference
