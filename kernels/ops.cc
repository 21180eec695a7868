// The checked entry points of kernels/ops.h: validate once, ask the
// Context's backend, hand over (kernels/backend.h).
#include "kernels/ops.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <initializer_list>
#include <string>
#include <utility>

#include "fp8moe/tensor.h"
#include "kernels/backend.h"

namespace fp8moe::internal {

std::string_view OpName(Op op) {
  static constexpr std::string_view kNames[] = {
      "gmm",          "gmm_dlhs",          "tgmm",       "embedding_gather",
      "embedding_scatter_add", "add",      "rms_norm_forward", "rms_norm_backward",
      "rope",         "attention_forward", "attention_backward", "copy_columns", "cross_entropy",
      "adamw",
      // The MoE layer: routing and row permutation
      "route", "sort_by_expert", "permute_rows", "combine_rows", "combine_rows_backward",
      "scatter_add_rows", "router_backward",
      // Quantization (quant/ is the cpu implementation's code)
      "quantize_rows", "dequantize_rows", "quantize_channels", "dequantize_channels_to_bf16",
      "scale_to_f32", "fp8_health_count"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Op::kCount));
  return kNames[static_cast<size_t>(op)];
}

namespace {
// SetBackendForTesting's stand-ins, by BackendKind; null in a program that
// is not a test.
constexpr size_t kKinds = static_cast<size_t>(BackendKind::kReference) + 1;  // the last kind
std::atomic<Backend*> stand_in[kKinds] = {};
}  // namespace

Backend& BackendOf(const Context& ctx) {
  const auto kind = static_cast<size_t>(ctx.backend());
  if (Backend* b = stand_in[kind].load(std::memory_order_relaxed)) return *b;
  return ctx.backend() == BackendKind::kReference ? ReferenceBackend() : CpuBackend();
}

Backend* SetBackendForTesting(BackendKind kind, Backend* backend) {
  return stand_in[static_cast<size_t>(kind)].exchange(backend);
}

namespace {

// An operand of `dims` f32 (or int32) elements: no negative dimension, no
// product that overflows (CheckedNumElements), and data unless it is empty.
Status Operand(Op op, const char* what, const void* data, Shape dims, size_t elem = 4) {
  const auto n = CheckedNumElements(dims, elem);
  if (!n.ok()) {
    return InvalidArgument(std::string(OpName(op)) + ": " + what + " " + n.status().message());
  }
  if (data == nullptr && *n > 0) {
    return InvalidArgument(std::string(OpName(op)) + ": " + what + " " + ShapeToString(dims) +
                           " has no data");
  }
  return OkStatus();
}

Status Tokens(Op op, const int32_t* tokens, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return InvalidArgument(std::string(OpName(op)) + ": token " + std::to_string(tokens[i]) +
                             " at row " + std::to_string(i) + " is outside the table [0, " +
                             std::to_string(vocab) + ")");
    }
  }
  return OkStatus();
}

// Hands checked arguments to the context's backend, if it runs the op.
template <class Args>
Status Run(Context& ctx, const Args& a, Status (Backend::*fn)(Context&, const Args&)) {
  Backend& b = BackendOf(ctx);
  if (!b.Supports(a)) {
    return FailedPrecondition("the " + std::string(BackendName(b.kind())) +
                              " backend does not run op " + std::string(OpName(a.op)) +
                              " with these arguments");
  }
  return (b.*fn)(ctx, a);
}

}  // namespace

Status EmbeddingGather(Context& ctx, const float* table, const int32_t* tokens, int64_t n,
                       int64_t vocab, int64_t d, float* out) {
  const Op op = Op::kEmbeddingGather;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "table", table, {vocab, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "tokens", tokens, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {n, d}));
  FP8MOE_RETURN_IF_ERROR(Tokens(op, tokens, n, vocab));
  return Run(ctx, EmbeddingGatherArgs{{op}, table, tokens, n, vocab, d, out},
             &Backend::EmbeddingGather);
}

Status EmbeddingScatterAdd(Context& ctx, const float* dout, const int32_t* tokens, int64_t n,
                           int64_t vocab, int64_t d, float* dtable) {
  const Op op = Op::kEmbeddingScatterAdd;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dout", dout, {n, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "tokens", tokens, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dtable", dtable, {vocab, d}));
  FP8MOE_RETURN_IF_ERROR(Tokens(op, tokens, n, vocab));
  return Run(ctx, EmbeddingScatterAddArgs{{op}, dout, tokens, n, vocab, d, dtable},
             &Backend::EmbeddingScatterAdd);
}

Status Add(Context& ctx, const float* a, const float* b, int64_t n, float* out) {
  const Op op = Op::kAdd;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "a", a, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "b", b, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {n}));
  return Run(ctx, AddArgs{{op}, a, b, n, out}, &Backend::Add);
}

Status RmsNormForward(Context& ctx, const float* x, const float* g, int64_t rows, int64_t d,
                      float eps, float* y, float* inv_rms) {
  const Op op = Op::kRmsNormForward;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {rows, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "g", g, {d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "y", y, {rows, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "inv_rms", inv_rms, {rows}));
  return Run(ctx, RmsNormForwardArgs{{op}, x, g, rows, d, eps, y, inv_rms},
             &Backend::RmsNormForward);
}

Status RmsNormBackward(Context& ctx, const float* x, const float* g, const float* inv_rms,
                       const float* dy, int64_t rows, int64_t d, float* dx, float* dg) {
  const Op op = Op::kRmsNormBackward;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {rows, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "g", g, {d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "inv_rms", inv_rms, {rows}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dy", dy, {rows, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dx", dx, {rows, d}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dg", dg, {d}));
  return Run(ctx, RmsNormBackwardArgs{{op}, x, g, inv_rms, dy, rows, d, dx, dg},
             &Backend::RmsNormBackward);
}

namespace {

// Hkv >= 1 dividing H (kernels/ops.h); zero heads of both is an empty call.
Status KvHeads(Op op, int64_t heads, int64_t kv_heads) {
  if ((heads == 0 && kv_heads == 0) || (kv_heads >= 1 && heads >= 0 && heads % kv_heads == 0)) {
    return OkStatus();
  }
  return InvalidArgument(std::string(OpName(op)) + ": " + std::to_string(heads) +
                         " query heads do not split into groups of " +
                         std::to_string(kv_heads) + " kv heads (kv_heads must be >= 1 and "
                         "divide heads)");
}

}  // namespace

namespace {

// Attention's qkv operand: [batch, seq, heads + 2 kv_heads, hd] where the
// value heads are hd wide (the check every caller had before vd), else its
// q and k heads [batch, seq, heads + kv_heads, hd] and its v heads [batch,
// seq, kv_heads, vd], each checked for overflow, and their sum.
Status QkvOperand(Op op, const char* what, const float* qkv, int64_t batch, int64_t seq,
                  int64_t heads, int64_t kv_heads, int64_t hd, int64_t vd) {
  if (vd == hd) return Operand(op, what, qkv, {batch, seq, heads + 2 * kv_heads, hd});
  if (vd < 0) {
    return InvalidArgument(std::string(OpName(op)) + ": value head width " + std::to_string(vd) +
                           " is negative");
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, what, qkv, {batch, seq, heads + kv_heads, hd}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, what, qkv, {batch, seq, kv_heads, vd}));
  return Operand(op, what, qkv, {batch, seq, (heads + kv_heads) * hd + kv_heads * vd});
}

// Scores q.k / sqrt(hd) need hd >= 1 where there are values to weigh:
// with hd 0 the scale 1/sqrt(0) makes every score NaN. hd = vd = 0 (no
// heads' columns at all) stays as it was.
Status ScoreWidth(Op op, int64_t hd, int64_t vd) {
  if (hd != 0 || vd <= 0) return OkStatus();
  return InvalidArgument(std::string(OpName(op)) + ": head dimension 0 with value width " +
                         std::to_string(vd) + "; the scores q.k / sqrt(hd) need hd >= 1");
}

}  // namespace

Status RopeApply(Context& ctx, float* qkv, int64_t batch, int64_t seq, int64_t heads,
                 int64_t kv_heads, int64_t hd, const float* cos, const float* sin,
                 bool inverse, int64_t rope_dim, bool interleaved, int64_t vd) {
  const Op op = Op::kRope;
  if (vd == -1) vd = hd;
  // Only the rotated span must pair up: an MLA head's nope part (hd -
  // rope_dim) may be odd.
  if (rope_dim == -1) {
    if (hd % 2 != 0) {
      return InvalidArgument("rope: head dimension " + std::to_string(hd) +
                             " is odd; RoPE rotates pairs of dimensions");
    }
    rope_dim = hd;
  }
  if (rope_dim < 0) {
    return InvalidArgument("rope: rope_dim " + std::to_string(rope_dim) +
                           " is negative; pass -1 for the whole head or a width in [0, hd]");
  }
  if (rope_dim % 2 != 0 || rope_dim > hd) {
    return InvalidArgument("rope: rope_dim " + std::to_string(rope_dim) +
                           " must be even and at most the head dimension " + std::to_string(hd));
  }
  FP8MOE_RETURN_IF_ERROR(KvHeads(op, heads, kv_heads));
  FP8MOE_RETURN_IF_ERROR(QkvOperand(op, "qkv", qkv, batch, seq, heads, kv_heads, hd, vd));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "cos", cos, {seq, rope_dim / 2}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "sin", sin, {seq, rope_dim / 2}));
  return Run(ctx,
             RopeArgs{{op}, qkv, batch, seq, heads, kv_heads, hd, cos, sin, inverse, rope_dim,
                      interleaved, vd},
             &Backend::Rope);
}

Status AttentionForward(Context& ctx, const float* qkv, int64_t batch, int64_t seq,
                        int64_t heads, int64_t kv_heads, int64_t hd, float* probs, float* out,
                        int64_t vd) {
  const Op op = Op::kAttentionForward;
  if (vd == -1) vd = hd;
  FP8MOE_RETURN_IF_ERROR(KvHeads(op, heads, kv_heads));
  FP8MOE_RETURN_IF_ERROR(ScoreWidth(op, hd, vd));
  FP8MOE_RETURN_IF_ERROR(QkvOperand(op, "qkv", qkv, batch, seq, heads, kv_heads, hd, vd));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "probs", probs, {batch, heads, seq, seq}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {batch, seq, heads, vd}));
  return Run(ctx,
             AttentionForwardArgs{{op}, qkv, batch, seq, heads, kv_heads, hd, probs, out, vd},
             &Backend::AttentionForward);
}

Status AttentionBackward(Context& ctx, const float* qkv, const float* probs, const float* dout,
                         int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd,
                         float* dqkv, int64_t vd) {
  const Op op = Op::kAttentionBackward;
  if (vd == -1) vd = hd;
  FP8MOE_RETURN_IF_ERROR(KvHeads(op, heads, kv_heads));
  FP8MOE_RETURN_IF_ERROR(ScoreWidth(op, hd, vd));
  FP8MOE_RETURN_IF_ERROR(QkvOperand(op, "qkv", qkv, batch, seq, heads, kv_heads, hd, vd));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "probs", probs, {batch, heads, seq, seq}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dout", dout, {batch, seq, heads, vd}));
  FP8MOE_RETURN_IF_ERROR(QkvOperand(op, "dqkv", dqkv, batch, seq, heads, kv_heads, hd, vd));
  return Run(ctx,
             AttentionBackwardArgs{{op}, qkv, probs, dout, batch, seq, heads, kv_heads, hd, dqkv,
                                   vd},
             &Backend::AttentionBackward);
}

Status CopyColumns(Context& ctx, const float* src, int64_t rows, int64_t src_cols,
                   int64_t src_offset, int64_t src_step, int64_t blocks, int64_t width,
                   float* dst, int64_t dst_cols, int64_t dst_offset, int64_t dst_step,
                   bool accumulate) {
  const Op op = Op::kCopyColumns;
  auto bad = [&](const std::string& why) {
    return InvalidArgument("copy_columns: " + why + " (rows " + std::to_string(rows) +
                           ", blocks " + std::to_string(blocks) + " of width " +
                           std::to_string(width) + ", src [" + std::to_string(src_cols) +
                           "] offset " + std::to_string(src_offset) + " step " +
                           std::to_string(src_step) + ", dst [" + std::to_string(dst_cols) +
                           "] offset " + std::to_string(dst_offset) + " step " +
                           std::to_string(dst_step) + ")");
  };
  for (int64_t v : {rows, src_cols, src_offset, src_step, blocks, width, dst_cols, dst_offset,
                    dst_step}) {
    if (v < 0) return bad("a negative size, offset or step");
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, "src", src, {rows, src_cols}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dst", dst, {rows, dst_cols}));
  if (blocks > 0 && width > 0) {
    // The last block's end, in 128 bits: offsets and steps may be anything.
    auto end = [&](int64_t offset, int64_t step) {
      return static_cast<__int128>(offset) + static_cast<__int128>(blocks - 1) * step + width;
    };
    if (end(src_offset, src_step) > src_cols) return bad("a src block ends past its row");
    if (end(dst_offset, dst_step) > dst_cols) return bad("a dst block ends past its row");
    if (blocks > 1 && dst_step == 0 && !accumulate) {
      return bad("dst step 0 overwrites one block with the next; accumulate them");
    }
    if (blocks > 1 && dst_step > 0 && dst_step < width) return bad("dst blocks overlap");
    const auto* s0 = reinterpret_cast<const char*>(src);
    const auto* d0 = reinterpret_cast<const char*>(dst);
    const size_t sn = static_cast<size_t>(rows * src_cols) * 4;
    const size_t dn = static_cast<size_t>(rows * dst_cols) * 4;
    if (rows > 0 && s0 < d0 + dn && d0 < s0 + sn) return bad("dst overlaps src");
  }
  return Run(ctx,
             CopyColumnsArgs{{op}, src, rows, src_cols, src_offset, src_step, blocks, width, dst,
                             dst_cols, dst_offset, dst_step, accumulate},
             &Backend::CopyColumns);
}

Result<double> CrossEntropy(Context& ctx, const float* logits, const int32_t* targets,
                            int64_t rows, int64_t v, float* dlogits) {
  const Op op = Op::kCrossEntropy;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "logits", logits, {rows, v}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "targets", targets, {rows}));
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0 || targets[r] >= v) {
      return InvalidArgument("target token " + std::to_string(targets[r]) + " at row " +
                             std::to_string(r) + " is outside the vocabulary [0, " +
                             std::to_string(v) + ")");
    }
  }
  double loss = 0;
  FP8MOE_RETURN_IF_ERROR(
      Run(ctx, CrossEntropyArgs{{op}, logits, targets, rows, v, dlogits, &loss},
          &Backend::CrossEntropy));
  return loss;
}

Status AdamW(Context& ctx, const AdamWConstants& k, const float* g, float* p, float* m,
             float* v, int64_t n) {
  const Op op = Op::kAdamW;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "g", g, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "p", p, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "m", m, {n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "v", v, {n}));
  return Run(ctx, AdamWArgs{{op}, g, p, m, v, n, k}, &Backend::AdamW);
}

// The MoE layer: routing and row permutation

namespace {

// Every entry of map [n] in [lo, hi): a row or pair index that an op
// follows into a buffer.
Status MapEntries(Op op, const char* what, const int64_t* map, int64_t n, int64_t lo,
                  int64_t hi, const char* range) {
  for (int64_t i = 0; i < n; ++i) {
    if (map[i] < lo || map[i] >= hi) {
      return InvalidArgument(std::string(OpName(op)) + ": " + what + "[" + std::to_string(i) +
                             "] = " + std::to_string(map[i]) + " is outside [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + ") (" + range +
                             ")");
    }
  }
  return OkStatus();
}

// A buffer of rows: F32 or BF16.
Status RowDType(Op op, const char* what, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return OkStatus();
  return InvalidArgument(std::string(OpName(op)) + ": " + what + " is " +
                         std::string(DTypeName(dtype)) + "; the rows are float32 or bfloat16");
}

// k >= 1 experts per token.
Status PerToken(Op op, int64_t k) {
  if (k >= 1) return OkStatus();
  return InvalidArgument(std::string(OpName(op)) + ": k = " + std::to_string(k) +
                         " experts per token; it must be at least 1");
}

// The checks the ops over row_of_pair share: the buffer [rows, cols] of
// dtype and the map [tokens*k], every entry in [-1, rows).
Status PairRows(Op op, const void* buffer, DType dtype, int64_t rows, int64_t cols,
                const int64_t* row_of_pair, int64_t tokens, int64_t k) {
  FP8MOE_RETURN_IF_ERROR(PerToken(op, k));
  FP8MOE_RETURN_IF_ERROR(RowDType(op, "the buffer", dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "buffer", buffer, {rows, cols}, DTypeSize(dtype)));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "row_of_pair", row_of_pair, {tokens, k}, 8));
  return MapEntries(op, "row_of_pair", row_of_pair, tokens * k, -1, rows,
                    "the buffer's rows; -1: no row");
}

}  // namespace

// RouteScoring's contract (kernels/ops.h) for `experts` and top-k `k`.
Status Scoring(Op op, const RouteScoring& s, int64_t experts, int64_t k) {
  const std::string name(OpName(op));
  if (!std::isfinite(s.scaling)) {
    return InvalidArgument(name + ": scaling " + std::to_string(s.scaling) +
                           " is not finite; the weights' scaling must be a finite number");
  }
  if (!s.sigmoid && (s.bias != nullptr || s.groups != 0)) {
    return InvalidArgument(name + ": a choice bias or routing groups need sigmoid scoring");
  }
  if (s.groups == 0) return OkStatus();
  const bool shape_ok = s.groups > 0 && experts % s.groups == 0 && experts / s.groups >= 2;
  if (!shape_ok || s.topk_groups < 1 || s.topk_groups > s.groups ||
      s.topk_groups * (experts / s.groups) < k) {
    return InvalidArgument(name + ": " + std::to_string(s.groups) + " routing groups keeping " +
                           std::to_string(s.topk_groups) + " of " + std::to_string(experts) +
                           " experts for top-" + std::to_string(k) +
                           "; groups must divide the experts into groups of at least 2 and "
                           "the kept groups hold at least k experts");
  }
  return OkStatus();
}

Status RouteTopK(Context& ctx, const float* logits, int64_t tokens, int64_t experts, int64_t k,
                 const RouteScoring& scoring, int32_t* expert, float* weight, double* softmax,
                 double* probs) {
  const Op op = Op::kRoute;
  if (k < 1 || k > experts || experts > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("route: k = " + std::to_string(k) + " of " + std::to_string(experts) +
                           " experts; k must be in [1, experts] and experts below 2^31");
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, "logits", logits, {tokens, experts}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "expert", expert, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "weight", weight, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "softmax", softmax, {tokens, k}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "probs", probs, {tokens, experts}, 8));
  FP8MOE_RETURN_IF_ERROR(Scoring(op, scoring, experts, k));
  return Run(ctx,
             RouteArgs{{op}, logits, tokens, experts, k, scoring, expert, weight, softmax, probs},
             &Backend::Route);
}

Result<int64_t> SortByExpert(Context& ctx, const int32_t* expert, int64_t pairs, int64_t first,
                             int64_t count, int32_t* group_sizes, int64_t* row_of_pair,
                             int64_t* pair_of_row, int64_t* next_row) {
  const Op op = Op::kSortByExpert;
  if (first < 0 || count < 0 || pairs > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("sort_by_expert: experts [" + std::to_string(first) + ", " +
                           std::to_string(first) + " + " + std::to_string(count) + ") of " +
                           std::to_string(pairs) +
                           " pairs; the range must not be negative and the pairs below 2^31 "
                           "(an int32 group size)");
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, "expert", expert, {pairs}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "group_sizes", group_sizes, {count}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "row_of_pair", row_of_pair, {pairs}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "pair_of_row", pair_of_row, {pairs}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "next_row", next_row, {count}, 8));
  int64_t rows = 0;
  FP8MOE_RETURN_IF_ERROR(Run(ctx,
                             SortByExpertArgs{{op}, expert, pairs, first, count, group_sizes,
                                              row_of_pair, pair_of_row, next_row, &rows},
                             &Backend::SortByExpert));
  return rows;
}

Status PermuteRows(Context& ctx, const void* src, DType src_dtype, int64_t tokens, int64_t cols,
                   int64_t k, const int64_t* pair_of_row, int64_t rows, void* out,
                   DType out_dtype) {
  const Op op = Op::kPermuteRows;
  FP8MOE_RETURN_IF_ERROR(PerToken(op, k));
  FP8MOE_RETURN_IF_ERROR(RowDType(op, "src", src_dtype));
  FP8MOE_RETURN_IF_ERROR(RowDType(op, "out", out_dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "src", src, {tokens, cols}, DTypeSize(src_dtype)));
  if (const auto pairs = CheckedNumElements({tokens, k}, 8); !pairs.ok()) {
    return InvalidArgument("permute_rows: the pairs " + pairs.status().message());
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, "pair_of_row", pair_of_row, {rows}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {rows, cols}, DTypeSize(out_dtype)));
  FP8MOE_RETURN_IF_ERROR(MapEntries(op, "pair_of_row", pair_of_row, rows, 0, tokens * k,
                                    "the pairs of src's tokens"));
  return Run(ctx,
             PermuteRowsArgs{{op}, src, src_dtype, tokens, cols, k, pair_of_row, rows, out,
                             out_dtype},
             &Backend::PermuteRows);
}

Status CombineRows(Context& ctx, const void* buffer, DType dtype, int64_t rows, int64_t cols,
                   const int64_t* row_of_pair, const float* weight, int64_t tokens, int64_t k,
                   float* y) {
  const Op op = Op::kCombineRows;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "y", y, {tokens, cols}));
  FP8MOE_RETURN_IF_ERROR(PairRows(op, buffer, dtype, rows, cols, row_of_pair, tokens, k));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "weight", weight, {tokens, k}));
  return Run(ctx,
             CombineRowsArgs{{op}, buffer, dtype, rows, cols, tokens, k, row_of_pair, weight, y},
             &Backend::CombineRows);
}

Status CombineRowsBackward(Context& ctx, const float* dy, const void* buffer, DType dtype,
                           int64_t rows, int64_t cols, const int64_t* row_of_pair,
                           const float* weight, int64_t tokens, int64_t k, void* dbuffer,
                           float* dweight) {
  const Op op = Op::kCombineRowsBackward;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dy", dy, {tokens, cols}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dweight", dweight, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(PairRows(op, buffer, dtype, rows, cols, row_of_pair, tokens, k));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "weight", weight, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dbuffer", dbuffer, {rows, cols}, DTypeSize(dtype)));
  return Run(ctx,
             CombineRowsBackwardArgs{{op}, dy, buffer, dtype, rows, cols, tokens, k, row_of_pair,
                                     weight, dbuffer, dweight},
             &Backend::CombineRowsBackward);
}

Status ScatterAddRows(Context& ctx, const float* dbuffer, int64_t rows, int64_t cols,
                      const int64_t* row_of_pair, int64_t tokens, int64_t k, bool accumulate,
                      float* dx) {
  const Op op = Op::kScatterAddRows;
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dx", dx, {tokens, cols}));
  FP8MOE_RETURN_IF_ERROR(
      PairRows(op, dbuffer, DType::kF32, rows, cols, row_of_pair, tokens, k));
  return Run(ctx,
             ScatterAddRowsArgs{{op}, dbuffer, rows, cols, tokens, k, row_of_pair, accumulate, dx},
             &Backend::ScatterAddRows);
}

Status RouterBackward(Context& ctx, const int32_t* expert, const double* softmax,
                      const double* probs, const float* dweight, const double* fraction,
                      int64_t tokens, int64_t experts, int64_t k, const RouteScoring& scoring,
                      double lb_weight, float* dlogits) {
  const Op op = Op::kRouterBackward;
  FP8MOE_RETURN_IF_ERROR(PerToken(op, k));
  if (!std::isfinite(scoring.scaling)) {
    return InvalidArgument("router_backward: scaling " + std::to_string(scoring.scaling) +
                           " is not finite; the weights' scaling must be a finite number");
  }
  FP8MOE_RETURN_IF_ERROR(Operand(op, "expert", expert, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "softmax", softmax, {tokens, k}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "probs", probs, {tokens, experts}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dweight", dweight, {tokens, k}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "fraction", fraction, {experts}, 8));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "dlogits", dlogits, {tokens, experts}));
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (expert[i] < 0 || expert[i] >= experts) {
      return InvalidArgument("router_backward: expert[" + std::to_string(i) + "] = " +
                             std::to_string(expert[i]) + " is outside [0, " +
                             std::to_string(experts) + ") (the experts)");
    }
  }
  return Run(ctx,
             RouterBackwardArgs{{op}, expert, softmax, probs, dweight, fraction, tokens, experts,
                                k, scoring, lb_weight, dlogits},
             &Backend::RouterBackward);
}

// ---- Quantization (quant/ is the cpu implementation's code) ----

namespace {

Status QuantError(Op op, const std::string& what) {
  return InvalidArgument(std::string(OpName(op)) + ": " + what);
}

// A dimension that is not a shape's (a row count, a block size): >= 0.
Status NonNegative(Op op, const char* what, int64_t v) {
  if (v >= 0) return OkStatus();
  return QuantError(op, std::string(what) + " = " + std::to_string(v) + " is negative");
}

// One of the five formats (an out-of-range enum would index past the
// decode tables).
Status Format(Op op, QuantDType dtype) {
  if (static_cast<uint8_t>(dtype) <= static_cast<uint8_t>(QuantDType::kInt8)) return OkStatus();
  return QuantError(op, "quant dtype " + std::to_string(static_cast<int>(dtype)) +
                            " is none of e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, int8");
}

// An output of `out_bytes` at `out` shares no byte with an input of
// `in_bytes` at `in` (empty ranges never do): every op reads an element's
// inputs while others are already written.
Status Disjoint(Op op, const char* out_name, const void* out, size_t out_bytes,
                const char* in_name, const void* in, size_t in_bytes) {
  const auto o = reinterpret_cast<uintptr_t>(out), i = reinterpret_cast<uintptr_t>(in);
  if (out_bytes == 0 || in_bytes == 0 || o + out_bytes <= i || i + in_bytes <= o) {
    return OkStatus();
  }
  return QuantError(op, std::string(out_name) + " overlaps " + in_name +
                            "; give the output a buffer of its own");
}

// Bytes of an operand `Operand` accepted.
size_t Bytes(Shape dims, size_t elem) { return NumElements(dims) * elem; }

}  // namespace

Status QuantizeRows(Context& ctx, const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales) {
  const Op op = Op::kQuantizeRows;
  FP8MOE_RETURN_IF_ERROR(NonNegative(op, "valid_rows", valid_rows));
  FP8MOE_RETURN_IF_ERROR(NonNegative(op, "block_size", block_size));
  FP8MOE_RETURN_IF_ERROR(Format(op, dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "q", q, {rows, cols}, 1));
  if (valid_rows > rows) {
    return QuantError(op, "valid_rows = " + std::to_string(valid_rows) + " exceeds rows = " +
                              std::to_string(rows));
  }
  const int64_t blocks = NumBlocks(cols, block_size);
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {valid_rows, cols}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "scales", scales, {rows, blocks}));
  const size_t x_bytes = Bytes({valid_rows, cols}, 4);
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "q", q, Bytes({rows, cols}, 1), "x", x, x_bytes));
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "scales", scales, Bytes({rows, blocks}, 4), "x", x, x_bytes));
  return Run(ctx,
             QuantizeRowsArgs{{op}, x, rows, cols, valid_rows, block_size, dtype, calib, q, scales},
             &Backend::QuantizeRows);
}

Status DequantizeRows(Context& ctx, const uint8_t* q, int64_t rows, int64_t cols,
                      int64_t block_size, const float* scales, QuantDType dtype, float* x) {
  const Op op = Op::kDequantizeRows;
  FP8MOE_RETURN_IF_ERROR(NonNegative(op, "block_size", block_size));
  FP8MOE_RETURN_IF_ERROR(Format(op, dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "q", q, {rows, cols}, 1));
  const Shape scale_dims{rows, NumBlocks(cols, block_size)};
  FP8MOE_RETURN_IF_ERROR(Operand(op, "scales", scales, scale_dims));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {rows, cols}));
  const size_t x_bytes = Bytes({rows, cols}, 4);
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "x", x, x_bytes, "q", q, Bytes({rows, cols}, 1)));
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "x", x, x_bytes, "scales", scales, Bytes(scale_dims, 4)));
  return Run(ctx, DequantizeRowsArgs{{op}, q, scales, rows, cols, block_size, dtype, x},
             &Backend::DequantizeRows);
}

Status QuantizeChannels(Context& ctx, const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q, float* scales) {
  const Op op = Op::kQuantizeChannels;
  FP8MOE_RETURN_IF_ERROR(Format(op, dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "w", w, {experts, k, n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "q", q, {experts, k, n}, 1));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "scales", scales, {experts, n}));
  const size_t w_bytes = Bytes({experts, k, n}, 4);
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "q", q, Bytes({experts, k, n}, 1), "w", w, w_bytes));
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "scales", scales, Bytes({experts, n}, 4), "w", w, w_bytes));
  return Run(ctx, QuantizeChannelsArgs{{op}, w, experts, k, n, dtype, calib, q, scales},
             &Backend::QuantizeChannels);
}

Status DequantizeChannelsToBf16(Context& ctx, const uint8_t* q, int64_t experts, int64_t k,
                                int64_t n, const float* scales, QuantDType dtype,
                                uint16_t* out) {
  const Op op = Op::kDequantizeChannelsToBf16;
  FP8MOE_RETURN_IF_ERROR(Format(op, dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "q", q, {experts, k, n}, 1));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "scales", scales, {experts, n}));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {experts, k, n}, 2));
  const size_t out_bytes = Bytes({experts, k, n}, 2);
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "out", out, out_bytes, "q", q, Bytes({experts, k, n}, 1)));
  FP8MOE_RETURN_IF_ERROR(
      Disjoint(op, "out", out, out_bytes, "scales", scales, Bytes({experts, n}, 4)));
  return Run(ctx, DequantizeChannelsToBf16Args{{op}, q, scales, experts, k, n, dtype, out},
             &Backend::DequantizeChannelsToBf16);
}

Status ScaleToF32(Context& ctx, const void* x, DType x_dtype, int64_t rows, int64_t cols,
                  const int32_t* group_sizes, int64_t groups, ScaleBy by, const float* scale,
                  float* out) {
  const Op op = Op::kScaleToF32;
  if (x_dtype != DType::kF32 && x_dtype != DType::kBF16) {
    return QuantError(op, "x is " + std::string(DTypeName(x_dtype)) + "; it must be f32 or bf16");
  }
  if (by != ScaleBy::kRow && by != ScaleBy::kGroupColumn) {
    return QuantError(op, "scale_by " + std::to_string(static_cast<int>(by)) +
                              " is neither per row nor per (group, column)");
  }
  const size_t elem = DTypeSize(x_dtype);
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {rows, cols}, elem));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "group_sizes", group_sizes, {groups}));
  if (const Status s = CheckGroupSizes(group_sizes, groups, rows); !s.ok()) {
    return QuantError(op, s.message());
  }
  const Shape scale_dims = by == ScaleBy::kRow ? Shape{rows} : Shape{groups, cols};
  FP8MOE_RETURN_IF_ERROR(Operand(op, "scale", scale, scale_dims));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "out", out, {rows, cols}));
  const size_t out_bytes = Bytes({rows, cols}, 4);
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "out", out, out_bytes, "x", x, Bytes({rows, cols}, elem)));
  FP8MOE_RETURN_IF_ERROR(Disjoint(op, "out", out, out_bytes, "scale", scale, Bytes(scale_dims, 4)));
  return Run(ctx,
             ScaleToF32Args{{op}, x, x_dtype, rows, cols, group_sizes, groups, by, scale, out},
             &Backend::ScaleToF32);
}

Result<Fp8CodeCounts> Fp8HealthCount(Context& ctx, const uint8_t* q, const float* x, int64_t n,
                                     QuantDType dtype) {
  const Op op = Op::kFp8HealthCount;
  FP8MOE_RETURN_IF_ERROR(Format(op, dtype));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "q", q, {n}, 1));
  FP8MOE_RETURN_IF_ERROR(Operand(op, "x", x, {n}));
  Fp8CodeCounts counts;
  FP8MOE_RETURN_IF_ERROR(
      Run(ctx, Fp8HealthCountArgs{{op}, q, x, n, dtype, &counts}, &Backend::Fp8HealthCount));
  return counts;
}

}  // namespace fp8moe::internal
