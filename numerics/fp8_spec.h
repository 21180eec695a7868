// The four fp8 formats as compile-time constants, shared by the scalar
// reference (fp8.cc) and the SIMD code (convert-inl.h).
#ifndef FP8MOE_NUMERICS_FP8_SPEC_H_
#define FP8MOE_NUMERICS_FP8_SPEC_H_

#include <bit>
#include <cstdint>

#include "fp8moe/numerics.h"

namespace fp8moe {

// Indexed by Fp8Format.
//                    exp man bias  max       fnuz   inf    nan   max_code
inline constexpr Fp8Spec kFp8Specs[] = {
    /* e4m3fn   */ {4, 3, 7, 448.0f, false, false, 0x7F, 0x7E},
    /* e4m3fnuz */ {4, 3, 8, 240.0f, true, false, 0x80, 0x7F},
    /* e5m2     */ {5, 2, 15, 57344.0f, false, true, 0x7E, 0x7B},
    /* e5m2fnuz */ {5, 2, 16, 57344.0f, true, false, 0x80, 0x7F},
};

constexpr const Fp8Spec& SpecOf(Fp8Format f) {
  return kFp8Specs[static_cast<int>(f)];
}

// 2^e as f32 bits, for |e| <= 126 (normal range).
constexpr uint32_t Pow2Bits(int e) { return static_cast<uint32_t>(e + 127) << 23; }
constexpr float kPow2(int e) { return std::bit_cast<float>(Pow2Bits(e)); }
// The bf16 bits of a value that is exactly a bf16 value (no rounding).
constexpr uint16_t F32ToBf16Const(float v) {
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(v) >> 16);
}

}  // namespace fp8moe

#endif  // FP8MOE_NUMERICS_FP8_SPEC_H_
