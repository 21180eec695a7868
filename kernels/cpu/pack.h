// Packing of GEMM operands into the panels the microkernels read, with the
// operand conversion fused in (bf16 -> f32, fp8 decode, per-channel scale,
// rounding to bf16, int8 -> int16). The packers are per-target code
// (pack-inl.h, compiled for every SIMD target with the kernels that read
// their panels); this header holds their plain-data types and the
// dispatched entry points the tests call.
//
// Panels (MR, NR: the kernel's register tile):
//   A, f32:    [ceil(rows/MR)][kc][MR]        element (i, r)
//   A, pairs:  [ceil(rows/MR)][kc/2][MR] u32  (A(i, 2p) | A(i, 2p+1) << 16)
//   B, f32:    [ceil(cols/NR)][kc][NR]        element (r, j)
//   B, pairs:  [ceil(cols/NR)][kc/2][NR] u32
// Rows, columns and reduction steps past the end are zero, so the kernels
// always run full tiles.
#ifndef FP8MOE_KERNELS_CPU_PACK_H_
#define FP8MOE_KERNELS_CPU_PACK_H_

#include <cstddef>
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

// The source rows [r_begin, r_end) and columns [c0, c0 + n) that a pack
// reads (RegionOfA / RegionOfB), for prefetching it ahead of the pack.
struct SourceRegion {
  int64_t r_begin = 0, r_end = 0, c0 = 0, n = 0;
};

// What PackAT(a, kind, i0, rows, r0, kc, ...) reads.
inline SourceRegion RegionOfA(const Operand& a, int64_t i0, int64_t rows, int64_t r0,
                              int64_t kc) {
  return a.transposed ? SourceRegion{r0, r0 + kc, i0, rows} : SourceRegion{i0, i0 + rows, r0, kc};
}

// What PackBT reads for one column run [c0, c0 + count) over [r0, r0 + kc).
inline SourceRegion RegionOfB(const Operand& b, int64_t r0, int64_t kc, int64_t c0,
                              int64_t count) {
  return b.transposed ? SourceRegion{c0, c0 + count, r0, kc} : SourceRegion{r0, r0 + kc, c0, count};
}

// Bytes of panels covering `extent` rows (A) or columns (B) in tiles of
// `tile` (MR or NR) over a reduction block of kc: the one rule that sizes
// the packing buffers (gemm_exec.cc allocates with it, and checks every
// pack against it).
inline size_t PanelBytes(PanelKind kind, int64_t extent, int64_t tile, int64_t kc) {
  const int64_t panels = (extent + tile - 1) / tile;
  const int64_t depth = kind == PanelKind::kF32 ? kc : (kc + 1) / 2;
  return static_cast<size_t>(panels * depth * tile) * 4;
}

// The rows a packer converts before it lays them into panels, carved
// out of one worker buffer. `width` bounds every row length a pack of this
// call converts (padded columns, padded rows of a transposed A, kc + 1).
struct PackScratch {
  static constexpr int64_t kTransposeRows = 16;  // rows transposed together
  float* f32 = nullptr;   // [width]
  float* tmp = nullptr;   // [width]
  float* zero = nullptr;  // [width], all zero
  float* rows = nullptr;  // [kTransposeRows * (kc + 1)]; pairs: 4 rows of kc + 2 halves
  uint16_t* lo = nullptr;  // [width]
  uint16_t* hi = nullptr;  // [width]
  int64_t width = 0, kc = 0;

  static size_t Bytes(int64_t width, int64_t kc) {
    return static_cast<size_t>(3 * width + kTransposeRows * (kc + 1)) * sizeof(float) +
           static_cast<size_t>(2 * width) * sizeof(uint16_t);
  }
  // Lays the scratch out over `bytes` >= Bytes(width, kc) at p.
  void Carve(uint8_t* p, int64_t w, int64_t k);
};

// Dispatched to the best SIMD target (tests; the executor calls the
// per-target packers directly). ap / bp must hold PanelBytes(...).
// A rows [i0, i0 + rows) x reduction [r0, r0 + kc) into MR panels.
void PackA(const Operand& a, PanelKind kind, int64_t i0, int64_t rows, int64_t r0,
           int64_t kc, int64_t mr, void* ap, PackScratch& s);
// B reduction [r0, r0 + kc) x the columns of `cols` into NR panels; returns
// the number of panels written.
int64_t PackB(const Operand& b, PanelKind kind, int64_t r0, int64_t kc, const ColumnRuns& cols,
              int64_t nr, void* bp, PackScratch& s);

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_PACK_H_
