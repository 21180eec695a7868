// Float64 twins of the model's pieces (plain loops, no threads), for tests:
// the fast f32 pieces are compared with them and their gradients with
// central finite differences of them.
#ifndef FP8MOE_MODEL_REFERENCE_LAYERS_REFERENCE_H_
#define FP8MOE_MODEL_REFERENCE_LAYERS_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "fp8moe/moe_config.h"

namespace fp8moe::reference {

// y [rows, d] = x / sqrt(mean(x^2) + eps) * g.
void RmsNorm(const double* x, const double* g, int64_t rows, int64_t d, double eps, double* y);

// qkv [B*S, (H + 2 Hkv) hd]: H query heads, then Hkv key heads and Hkv value
// heads; query head h reads kv head h / (H / Hkv) (grouped-query attention).

// Rotates the q and k heads of qkv in place (RoPE, pairs (i, i + hd/2),
// angle p / max_timescale^(2i/hd)).
void Rope(double* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd,
          double max_timescale);

// Causal softmax attention, scale 1/sqrt(hd): out [B*S, H*hd] from qkv.
void Attention(const double* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
               int64_t hd, double* out);

// Mean over rows of -log softmax(logits[r])[targets[r]].
double CrossEntropy(const double* logits, const int32_t* targets, int64_t rows, int64_t v);

// The MoE FFN of dtype=float32 in double: y [T, D]; returns the aux loss and
// appends the chosen experts of every token to *routing.
double MoeFfn(const double* x, int64_t tokens, int64_t d, const float* router, const float* wi,
              const float* wo, int64_t experts, int64_t k, int64_t f, const MoeConfig& moe,
              double lb_weight, double* y, std::vector<int32_t>* routing);

// A dense SwiGLU MLP in double, added to y: y [rows, d] += (silu(gate) * up)
// @ wo, gate | up = x [rows, d] @ wi [d, 2w] (columns [0, w) | [w, 2w)),
// wo [w, d]. The shared experts (w = S*F) and the dense layers' MLP.
void AddSwiGluMlp(const double* x, int64_t rows, int64_t d, const float* wi, const float* wo,
                  int64_t w, double* y);

}  // namespace fp8moe::reference

#endif  // FP8MOE_MODEL_REFERENCE_LAYERS_REFERENCE_H_
