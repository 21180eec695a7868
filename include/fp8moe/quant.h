// Quantization to fp8 or int8 with f32 scales (docs/design.md §3.2).
//
// For every scaling group: amax = max |x| over the group's valid elements
// (NaN if any is NaN), scale = max(amax, 1e-12) / fmax in f32, and
// q = saturating_cast(x / scale) with a true f32 division; or, with
// ScaleArithmetic::kXlaReciprocal, what XLA computes for the same formulas
// (below). Dequantization is f32(q) * scale. A NaN or Inf inside a group makes that group's scale NaN or
// Inf and so reaches only that group; tail rows (past the valid rows of a
// buffer) are never read, get code 0 and, where they own a scale, scale 0.
//
// The quantizers (Quantize*) have plain-loop twins in namespace
// fp8moe::reference with the same signatures; tests check the two give the
// same bits.
#ifndef FP8MOE_QUANT_H_
#define FP8MOE_QUANT_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "fp8moe/dtype.h"
#include "fp8moe/numerics.h"
#include "fp8moe/status.h"

namespace fp8moe {

enum class QuantDType : uint8_t { kE4M3FN, kE4M3FNUZ, kE5M2, kE5M2FNUZ, kInt8 };

// "e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "int8".
std::string_view QuantDTypeName(QuantDType dtype);
Result<QuantDType> ParseQuantDType(std::string_view name);
// The largest magnitude a code can hold: 448, 240, 57344, 57344, 127.
float QuantMax(QuantDType dtype);
// The tensor dtype of the codes (kE4M3FN ... kI8).
DType QuantStorageDType(QuantDType dtype);
// The quant dtype storing codes of `dtype`; an error for non-code dtypes.
Result<QuantDType> QuantDTypeOf(DType dtype);

// How a scale and the codes are computed from amax (docs/numerics.md).
//  kExactDivide    scale = max(amax, 1e-12) / fmax; q = cast(x / scale), both
//                  true f32 divisions (docs/design.md §3.2). The default.
//  kXlaReciprocal  what qwix's quantizer computes under jax.jit on XLA:CPU,
//                  whose algebraic simplifier turns a division by a constant
//                  or by a broadcast scale into a multiplication by its
//                  reciprocal, and which floors tiny scales instead of
//                  adding an epsilon:
//                    absmax: scale = amax * f32(1 / fmax)
//                    fixed:  scale = amax / fmax (a constant: XLA folds it
//                            exactly)
//                    then a scale below sqrt(f32 tiny) = 2^-63 becomes 1
//                    (amax 0 included; NaN stays NaN), and
//                    q = cast(x * f32(1 / scale)).
enum class ScaleArithmetic : uint8_t { kExactDivide, kXlaReciprocal };

// "exact_divide", "xla_reciprocal".
std::string_view ScaleArithmeticName(ScaleArithmetic arithmetic);
Result<ScaleArithmetic> ParseScaleArithmetic(std::string_view name);

// How amax is found: from the data of each scaling group ("absmax") or fixed
// for the whole tensor ("fixed,a,b": amax = max(|a|, |b|)); and the
// arithmetic that turns amax into scales and codes (not part of the text
// form: Parse leaves it kExactDivide).
struct Calibration {
  enum class Kind : uint8_t { kAbsMax, kFixed };
  Kind kind = Kind::kAbsMax;
  float lo = 0.0f, hi = 0.0f;  // kFixed only
  ScaleArithmetic arithmetic = ScaleArithmetic::kExactDivide;

  static Calibration AbsMax() { return {}; }
  static Calibration Fixed(float lo, float hi) {
    return {Kind::kFixed, lo, hi, ScaleArithmetic::kExactDivide};
  }
  // This calibration with `a` as its arithmetic.
  Calibration With(ScaleArithmetic a) const {
    Calibration c = *this;
    c.arithmetic = a;
    return c;
  }
  // Parses "absmax" or "fixed,a,b" (a, b finite decimal numbers, not both 0).
  static Result<Calibration> Parse(std::string_view text);
  // "absmax" or "fixed,a,b" (without the arithmetic).
  std::string ToString() const;
  // The fixed amax max(|lo|, |hi|).
  float FixedAmax() const;
};

// ---- Scalar building blocks ----

// max(amax, 1e-12) / fmax in f32; NaN stays NaN (kExactDivide).
float ScaleFromAmax(float amax, QuantDType dtype);
// The scale of one scaling group whose data has this amax (ignored by a fixed
// calibration), in calib's arithmetic.
float CalibratedScale(float amax, QuantDType dtype, const Calibration& calib);
// The code of x / scale (kExactDivide) or x * f32(1 / scale)
// (kXlaReciprocal); int8 codes as their two's complement byte.
uint8_t QuantizeValue(float x, float scale, QuantDType dtype,
                      ScaleArithmetic arithmetic = ScaleArithmetic::kExactDivide);
// f32(q) * scale.
float DequantizeValue(uint8_t code, float scale, QuantDType dtype);

// ---- Granularities. Shapes in comments; all row-major. ----

// Per tensor: x [n] -> q [n], scale [1].
Status QuantizeTensor(const float* x, int64_t n, QuantDType dtype,
                      const Calibration& calib, uint8_t* q, float* scale);

// Per row, optionally per K-block: x [rows, cols] -> q [rows, cols],
// scales [rows, NumBlocks(cols, block_size)]. block_size 0 means the full
// row. Rows >= valid_rows are tail rows: not read, q = 0, scales = 0.
Status QuantizeRows(const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales);
// Number of K-blocks per row: 1 for block_size 0, else ceil(cols / block).
int64_t NumBlocks(int64_t cols, int64_t block_size);

// Per output channel of a weight: w [E, K, N] -> q [E, K, N], scales [E, N]
// (amax over K for each expert e and channel n).
Status QuantizeChannels(const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q,
                        float* scales);

// Ragged row groups (docs/design.md §2): x [M, C] with rows sorted by group; group g
// owns rows [off_g, off_g + group_sizes[g]). Each group is cut into tiles of
// tile_m rows and each (tile, channel) gets a scale over the tile's valid rows
// only. scales [NumGroupTiles, C], tiles in group order; an empty group has no
// tiles. tile_m 0 means exactly one tile per group, empty groups included, so
// scales is [groups, C] (an empty group's scales are those of amax 0).
// Rows past sum(group_sizes) are tail rows: q = 0, never read.
Status QuantizeGroupTileChannels(const float* x, int64_t m, int64_t c,
                                 const int32_t* group_sizes, int64_t groups,
                                 int64_t tile_m, QuantDType dtype,
                                 const Calibration& calib, uint8_t* q,
                                 float* scales);
// Number of (group, tile) pairs; an error for negative sizes, a sum above m
// or a negative tile_m.
Result<int64_t> NumGroupTiles(const int32_t* group_sizes, int64_t groups,
                              int64_t m, int64_t tile_m);
// Checks group_sizes against a buffer of m rows: no negative size, sum <= m.
Status CheckGroupSizes(const int32_t* group_sizes, int64_t groups, int64_t m);

// ---- Dequantization, same layouts; tail rows come out as 0. ----
void DequantizeTensor(const uint8_t* q, int64_t n, float scale,
                      QuantDType dtype, float* x);
void DequantizeRows(const uint8_t* q, int64_t rows, int64_t cols,
                    int64_t block_size, const float* scales, QuantDType dtype,
                    float* x);
void DequantizeChannels(const uint8_t* q, int64_t experts, int64_t k,
                        int64_t n, const float* scales, QuantDType dtype,
                        float* w);
Status DequantizeGroupTileChannels(const uint8_t* q, int64_t m, int64_t c,
                                   const int32_t* group_sizes, int64_t groups,
                                   int64_t tile_m, const float* scales,
                                   QuantDType dtype, float* x);

namespace reference {
// Plain-loop twins of the functions above (same contracts).
Status QuantizeTensor(const float* x, int64_t n, QuantDType dtype,
                      const Calibration& calib, uint8_t* q, float* scale);
Status QuantizeRows(const float* x, int64_t rows, int64_t cols,
                    int64_t valid_rows, int64_t block_size, QuantDType dtype,
                    const Calibration& calib, uint8_t* q, float* scales);
Status QuantizeChannels(const float* w, int64_t experts, int64_t k, int64_t n,
                        QuantDType dtype, const Calibration& calib, uint8_t* q,
                        float* scales);
Status QuantizeGroupTileChannels(const float* x, int64_t m, int64_t c,
                                 const int32_t* group_sizes, int64_t groups,
                                 int64_t tile_m, QuantDType dtype,
                                 const Calibration& calib, uint8_t* q,
                                 float* scales);
}  // namespace reference

}  // namespace fp8moe

#endif  // FP8MOE_QUANT_H_
