// Shared helpers of the dist tests: seeded random inputs (FP8MOE_TEST_SEED
// replays a failing case) with the values that make reductions interesting.
#ifndef FP8MOE_DISTRIBUTED_DIST_TEST_UTIL_H_
#define FP8MOE_DISTRIBUTED_DIST_TEST_UTIL_H_

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "distributed/reduce.h"
#include "fp8moe/dtype.h"

namespace fp8moe::testing_util {

inline uint32_t TestSeed() {
  static const uint32_t seed = [] {
    const char* env = std::getenv("FP8MOE_TEST_SEED");
    const uint32_t s = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10))
                                      : std::random_device{}();
    std::printf("random seed %u (FP8MOE_TEST_SEED=%u replays it)\n", s, s);
    return s;
  }();
  return seed;
}

// f32 values over many binades, with specials sprinkled in when `specials`:
// +-0, subnormals, +-inf, NaN, +-FLT_MAX.
inline std::vector<float> RandomF32(size_t n, std::mt19937& rng, bool specials) {
  std::vector<float> v(n);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-40, 40), pick(0, 63);
  const float kSpecial[] = {0.0f, -0.0f, 1e-40f, -1e-42f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
  for (size_t i = 0; i < n; ++i) {
    const int p = pick(rng);
    if (specials && p < 9) {
      v[i] = kSpecial[p];
    } else {
      v[i] = nd(rng) * std::ldexp(1.0f, ex(rng));
    }
  }
  return v;
}

// Random bytes of `count` elements of a dtype; for f32 and bf16 random
// values (bf16: the rounding of RandomF32).
inline std::vector<uint8_t> RandomElements(DType dtype, int64_t count, std::mt19937& rng,
                                           bool specials) {
  const size_t elem = DTypeSize(dtype);
  std::vector<uint8_t> out(static_cast<size_t>(count) * elem);
  if (dtype == DType::kF32 || dtype == DType::kBF16) {
    const std::vector<float> f = RandomF32(static_cast<size_t>(count), rng, specials);
    for (int64_t i = 0; i < count; ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(out.data() + i * 4, &f[i], 4);
      } else {
        const uint16_t b = internal::RoundToBf16(f[i]);
        std::memcpy(out.data() + i * 2, &b, 2);
      }
    }
  } else {
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : out) b = static_cast<uint8_t>(byte(rng));
  }
  return out;
}

// Small integer values (|v| <= 64) whose sums over <= 8 ranks are exact in
// f32 and bf16 whatever the order.
inline std::vector<uint8_t> IntegerValued(DType dtype, int64_t count, std::mt19937& rng) {
  const size_t elem = DTypeSize(dtype);
  std::vector<uint8_t> out(static_cast<size_t>(count) * elem);
  std::uniform_int_distribution<int> v(-16, 16);
  for (int64_t i = 0; i < count; ++i) {
    const int x = v(rng);
    if (dtype == DType::kF32) {
      const float f = static_cast<float>(x);
      std::memcpy(out.data() + i * 4, &f, 4);
    } else if (dtype == DType::kBF16) {
      const uint16_t b = internal::RoundToBf16(static_cast<float>(x));
      std::memcpy(out.data() + i * 2, &b, 2);
    } else if (dtype == DType::kI64) {
      const int64_t w = x;
      std::memcpy(out.data() + i * 8, &w, 8);
    } else if (dtype == DType::kU32) {
      const uint32_t w = static_cast<uint32_t>(x + 16);
      std::memcpy(out.data() + i * 4, &w, 4);
    }
  }
  return out;
}

// Fills with a byte pattern no collective writes by chance (NaN for f32).
inline void Poison(std::vector<uint8_t>& v) {
  if (!v.empty()) std::memset(v.data(), 0xFF, v.size());
}

// Index of the first differing byte's element, or -1.
inline int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                               size_t elem) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i / elem);
  }
  return -1;
}

}  // namespace fp8moe::testing_util

#endif  // FP8MOE_DISTRIBUTED_DIST_TEST_UTIL_H_
