// Shared helpers of the kernel tests (gmm_test.cc, gmm_edge_test.cc): random
// operands in every representation, NaN-poisoned outputs, the error-bound
// check, and the backends every op runs on.
#ifndef FP8MOE_KERNELS_GMM_TEST_UTIL_H_
#define FP8MOE_KERNELS_GMM_TEST_UTIL_H_

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/cpu/kernel_path.h"

namespace fp8moe::gmm_test {

using internal::KernelPath;
using internal::ResetKernelCounts;

inline const float kNaN = std::numeric_limits<float>::quiet_NaN();

inline Tensor Make(DType d, Shape s) { return std::move(Tensor::Create(d, std::move(s))).value(); }

struct TestRng {
  std::mt19937 gen;
  explicit TestRng(uint64_t seed) : gen(static_cast<uint32_t>(seed ^ (seed >> 32))) {}
  float Normal() { return std::normal_distribution<float>(0.0f, 1.0f)(gen); }
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
};

// Random group sizes summing to at most m, with empty groups.
inline std::vector<int32_t> Groups(TestRng& r, int64_t e, int64_t m) {
  std::vector<int32_t> s(static_cast<size_t>(e), 0);
  int64_t left = m - r.Int(0, static_cast<int>(std::min<int64_t>(m, 5)));  // tail rows
  for (int64_t g = 0; g < e && left > 0; ++g) {
    if (r.Int(0, 3) == 0) continue;  // empty
    const int64_t take = g + 1 == e ? left : r.Int(0, static_cast<int>(left));
    s[static_cast<size_t>(g)] = static_cast<int32_t>(take);
    left -= take;
  }
  return s;
}

// The group_sizes operand [e] holding `sizes`.
inline Tensor GroupSizes(const std::vector<int32_t>& sizes) {
  Tensor gs = Make(DType::kI32, {static_cast<int64_t>(sizes.size())});
  std::copy(sizes.begin(), sizes.end(), gs.data_as<int32_t>());
  return gs;
}

inline int64_t Sum(const std::vector<int32_t>& s) {
  int64_t t = 0;
  for (int32_t v : s) t += v;
  return t;
}

// f32 [rows, cols] of normal values; rows >= valid are NaN/Inf (tail).
inline Tensor RandomF32(TestRng& r, Shape shape, int64_t valid_rows = -1) {
  Tensor t = Make(DType::kF32, shape);
  const int64_t cols = shape.back();
  float* p = t.data_as<float>();
  for (size_t i = 0; i < t.num_elements(); ++i) {
    const bool tail = valid_rows >= 0 && static_cast<int64_t>(i) / cols >= valid_rows;
    p[i] = tail ? ((i % 3) ? kNaN : std::numeric_limits<float>::infinity()) : r.Normal();
  }
  return t;
}

inline Tensor ToBf16(const Tensor& f) {
  Tensor t = Make(DType::kBF16, f.shape());
  F32ToBf16Span(f.data_as<float>(), t.data_as<uint16_t>(), f.num_elements());
  return t;
}

// |x| of a tensor of values or codes (fp8 sign bit cleared, int8 negated).
inline Tensor Abs(const Tensor& t) {
  Tensor a = Make(t.dtype(), t.shape());
  std::memcpy(a.data(), t.data(), t.num_bytes());
  const size_t n = t.num_elements();
  switch (t.dtype()) {
    case DType::kF32:
      for (size_t i = 0; i < n; ++i) a.data_as<float>()[i] = std::fabs(a.data_as<float>()[i]);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) a.data_as<uint16_t>()[i] &= 0x7FFF;
      break;
    case DType::kI8:
      for (size_t i = 0; i < n; ++i) {
        int8_t& v = a.data_as<int8_t>()[i];
        v = static_cast<int8_t>(v < 0 ? -v : v);
      }
      break;
    case DType::kI32:
      break;
    default:  // fp8 codes (no NaN codes occur in quantized weights)
      for (size_t i = 0; i < n; ++i) a.data_as<uint8_t>()[i] &= 0x7F;
      break;
  }
  return a;
}

inline Tensor Poisoned(DType d, Shape s) {
  Tensor t = Make(d, std::move(s));
  if (d == DType::kF32) {
    for (size_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = kNaN;
  } else {
    for (size_t i = 0; i < t.num_elements(); ++i) t.data_as<uint16_t>()[i] = 0x7FC1;
  }
  return t;
}

inline float ValueAt(const Tensor& t, size_t i) {
  return t.dtype() == DType::kF32 ? t.data_as<float>()[i] : Bf16ToF32(t.data_as<uint16_t>()[i]);
}

// A weight [E, K, N] in the mode's representation (+ scale for codes).
struct Weight {
  Tensor w, scale;
  bool codes = false;
  ConstTensorView scale_view = {};
  // The scale argument of the GMM calls: its view for codes, else nullptr.
  const ConstTensorView* Scale() {
    if (!codes) return nullptr;
    scale_view = scale.view();
    return &scale_view;
  }
};

inline Weight MakeWeight(TestRng& r, DType dtype, int64_t e, int64_t k, int64_t n) {
  Tensor f = RandomF32(r, {e, k, n});
  Weight out;
  if (dtype == DType::kF32) {
    out.w = std::move(f);
  } else if (dtype == DType::kBF16) {
    out.w = ToBf16(f);
  } else {
    const QuantDType q = *QuantDTypeOf(dtype);
    out.w = Make(dtype, {e, k, n});
    out.scale = Make(DType::kF32, {e, n});
    EXPECT_TRUE(QuantizeChannels(f.data_as<float>(), e, k, n, q, Calibration::AbsMax(),
                                 out.w.data_as<uint8_t>(), out.scale.data_as<float>()).ok());
    out.codes = true;
  }
  return out;
}

// The weight dtype a forward of `mode` takes (E4M3FN codes for fp8 modes).
inline DType WeightDTypeOf(GmmMode mode) {
  return mode == GmmMode::kF32    ? DType::kF32
         : mode == GmmMode::kBf16 ? DType::kBF16
         : mode == GmmMode::kInt8 ? DType::kI8
                                  : DType::kE4M3FN;
}

// Expects |got - want| <= bound element-wise over valid rows (want in
// double, e.g. the float64 oracle's); tail rows 0.
inline void ExpectNear(const Tensor& got, const std::vector<double>& want,
                       const std::vector<double>& bound, int64_t valid_rows,
                       const std::string& what) {
  ASSERT_EQ(got.num_elements(), want.size());
  const int64_t cols = got.shape().back();
  const size_t valid = static_cast<size_t>(valid_rows * cols);
  for (size_t i = 0; i < got.num_elements(); ++i) {
    const float g = ValueAt(got, i);
    if (i >= valid && got.rank() == 2) {
      ASSERT_EQ(std::bit_cast<uint32_t>(g), 0u) << what << ": tail element " << i;
      continue;
    }
    ASSERT_FALSE(std::isnan(g)) << what << ": NaN at " << i;
    ASSERT_LE(std::fabs(static_cast<double>(g) - want[i]), bound[i])
        << what << ": element " << i << " got " << g << " want " << want[i];
  }
}

// The same against another tensor's values.
inline void ExpectWithin(const Tensor& got, const Tensor& want, const std::vector<double>& bound,
                  int64_t valid_rows, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape());
  std::vector<double> w(want.num_elements());
  for (size_t i = 0; i < w.size(); ++i) w[i] = ValueAt(want, i);
  ExpectNear(got, w, bound, valid_rows, what);
}

inline double Gamma(int64_t r) {
  const double u = std::ldexp(1.0, -24);
  return (r * u) / (1 - r * u) + 4 * u;
}

// ---- Backends ----------------------------------------------------------------
//
// Like ggml's test-backend-ops: every op x mode x epilogue x shape case below
// runs on every backend a Context can name (the fast CPU kernels and the
// plain-loop reference twins), each compared with the float64 oracle
// (gmm_oracle_test_util.h), which shares no code with either, at the stated
// bounds.

inline const std::vector<BackendKind>& AllBackends() {
  static const std::vector<BackendKind> kinds = {BackendKind::kCpu, BackendKind::kReference};
  return kinds;
}

inline ContextOptions OnBackend(BackendKind b) {
  ContextOptions o;
  o.backend = b;
  return o;
}

// The calls ran on ctx's backend and nowhere else.
inline void ExpectRanOn(const Context& ctx, BackendKind b) {
  int64_t fast = 0;
  for (size_t i = 0; i < static_cast<size_t>(KernelPath::kCount); ++i) {
    if (static_cast<KernelPath>(i) != KernelPath::kReference &&
        IsKernelPath(static_cast<KernelPath>(i))) {
      fast += KernelCount(ctx, static_cast<KernelPath>(i));
    }
  }
  if (b == BackendKind::kReference) {
    EXPECT_GT(KernelCount(ctx, KernelPath::kReference), 0);
    EXPECT_EQ(fast, 0);
  } else {
    EXPECT_EQ(KernelCount(ctx, KernelPath::kReference), 0);
    EXPECT_GT(fast, 0);
  }
}

}  // namespace fp8moe::gmm_test

#endif  // FP8MOE_KERNELS_GMM_TEST_UTIL_H_
