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

// Rows [first, first + rows) of one (group, tile) pair.
struct RowTile {
  int64_t first;
  int64_t rows;
};

// The tiles of NumGroupTiles in group order (group_sizes already checked).
inline std::vector<RowTile> GroupTiles(const int32_t* group_sizes,
                                       int64_t groups, int64_t tile_m) {
  std::vector<RowTile> tiles;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = group_sizes[g];
    if (tile_m == 0) {
      tiles.push_back({row, size});
    } else {
      for (int64_t t0 = 0; t0 < size;) {  // steps never pass size: no overflow
        const int64_t rows = std::min(tile_m, size - t0);
        tiles.push_back({row + t0, rows});
        t0 += rows;
      }
    }
    row += size;
  }
  return tiles;
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_QUANT_QUANT_INTERNAL_H_
