// The description of one grouped GEMM that gmm.cc plans and the per-target
// executor (gemm_exec.cc) runs. Plain data, no SIMD types, so the planner
// stays target-independent.
//
// Every pass computes, for each work item, an output tile
//   C[i, j] = sum_r A(i, r) * B(r, j)
// over the item's reduction range, then an epilogue writes it out:
//   kFwd   A = lhs rows of group g   [rows, K],  B = rhs[g]        [K, N]
//   kDlhs  A = dout rows of group g  [rows, N],  B = rhs[g]^T      [N, K]
//   kTgmm  A = lhs^T of group g      [K, rows],  B = dout rows     [rows, N]
// Work items never share an output element, so the result does not depend
// on how items are spread over threads.
#ifndef FP8MOE_KERNELS_CPU_GEMM_CALL_H_
#define FP8MOE_KERNELS_CPU_GEMM_CALL_H_

#include <cstdint>
#include <vector>

#include "fp8moe/context.h"
#include "fp8moe/dtype.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"

namespace fp8moe::internal {

enum class Pass : uint8_t { kFwd, kDlhs, kTgmm };

// How a source element becomes a value.
enum class SrcKind : uint8_t {
  kF32,   // f32
  kBf16,  // bf16 bits
  kFp8,   // fp8 codes: DecodeFp8, then the optional scale
  kI8,    // int8 codes (integer GEMM only)
};

// A row-major 2-D source, element (r, c) at data + r * ld + c. For rhs the
// group g's matrix starts group_stride elements further per group.
struct Source {
  SrcKind kind = SrcKind::kF32;
  const void* data = nullptr;
  int64_t ld = 0;
  int64_t group_stride = 0;
  Fp8Format fp8 = Fp8Format::kE4M3FN;
  // Optional per-channel scale of kFp8 sources: value = dec(q) * scale with
  // scale = col_scale[g * col_scale_group_stride + c].
  const float* col_scale = nullptr;
  int64_t col_scale_group_stride = 0;
  // Round the scaled value to bf16 (the fake-QAT weight copy's values).
  bool round_bf16 = false;
  // Row r is stored at (r - first_row) * ld: a buffer that holds rows from
  // first_row on (an item's activation codes, LhsQuantPlan).
  int64_t first_row = 0;

  // Bytes per stored element.
  size_t ElementBytes() const {
    return kind == SrcKind::kF32 ? 4 : kind == SrcKind::kBf16 ? 2 : 1;
  }
};

// What happens to the finished f32 (or int32) tile.
struct Epilogue {
  enum class Kind : uint8_t {
    kStore,    // out = C
    kSwiGlu,   // C holds gate | up halves: out = silu(gate) * up, h_out = C
    kDSwiGlu,  // C is da: out = dh from da and h
    kAccumulateF32,  // (internal) C is the f32 output itself
  };
  Kind kind = Kind::kStore;
  // out[i, col] with i the absolute row; F32 or BF16.
  void* out = nullptr;
  DType out_dtype = DType::kF32;
  int64_t out_ld = 0;
  // Optional scaling before anything else: C * row_scale[i] * col_scale[col]
  // (native fp8 and int8: the activation and weight scales).
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;  // + g * col_scale_group_stride
  int64_t col_scale_group_stride = 0;
  // kSwiGlu: the pre-activation h_out [M, 2F] (optional), written.
  // kDSwiGlu: the saved pre-activation h [M, 2K], read. Both F32 or BF16.
  void* h_out = nullptr;
  const void* h = nullptr;
  DType h_dtype = DType::kF32;
  int64_t h_ld = 0;
  int64_t half = 0;  // F (kSwiGlu) or K (kDSwiGlu): offset of the up half
};

// Native fp8 and int8 forward: the activation's codes made item by item
// instead of in a pre-pass over all rows. Where every item holds all the
// columns of its rows (no row is quantized twice), an item quantizes its
// rows (or, in row-block order, each block of rows) into its worker's
// buffer just before packing them, writes their scales, and packs A from
// that buffer: the same codes and scales (QuantizeOneRow), without writing
// them all to memory and reading them back. A packed fp8 item writes the
// codes' values instead (bf16 bits, QuantizeOneRowValues: what packing
// would decode the codes to), so its A is packed as bf16; a direct item
// (and int8) keeps the codes, which its kernel reads raw.
struct LhsQuantPlan {
  const void* x = nullptr;  // lhs [m, k], F32 or BF16 (bf16)
  bool bf16 = false;
  int64_t k = 0;
  int64_t block = 0;  // K-block of the scales; 0: one per row
  QuantDType dtype = QuantDType::kE4M3FN;
  Calibration calib;
  float* scales = nullptr;  // [m, blocks]: row r's at r * blocks
  int64_t blocks = 0;

  // Bytes per activation element in a worker's buffer: the values' bf16
  // (native fp8's e4m3 formats, packed items), else a code.
  size_t BufferElementBytes() const { return dtype == QuantDType::kInt8 ? 1 : 2; }
};

struct WorkItem {
  int32_t group;
  int64_t row0, rows;  // output rows (absolute for kFwd/kDlhs; K rows for kTgmm)
  int64_t col0, cols;  // output columns (logical: kSwiGlu counts a's columns)
  int64_t red0, red_len;  // reduction range (kTgmm: absolute rows of the group)
};

struct GemmCall {
  Pass pass = Pass::kFwd;
  bool integer = false;  // int8 x int8 with int32 accumulation
  Source a, b;
  // Native fp8 with K-blocks: partial sums per block of `block` (> 0 only
  // then) reduction steps are scaled by a_block_scale[i * a_block_scale_ld +
  // block index].
  const float* a_block_scale = nullptr;
  int64_t a_block_scale_ld = 0;
  int64_t block = 0;
  // TGMM with a quantized gradient: B holds its raw codes and the scales are
  // applied per reduction tile and column, C[i, j] += scale[tile, j] * sum
  // over the tile (b_block > 0, the tile rows; blocks start at each group's
  // first row), or once per group at the end (b_block == 0). The tile of an
  // absolute row r is b_row_tile[r].
  const float* b_col_scale = nullptr;  // [tiles, b_col_scale_ld]
  int64_t b_col_scale_ld = 0;
  const int32_t* b_row_tile = nullptr;
  int64_t b_block = 0;
  Epilogue epi;
  // Set: A's codes are made item by item from this (a holds their kind).
  const LhsQuantPlan* lhs_quant = nullptr;
  // Output of kTgmm: drhs[g] [K, N] f32 at out + g * out_group_stride.
  int64_t out_group_stride = 0;
  int64_t kc = 256;  // reduction block (even)
  std::vector<WorkItem> items;
  // Bounds on every item's rows and columns that depend on the shapes and
  // tiles only, never on the group sizes: the workers' buffers are sized by
  // them, so a trainer's steps (the same shapes, other routings) find their
  // buffers allocated by the first step. 0: the items' own largest.
  int64_t max_item_rows = 0, max_item_cols = 0, max_reduction_step = 0;

  // The reduction block the executor steps by: the K-block of block-scaled
  // activations, the gradient's quantization tile, or kc.
  int64_t ReductionStep() const { return block > 0 ? block : b_block > 0 ? b_block : kc; }
};

// Runs a planned call on the best SIMD target of this CPU with ctx's
// threads and worker scratch, counting each work item on its KernelPath.
Status ExecuteGemm(Context& ctx, const GemmCall& call);

// Whether the direct kernels may decode fp8 weights with byte tables on
// AVX512-VBMI CPUs (default true). For tests: false runs the u16 decode that
// AVX512-BF16 CPUs without VBMI (Cooper Lake) take.
bool Fp8ByteTableDecode();
void SetFp8ByteTableDecode(bool on);

// Whether packed forward and dLHS items taller than 512 rows of a call like
// this one with up to `cols` output columns and a reduction of red_len run
// in row-block order, B packed once for the whole reduction (gemm_exec.cc):
// the planner then makes such items whole groups (cpu_backend.cc).
bool RowBlockOrderFits(const GemmCall& call, int64_t cols, int64_t red_len);
// Row-block order on (default) or off. For tests: off runs every item in
// chunk order, B packed per reduction block; the bits are the same.
bool RowBlockOrderOn();
void SetRowBlockOrder(bool on);
// Whether packed items prefetch the source of their next pack while their
// register tiles run (PackPrefetch, default on). For A/B measurements; the
// bits are the same either way.
bool PackPrefetchOn();
void SetPackPrefetch(bool on);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_GEMM_CALL_H_
