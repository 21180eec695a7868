// Fast quantizers: SIMD spans from quantize-inl.h, threads over rows, tiles
// or chunks. Each has a plain-loop twin in quantize_reference.cc and gives the
// same bits for any thread count (amax is a max, which is exact).
#include <omp.h>

#include <bit>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "base/check.h"
#include "fp8moe/quant.h"
#include "quant/quant_internal.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant/quantize.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "quant/quantize-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

// q [n] = codes of x [n] (f32 or bf16 bits) by factors[kPerLane ? i : 0]:
// the run-time choices (format, arithmetic, finite) turned into one
// instantiation of QuantizeSpanT. multiply: `factors` hold reciprocal scales
// (ScaleArithmetic::kXlaReciprocal). finite (one scale only): every x is
// finite (the block's amax is), which leaves out the NaN handling
// (QuantizeVec's kFinite).
template <bool kPerLane, class TIn>
void QuantizeSpanOf(const TIn* x, size_t n, const float* factors, bool multiply, bool finite,
                    QuantDType dtype, uint8_t* q) {
#define FP8MOE_Q(D)                                                                       \
  if constexpr (!kPerLane) {                                                              \
    if (finite) {                                                                         \
      return multiply ? QuantizeSpanT<D, false, true, true>(x, n, factors, q)             \
                      : QuantizeSpanT<D, false, false, true>(x, n, factors, q);           \
    }                                                                                     \
  }                                                                                       \
  return multiply ? QuantizeSpanT<D, kPerLane, true, false>(x, n, factors, q)             \
                  : QuantizeSpanT<D, kPerLane, false, false>(x, n, factors, q)
  switch (dtype) {
    case QuantDType::kE4M3FN: FP8MOE_Q(QuantDType::kE4M3FN);
    case QuantDType::kE4M3FNUZ: FP8MOE_Q(QuantDType::kE4M3FNUZ);
    case QuantDType::kE5M2: FP8MOE_Q(QuantDType::kE5M2);
    case QuantDType::kE5M2FNUZ: FP8MOE_Q(QuantDType::kE5M2FNUZ);
    case QuantDType::kInt8: FP8MOE_Q(QuantDType::kInt8);
  }
#undef FP8MOE_Q
}

// f32 x with one factor or one per lane (per_lane: never finite).
void QuantizeSpan(const float* x, size_t n, const float* factors, bool per_lane,
                  bool multiply, bool finite, QuantDType dtype, uint8_t* q) {
  return per_lane ? QuantizeSpanOf<true>(x, n, factors, multiply, false, dtype, q)
                  : QuantizeSpanOf<false>(x, n, factors, multiply, finite, dtype, q);
}

// One scale over bf16 bits x [n] (a GMM's BF16 activation row or block).
void QuantizeSpanBf16(const uint16_t* x, size_t n, float factor, bool multiply, bool finite,
                      QuantDType dtype, uint8_t* q) {
  QuantizeSpanOf<false>(x, n, &factor, multiply, finite, dtype, q);
}

// values [n] = bf16 bits of the values of the codes QuantizeSpanOf<false>
// gives: the e4m3 formats of native fp8 only (QuantizeOneRowValues checks;
// the others would be instances nothing calls).
template <class TIn>
void QuantizeValuesSpanOf(const TIn* x, size_t n, float factor, bool multiply, bool finite,
                          QuantDType dtype, uint16_t* values) {
#define FP8MOE_V(D)                                                                    \
  if (finite) {                                                                        \
    return multiply ? QuantizeValuesSpanT<D, true, true>(x, n, factor, values)         \
                    : QuantizeValuesSpanT<D, false, true>(x, n, factor, values);       \
  }                                                                                    \
  return multiply ? QuantizeValuesSpanT<D, true, false>(x, n, factor, values)          \
                  : QuantizeValuesSpanT<D, false, false>(x, n, factor, values)
  switch (dtype) {
    case QuantDType::kE4M3FN: FP8MOE_V(QuantDType::kE4M3FN);
    case QuantDType::kE4M3FNUZ: FP8MOE_V(QuantDType::kE4M3FNUZ);
    case QuantDType::kE5M2:
    case QuantDType::kE5M2FNUZ:
    case QuantDType::kInt8: return;
  }
#undef FP8MOE_V
}

void QuantizeValuesSpan(const float* x, size_t n, float factor, bool multiply, bool finite,
                        QuantDType dtype, uint16_t* values) {
  QuantizeValuesSpanOf(x, n, factor, multiply, finite, dtype, values);
}

void QuantizeValuesSpanBf16(const uint16_t* x, size_t n, float factor, bool multiply,
                            bool finite, QuantDType dtype, uint16_t* values) {
  QuantizeValuesSpanOf(x, n, factor, multiply, finite, dtype, values);
}

uint32_t AbsMaxBits(const float* x, size_t n) { return AbsMaxBitsT(x, n); }

uint32_t AbsMaxBitsBf16(const uint16_t* x, size_t n) { return AbsMaxBitsBf16T(x, n); }

void AbsMaxAccumulate(const float* x, size_t n, int32_t* acc) {
  AbsMaxAccumulateT(x, n, acc);
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe {

HWY_EXPORT(QuantizeSpan);
HWY_EXPORT(QuantizeSpanBf16);
HWY_EXPORT(QuantizeValuesSpan);
HWY_EXPORT(QuantizeValuesSpanBf16);
HWY_EXPORT(AbsMaxBits);
HWY_EXPORT(AbsMaxBitsBf16);
HWY_EXPORT(AbsMaxAccumulate);

namespace {

constexpr int64_t kChunk = int64_t{1} << 16;
constexpr int64_t kParallelMin = int64_t{1} << 18;

float AmaxFromBits(uint32_t bits) {
  if (bits > 0x7F800000u) return std::numeric_limits<float>::quiet_NaN();
  return std::bit_cast<float>(bits);
}

bool Reciprocal(const Calibration& calib) {
  return calib.arithmetic == ScaleArithmetic::kXlaReciprocal;
}

// x [n] by one scale; `finite`: every x is finite, known from an amax that
// is (a finite amax gives a finite, non-zero scale: CalibratedScale). Into
// codes q (uint8_t), or the bf16 bits of their values (uint16_t).
template <class T, class TOut>
void QuantizeOneScale(const T* x, int64_t n, float scale, bool finite, QuantDType dtype,
                      const Calibration& calib, TOut* q) {
  const bool rcp = Reciprocal(calib);
  const float factor = rcp ? 1.0f / scale : scale;
  if constexpr (std::is_same_v<TOut, uint16_t>) {
    if constexpr (std::is_same_v<T, float>) {
      HWY_DYNAMIC_DISPATCH(QuantizeValuesSpan)(x, static_cast<size_t>(n), factor, rcp, finite,
                                               dtype, q);
    } else {
      HWY_DYNAMIC_DISPATCH(QuantizeValuesSpanBf16)(x, static_cast<size_t>(n), factor, rcp,
                                                   finite, dtype, q);
    }
  } else if constexpr (std::is_same_v<T, float>) {
    HWY_DYNAMIC_DISPATCH(QuantizeSpan)(x, static_cast<size_t>(n), &factor, false, rcp, finite,
                                       dtype, q);
  } else {
    HWY_DYNAMIC_DISPATCH(QuantizeSpanBf16)(x, static_cast<size_t>(n), factor, rcp, finite, dtype,
                                           q);
  }
}

// Whether the x that gave `amax` under `calib` are all finite: only an
// absmax calibration looked at them.
bool AllFinite(float amax, const Calibration& calib) {
  return calib.kind == Calibration::Kind::kAbsMax && amax <= std::numeric_limits<float>::max();
}

// Quantizes one row x [n] with per-channel scales [n]; `inv` [n] is scratch
// for the reciprocals of kXlaReciprocal, filled once per scaling group by
// Reciprocals().
void QuantizeChannelRow(const float* x, int64_t n, const float* scales,
                        const float* inv, QuantDType dtype,
                        const Calibration& calib, uint8_t* q) {
  const bool rcp = Reciprocal(calib);
  HWY_DYNAMIC_DISPATCH(QuantizeSpan)(x, static_cast<size_t>(n), rcp ? inv : scales,
                                     true, rcp, false, dtype, q);
}

void Reciprocals(const float* scales, int64_t n, const Calibration& calib,
                 float* inv) {
  if (!Reciprocal(calib)) return;
  for (int64_t j = 0; j < n; ++j) inv[j] = 1.0f / scales[j];
}

float AbsMax(const float* x, int64_t n) {
  return AmaxFromBits(
      HWY_DYNAMIC_DISPATCH(AbsMaxBits)(x, static_cast<size_t>(n)));
}
float AbsMax(const uint16_t* x, int64_t n) {
  return AmaxFromBits(HWY_DYNAMIC_DISPATCH(AbsMaxBitsBf16)(x, static_cast<size_t>(n)));
}

// QuantizeOneRow over f32 or bf16 bits (the same values, the same bits).
template <class T, class TOut>
void QuantizeOneRowOf(const T* x, int64_t cols, int64_t block_size, QuantDType dtype,
                      const Calibration& calib, TOut* q, float* scales) {
  const int64_t nb = NumBlocks(cols, block_size);
  const int64_t bs = block_size > 0 ? block_size : cols;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t c0 = b * bs, len = std::min(cols, c0 + bs) - c0;
    const T* xb = x + c0;
    const float amax = calib.kind == Calibration::Kind::kAbsMax ? AbsMax(xb, len) : 0.0f;
    const float s = CalibratedScale(amax, dtype, calib);
    scales[b] = s;
    QuantizeOneScale(xb, len, s, AllFinite(amax, calib), dtype, calib, q + c0);
  }
}

// amax over x [n] with the chunks in parallel (max is exact: order-free).
float AbsMaxParallel(const float* x, int64_t n) {
  if (n < kParallelMin) return AbsMax(x, n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  uint32_t best = 0;
#pragma omp parallel for schedule(static) reduction(max : best)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    best = std::max(best, HWY_DYNAMIC_DISPATCH(AbsMaxBits)(
                              x + b, static_cast<size_t>(std::min(kChunk, n - b))));
  }
  return AmaxFromBits(best);
}

// Per-channel scales of the `rows` rows of x [rows, c] starting at x.
void ChannelScales(const float* x, int64_t rows, int64_t c, QuantDType dtype,
                   const Calibration& calib, int32_t* acc, float* scales) {
  std::fill(acc, acc + c, 0);
  if (calib.kind == Calibration::Kind::kAbsMax) {
    for (int64_t r = 0; r < rows; ++r) {
      HWY_DYNAMIC_DISPATCH(AbsMaxAccumulate)(x + r * c, static_cast<size_t>(c), acc);
    }
  }
  for (int64_t j = 0; j < c; ++j) {
    scales[j] = CalibratedScale(AmaxFromBits(static_cast<uint32_t>(acc[j])), dtype,
                                calib);
  }
}

}  // namespace

Status QuantizeTensor(const float* x, int64_t n, QuantDType dtype,
                      const Calibration& calib, uint8_t* q, float* scale) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"n", n}}));
  const float amax = calib.kind == Calibration::Kind::kAbsMax ? AbsMaxParallel(x, n) : 0.0f;
  const float s = CalibratedScale(amax, dtype, calib);
  const bool finite = AllFinite(amax, calib);
  *scale = s;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    QuantizeOneScale(x + b, std::min(kChunk, n - b), s, finite, dtype, calib, q + b);
  }
  return OkStatus();
}

namespace internal {

void QuantizeOneRow(const float* x, int64_t cols, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales) {
  QuantizeOneRowOf(x, cols, block_size, dtype, calib, q, scales);
}

void QuantizeOneRowBf16(const uint16_t* x, int64_t cols, int64_t block_size, QuantDType dtype,
                        const Calibration& calib, uint8_t* q, float* scales) {
  QuantizeOneRowOf(x, cols, block_size, dtype, calib, q, scales);
}

void QuantizeOneRowValues(const float* x, int64_t cols, int64_t block_size, QuantDType dtype,
                          const Calibration& calib, uint16_t* values, float* scales) {
  FP8MOE_DCHECK(dtype == QuantDType::kE4M3FN || dtype == QuantDType::kE4M3FNUZ);
  QuantizeOneRowOf(x, cols, block_size, dtype, calib, values, scales);
}

void QuantizeOneRowValues(const uint16_t* x, int64_t cols, int64_t block_size, QuantDType dtype,
                          const Calibration& calib, uint16_t* values, float* scales) {
  FP8MOE_DCHECK(dtype == QuantDType::kE4M3FN || dtype == QuantDType::kE4M3FNUZ);
  QuantizeOneRowOf(x, cols, block_size, dtype, calib, values, scales);
}

}  // namespace internal

Status QuantizeRows(const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckRowArgs(rows, cols, valid_rows, block_size));
  const int64_t nb = NumBlocks(cols, block_size);
  // No codes and no scales to write: a zero-width x of any height costs
  // nothing (the work is bounded by the elements, not the dimensions).
  if (cols == 0 && nb == 0) return OkStatus();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    if (r >= valid_rows) {  // tail row: never read
      if (cols > 0) std::memset(q + r * cols, 0, static_cast<size_t>(cols));
      std::fill(scales + r * nb, scales + (r + 1) * nb, 0.0f);
      continue;
    }
    internal::QuantizeOneRow(x + r * cols, cols, block_size, dtype, calib, q + r * cols,
                             scales + r * nb);
  }
  return OkStatus();
}

Status QuantizeChannels(const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q,
                        float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"experts", experts}, {"k", k}, {"n", n}}));
  FP8MOE_RETURN_IF_ERROR(internal::CheckBuffer("w [experts, k, n]", {experts, k, n}, sizeof(float)));
  // No channels or no experts: no scales, no codes (and no [n] scratch: n
  // can be 2^40 beside a zero).
  if (n == 0 || experts == 0) return OkStatus();
  std::vector<int32_t> acc(static_cast<size_t>(n));
  std::vector<float> inv(Reciprocal(calib) ? static_cast<size_t>(n) : 0);
  for (int64_t e = 0; e < experts; ++e) {
    const float* we = w + e * k * n;
    float* se = scales + e * n;
    ChannelScales(we, k, n, dtype, calib, acc.data(), se);
    Reciprocals(se, n, calib, inv.data());
#pragma omp parallel for schedule(static) if (k * n >= kParallelMin)
    for (int64_t i = 0; i < k; ++i) {
      QuantizeChannelRow(we + i * n, n, se, inv.data(), dtype, calib,
                         q + e * k * n + i * n);
    }
  }
  return OkStatus();
}

namespace internal {

void QuantizeGroupTileChannelsWith(const float* x, int64_t m, int64_t c,
                                   const int32_t* group_sizes, int64_t groups, int64_t tile_m,
                                   int64_t num_tiles, QuantDType dtype, const Calibration& calib,
                                   uint8_t* q, float* scales, int threads, RowTile* tiles,
                                   int32_t* acc, float* inv) {
  if (c == 0) return;  // no channels: no scales, no codes
  FillGroupTiles(group_sizes, groups, tile_m, tiles);
  const int64_t row = num_tiles == 0 ? 0 : tiles[num_tiles - 1].first + tiles[num_tiles - 1].rows;
  if (m > row && c > 0) {  // tail rows
    std::memset(q + row * c, 0, static_cast<size_t>((m - row) * c));
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t me = omp_get_thread_num();
    int32_t* my_acc = acc + me * c;
    float* my_inv = Reciprocal(calib) ? inv + me * c : nullptr;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const auto [r0, rows] = tiles[t];
      float* st = scales + t * c;
      ChannelScales(x + r0 * c, rows, c, dtype, calib, my_acc, st);
      Reciprocals(st, c, calib, my_inv);
      for (int64_t i = 0; i < rows; ++i) {
        QuantizeChannelRow(x + (r0 + i) * c, c, st, my_inv, dtype, calib, q + (r0 + i) * c);
      }
    }
  }
}

}  // namespace internal

Status QuantizeGroupTileChannels(const float* x, int64_t m, int64_t c,
                                 const int32_t* group_sizes, int64_t groups,
                                 int64_t tile_m, QuantDType dtype,
                                 const Calibration& calib, uint8_t* q,
                                 float* scales) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"m", m}, {"c", c}}));
  FP8MOE_RETURN_IF_ERROR(internal::CheckBuffer("x [m, c]", {m, c}, sizeof(float)));
  FP8MOE_ASSIGN_OR_RETURN(const int64_t num_tiles,
                          NumGroupTiles(group_sizes, groups, m, tile_m));
  // No channels, or no rows and no tiles: nothing to write (and no [c]
  // scratch: c can be 2^40 beside a zero).
  if (c == 0 || (m == 0 && num_tiles == 0)) return OkStatus();
  const int threads = omp_get_max_threads();
  std::vector<internal::RowTile> tiles(static_cast<size_t>(num_tiles));
  std::vector<int32_t> acc(static_cast<size_t>(threads) * static_cast<size_t>(c));
  std::vector<float> inv(Reciprocal(calib) ? static_cast<size_t>(threads) * static_cast<size_t>(c)
                                           : 0);
  internal::QuantizeGroupTileChannelsWith(x, m, c, group_sizes, groups, tile_m, num_tiles,
                                          dtype, calib, q, scales, threads, tiles.data(),
                                          acc.data(), inv.data());
  return OkStatus();
}

// ---- Dequantization: a 256-entry table of decoded codes times the scale.

namespace {
struct DecodeTable {
  float v[256];
  explicit DecodeTable(QuantDType dtype) {
    for (int i = 0; i < 256; ++i) v[i] = DequantizeValue(static_cast<uint8_t>(i), 1.0f, dtype);
  }
};
void DequantizeSpan(const uint8_t* q, int64_t n, const float* scales,
                    bool per_lane, const DecodeTable& t, float* x) {
  if (per_lane) {
    for (int64_t i = 0; i < n; ++i) x[i] = t.v[q[i]] * scales[i];
  } else {
    const float s = scales[0];
    for (int64_t i = 0; i < n; ++i) x[i] = t.v[q[i]] * s;
  }
}
}  // namespace

void DequantizeTensor(const uint8_t* q, int64_t n, float scale,
                      QuantDType dtype, float* x) {
  if (n <= 0) return;
  const DecodeTable t(dtype);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    DequantizeSpan(q + b, std::min(kChunk, n - b), &scale, false, t, x + b);
  }
}

void DequantizeRows(const uint8_t* q, int64_t rows, int64_t cols,
                    int64_t block_size, const float* scales, QuantDType dtype,
                    float* x) {
  if (rows <= 0 || cols <= 0) return;  // no elements to write
  const DecodeTable t(dtype);
  const int64_t nb = NumBlocks(cols, block_size);
  const int64_t bs = block_size > 0 ? block_size : cols;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * bs, len = std::min(cols, c0 + bs) - c0;
      DequantizeSpan(q + r * cols + c0, len, scales + r * nb + b, false, t,
                     x + r * cols + c0);
    }
  }
}

void DequantizeChannels(const uint8_t* q, int64_t experts, int64_t k,
                        int64_t n, const float* scales, QuantDType dtype,
                        float* w) {
  if (experts <= 0 || k <= 0 || n <= 0) return;  // no elements to write
  const DecodeTable t(dtype);
#pragma omp parallel for schedule(static) if (experts * k * n >= kParallelMin)
  for (int64_t r = 0; r < experts * k; ++r) {
    DequantizeSpan(q + r * n, n, scales + (r / k) * n, true, t, w + r * n);
  }
}

Status DequantizeGroupTileChannels(const uint8_t* q, int64_t m, int64_t c,
                                   const int32_t* group_sizes, int64_t groups,
                                   int64_t tile_m, const float* scales,
                                   QuantDType dtype, float* x) {
  FP8MOE_RETURN_IF_ERROR(internal::CheckDims({{"m", m}, {"c", c}}));
  FP8MOE_RETURN_IF_ERROR(internal::CheckBuffer("x [m, c]", {m, c}, sizeof(float)));
  FP8MOE_RETURN_IF_ERROR(NumGroupTiles(group_sizes, groups, m, tile_m).status());
  if (c == 0) return OkStatus();  // no elements to write
  const DecodeTable t(dtype);
  const auto tiles = internal::GroupTiles(group_sizes, groups, tile_m);
  int64_t row = 0;  // end of the valid rows
  for (size_t i = 0; i < tiles.size(); ++i) {
    for (int64_t r = tiles[i].first; r < tiles[i].first + tiles[i].rows; ++r) {
      DequantizeSpan(q + r * c, c, scales + static_cast<int64_t>(i) * c, true,
                     t, x + r * c);
    }
    row = tiles[i].first + tiles[i].rows;
  }
  std::fill(x + row * c, x + m * c, 0.0f);  // tail rows
  return OkStatus();
}

}  // namespace fp8moe
#endif  // HWY_ONCE
