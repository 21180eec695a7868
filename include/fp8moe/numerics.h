// FP8, BF16 and int8 numerics, bit-exact with ml_dtypes (docs/design.md §3.1).
//
// Scalar functions are the reference; the span functions are SIMD (Highway,
// run-time dispatch) and give identical bits. Span functions split work over
// OpenMP threads when the span is large; results never depend on the thread
// count because every element is converted on its own.
#ifndef FP8MOE_NUMERICS_H_
#define FP8MOE_NUMERICS_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"

namespace fp8moe {

enum class Fp8Format : uint8_t { kE4M3FN, kE4M3FNUZ, kE5M2, kE5M2FNUZ };

// The shape of a format: 1 sign bit, exponent_bits, mantissa_bits.
struct Fp8Spec {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  float max;          // largest finite value
  bool fnuz;          // no -0, 0x80 is the only NaN
  bool has_inf;       // e5m2 only
  uint8_t nan_code;   // the NaN a conversion produces (sign OR-ed in unless fnuz)
  uint8_t max_code;   // code of +max
};

const Fp8Spec& GetFp8Spec(Fp8Format format);
std::string_view Fp8FormatName(Fp8Format format);  // "e4m3fn", ...
// Accepts "e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz" (and "float8_" prefixes).
Result<Fp8Format> ParseFp8Format(std::string_view name);
DType Fp8FormatDType(Fp8Format format);
// The format of an fp8 dtype; an error for any other dtype.
Result<Fp8Format> Fp8FormatOf(DType dtype);

// ---- Scalar reference conversions ----

// Exact value of an fp8 code (subnormals included; NaN codes give the
// canonical quiet NaN with ml_dtypes' sign; e5m2 infinities give +-inf).
float DecodeFp8(uint8_t code, Fp8Format format);

// f32 -> fp8, round to nearest, ties to even.
// saturate=false (ml_dtypes astype): a value that rounds past max becomes NaN
//   (no-inf formats) or +-inf (e5m2); inf -> NaN on no-inf formats.
// saturate=true (quantization): |x| is clipped to max first; +-inf -> +-max;
//   NaN stays NaN.
uint8_t EncodeFp8(float x, Fp8Format format, bool saturate);

// f32 -> bf16 bits, round to nearest even; NaN -> canonical quiet NaN.
uint16_t F32ToBf16(float x);
// bf16 bits -> f32 (exact).
float Bf16ToF32(uint16_t bits);

// int8 quantized value of x / scale already divided: round half to even,
// clamp to [-127, 127]; NaN -> 0 (a NaN scale marks the group instead).
int8_t EncodeInt8(float x_over_scale);

// ---- Span conversions (SIMD, dispatched at run time) ----
// All take n elements; in and out must not overlap.

// codes[n] -> out[n]
void DecodeFp8Span(const uint8_t* codes, float* out, size_t n,
                   Fp8Format format);
// codes[n] -> bf16 bits out[n] (exact: every fp8 value is a bf16 value)
void DecodeFp8ToBf16Span(const uint8_t* codes, uint16_t* out, size_t n,
                         Fp8Format format);
// codes[n], scales[n] -> bf16 bits out[n] = bf16(f32(decode(codes[i])) *
// scales[i]): the values of a dequantized BF16 weight copy.
void DequantizeFp8ToBf16Span(const uint8_t* codes, const float* scales,
                             uint16_t* out, size_t n, Fp8Format format);
// x[n] -> codes[n]
void EncodeFp8Span(const float* x, uint8_t* codes, size_t n, Fp8Format format,
                   bool saturate);
// x[n] -> bf16 bits out[n]
void F32ToBf16Span(const float* x, uint16_t* out, size_t n);
// bf16 bits[n] -> out[n]
void Bf16ToF32Span(const uint16_t* bits, float* out, size_t n);

// Name of the SIMD target the kernels dispatch to on this CPU, e.g. "AVX2".
// "AVX3_SPR" is Highway's AVX3 with the AVX-512 extensions the kernels use
// where the CPU has them (BF16 dot products, VNNI, VBMI: Sapphire Rapids,
// Zen 4); on such a CPU "AVX3" is plain AVX-512 (a Skylake-X's kernels),
// elsewhere AVX3 with whatever extensions the CPU has (VNNI on Cascade Lake).
const char* SimdTargetName();

// Restricts run-time dispatch (of every fp8moe kernel) to the named target
// and the ones below it, e.g. "AVX2" on an AVX-512 machine to measure or test
// the AVX2 path, or "AVX3" on a CPU with AVX512-BF16 for plain AVX-512
// kernels. An error names the targets this CPU and build support.
Status RestrictSimdTarget(std::string_view name);

// Whether this CPU has AVX512-BF16 dot products (vdpbf16ps).
bool CpuHasAvx512Bf16Dot();

// Whether the AVX-512 kernels may use the CPU's extensions (off after
// RestrictSimdTarget("AVX3")).
bool Avx512ExtensionsEnabled();

// Whether the GMM kernels use AVX512-BF16 dot products (vdpbf16ps) for bf16
// and fp8 operands: on AVX3_SPR, where they are faster than f32 FMAs on the
// same operands. Zen 4 runs vdpbf16ps zmm at twice the flops of its FMAs,
// Sapphire Rapids at half (measured, docs/kernels.md), so on Intel CPUs the
// f32 kernels are used. FP8MOE_BF16_DOT=on or off (read once) overrides the
// choice. The choice changes the bits within the stated error bounds, never
// between runs on one machine with one setting.
bool UseBf16DotProducts();

// FP8MOE_BF16_DOT as set in the environment: 1 (on), 0 (off) or -1 (unset);
// any other value is an InvalidArgument naming it (UseBf16DotProducts then
// keeps the CPU's default and warns once on stderr).
Result<int> Bf16DotSetting();

namespace internal {
// For tests that run every target: turns the AVX-512 extensions off or on.
void SetAvx512ExtensionsEnabled(bool on);
// For tests: 1 uses bf16 dot products where the CPU has them, 0 does not,
// -1 restores the default choice.
void SetBf16DotProducts(int use);
}  // namespace internal

}  // namespace fp8moe

#endif  // FP8MOE_NUMERICS_H_
