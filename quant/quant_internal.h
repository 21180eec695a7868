// Argument checks and tile enumeration shared by the quantizers and their
// reference twins.
#ifndef FP8MOE_QUANT_QUANT_INTERNAL_H_
#define FP8MOE_QUANT_QUANT_INTERNAL_H_

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "fp8moe/quant.h"
#include "fp8moe/tensor.h"

namespace fp8moe::internal {

// Every named dimension must be >= 0.
inline Status CheckDims(
    std::initializer_list<std::pair<const char*, int64_t>> dims) {
  for (const auto& [name, v] : dims) {
    if (v < 0) {
      return InvalidArgument(std::string(name) + " = " + std::to_string(v) +
                             " is negative");
    }
  }
  return OkStatus();
}

// The buffer of `dims` (elements of `elem_bytes`) must be addressable: its
// nonzero dimensions multiplied stay in range (tensor.h's rule), so index
// arithmetic such as r * cols + c cannot overflow even when a dimension is 0.
inline Status CheckBuffer(const char* what, const Shape& dims, size_t elem_bytes) {
  const auto n = CheckedNumElements(dims, elem_bytes);
  if (!n.ok()) return InvalidArgument(std::string(what) + ": " + n.status().message());
  return OkStatus();
}

inline Status CheckRowArgs(int64_t rows, int64_t cols, int64_t valid_rows,
                           int64_t block_size) {
  FP8MOE_RETURN_IF_ERROR(CheckDims({{"rows", rows}, {"cols", cols},
                                    {"valid_rows", valid_rows},
                                    {"block_size", block_size}}));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("x [rows, cols]", {rows, cols}, sizeof(float)));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("scales [rows, blocks]",
                                     {rows, NumBlocks(cols, block_size)}, sizeof(float)));
  if (valid_rows > rows) {
    return InvalidArgument("valid_rows = " + std::to_string(valid_rows) +
                           " exceeds rows = " + std::to_string(rows));
  }
  return OkStatus();
}

// One row x [cols] of QuantizeRows (fp8moe/quant.h): codes q [cols] and a
// scale per block of block_size columns (0: one for the row) in scales.
// Serial: it opens no parallel region, so a caller's threads can each
// quantize rows of their own (the GMM's activation) without nesting one.
void QuantizeOneRow(const float* x, int64_t cols, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales);

// The same row as bf16 bits x [cols]: the codes and scales of QuantizeOneRow
// on the row widened to f32 (exact), read without widening it in memory.
void QuantizeOneRowBf16(const uint16_t* x, int64_t cols, int64_t block_size, QuantDType dtype,
                        const Calibration& calib, uint8_t* q, float* scales);

// The same row's values instead of its codes: values [cols] holds the bf16
// bits of each code's value (what decoding the codes of QuantizeOneRow gives,
// NaN included; every fp8 value is a bf16 value), scales as QuantizeOneRow.
// What a native fp8 GEMM packs (kernels/cpu/gemm_exec.cc), without the
// codes' round trip. e4m3fn and e4m3fnuz only, native fp8's formats (a
// caller's invariant: FP8MOE_DCHECK).
void QuantizeOneRowValues(const float* x, int64_t cols, int64_t block_size, QuantDType dtype,
                          const Calibration& calib, uint16_t* values, float* scales);
void QuantizeOneRowValues(const uint16_t* x, int64_t cols, int64_t block_size, QuantDType dtype,
                          const Calibration& calib, uint16_t* values, float* scales);

// Rows [first, first + rows) of one (group, tile) pair.
struct RowTile {
  int64_t first;
  int64_t rows;
};

// Writes the tiles of NumGroupTiles in group order to tiles [NumGroupTiles]
// (group_sizes already checked); returns how many it wrote.
inline int64_t FillGroupTiles(const int32_t* group_sizes, int64_t groups, int64_t tile_m,
                              RowTile* tiles) {
  int64_t n = 0, row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = group_sizes[g];
    if (tile_m == 0) {
      tiles[n++] = {row, size};
    } else {
      for (int64_t t0 = 0; t0 < size;) {  // steps never pass size: no overflow
        const int64_t rows = std::min(tile_m, size - t0);
        tiles[n++] = {row + t0, rows};
        t0 += rows;
      }
    }
    row += size;
  }
  return n;
}

// The same tiles in a vector (the reference twins and the callers that may
// allocate).
inline std::vector<RowTile> GroupTiles(const int32_t* group_sizes,
                                       int64_t groups, int64_t tile_m) {
  int64_t count = 0;
  for (int64_t g = 0; g < groups; ++g) {
    count += tile_m == 0 ? 1 : (group_sizes[g] + tile_m - 1) / tile_m;
  }
  std::vector<RowTile> tiles(static_cast<size_t>(count));
  FillGroupTiles(group_sizes, groups, tile_m, tiles.data());
  return tiles;
}

// QuantizeGroupTileChannels (fp8moe/quant.h) on the caller's scratch, for
// callers that must not allocate (a training step): arguments already
// checked (num_tiles from NumGroupTiles); tiles [num_tiles], acc
// [threads, c] and inv [threads, c] (read only with kXlaReciprocal, may be
// null otherwise) are scratch; runs on `threads` threads (the bits do not
// depend on it: each tile is one thread's).
void QuantizeGroupTileChannelsWith(const float* x, int64_t m, int64_t c,
                                   const int32_t* group_sizes, int64_t groups, int64_t tile_m,
                                   int64_t num_tiles, QuantDType dtype, const Calibration& calib,
                                   uint8_t* q, float* scales, int threads, RowTile* tiles,
                                   int32_t* acc, float* inv);

}  // namespace fp8moe::internal

#endif  // FP8MOE_QUANT_QUANT_INTERNAL_H_
