// Run-time dispatch and threading for the span conversions in convert-inl.h.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fp8moe/numerics.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "numerics/convert.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "numerics/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

// Format and flags are run-time values at the API and template parameters in
// the loops; one switch per call picks the instantiation.
void EncodeFp8Span(const float* x, uint8_t* codes, size_t n, Fp8Format format,
                   bool saturate) {
#define FP8MOE_ENC(F) \
  return saturate ? EncodeFp8SpanT<F, true>(x, codes, n) \
                  : EncodeFp8SpanT<F, false>(x, codes, n)
  switch (format) {
    case Fp8Format::kE4M3FN: FP8MOE_ENC(Fp8Format::kE4M3FN);
    case Fp8Format::kE4M3FNUZ: FP8MOE_ENC(Fp8Format::kE4M3FNUZ);
    case Fp8Format::kE5M2: FP8MOE_ENC(Fp8Format::kE5M2);
    case Fp8Format::kE5M2FNUZ: FP8MOE_ENC(Fp8Format::kE5M2FNUZ);
  }
#undef FP8MOE_ENC
}

void DecodeFp8Span(const uint8_t* codes, float* out, size_t n,
                   Fp8Format format, bool stream) {
#define FP8MOE_DEC(F) \
  return stream ? DecodeFp8SpanT<F, true>(codes, out, n) \
                : DecodeFp8SpanT<F, false>(codes, out, n)
  switch (format) {
    case Fp8Format::kE4M3FN: FP8MOE_DEC(Fp8Format::kE4M3FN);
    case Fp8Format::kE4M3FNUZ: FP8MOE_DEC(Fp8Format::kE4M3FNUZ);
    case Fp8Format::kE5M2: FP8MOE_DEC(Fp8Format::kE5M2);
    case Fp8Format::kE5M2FNUZ: FP8MOE_DEC(Fp8Format::kE5M2FNUZ);
  }
#undef FP8MOE_DEC
}

void DecodeFp8ToBf16Span(const uint8_t* codes, uint16_t* out, size_t n,
                         Fp8Format format) {
  switch (format) {
    case Fp8Format::kE4M3FN:
      return DecodeFp8ToBf16SpanT<Fp8Format::kE4M3FN>(codes, out, n);
    case Fp8Format::kE4M3FNUZ:
      return DecodeFp8ToBf16SpanT<Fp8Format::kE4M3FNUZ>(codes, out, n);
    case Fp8Format::kE5M2:
      return DecodeFp8ToBf16SpanT<Fp8Format::kE5M2>(codes, out, n);
    case Fp8Format::kE5M2FNUZ:
      return DecodeFp8ToBf16SpanT<Fp8Format::kE5M2FNUZ>(codes, out, n);
  }
}

void DequantizeFp8ToBf16Span(const uint8_t* codes, const float* scales,
                             uint16_t* out, size_t n, Fp8Format format) {
  switch (format) {
    case Fp8Format::kE4M3FN:
      return DequantizeFp8ToBf16SpanT<Fp8Format::kE4M3FN>(codes, scales, out, n);
    case Fp8Format::kE4M3FNUZ:
      return DequantizeFp8ToBf16SpanT<Fp8Format::kE4M3FNUZ>(codes, scales, out, n);
    case Fp8Format::kE5M2:
      return DequantizeFp8ToBf16SpanT<Fp8Format::kE5M2>(codes, scales, out, n);
    case Fp8Format::kE5M2FNUZ:
      return DequantizeFp8ToBf16SpanT<Fp8Format::kE5M2FNUZ>(codes, scales, out, n);
  }
}

void F32ToBf16Span(const float* x, uint16_t* out, size_t n) {
  F32ToBf16SpanT(x, out, n);
}

void Bf16ToF32Span(const uint16_t* bits, float* out, size_t n, bool stream) {
  return stream ? Bf16ToF32SpanT<true>(bits, out, n)
                : Bf16ToF32SpanT<false>(bits, out, n);
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe {

HWY_EXPORT(EncodeFp8Span);
HWY_EXPORT(DecodeFp8Span);
HWY_EXPORT(DecodeFp8ToBf16Span);
HWY_EXPORT(F32ToBf16Span);
HWY_EXPORT(DequantizeFp8ToBf16Span);
HWY_EXPORT(Bf16ToF32Span);
HWY_EXPORT(TargetName);

namespace {

// Spans below this many elements run on the calling thread: below it the
// fork/join costs more than the conversion.
constexpr size_t kParallelMin = size_t{1} << 18;
// Chunks are a multiple of 64 elements so that each chunk of an aligned output
// starts aligned (needed by streaming stores).
constexpr size_t kChunk = size_t{1} << 16;
// Outputs at least this large are written with non-temporal stores: they do
// not fit in the caches anyway.
constexpr size_t kStreamBytes = size_t{8} << 20;

bool ShouldStream(const void* out, size_t out_bytes) {
  return out_bytes >= kStreamBytes &&
         reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

// Calls fn(begin, end) over [0, n) in chunks, in parallel for large n.
template <class Fn>
void ForChunks(size_t n, const Fn& fn) {
  if (n < kParallelMin) {
    fn(size_t{0}, n);
    return;
  }
  const int64_t num_chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    fn(begin, std::min(n, begin + kChunk));
  }
}

}  // namespace

void EncodeFp8Span(const float* x, uint8_t* codes, size_t n, Fp8Format format,
                   bool saturate) {
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(EncodeFp8Span)(x + b, codes + b, e - b, format,
                                        saturate);
  });
}

void DecodeFp8Span(const uint8_t* codes, float* out, size_t n,
                   Fp8Format format) {
  const bool stream = ShouldStream(out, n * sizeof(float));
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(DecodeFp8Span)(codes + b, out + b, e - b, format,
                                        stream);
  });
}

void DecodeFp8ToBf16Span(const uint8_t* codes, uint16_t* out, size_t n,
                         Fp8Format format) {
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(DecodeFp8ToBf16Span)(codes + b, out + b, e - b,
                                              format);
  });
}

void DequantizeFp8ToBf16Span(const uint8_t* codes, const float* scales,
                             uint16_t* out, size_t n, Fp8Format format) {
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(DequantizeFp8ToBf16Span)(codes + b, scales + b, out + b,
                                                  e - b, format);
  });
}

void F32ToBf16Span(const float* x, uint16_t* out, size_t n) {
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(F32ToBf16Span)(x + b, out + b, e - b);
  });
}

void Bf16ToF32Span(const uint16_t* bits, float* out, size_t n) {
  const bool stream = ShouldStream(out, n * sizeof(float));
  ForChunks(n, [&](size_t b, size_t e) {
    HWY_DYNAMIC_DISPATCH(Bf16ToF32Span)(bits + b, out + b, e - b, stream);
  });
}

namespace {
// Off only after RestrictSimdTarget("AVX3") (or a test) asked for plain
// AVX-512 on a CPU that has AVX3_SPR.
std::atomic<bool> g_avx512_extensions{true};
std::atomic<int> g_bf16_dot_override{-1};
constexpr const char* kAvx3Spr = "AVX3_SPR";

// FP8MOE_BF16_DOT, else the CPU's vendor: Intel's vdpbf16ps zmm ran at
// 0.46-0.50 instructions per cycle against two FMAs per cycle (Sapphire
// Rapids, 2026-12-01), AMD's Zen 4 at two FMAs' flops.
bool DefaultBf16DotProducts() {
  static const bool use = [] {
    const Result<int> setting = Bf16DotSetting();
    if (!setting.ok()) {
      std::fprintf(stderr, "fp8moe: %s; ignored\n", setting.status().message().c_str());
    } else if (*setting >= 0) {
      return *setting == 1;
    }
    return !__builtin_cpu_is("intel");
  }();
  return use;
}
}  // namespace

Result<int> Bf16DotSetting() {
  const char* env = std::getenv("FP8MOE_BF16_DOT");
  if (env == nullptr) return -1;
  if (std::strcmp(env, "on") == 0) return 1;
  if (std::strcmp(env, "off") == 0) return 0;
  return InvalidArgument("FP8MOE_BF16_DOT=" + std::string(env) +
                         ": write on or off (or unset it for the CPU's default, "
                         "docs/kernels.md)");
}

bool CpuHasAvx512Bf16Dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

bool Avx512ExtensionsEnabled() { return g_avx512_extensions.load(std::memory_order_relaxed); }

bool UseBf16DotProducts() {
  if (!CpuHasAvx512Bf16Dot() || !Avx512ExtensionsEnabled()) return false;
  const int o = g_bf16_dot_override.load(std::memory_order_relaxed);
  return o < 0 ? DefaultBf16DotProducts() : o == 1;
}

namespace internal {
void SetAvx512ExtensionsEnabled(bool on) { g_avx512_extensions.store(on); }
void SetBf16DotProducts(int use) { g_bf16_dot_override.store(use < 0 ? -1 : use != 0); }
}  // namespace internal

const char* SimdTargetName() {
  const char* name = HWY_DYNAMIC_DISPATCH(TargetName)();
  if (std::strcmp(name, "AVX3") == 0 && CpuHasAvx512Bf16Dot() && Avx512ExtensionsEnabled()) {
    return kAvx3Spr;
  }
  return name;
}

Status RestrictSimdTarget(std::string_view name) {
  std::string names;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    const bool avx3 = t == HWY_AVX3;
    // AVX3_SPR is Highway's AVX3 with this CPU's AVX-512 extensions, AVX3
    // without them: a Skylake-X's kernels on this machine.
    const bool spr = avx3 && CpuHasAvx512Bf16Dot();
    if (spr) {
      if (name == kAvx3Spr) {
        hwy::DisableTargets(t - 1);  // smaller bits are better targets
        internal::SetAvx512ExtensionsEnabled(true);
        return OkStatus();
      }
      names += (names.empty() ? "" : ", ") + std::string(kAvx3Spr);
    }
    if (name == hwy::TargetName(t)) {
      hwy::DisableTargets(t - 1);
      internal::SetAvx512ExtensionsEnabled(!spr);  // elsewhere AVX3 keeps e.g. VNNI
      return OkStatus();
    }
    names += (names.empty() ? "" : ", ") + std::string(hwy::TargetName(t));
  }
  return InvalidArgument("SIMD target '" + std::string(name) +
                         "' is not available; this CPU and build support: " +
                         names);
}

}  // namespace fp8moe
#endif  // HWY_ONCE
