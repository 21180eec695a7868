// The seam between the layers and the implementations of every op a model
// step runs (docs/design.md 7.2; ggml's backend interface is the model: one
// registry of ops, each with a reference and a fast implementation). The
// layers call the checked entry points of kernels/ops.h (the GMMs:
// fp8moe/gmm.h), which validate the arguments once and hand them to the
// backend the Context names:
//   cpu        the fast implementations (kernels/cpu/)
//   reference  plain loops, one thread (kernels/reference/)
// A device backend is another implementation of this interface: it answers
// Supports for each op it runs, and the entry points refuse the others with
// a FailedPrecondition naming the op; nothing falls back to another backend
// silently. One virtual call per op call, never per row or element.
#ifndef FP8MOE_KERNELS_BACKEND_H_
#define FP8MOE_KERNELS_BACKEND_H_

#include <cstdint>
#include <string_view>

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/quant.h"
#include "kernels/gmm_problem.h"
#include "kernels/ops.h"

namespace fp8moe::internal {

// Every op of a training step (forward, backward, optimizer) behind the
// seam. Shapes are in kernels/ops.h, at each entry point.
enum class Op : uint8_t {
  kGmm,                  // grouped matmul (+ SwiGLU epilogue)
  kGmmDlhs,              // its dLHS (+ dSwiGLU epilogue)
  kTgmm,                 // its dRHS
  kEmbeddingGather,      // rows of the embedding table by token
  kEmbeddingScatterAdd,  // the table's gradient: rows added back by token
  kAdd,                  // residual: out = a + b
  kRmsNormForward,
  kRmsNormBackward,
  kRope,                 // rotation of q and k (inverse: its backward)
  kAttentionForward,     // causal softmax attention
  kAttentionBackward,
  kCopyColumns,          // column blocks between row buffers (MLA's splits, its shared k_rope)
  kCrossEntropy,         // mean loss and its gradient
  kAdamW,                // the optimizer update
  // The MoE layer: routing and row permutation
  kRoute,                // top-k of the router logits, the softmaxes in double
  kSortByExpert,         // the stable sort of (token, slot) pairs by expert
  kPermuteRows,          // token rows into the expert-sorted buffer
  kCombineRows,          // the weighted sum of each token's rows (unpermute)
  kCombineRowsBackward,  // its backward: the rows' gradients and dweight
  kScatterAddRows,       // the permute's backward: rows added back to their tokens
  kRouterBackward,       // dlogits of the router
  // Quantization (quant/ is the cpu implementation's code)
  kQuantizeRows,              // codes + a scale per row (or row block)
  kDequantizeRows,            // their values in f32
  kQuantizeChannels,          // a weight's codes + a scale per (expert, channel)
  kDequantizeChannelsToBf16,  // their values rounded to bf16
  kScaleToF32,                // x times a scale per row or per (group, column)
  kFp8HealthCount,            // codes at the format's max, and flushed to zero
  kCount
};
std::string_view OpName(Op op);

// What every op's arguments start with: the op, so that Supports can look at
// an op's own arguments (its struct below) by casting on `op`.
struct OpArgs {
  Op op;
};

// The arguments of each op, checked by its entry point (kernels/ops.cc):
// sizes non-negative, pointers non-null where there is something to read or
// write. All data is f32 unless said otherwise.
struct GmmArgs : OpArgs {  // kGmm, kGmmDlhs, kTgmm (the GMM entry points' own checks)
  GmmMode mode;
};
struct EmbeddingGatherArgs : OpArgs {
  const float* table;      // [vocab, d]
  const int32_t* tokens;   // [n], each in [0, vocab)
  int64_t n, vocab, d;
  float* out;              // [n, d]
};
struct EmbeddingScatterAddArgs : OpArgs {
  const float* dout;       // [n, d]
  const int32_t* tokens;   // [n], each in [0, vocab)
  int64_t n, vocab, d;
  float* dtable;           // [vocab, d] (overwritten: zero, then rows added in token order)
};
struct AddArgs : OpArgs {
  const float* a;          // [n]
  const float* b;          // [n]
  int64_t n;
  float* out;              // [n]; may be a or b
};
struct RmsNormForwardArgs : OpArgs {
  const float* x;          // [rows, d]
  const float* g;          // [d]
  int64_t rows, d;
  float eps;
  float* y;                // [rows, d]
  float* inv_rms;          // [rows]
};
struct RmsNormBackwardArgs : OpArgs {
  const float* x;          // [rows, d]
  const float* g;          // [d]
  const float* inv_rms;    // [rows]
  const float* dy;         // [rows, d]
  int64_t rows, d;
  float* dx;               // [rows, d] (added to)
  float* dg;               // [d] (overwritten)
};
// Attention's rows hold q | k | v: `heads` query heads, then `kv_heads` key
// heads and `kv_heads` value heads of hd each (width (heads + 2 kv_heads)
// hd); query head h reads kv head h / (heads / kv_heads).
struct RopeArgs : OpArgs {
  float* qkv;              // [batch*seq, (heads + 2*kv_heads)*hd], q and k rotated in place
  int64_t batch, seq, heads, kv_heads, hd;
  const float* cos;        // [seq, rope_dim/2]
  const float* sin;        // [seq, rope_dim/2]
  bool inverse;
  int64_t rope_dim;        // the last rope_dim columns of each q and k head rotate (even, <= hd)
  bool interleaved;        // pairs (2i, 2i+1) of them; false: (i, i + rope_dim/2)
  int64_t vd;              // the value heads' width (rows (heads + kv_heads) hd + kv_heads vd)
};
// The value heads may have their own width vd (MLA's v_head_dim; vd = hd
// otherwise): qkv rows are then [(heads + kv_heads) hd + kv_heads vd] and the
// output [heads vd].
struct AttentionForwardArgs : OpArgs {
  const float* qkv;        // [batch*seq, (heads + kv_heads)*hd + kv_heads*vd]
  int64_t batch, seq, heads, kv_heads, hd;  // kv_heads >= 1 divides heads
  float* probs;            // [batch, heads, seq, seq]
  float* out;              // [batch*seq, heads*vd]
  int64_t vd;              // the value heads' width
};
struct AttentionBackwardArgs : OpArgs {
  const float* qkv;        // [batch*seq, (heads + kv_heads)*hd + kv_heads*vd]
  const float* probs;      // [batch, heads, seq, seq]
  const float* dout;       // [batch*seq, heads*vd]
  int64_t batch, seq, heads, kv_heads, hd;  // kv_heads >= 1 divides heads
  float* dqkv;             // like qkv (overwritten); dk, dv summed over a kv head's query heads
  int64_t vd;              // the value heads' width
};
struct CopyColumnsArgs : OpArgs {
  const float* src;        // [rows, src_cols]
  // Block b: src columns src_offset + b src_step + [0, width).
  int64_t rows, src_cols, src_offset, src_step;
  int64_t blocks, width;
  float* dst;              // [rows, dst_cols]; overlaps no part of src
  int64_t dst_cols, dst_offset, dst_step;  // block b: columns dst_offset + b dst_step + [0, width)
  bool accumulate;         // dst += the blocks, in block order; false: dst = them
};
struct CrossEntropyArgs : OpArgs {
  const float* logits;     // [rows, v]
  const int32_t* targets;  // [rows], each in [0, v)
  int64_t rows, v;
  float* dlogits;          // [rows, v] or null: no gradient
  double* loss;            // the mean over rows
};
struct AdamWArgs : OpArgs {
  const float* g;          // [n] gradient
  float* p;                // [n] parameters, updated in place
  float* m;                // [n] first moment
  float* v;                // [n] second moment
  int64_t n;
  AdamWConstants k;        // kernels/ops.h
};
// The MoE layer: routing and row permutation. Pair p = t*k + j is token t's
// j-th expert; a buffer holds, sorted by expert, the rows of the pairs whose
// expert runs here (all of them on one rank; a ring's local experts on an
// expert ring). row_of_pair [pairs] maps a pair to its row, -1 where it has
// none; pair_of_row [rows] is its inverse. The local and the ring's paths
// run the same ops on their own maps.
struct RouteArgs : OpArgs {
  const float* logits;     // [tokens, experts]
  int64_t tokens, experts, k;  // 1 <= k <= experts
  RouteScoring scoring;    // checked: bias [experts] or null, groups valid
  int32_t* expert;         // [tokens, k] slot j: the j-th largest choice score (ties: the lower index)
  float* weight;           // [tokens, k] the routing weights
  double* softmax;         // [tokens, k] softmax over the k selected logits, or their sigmoid scores
  double* probs;           // [tokens, experts] the softmax over all logits
};
struct SortByExpertArgs : OpArgs {
  const int32_t* expert;   // [pairs]
  int64_t pairs, first, count;  // the experts [first, first + count) get rows
  int32_t* group_sizes;    // [count] pairs per expert
  int64_t* row_of_pair;    // [pairs] (-1: the pair's expert is not in the range)
  int64_t* pair_of_row;    // [pairs] its first *rows entries written
  int64_t* next_row;       // [count] scratch
  int64_t* rows;           // the pairs that got a row
};
struct PermuteRowsArgs : OpArgs {
  const void* src;         // [tokens, cols] F32 or BF16
  DType src_dtype;
  int64_t tokens, cols, k;
  const int64_t* pair_of_row;  // [rows], each in [0, tokens*k)
  int64_t rows;
  void* out;               // [rows, cols] F32 or BF16: row i = src row pair_of_row[i] / k
  DType out_dtype;
};
struct CombineRowsArgs : OpArgs {
  const void* buffer;      // [rows, cols] F32 or BF16
  DType dtype;
  int64_t rows, cols, tokens, k;
  const int64_t* row_of_pair;  // [tokens*k], each in [-1, rows)
  const float* weight;     // [tokens*k]
  float* y;                // [tokens, cols] (overwritten)
};
struct CombineRowsBackwardArgs : OpArgs {
  const float* dy;         // [tokens, cols]
  const void* buffer;      // [rows, cols] the rows the forward combined, F32 or BF16
  DType dtype;             // of buffer and dbuffer
  int64_t rows, cols, tokens, k;
  const int64_t* row_of_pair;  // [tokens*k], each in [-1, rows)
  const float* weight;     // [tokens*k]
  void* dbuffer;           // [rows, cols] (the rows of no pair untouched)
  float* dweight;          // [tokens*k] (0 for a pair without a row)
};
struct ScatterAddRowsArgs : OpArgs {
  const float* dbuffer;    // [rows, cols]
  int64_t rows, cols, tokens, k;
  const int64_t* row_of_pair;  // [tokens*k], each in [-1, rows)
  bool accumulate;         // dx += the rows; false: dx = them
  float* dx;               // [tokens, cols]
};
struct RouterBackwardArgs : OpArgs {
  const int32_t* expert;   // [tokens, k] Route's, each in [0, experts)
  const double* softmax;   // [tokens, k] Route's
  const double* probs;     // [tokens, experts] Route's
  const float* dweight;    // [tokens, k] the loss's gradient of the routing weights
  const double* fraction;  // [experts] f_e of the load-balancing loss
  int64_t tokens, experts, k;
  RouteScoring scoring;    // Route's (only sigmoid, norm_topk_prob and scaling are read)
  double lb_weight;        // the load-balancing loss weight
  float* dlogits;          // [tokens, experts] (overwritten)
};
// Quantization (quant/ is the cpu implementation's code). Codes are bytes of
// `dtype` (fp8moe/quant.h), scales f32.
struct QuantizeRowsArgs : OpArgs {
  const float* x;          // [rows, cols]; rows >= valid_rows are not read
  int64_t rows, cols, valid_rows, block_size;  // block_size 0: one block per row
  QuantDType dtype;
  Calibration calib;
  uint8_t* q;              // [rows, cols] (tail rows: 0)
  float* scales;           // [rows, NumBlocks(cols, block_size)] (tail rows: 0)
};
struct DequantizeRowsArgs : OpArgs {
  const uint8_t* q;        // [rows, cols]
  const float* scales;     // [rows, NumBlocks(cols, block_size)]
  int64_t rows, cols, block_size;
  QuantDType dtype;
  float* x;                // [rows, cols]
};
struct QuantizeChannelsArgs : OpArgs {
  const float* w;          // [experts, k, n]
  int64_t experts, k, n;
  QuantDType dtype;
  Calibration calib;
  uint8_t* q;              // [experts, k, n]
  float* scales;           // [experts, n]
};
struct DequantizeChannelsToBf16Args : OpArgs {
  const uint8_t* q;        // [experts, k, n]
  const float* scales;     // [experts, n]
  int64_t experts, k, n;
  QuantDType dtype;
  uint16_t* out;           // [experts, k, n] bf16 bits
};
struct ScaleToF32Args : OpArgs {
  const void* x;           // [rows, cols] of x_dtype: F32 or BF16
  DType x_dtype;
  int64_t rows, cols;
  const int32_t* group_sizes;  // [groups], sum <= rows: the rows written
  int64_t groups;
  ScaleBy by;
  const float* scale;      // kRow: [rows]; kGroupColumn: [groups, cols]
  float* out;              // [rows, cols]; rows past sum(group_sizes) untouched
};
struct Fp8HealthCountArgs : OpArgs {
  const uint8_t* q;        // [n] codes of x
  const float* x;          // [n] the values they were quantized from
  int64_t n;
  QuantDType dtype;
  Fp8CodeCounts* counts;   // kernels/ops.h
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  // Whether this backend runs the op with these arguments (a device backend
  // may run an op for some dtypes or sizes only).
  virtual bool Supports(const OpArgs& args) const = 0;

  // The arguments of Gmm / GmmDlhs / Tgmm (gmm.h), already checked: p is
  // their problem. Outputs are written in full (tail rows as zero).
  virtual Status Gmm(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                     const ConstTensorView& lhs, const ConstTensorView& rhs,
                     const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                     const TensorView& out, const TensorView* h_out) = 0;
  virtual Status Dlhs(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                      const ConstTensorView& dout, const ConstTensorView& rhs,
                      const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                      const TensorView& out, const ConstTensorView* h) = 0;
  virtual Status Tgmm(Context& ctx, const GmmProblem& p, const GmmOptions& options,
                      const TgmmQuant& quant, const ConstTensorView& lhs,
                      const ConstTensorView& dout, const ConstTensorView& group_sizes,
                      const TensorView& drhs) = 0;

  // The ops of kernels/ops.h, their arguments checked.
  virtual Status EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a) = 0;
  virtual Status EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a) = 0;
  virtual Status Add(Context& ctx, const AddArgs& a) = 0;
  virtual Status RmsNormForward(Context& ctx, const RmsNormForwardArgs& a) = 0;
  virtual Status RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a) = 0;
  virtual Status Rope(Context& ctx, const RopeArgs& a) = 0;
  virtual Status AttentionForward(Context& ctx, const AttentionForwardArgs& a) = 0;
  virtual Status AttentionBackward(Context& ctx, const AttentionBackwardArgs& a) = 0;
  virtual Status CopyColumns(Context& ctx, const CopyColumnsArgs& a) = 0;
  virtual Status CrossEntropy(Context& ctx, const CrossEntropyArgs& a) = 0;
  virtual Status AdamW(Context& ctx, const AdamWArgs& a) = 0;
  // The MoE layer: routing and row permutation
  virtual Status Route(Context& ctx, const RouteArgs& a) = 0;
  virtual Status SortByExpert(Context& ctx, const SortByExpertArgs& a) = 0;
  virtual Status PermuteRows(Context& ctx, const PermuteRowsArgs& a) = 0;
  virtual Status CombineRows(Context& ctx, const CombineRowsArgs& a) = 0;
  virtual Status CombineRowsBackward(Context& ctx, const CombineRowsBackwardArgs& a) = 0;
  virtual Status ScatterAddRows(Context& ctx, const ScatterAddRowsArgs& a) = 0;
  virtual Status RouterBackward(Context& ctx, const RouterBackwardArgs& a) = 0;
  // Quantization (quant/ is the cpu implementation's code)
  virtual Status QuantizeRows(Context& ctx, const QuantizeRowsArgs& a) = 0;
  virtual Status DequantizeRows(Context& ctx, const DequantizeRowsArgs& a) = 0;
  virtual Status QuantizeChannels(Context& ctx, const QuantizeChannelsArgs& a) = 0;
  virtual Status DequantizeChannelsToBf16(Context& ctx, const DequantizeChannelsToBf16Args& a) = 0;
  virtual Status ScaleToF32(Context& ctx, const ScaleToF32Args& a) = 0;
  virtual Status Fp8HealthCount(Context& ctx, const Fp8HealthCountArgs& a) = 0;
};

// A backend whose ops besides the GMMs are the static functions of `Ops`,
// each `void Name(Context&, const NameArgs&)` on checked arguments: the cpu
// backend (CpuOps, kernels/cpu/cpu_ops.h) and the reference backend
// (ReferenceOps, kernels/reference/ops_reference.h) are this over their code.
template <class Ops>
class OpsBackend : public Backend {
 public:
  Status EmbeddingGather(Context& ctx, const EmbeddingGatherArgs& a) final {
    Ops::EmbeddingGather(ctx, a);
    return OkStatus();
  }
  Status EmbeddingScatterAdd(Context& ctx, const EmbeddingScatterAddArgs& a) final {
    Ops::EmbeddingScatterAdd(ctx, a);
    return OkStatus();
  }
  Status Add(Context& ctx, const AddArgs& a) final {
    Ops::Add(ctx, a);
    return OkStatus();
  }
  Status RmsNormForward(Context& ctx, const RmsNormForwardArgs& a) final {
    Ops::RmsNormForward(ctx, a);
    return OkStatus();
  }
  Status RmsNormBackward(Context& ctx, const RmsNormBackwardArgs& a) final {
    Ops::RmsNormBackward(ctx, a);
    return OkStatus();
  }
  Status Rope(Context& ctx, const RopeArgs& a) final {
    Ops::Rope(ctx, a);
    return OkStatus();
  }
  Status AttentionForward(Context& ctx, const AttentionForwardArgs& a) final {
    Ops::AttentionForward(ctx, a);
    return OkStatus();
  }
  Status AttentionBackward(Context& ctx, const AttentionBackwardArgs& a) final {
    Ops::AttentionBackward(ctx, a);
    return OkStatus();
  }
  Status CopyColumns(Context& ctx, const CopyColumnsArgs& a) final {
    Ops::CopyColumns(ctx, a);
    return OkStatus();
  }
  Status CrossEntropy(Context& ctx, const CrossEntropyArgs& a) final {
    Ops::CrossEntropy(ctx, a);
    return OkStatus();
  }
  Status AdamW(Context& ctx, const AdamWArgs& a) final {
    Ops::AdamW(ctx, a);
    return OkStatus();
  }
  // The MoE layer: routing and row permutation
  Status Route(Context& ctx, const RouteArgs& a) final {
    Ops::Route(ctx, a);
    return OkStatus();
  }
  Status SortByExpert(Context& ctx, const SortByExpertArgs& a) final {
    Ops::SortByExpert(ctx, a);
    return OkStatus();
  }
  Status PermuteRows(Context& ctx, const PermuteRowsArgs& a) final {
    Ops::PermuteRows(ctx, a);
    return OkStatus();
  }
  Status CombineRows(Context& ctx, const CombineRowsArgs& a) final {
    Ops::CombineRows(ctx, a);
    return OkStatus();
  }
  Status CombineRowsBackward(Context& ctx, const CombineRowsBackwardArgs& a) final {
    Ops::CombineRowsBackward(ctx, a);
    return OkStatus();
  }
  Status ScatterAddRows(Context& ctx, const ScatterAddRowsArgs& a) final {
    Ops::ScatterAddRows(ctx, a);
    return OkStatus();
  }
  Status RouterBackward(Context& ctx, const RouterBackwardArgs& a) final {
    Ops::RouterBackward(ctx, a);
    return OkStatus();
  }
  // Quantization (quant/ is the cpu implementation's code)
  Status QuantizeRows(Context& ctx, const QuantizeRowsArgs& a) final {
    Ops::QuantizeRows(ctx, a);
    return OkStatus();
  }
  Status DequantizeRows(Context& ctx, const DequantizeRowsArgs& a) final {
    Ops::DequantizeRows(ctx, a);
    return OkStatus();
  }
  Status QuantizeChannels(Context& ctx, const QuantizeChannelsArgs& a) final {
    Ops::QuantizeChannels(ctx, a);
    return OkStatus();
  }
  Status DequantizeChannelsToBf16(Context& ctx, const DequantizeChannelsToBf16Args& a) final {
    Ops::DequantizeChannelsToBf16(ctx, a);
    return OkStatus();
  }
  Status ScaleToF32(Context& ctx, const ScaleToF32Args& a) final {
    Ops::ScaleToF32(ctx, a);
    return OkStatus();
  }
  Status Fp8HealthCount(Context& ctx, const Fp8HealthCountArgs& a) final {
    Ops::Fp8HealthCount(ctx, a);
    return OkStatus();
  }
};

Backend& CpuBackend();
Backend& ReferenceBackend();
// The backend a Context names.
Backend& BackendOf(const Context& ctx);

// Tests only: makes every Context of `kind` run on `backend` (null: the
// kind's own again) and returns the one it replaces, so that a test can stand
// in a backend that supports some ops only, as a device backend would. Not
// for concurrent use with calls on contexts of that kind.
Backend* SetBackendForTesting(BackendKind kind, Backend* backend);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_BACKEND_H_
