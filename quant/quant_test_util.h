// Test helpers shared by the quantizer tests and the kernel tests that
// quantize inside a GMM.
#ifndef FP8MOE_QUANT_QUANT_TEST_UTIL_H_
#define FP8MOE_QUANT_QUANT_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "fp8moe/quant.h"

namespace fp8moe::test {

// The midpoints between neighbouring finite codes of `dtype` at scale 1
// (ascending code order): values next to them, times a scale, are where
// x / s and x * (1 / s) can round to different codes.
inline std::vector<float> CodeMidpoints(QuantDType dtype) {
  std::vector<float> mids;
  for (int c = 0; c < 255; ++c) {
    const float a = DequantizeValue(static_cast<uint8_t>(c), 1.0f, dtype);
    const float b = DequantizeValue(static_cast<uint8_t>(c + 1), 1.0f, dtype);
    if (std::isfinite(a) && std::isfinite(b) && a < b) mids.push_back(0.5f * (a + b));
  }
  return mids;
}

}  // namespace fp8moe::test

#endif  // FP8MOE_QUANT_QUANT_TEST_UTIL_H_
