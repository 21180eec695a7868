// Grouped matmuls of the routed experts (docs/design.md §2, §3.3, §4): the forward
// GMM, the activation gradient dLHS and the weight gradient TGMM, in every
// operand mode, ragged-safe and deterministic for any thread count.
//
// Rows are sorted by group: group g owns rows [off_g, off_g + group_sizes[g])
// with off_g = sum of the sizes before it. Rows past sum(group_sizes) are tail
// rows of a static buffer: never read (they may hold NaN or Inf) and their
// output rows are written as zero. Empty groups are legal. Negative sizes or
// a sum above M are errors.
//
// Operands are read through ConstTensorViews and outputs written through
// TensorViews (fp8moe/tensor.h); an output's view converts to an operand's,
// so a buffer just written may be handed to the next call as its input.
//
// Every function has a twin in namespace fp8moe::reference (plain loops,
// double accumulation) with the signature of the overload without a Context
// and the same validation.
//
// Each runs on a Context (context.h): its backend (the fast CPU kernels, or
// the reference twins as a backend), its threads and its scratch memory,
// kept from call to call so that a repeated call allocates nothing. The
// overloads without a Context run on DefaultContext(), one call at a time.
#ifndef FP8MOE_GMM_H_
#define FP8MOE_GMM_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "fp8moe/context.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {

// How the operands of a GMM are represented (docs/design.md §4).
//  kF32       f32 x f32, f32 accumulation.
//  kBf16      bf16 x bf16, f32 accumulation.
//  kFakeQat   rhs codes + per-channel scale are first dequantized to a BF16
//             copy w = bf16(f32(q) * s) (allocated and written), then kBf16.
//  kNativeFp8 rhs codes + scale read directly; lhs quantized per row inside
//             the call (quant_dtype, f32 scale, full K or K-blocks) from its
//             valid rows; f32 accumulation of exact fp8 x fp8 products:
//             out[i,n] = (sum_k qa[i,k] qw[g,k,n]) * sa[i] * sw[g,n], or with
//             K-blocks (sum_b sa[i,b] sum_{k in b} qa qw) * sw[g,n].
//             No BF16 copy of the weight is made.
//  kInt8      lhs quantized per row to int8 inside the call, rhs int8 codes +
//             per-channel scale; int32 accumulation:
//             out[i,n] = f32(sum_k qa qw) * sa[i] * sw[g,n].
enum class GmmMode : uint8_t { kF32, kBf16, kFakeQat, kNativeFp8, kInt8 };

std::string_view GmmModeName(GmmMode mode);  // "f32", "bf16", "fake_qat", ...
Result<GmmMode> ParseGmmMode(std::string_view name);

enum class GmmEpilogue : uint8_t {
  kNone,
  // Gmm only, for wi [E, D, 2F]: the 2F columns are gate [0, F) | up [F, 2F);
  // out [M, F] = silu(gate) * up. The pre-activation may be kept (h_out).
  kSwiGlu,
  // GmmDlhs only, for wo's input: the product is da [M, F]; with the saved
  // pre-activation h [M, 2F] the output is dh [M, 2F]:
  // dgate = da * up * silu'(gate), dup = da * silu(gate).
  kDSwiGlu,
};

// Tile sizes of one pass (fwd, dlhs or drhs); unset ones are chosen per
// shape. m: the most rows of a work item (a taller group is cut into
// near-equal items) (drhs: rows reduced per block, which is also
// the in-kernel quantization tile when set; unset, the block is 256 rows and
// the quantization tile 512), k: reduction block (drhs: output rows per
// item), n: columns per item. Any positive size is accepted and gives the
// same bits as any other: sizes the kernel cannot take exactly are adjusted
// (docs/kernels.md). 0, negative, an odd k, or a size above kMaxGmmTile are
// errors.
struct GmmTiles {
  std::optional<int64_t> m, k, n;
};

// The largest tile size accepted (2^20). Bounding tiles keeps every tile
// computation (row + tile, tile + 1) far from int64 overflow; a tile larger
// than its dimension acts as the whole dimension anyway.
inline constexpr int64_t kMaxGmmTile = int64_t{1} << 20;

struct GmmOptions {
  GmmMode mode = GmmMode::kBf16;
  // kNativeFp8: kE4M3FN, or kE4M3FNUZ for the nanoo_fp8 scheme.
  QuantDType fp8_dtype = QuantDType::kE4M3FN;
  // kNativeFp8: 0 (a scale per row over the full K), 128 or 512.
  int64_t lhs_quant_block_size = 0;
  // kNativeFp8, kInt8: how the activation's scales are found (absmax per row
  // or block, or one fixed scale).
  Calibration lhs_calibration;
  GmmEpilogue epilogue = GmmEpilogue::kNone;
  GmmTiles tiles;
};

// out [M, N] (kSwiGlu: [M, N/2]) = lhs [M, K] x rhs [E, K, N] per group.
//  lhs: F32 (kF32); BF16 (kBf16, kFakeQat); F32 or BF16 (kNativeFp8, kInt8).
//  rhs: F32 (kF32), BF16 (kBf16), codes of fp8_dtype (kFakeQat, kNativeFp8;
//       kFakeQat accepts any fp8 format) or I8 (kInt8).
//  rhs_scale: F32 [E, N], required exactly when rhs holds codes.
//  group_sizes: I32 [E].  out: F32 or BF16.
//  h_out (kSwiGlu only, optional): F32 or BF16 [M, N], the pre-activation.
Status Gmm(Context& ctx, const GmmOptions& options, const ConstTensorView& lhs,
           const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
           const ConstTensorView& group_sizes, const TensorView& out,
           const TensorView* h_out = nullptr);
Status Gmm(const GmmOptions& options, const ConstTensorView& lhs, const ConstTensorView& rhs,
           const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
           const TensorView& out, const TensorView* h_out = nullptr);

// dlhs [M, K] = dout [M, N] x rhs[g]^T per group (rhs [E, K, N]).
//  kF32: dout F32; rhs F32, or codes + scale used as f32(q) * s.
//  kBf16: dout BF16; rhs BF16, or codes + scale dequantized tile by tile
//         inside the kernel to bf16(f32(q) * s): no BF16 copy is made, and
//         the result is bit-identical to kFakeQat's.
//  kFakeQat: dout BF16; rhs codes + scale, dequantized to a BF16 copy first.
//  kDSwiGlu: h [M, 2K] (F32 or BF16) is required and out is dh [M, 2K].
//  out: F32 or BF16.
Status GmmDlhs(Context& ctx, const GmmOptions& options, const ConstTensorView& dout,
               const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
               const ConstTensorView& group_sizes, const TensorView& out,
               const ConstTensorView* h = nullptr);
Status GmmDlhs(const GmmOptions& options, const ConstTensorView& dout, const ConstTensorView& rhs,
               const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
               const TensorView& out, const ConstTensorView* h = nullptr);

// How TGMM treats its gradient operand (the fp8_full recipe, docs/design.md §4).
struct TgmmQuant {
  // Quantize dout with this fp8 dtype (kE5M2 or kE4M3FN), or not at all.
  std::optional<QuantDType> dout_dtype;
  // true: one scale per (group, channel) over the group's valid rows (the
  // dense path). false: one scale per (m-tile of the group, channel), the
  // m-tile being tiles.m (default 512) (the in-kernel path,
  // moe_bwd_inkernel_quant).
  bool per_group = true;
  // How each scale's amax is found (bwd_quantization_calibration_method).
  Calibration calibration;
};

// drhs [E, K, N] = lhs[rows of g]^T x dout[rows of g] for every group g; an
// empty group gives an all-zero slice.
//  kF32: lhs, dout F32.  kBf16: lhs, dout BF16.
//  lhs may instead hold fp8 codes (the forward's quantized activation), used
//  as their exact values f32(q) without a scale, in either mode.
//  With quant.dout_dtype, dout (F32) is quantized inside the call over valid
//  rows only and used dequantized: f32(q) * scale.
//  drhs: F32.
Status Tgmm(Context& ctx, const GmmOptions& options, const TgmmQuant& quant,
            const ConstTensorView& lhs, const ConstTensorView& dout,
            const ConstTensorView& group_sizes, const TensorView& drhs);
Status Tgmm(const GmmOptions& options, const TgmmQuant& quant, const ConstTensorView& lhs,
            const ConstTensorView& dout, const ConstTensorView& group_sizes,
            const TensorView& drhs);

// The kernels keep their scratch (packing buffers, activation codes, the
// fake-QAT weight copy) in the Context from call to call; this frees
// DefaultContext()'s (Context::ReleaseScratch frees another's).
void ReleaseGmmScratch();

namespace reference {
Status Gmm(const GmmOptions& options, const ConstTensorView& lhs, const ConstTensorView& rhs,
           const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
           const TensorView& out, const TensorView* h_out = nullptr);
Status GmmDlhs(const GmmOptions& options, const ConstTensorView& dout, const ConstTensorView& rhs,
               const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
               const TensorView& out, const ConstTensorView* h = nullptr);
Status Tgmm(const GmmOptions& options, const TgmmQuant& quant, const ConstTensorView& lhs,
            const ConstTensorView& dout, const ConstTensorView& group_sizes,
            const TensorView& drhs);
}  // namespace reference

}  // namespace fp8moe

#endif  // FP8MOE_GMM_H_
