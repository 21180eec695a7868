// Routing of the MoE layer: top-k with softmax over the selected logits, the
// load-balancing loss, the stable sort of (token, slot) pairs by expert, and
// the gathers and scatters between token order and the ragged buffer.
// Internal to moe/; semantics in include/fp8moe/moe.h.
#ifndef FP8MOE_MOE_ROUTING_H_
#define FP8MOE_MOE_ROUTING_H_

#include <cstdint>
#include <vector>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"

namespace fp8moe::internal {

struct Routing {
  int64_t tokens = 0, experts = 0, k = 0;
  std::vector<int32_t> expert;       // [T, k] chosen experts, slot j = j-th largest
  std::vector<float> weight;         // [T, k] routing weights (norm_topk_prob applied)
  // In double, for the backward: where a softmax saturates its small values
  // keep their digits, and 1 - p is not lost to f32 rounding (issue 35).
  std::vector<double> softmax;       // [T, k] softmax over the k selected logits
  std::vector<double> probs;         // [T, E] softmax over all logits (aux loss)
  std::vector<int32_t> group_sizes;  // [E]
  std::vector<int64_t> row_of_pair;  // [T*k] buffer row of pair p = t*k + j
  std::vector<int64_t> pair_of_row;  // [T*k] inverse: pair of valid row i
  std::vector<int64_t> next_row;     // [E] scratch of the sort
};

// Every gather and scatter index is clamped into its buffer: a corrupt index
// can never read or write out of bounds.
int64_t Clamp(int64_t i, int64_t n);

// Row `row` of a [rows, cols] buffer of dtype F32 or BF16, as f32 into out;
// and v stored into that row. Both return at once for a zero-width row.
void RowToF32(const void* buffer, DType dtype, int64_t row, int64_t cols, float* out);
void StoreRow(const float* v, int64_t cols, void* buffer, DType dtype, int64_t row);

// logits [T, E] -> routing (top-k, weights, stable expert order) in *out;
// its vectors keep their capacity, so a routing reused step to step does not
// allocate.
void Route(const float* logits, int64_t tokens, int64_t experts, int64_t k,
           bool norm_topk_prob, Routing* out);
// The same into a fresh Routing (tests).
inline Routing Route(const float* logits, int64_t tokens, int64_t experts, int64_t k,
                     bool norm_topk_prob) {
  Routing r;
  Route(logits, tokens, experts, k, norm_topk_prob, &r);
  return r;
}

// f_e [E] of the load-balancing loss: routed pairs of expert e over all
// pairs. Of this batch when `batch` is null; else of the larger batch this
// one is a part of (FSDP): batch [E + 1] holds its pairs per expert and, last,
// its tokens.
void LoadFractions(const Routing& r, const int64_t* batch, std::vector<double>* f);

// The load-balancing loss weight * E * sum_e f_e p_e (p_e: this batch's mean
// probability).
double LoadBalanceLoss(const Routing& r, const std::vector<double>& f, double weight);

// dlogits [T, E] of the router: from dweight [T, k] (the loss's gradient
// with respect to the routing weights) and the load-balancing loss with
// fractions f. Computed in double from the double softmaxes, each token's
// row rounded to f32 once.
void RouterBackward(const Routing& r, const std::vector<double>& f, const float* dweight,
                    bool norm_topk_prob, double lb_weight, float* dlogits);

// buffer [rows, cols] (F32 or BF16): valid row i <- x[token of row i] (f32
// [T, cols]), converted. Tail rows untouched.
void GatherRows(const Routing& r, const float* x, int64_t cols, void* buffer,
                DType dtype);

// y [T, cols] f32 = sum over slots of weight * buffer row (F32 or BF16).
void CombineRows(const Routing& r, const void* buffer, DType dtype,
                 int64_t cols, float* y);

// The combine's backward: dbuffer row of (t, j) = weight[t, j] * dy[t]
// (F32 or BF16) and dweight[t, j] = <dy[t], buffer row of (t, j)>.
void CombineBackward(const Routing& r, const float* dy, const void* buffer,
                     DType dtype, int64_t cols, void* dbuffer, float* dweight);

// dx [T, cols] += sum over slots of dbuffer row (f32 [rows, cols]).
void ScatterAddRows(const Routing& r, const float* dbuffer, int64_t cols,
                    float* dx);

}  // namespace fp8moe::internal

#endif  // FP8MOE_MOE_ROUTING_H_
