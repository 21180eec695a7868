// Plain-loop twins of the quantizers in quantize.cc: one element at a time,
// straight from the definitions in docs/design.md §3.2.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "fp8moe/quant.h"
#include "quant/quant_internal.h"

namespace fp8moe::reference {
namespace {

// amax over x[0..n) with stride; NaN if any element is NaN.
float AbsMax(const float* x, int64_t n, int64_t stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i * stride];
    if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
    amax = std::fmax(amax, std::fabs(v));
  }
  return amax;
}

// The scale of one group, from the definitions in quant.h.
float GroupScale(float amax, QuantDType dtype, const Calibration& calib) {
  const bool fixed = calib.kind == Calibration::Kind::kFixed;
  if (fixed) amax = calib.FixedAmax();
  const float fmax = QuantMax(dtype);
  if (calib.arithmetic == ScaleArithmetic::kExactDivide) {
    if (std::isnan(amax)) return amax;
    return std::fmax(amax, 1e-12f) / fmax;
  }
  const float reciprocal_fmax = 1.0f / fmax;
  const float scale = fixed ? amax / fmax : amax * reciprocal_fmax;
  const float tiny_sqrt = std::sqrt(std::numeric_limits<float>::min());
  return scale < tiny_sqrt ? 1.0f : scale;
}

uint8_t Code(float x, float scale, QuantDType dtype, const Calibration& calib) {
  return QuantizeValue(x, scale, dtype, calib.arithmetic);
}

}  // namespace

Status QuantizeTensor(const float* x, int64_t n, QuantDType dtype,
                      const Calibration& calib, uint8_t* q, float* scale) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"n", n}}));
  *scale = GroupScale(AbsMax(x, n, 1), dtype, calib);
  for (int64_t i = 0; i < n; ++i) q[i] = Code(x[i], *scale, dtype, calib);
  return OkStatus();
}

Status QuantizeRows(const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckRowArgs(rows, cols, valid_rows, block_size));
  const int64_t nb = NumBlocks(cols, block_size);
  const int64_t bs = block_size > 0 ? block_size : cols;
  if (cols == 0 && nb == 0) return OkStatus();  // nothing to write
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * bs, c1 = std::min(cols, c0 + bs);
      if (r >= valid_rows) {
        scales[r * nb + b] = 0.0f;
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = 0;
        continue;
      }
      const float s = GroupScale(AbsMax(x + r * cols + c0, c1 - c0, 1), dtype, calib);
      scales[r * nb + b] = s;
      for (int64_t c = c0; c < c1; ++c) {
        q[r * cols + c] = Code(x[r * cols + c], s, dtype, calib);
      }
    }
  }
  return OkStatus();
}

Status QuantizeChannels(const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q,
                        float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"experts", experts}, {"k", k}, {"n", n}}));
  FP8MOE_RETURN_IF_ERROR(internal::CheckBuffer("w [experts, k, n]", {experts, k, n}, sizeof(float)));
  if (n == 0) return OkStatus();  // no channels: nothing to write
  for (int64_t e = 0; e < experts; ++e) {
    const float* we = w + e * k * n;
    for (int64_t j = 0; j < n; ++j) {
      const float s = GroupScale(AbsMax(we + j, k, n), dtype, calib);
      scales[e * n + j] = s;
      for (int64_t i = 0; i < k; ++i) {
        q[e * k * n + i * n + j] = Code(we[i * n + j], s, dtype, calib);
      }
    }
  }
  return OkStatus();
}

Status QuantizeGroupTileChannels(const float* x, int64_t m, int64_t c,
                                 const int32_t* group_sizes, int64_t groups,
                                 int64_t tile_m, QuantDType dtype,
                                 const Calibration& calib, uint8_t* q,
                                 float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"m", m}, {"c", c}}));
  FP8MOE_RETURN_IF_ERROR(internal::CheckBuffer("x [m, c]", {m, c}, sizeof(float)));
  FP8MOE_RETURN_IF_ERROR(NumGroupTiles(group_sizes, groups, m, tile_m).status());
  if (c == 0) return OkStatus();  // no channels: nothing to write
  if (m * c > 0) std::memset(q, 0, static_cast<size_t>(m * c));  // tail stays 0
  const auto tiles = internal::GroupTiles(group_sizes, groups, tile_m);
  for (size_t t = 0; t < tiles.size(); ++t) {
    const auto [first, rows] = tiles[t];
    for (int64_t j = 0; j < c; ++j) {
      const float s = GroupScale(AbsMax(x + first * c + j, rows, c), dtype, calib);
      scales[t * c + j] = s;
      for (int64_t i = first; i < first + rows; ++i) {
        q[i * c + j] = Code(x[i * c + j], s, dtype, calib);
      }
    }
  }
  return OkStatus();
}

}  // namespace fp8moe::reference
