// A float64 oracle of the grouped matmuls for the kernel tests: plain loops
// written from the contracts in include/fp8moe/gmm.h, sharing no code with
// the fast kernels (kernels/cpu) or the reference twins
// (kernels/reference/gmm_reference.cc), so that a test of either backend
// compares it with something it did not compute itself.
//
// Every operand becomes the value the mode defines, held in double; codes are
// decoded here, bit by bit, and every product and sum is taken in double.
// Each result element comes with sum |a_r b_r| over its reduction, the scale
// of any f32 rounding error the kernels may make (gmm_test.cc's bounds).
//
// The one shared piece is the activation quantizer of kNativeFp8 / kInt8 and
// of TGMM's dout (QuantizeRows, QuantizeGroupTileChannels): gmm.h defines the
// codes as theirs, and quant_test pins them bit for bit to ml_dtypes, to
// their own plain-loop twins and to an independent encoder.
#ifndef FP8MOE_KERNELS_GMM_ORACLE_TEST_UTIL_H_
#define FP8MOE_KERNELS_GMM_ORACLE_TEST_UTIL_H_

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/gmm.h"
#include "fp8moe/quant.h"
#include "fp8moe/tensor.h"
#include "kernels/gmm_problem.h"

namespace fp8moe::gmm_test {

// The value of one code without a scale, decoded from its bits: sign,
// exponent and mantissa fields of the fp8 format, or the int8 integer.
inline double OracleCodeValue(uint8_t code, QuantDType t) {
  if (t == QuantDType::kInt8) return static_cast<int8_t>(code);
  const bool e4 = t == QuantDType::kE4M3FN || t == QuantDType::kE4M3FNUZ;
  const bool fnuz = t == QuantDType::kE4M3FNUZ || t == QuantDType::kE5M2FNUZ;
  const int mbits = e4 ? 3 : 2, ebits = e4 ? 4 : 5;
  const int bias = (1 << (ebits - 1)) - 1 + (fnuz ? 1 : 0);
  const int exp_field = (code >> mbits) & ((1 << ebits) - 1);
  const int mant = code & ((1 << mbits) - 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (fnuz && code == 0x80) return nan;                       // the only NaN, no -0
  if (t == QuantDType::kE4M3FN && (code & 0x7F) == 0x7F) return nan;
  if (t == QuantDType::kE5M2 && exp_field == 31) {
    return mant != 0 ? nan : ((code & 0x80) ? -1.0 : 1.0) * std::numeric_limits<double>::infinity();
  }
  // Subnormals: 0.mant x 2^(1 - bias); normals: 1.mant x 2^(exp - bias).
  const double magnitude =
      exp_field == 0 ? std::ldexp(static_cast<double>(mant), 1 - bias - mbits)
                     : std::ldexp(static_cast<double>((1 << mbits) + mant), exp_field - bias - mbits);
  return (code & 0x80) ? -magnitude : magnitude;
}

// A bf16 value from its bits: the upper half of an f32.
inline double OracleBf16Value(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// x rounded to bf16, to nearest even (finite x: weights never hold NaN).
inline float OracleRoundToBf16(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return std::bit_cast<float>(rounded);
}

// Element i of an F32 or BF16 tensor, or the unscaled value of a code.
inline double OracleValueAt(const Tensor& t, size_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data_as<float>()[i];
    case DType::kBF16: return OracleBf16Value(t.data_as<uint16_t>()[i]);
    default: return OracleCodeValue(t.data_as<uint8_t>()[i], *QuantDTypeOf(t.dtype()));
  }
}

// Every element of t as OracleValueAt, decoded once.
inline std::vector<double> OracleValues(const Tensor& t) {
  std::vector<double> v(t.num_elements());
  for (size_t i = 0; i < v.size(); ++i) v[i] = OracleValueAt(t, i);
  return v;
}

inline double OracleSilu(double g) { return g / (1.0 + std::exp(-g)); }
// d silu / dg = s (1 + g (1 - s)), s = sigmoid(g).
inline double OracleSiluGrad(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s * (1.0 + g * (1.0 - s));
}

// An oracle result [rows, cols]: the value of every element and the sum of
// the absolute values of the products that make it.
struct OracleResult {
  std::vector<double> value, abs_sum;
  explicit OracleResult(size_t n) : value(n, 0.0), abs_sum(n, 0.0) {}
  // Element `at` = sum over j in [begin, end) of product(j), in double.
  template <class Product>
  void Sum(int64_t at, int64_t begin, int64_t end, const Product& product) {
    double sum = 0, abs_sum_of_products = 0;
    for (int64_t j = begin; j < end; ++j) {
      const double p = product(j);
      sum += p;
      abs_sum_of_products += std::fabs(p);
    }
    value[static_cast<size_t>(at)] = sum;
    abs_sum[static_cast<size_t>(at)] = abs_sum_of_products;
  }
};

// First row of each group (the exclusive prefix sum of sizes), and the end.
inline std::vector<int64_t> OracleOffsets(const std::vector<int32_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) off[g + 1] = off[g] + sizes[g];
  return off;
}

// The weight rhs [E, K, N] as the values a float GMM multiplies (gmm.h):
// F32 / BF16 values as they are; codes with scale [E, N] as the f32 product
// f32(q) * s, rounded to bf16 when the mode reads a bf16 weight (kBf16,
// kFakeQat: w = bf16(f32(q) * s)).
inline std::vector<double> OracleWeightValues(const Tensor& rhs, const Tensor* scale, bool to_bf16) {
  const int64_t e = rhs.shape()[0], k = rhs.shape()[1], n = rhs.shape()[2];
  std::vector<double> w(rhs.num_elements());
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        const size_t at = static_cast<size_t>((g * k + r) * n + c);
        if (scale == nullptr) {
          w[at] = OracleValueAt(rhs, at);
          continue;
        }
        const float v = static_cast<float>(OracleValueAt(rhs, at)) *
                        scale->data_as<float>()[g * n + c];
        w[at] = to_bf16 ? OracleRoundToBf16(v) : v;
      }
    }
  }
  return w;
}

// The pre-activation h [M, N] = lhs [M, K] x rhs [E, K, N] of a forward in
// mode o.mode (rhs_scale [E, N] with codes), rows by group `sizes`; tail
// rows stay 0. kNativeFp8 / kInt8: lhs is quantized per row (per K-block)
// as gmm.h says, and h = sum_k (qa sa) (qw sw) of the dequantized values,
// each an exact double product (a 4- or 8-bit code times an f32 scale).
inline OracleResult OracleGmm(const GmmOptions& o, const Tensor& lhs, const Tensor& rhs,
                              const Tensor* rhs_scale, const std::vector<int32_t>& sizes) {
  const int64_t m = lhs.shape()[0], k = lhs.shape()[1], n = rhs.shape()[2];
  const std::vector<int64_t> off = OracleOffsets(sizes);
  const int64_t valid = off.back();
  std::vector<double> a(static_cast<size_t>(m * k), 0.0), w;
  if (o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8) {
    const bool int8 = o.mode == GmmMode::kInt8;
    const QuantDType qdt = int8 ? QuantDType::kInt8 : o.fp8_dtype;
    const int64_t block = int8 ? 0 : o.lhs_quant_block_size;
    const int64_t bs = block > 0 ? block : k, nb = NumBlocks(k, block);
    std::vector<float> x(static_cast<size_t>(m * k), 0.0f), sa(static_cast<size_t>(m * nb));
    for (int64_t i = 0; i < valid * k; ++i) {
      x[static_cast<size_t>(i)] = static_cast<float>(OracleValueAt(lhs, static_cast<size_t>(i)));
    }
    std::vector<uint8_t> qa(static_cast<size_t>(m * k));
    EXPECT_TRUE(QuantizeRows(x.data(), m, k, valid, block, qdt, o.lhs_calibration, qa.data(),
                             sa.data()).ok());
    for (int64_t i = 0; i < valid; ++i) {
      for (int64_t r = 0; r < k; ++r) {
        a[static_cast<size_t>(i * k + r)] = OracleCodeValue(qa[static_cast<size_t>(i * k + r)], qdt) *
                                            sa[static_cast<size_t>(i * nb + r / bs)];
      }
    }
    // The weight's codes times their channel scales, in double (exact).
    w.resize(rhs.num_elements());
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t c = static_cast<int64_t>(i) % n, g = static_cast<int64_t>(i) / (k * n);
      w[i] = OracleValueAt(rhs, i) * static_cast<double>(rhs_scale->data_as<float>()[g * n + c]);
    }
  } else {
    for (int64_t i = 0; i < valid * k; ++i) {
      a[static_cast<size_t>(i)] = OracleValueAt(lhs, static_cast<size_t>(i));
    }
    w = OracleWeightValues(rhs, rhs_scale, o.mode != GmmMode::kF32);
  }
  OracleResult h(static_cast<size_t>(m * n));
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = off[g]; i < off[g + 1]; ++i) {
      for (int64_t c = 0; c < n; ++c) {
        h.Sum(i * n + c, 0, k, [&](int64_t r) {
          return a[static_cast<size_t>(i * k + r)] *
                 w[static_cast<size_t>((static_cast<int64_t>(g) * k + r) * n + c)];
        });
      }
    }
  }
  return h;
}

// da [M, K] = dout [M, N] x rhs[g]^T (rhs [E, K, N]) of a dLHS in mode
// o.mode: dout's values (F32 or BF16), the weight as OracleWeightValues
// (kF32 reads codes as f32(q) * s; kBf16 and kFakeQat as bf16(f32(q) * s)).
// Without the dSwiGLU epilogue, which the caller applies.
inline OracleResult OracleDlhs(const GmmOptions& o, const Tensor& dout, const Tensor& rhs,
                               const Tensor* rhs_scale, const std::vector<int32_t>& sizes) {
  const int64_t m = dout.shape()[0], n = dout.shape()[1], k = rhs.shape()[1];
  const std::vector<int64_t> off = OracleOffsets(sizes);
  const std::vector<double> w = OracleWeightValues(rhs, rhs_scale, o.mode != GmmMode::kF32);
  const std::vector<double> d = OracleValues(dout);
  OracleResult da(static_cast<size_t>(m * k));
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = off[g]; i < off[g + 1]; ++i) {
      for (int64_t r = 0; r < k; ++r) {
        da.Sum(i * k + r, 0, n, [&](int64_t c) {
          return d[static_cast<size_t>(i * n + c)] *
                 w[static_cast<size_t>((static_cast<int64_t>(g) * k + r) * n + c)];
        });
      }
    }
  }
  return da;
}

// drhs [E, K, N] = lhs[rows of g]^T x dout[rows of g] of a TGMM: lhs values
// (codes as their unscaled values), dout values, or with quant.dout_dtype
// dout quantized per (group or m-tile, channel) and used as f32(q) * scale.
// An empty group's slice is 0.
inline OracleResult OracleTgmm(const GmmOptions& o, const TgmmQuant& quant, const Tensor& lhs,
                               const Tensor& dout, const std::vector<int32_t>& sizes) {
  const int64_t m = lhs.shape()[0], k = lhs.shape()[1], n = dout.shape()[1];
  const int64_t e = static_cast<int64_t>(sizes.size());
  const std::vector<int64_t> off = OracleOffsets(sizes);
  std::vector<double> b(static_cast<size_t>(m * n), 0.0);
  if (quant.dout_dtype) {
    // gmm.h: the m-tile is tiles.m, unset 512 (kTgmmDefaultQuantTile).
    const int64_t tile = quant.per_group ? 0 : o.tiles.m.value_or(internal::kTgmmDefaultQuantTile);
    int64_t tiles = 0;
    for (int32_t s : sizes) tiles += tile == 0 ? 1 : (s + tile - 1) / tile;
    std::vector<uint8_t> q(static_cast<size_t>(m * n));
    std::vector<float> scales(static_cast<size_t>(tiles * n));
    EXPECT_TRUE(QuantizeGroupTileChannels(dout.data_as<float>(), m, n, sizes.data(), e, tile,
                                          *quant.dout_dtype, quant.calibration, q.data(),
                                          scales.data()).ok());
    int64_t first_tile = 0;  // group g's first tile
    for (int64_t g = 0; g < e; ++g) {
      for (int64_t i = off[g]; i < off[g + 1]; ++i) {
        const int64_t t = tile == 0 ? g : first_tile + (i - off[g]) / tile;
        for (int64_t c = 0; c < n; ++c) {
          b[static_cast<size_t>(i * n + c)] =
              static_cast<float>(OracleCodeValue(q[static_cast<size_t>(i * n + c)], *quant.dout_dtype)) *
              scales[static_cast<size_t>(t * n + c)];
        }
      }
      first_tile += tile == 0 ? 1 : (sizes[static_cast<size_t>(g)] + tile - 1) / tile;
    }
  } else {
    for (int64_t i = 0; i < off.back() * n; ++i) {
      b[static_cast<size_t>(i)] = OracleValueAt(dout, static_cast<size_t>(i));
    }
  }
  const std::vector<double> a = OracleValues(lhs);
  OracleResult d(static_cast<size_t>(e * k * n));
  for (int64_t g = 0; g < e; ++g) {
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        d.Sum((g * k + r) * n + c, off[g], off[g + 1], [&](int64_t i) {
          return a[static_cast<size_t>(i * k + r)] * b[static_cast<size_t>(i * n + c)];
        });
      }
    }
  }
  return d;
}

}  // namespace fp8moe::gmm_test

#endif  // FP8MOE_KERNELS_GMM_ORACLE_TEST_UTIL_H_
