// The checked entry points of the ops a model step runs besides the GMMs
// (kernels/backend.h has the registry; fp8moe/gmm.h the GMMs). Each
// validates its arguments once, asks the Context's backend whether it runs
// the op (else FailedPrecondition naming the op and the backend) and hands
// it over: one virtual call per op call. Data is f32, row-major.
#ifndef FP8MOE_KERNELS_OPS_H_
#define FP8MOE_KERNELS_OPS_H_

#include <cstdint>

#include "fp8moe/context.h"
#include "fp8moe/dtype.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"

namespace fp8moe::internal {

// out [n, d] = table [vocab, d] row tokens[i]; tokens [n] in [0, vocab).
Status EmbeddingGather(Context& ctx, const float* table, const int32_t* tokens, int64_t n,
                       int64_t vocab, int64_t d, float* out);
// dtable [vocab, d] = sum over i with tokens[i] = row of dout [n, d] row i,
// added in token order (overwritten: rows no token names are zero).
Status EmbeddingScatterAdd(Context& ctx, const float* dout, const int32_t* tokens, int64_t n,
                           int64_t vocab, int64_t d, float* dtable);
// out [n] = a [n] + b [n]; out may be a or b.
Status Add(Context& ctx, const float* a, const float* b, int64_t n, float* out);

// y [rows, d] = x * inv_rms * g, inv_rms[r] = 1 / sqrt(mean(x[r]^2) + eps)
// (sums in double, in order).
Status RmsNormForward(Context& ctx, const float* x, const float* g, int64_t rows, int64_t d,
                      float eps, float* y, float* inv_rms);
// dx [rows, d] += d/dx of sum(y * dy); dg [d] = sum over rows of dy * x * inv_rms
// (overwritten).
Status RmsNormBackward(Context& ctx, const float* x, const float* g, const float* inv_rms,
                       const float* dy, int64_t rows, int64_t d, float* dx, float* dg);

// Attention's rows [B*S, (H + 2 Hkv) hd] hold q | k | v: H = `heads` query
// heads, then Hkv = `kv_heads` key heads and Hkv value heads (grouped-query
// attention; Hkv = H is multi-head, Hkv = 1 multi-query). Query head h reads
// kv head h / (H / Hkv); Hkv >= 1 divides H (else InvalidArgument).

// Rotates the q and k heads of qkv in place: pairs (i, i + hd/2) of each
// head at position s by angle(s, i) of the tables cos, sin [S, hd/2];
// inverse rotates back (the backward of the rotation). v is not rotated.
// With rope_dim (-1: hd, which must then be even; any other negative is
// refused) only the last rope_dim columns of each q and k head rotate (MLA's
// rope part; rope_dim even, <= hd; hd itself may be odd), pairs (i, i +
// rope_dim/2) of them, or with `interleaved` pairs (2i, 2i + 1) (DeepSeek's
// layout), by angle(s, i) of tables [S, rope_dim/2]. vd (-1: hd): the
// value heads' width, as AttentionForward's.
Status RopeApply(Context& ctx, float* qkv, int64_t batch, int64_t seq, int64_t heads,
                 int64_t kv_heads, int64_t hd, const float* cos, const float* sin, bool inverse,
                 int64_t rope_dim = -1, bool interleaved = false, int64_t vd = -1);

// Causal softmax attention per (batch, query head) on qkv (q and k already
// rotated), scale 1/sqrt(hd): probs [B, H, S, S] (zero above the diagonal),
// out [B*S, H*vd]. vd (-1: hd) is the value heads' width (MLA's
// v_head_dim): qkv rows are then (H + Hkv) hd + Hkv vd wide, the v heads
// after the k heads. hd 0 with vd > 0 is refused (the scale would be NaN).
Status AttentionForward(Context& ctx, const float* qkv, int64_t batch, int64_t seq,
                        int64_t heads, int64_t kv_heads, int64_t hd, float* probs, float* out,
                        int64_t vd = -1);
// dqkv (qkv's shape, overwritten) from dout [B*S, H*vd]: dK and dV of a kv
// head are the sums over the query heads that share it, in head order.
Status AttentionBackward(Context& ctx, const float* qkv, const float* probs, const float* dout,
                         int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd,
                         float* dqkv, int64_t vd = -1);

// Copies `blocks` blocks of `width` columns per row between row buffers
// src [rows, src_cols] and dst [rows, dst_cols]: block b is src columns
// src_offset + b src_step + [0, width) and dst columns dst_offset + b
// dst_step + [0, width); accumulate: dst += the blocks in block order (a
// sum over blocks when dst_step is 0), else dst = them (dst_step 0 then
// needs blocks <= 1). src_step 0 reads one block into every dst block (a
// broadcast). Blocks lie inside their rows, dst blocks do not overlap one
// another (dst_step 0 or >= width), dst and src do not overlap. Exact: a
// copy, or sums in f32 in block order.
Status CopyColumns(Context& ctx, const float* src, int64_t rows, int64_t src_cols,
                   int64_t src_offset, int64_t src_step, int64_t blocks, int64_t width,
                   float* dst, int64_t dst_cols, int64_t dst_offset, int64_t dst_step,
                   bool accumulate);

// Mean over rows of -log softmax(logits[r])[target[r]]; logits [rows, v].
// With dlogits non-null: its gradient (softmax - onehot) / rows. A target
// outside [0, v) is an error.
Result<double> CrossEntropy(Context& ctx, const float* logits, const int32_t* targets,
                            int64_t rows, int64_t v, float* dlogits);

// One AdamW update of n elements in f32 (the constants as the optimizer
// rounds them, train/optimizer.cc): gi = g * grad_scale;
//   m = b1 m + (1 - b1) gi;  v = b2 v + (1 - b2) gi^2
//   p -= lr ((m c1) / (sqrt(v c2) + eps) + weight_decay p)
struct AdamWConstants {
  float b1, b2, c1, c2, eps, lr, grad_scale, weight_decay;
};
Status AdamW(Context& ctx, const AdamWConstants& k, const float* g, float* p, float* m,
             float* v, int64_t n);

// The MoE layer: routing and row permutation. Pair p = t*k + j is token t's
// j-th expert. A buffer holds the rows of the pairs whose expert runs here,
// sorted by expert; row_of_pair [pairs] maps a pair to its row (-1: none,
// its expert runs on another rank) and pair_of_row [rows] a row to its pair.
// One rank's maps cover every pair; an expert ring's its local experts'.
// The entry points check every map entry against its buffer.

// How RouteTopK scores, chooses and weighs the experts: the MoE flags
// routed_score_func, routed_bias, routed_scaling_factor, n_routing_groups,
// topk_routing_group and norm_topk_prob (include/fp8moe/moe_config.h). The
// default is the softmax routing every run had before these flags.
struct RouteScoring {
  bool sigmoid = false;         // score s_e = sigmoid(l_e); false: the logits
  bool norm_topk_prob = false;
  double scaling = 1.0;         // routed_scaling_factor: multiplies the weights
  // Group-limited routing (sigmoid only): the experts in `groups` groups of
  // E / groups (at least 2 each), the `topk_groups` groups of the largest
  // sum of their two largest choice scores kept. groups 0: off.
  int64_t groups = 0, topk_groups = 0;
  const float* bias = nullptr;  // [E] (sigmoid only) added to s for the choice, never the weights
};

// Per token t of logits [T, E] (1 <= k <= E): expert [T, k], slot j the
// expert of the j-th largest choice score, found by a scan in index order
// that moves only to a strictly larger score (ties go to the lower index; a
// NaN is chosen only as the first expert the scan sees). The choice score is
// the logit (softmax scoring) or sigmoid(l) + bias (sigmoid scoring; the
// sigmoid in double, exp(l)/(1+exp(l)) below 0 so small scores keep their
// digits); with groups only the experts of the kept groups are scanned (the
// groups chosen by the same scan over their scores, each the sum in double
// of the group's two largest choice scores).
// softmax [T, k]: softmax scoring, the softmax over the selected logits
// (exp(l - l_first) / sum); sigmoid scoring, the selected sigmoid scores
// (without the bias). probs [T, E]: the softmax over all logits (the
// load-balancing loss's, either scoring), in double, max: the scan's maximum.
// weight [T, k] f32, rounded once from double:
//   softmax: scaling * softmax_j (/ sum of the softmax with norm_topk_prob)
//   sigmoid: scaling * s_j (/ (sum of the k s + 1e-20) with norm_topk_prob)
Status RouteTopK(Context& ctx, const float* logits, int64_t tokens, int64_t experts, int64_t k,
                 const RouteScoring& scoring, int32_t* expert, float* weight, double* softmax,
                 double* probs);
// The pairs [pairs] of the experts [first, first + count), sorted stably by
// expert: group_sizes [count], row_of_pair [pairs] (-1 for another
// expert's pair), pair_of_row [pairs] (the first `rows` entries); next_row
// [count] is scratch. Returns rows, the pairs that got a row.
Result<int64_t> SortByExpert(Context& ctx, const int32_t* expert, int64_t pairs, int64_t first,
                             int64_t count, int32_t* group_sizes, int64_t* row_of_pair,
                             int64_t* pair_of_row, int64_t* next_row);
// out [rows, cols] (out_dtype) row i = src [tokens, cols] (src_dtype) row
// pair_of_row[i] / k, converted (F32 or BF16; BF16 rounds to nearest even).
Status PermuteRows(Context& ctx, const void* src, DType src_dtype, int64_t tokens, int64_t cols,
                   int64_t k, const int64_t* pair_of_row, int64_t rows, void* out,
                   DType out_dtype);
// y [tokens, cols] = sum over the slots j of token t that have a row of
// weight[t*k + j] * that row of buffer [rows, cols] (F32 or BF16), in f32,
// in slot order from +0.
Status CombineRows(Context& ctx, const void* buffer, DType dtype, int64_t rows, int64_t cols,
                   const int64_t* row_of_pair, const float* weight, int64_t tokens, int64_t k,
                   float* y);
// The combine's backward, for each pair p with a row: dbuffer's row (dtype)
// = weight[p] * dy [tokens, cols] row p / k, and dweight[p] = <dy row, buffer
// row> (summed in double, in order); dweight[p] = 0 for a pair without one.
Status CombineRowsBackward(Context& ctx, const float* dy, const void* buffer, DType dtype,
                           int64_t rows, int64_t cols, const int64_t* row_of_pair,
                           const float* weight, int64_t tokens, int64_t k, void* dbuffer,
                           float* dweight);
// dx [tokens, cols] (+)= sum over token t's slots with a row of dbuffer
// [rows, cols] f32 row, in slot order (accumulate false: from +0).
Status ScatterAddRows(Context& ctx, const float* dbuffer, int64_t rows, int64_t cols,
                      const int64_t* row_of_pair, int64_t tokens, int64_t k, bool accumulate,
                      float* dx);
// dlogits [tokens, experts] of the router, from RouteTopK's expert,
// softmax [tokens, k] and probs [tokens, experts] (made with the same
// scoring): the load-balancing loss lb_weight * E * sum_e fraction_e
// mean_t probs_te through probs, plus dweight [tokens, k] through the
// weights. With c = scoring.scaling and g = dweight:
//   softmax: c s_j sum_i s_i (g_j - g_i) / S (S: the softmax's sum with
//            norm_topk_prob, else 1), which does not cancel where the
//            softmax saturates;
//   sigmoid: s_j (1 - s_j) c (g_j 1e-20 / D + sum_i s_i (g_j - g_i) / D) / D
//            with D = sum s + 1e-20 under norm_topk_prob, else
//            s_j (1 - s_j) c g_j. The bias and the group choice have no
//            gradient (they only choose).
// In double, each row rounded to f32 once.
Status RouterBackward(Context& ctx, const int32_t* expert, const double* softmax,
                      const double* probs, const float* dweight, const double* fraction,
                      int64_t tokens, int64_t experts, int64_t k, const RouteScoring& scoring,
                      double lb_weight, float* dlogits);
// ---- Quantization (quant/ is the cpu implementation's code) ----
// The formulas, layouts and edge cases are fp8moe/quant.h's (scales from
// amax, saturating codes, NaN and Inf reaching only their scaling group);
// the arguments are checked as quant.h's functions check them. Every op is
// exact per element (a max, one division or multiplication, a table of
// decoded codes), so both backends give the same bits. None reads the
// Context's scratch or counters.

// QuantizeRows (quant.h): x [rows, cols] -> codes q [rows, cols] and scales
// [rows, NumBlocks(cols, block_size)]; rows >= valid_rows are tail rows: not
// read (x needs only valid_rows rows), code 0, scale 0.
Status QuantizeRows(Context& ctx, const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales);
// x [rows, cols] f32 = f32(q) * the scale of each element's row block;
// q [rows, cols], scales [rows, NumBlocks(cols, block_size)]. x may not
// overlap q or scales.
Status DequantizeRows(Context& ctx, const uint8_t* q, int64_t rows, int64_t cols,
                      int64_t block_size, const float* scales, QuantDType dtype, float* x);
// QuantizeChannels (quant.h): w [experts, k, n] -> codes q [experts, k, n]
// and scales [experts, n] (amax over k per expert and channel).
Status QuantizeChannels(Context& ctx, const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q, float* scales);
// out [experts, k, n] bf16 bits = bf16(f32(q) * scales[e, n]) (to nearest
// even): q [experts, k, n], scales [experts, n].
Status DequantizeChannelsToBf16(Context& ctx, const uint8_t* q, int64_t experts, int64_t k,
                                int64_t n, const float* scales, QuantDType dtype,
                                uint16_t* out);
// out [rows, cols] f32 = f32(x) * s, x [rows, cols] of x_dtype (f32 or bf16),
// with s per row (kRow: scale [rows]) or per column of the row's group
// (kGroupColumn: scale [groups, cols]). Group g owns rows [off_g, off_g +
// group_sizes[g]) (group_sizes [groups], no negative size, sum <= rows);
// rows past the sum are neither read nor written. out overlaps no input.
enum class ScaleBy : uint8_t { kRow, kGroupColumn };
Status ScaleToF32(Context& ctx, const void* x, DType x_dtype, int64_t rows, int64_t cols,
                  const int32_t* group_sizes, int64_t groups, ScaleBy by, const float* scale,
                  float* out);
// Of codes q [n] quantized from x [n]: those at the format's largest
// magnitude (QuantMax) and the zero codes of non-zero x. Integer counts:
// exact, for any thread count.
struct Fp8CodeCounts {
  int64_t saturated = 0, flushed = 0;
};
Result<Fp8CodeCounts> Fp8HealthCount(Context& ctx, const uint8_t* q, const float* x, int64_t n,
                                     QuantDType dtype);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_OPS_H_
