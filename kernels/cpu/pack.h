// Packing of GEMM operands into the panels the microkernels read, with the
// operand conversion fused in (bf16 -> f32, fp8 decode, per-channel or
// per-row-tile scale, rounding to bf16, int8 -> int16).
//
// Panels (MR, NR: the kernel's register tile):
//   A, f32:    [ceil(rows/MR)][kc][MR]        element (i, r)
//   A, pairs:  [ceil(rows/MR)][kc/2][MR] u32  (A(i, 2p) | A(i, 2p+1) << 16)
//   B, f32:    [ceil(cols/NR)][kc][NR]        element (r, j)
//   B, pairs:  [ceil(cols/NR)][kc/2][NR] u32
// Rows, columns and reduction steps past the end are zero, so the kernels
// always run full tiles. A packer is amortised over the other operand's
// extent (A over the item's columns, B over its rows), so these are plain
// loops; the ones on hot paths are written so the compiler vectorises them.
#ifndef FP8MOE_KERNELS_CPU_PACK_H_
#define FP8MOE_KERNELS_CPU_PACK_H_

#include <cstdint>

#include "kernels/cpu/gemm_call.h"

namespace fp8moe::internal {

// What a packer produces.
enum class PanelKind : uint8_t { kF32, kBf16Pairs, kI16Pairs };

// Columns of B taken from up to two runs of source columns (SwiGLU packs the
// gate and up halves of a tile side by side; each run starts a fresh panel).
struct ColumnRuns {
  int64_t start[2] = {0, 0};
  int64_t count = 0;  // columns per run
  int runs = 1;
};

// A view of one operand for one group: source element (row, col).
struct Operand {
  const Source* src;
  int32_t group;
  bool transposed;  // the GEMM's (i, r) or (r, j) is the source's (col, row)
};

// A rows [i0, i0 + rows) x reduction [r0, r0 + kc) into MR panels.
void PackA(const Operand& a, PanelKind kind, int64_t i0, int64_t rows,
           int64_t r0, int64_t kc, int64_t mr, void* ap);

// B reduction [r0, r0 + kc) x the columns of `cols` into NR panels; returns
// the number of panels written.
int64_t PackB(const Operand& b, PanelKind kind, int64_t r0, int64_t kc,
              const ColumnRuns& cols, int64_t nr, void* bp);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_PACK_H_
