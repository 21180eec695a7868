// Register-tiled microkernels: C[MR, NR] (+)= Ap[kc, MR] x Bp[kc, NR] on
// packed panels (pack-inl.h). Three kinds:
//   F32   f32 panels, one FMA per product (every target).
//   Pairs bf16 pairs along the reduction, vdpbf16ps (AVX512-BF16 CPUs only,
//         raw intrinsics: Highway 1.0.3 has no such op).
//   I16   int16 pairs along the reduction, int32 accumulation
//         (ReorderWidenMulAccumulate: vpmaddwd on x86).
//
// Register budget (AVX-512, 32 zmm): MR=12 x NV=2 -> 24 accumulators + 2 B
// vectors + 1 broadcast. AVX2 (16 ymm): 6 x 2 -> 12 + 2 + 1, the BLIS
// Haswell tile. Per reduction step the kernel loads NV vectors of B and MR
// broadcasts of A for MR*NV FMAs, well inside two loads per cycle.
//
// Summation order: with load_c the accumulators start from C, so C ends up
// holding the products added strictly in reduction order no matter how the
// reduction was cut into blocks (tile k never changes the bits). With a
// row_scale (native fp8 K-blocks) the block's sum starts at zero and is added
// as C += row_scale[i] * sum.

#if defined(FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#undef FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#else
#define FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"

#if HWY_TARGET == HWY_AVX3
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register tiles per target.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr size_t kMR = 12;
#elif HWY_TARGET == HWY_SCALAR
constexpr size_t kMR = 4;
#else
constexpr size_t kMR = 6;
#endif
constexpr size_t kNV = 2;

inline size_t KernelNR() { return kNV * hn::Lanes(hn::ScalableTag<float>()); }

// ---- F32 -----------------------------------------------------------------

// ap: kc x MR (row i of step k at ap[k*MR + i]); bp: kc x NR; c: MR rows of
// ldc floats.
template <size_t MR, size_t NV>
HWY_NOINLINE void MicroF32(size_t kc, const float* HWY_RESTRICT ap,
                           const float* HWY_RESTRICT bp, float* HWY_RESTRICT c,
                           size_t ldc, bool load_c,
                           const float* HWY_RESTRICT row_scale) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const size_t N = hn::Lanes(d);
  const size_t NR = NV * N;
  V acc[MR][NV];
  const bool start_from_c = load_c && row_scale == nullptr;
  for (size_t i = 0; i < MR; ++i) {
    for (size_t j = 0; j < NV; ++j) {
      acc[i][j] = start_from_c ? hn::LoadU(d, c + i * ldc + j * N) : hn::Zero(d);
    }
  }
  for (size_t k = 0; k < kc; ++k) {
    V b[NV];
    HWY_UNROLL(4)
    for (size_t j = 0; j < NV; ++j) b[j] = hn::Load(d, bp + k * NR + j * N);
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const V a = hn::Set(d, ap[k * MR + i]);
      HWY_UNROLL(4)
      for (size_t j = 0; j < NV; ++j) acc[i][j] = hn::MulAdd(a, b[j], acc[i][j]);
    }
  }
  for (size_t i = 0; i < MR; ++i) {
    for (size_t j = 0; j < NV; ++j) {
      float* p = c + i * ldc + j * N;
      if (row_scale != nullptr) {
        const V s = hn::Set(d, row_scale[i]);
        hn::StoreU(load_c ? hn::MulAdd(s, acc[i][j], hn::LoadU(d, p))
                          : hn::Mul(s, acc[i][j]),
                   d, p);
      } else {
        hn::StoreU(acc[i][j], d, p);
      }
    }
  }
}

// ---- I16 pairs -> int32 --------------------------------------------------

// ap: kc/2 x MR u32 (each an int16 pair (r, r+1)); bp: kc/2 x NR u32 pairs.
template <size_t MR, size_t NV>
HWY_NOINLINE void MicroI16(size_t kc2, const uint32_t* HWY_RESTRICT ap,
                           const uint32_t* HWY_RESTRICT bp,
                           int32_t* HWY_RESTRICT c, size_t ldc, bool load_c) {
#if HWY_TARGET == HWY_SCALAR
  // One-lane vectors cannot hold a pair; plain loops on this target.
  const size_t NR = NV;
  for (size_t i = 0; i < MR; ++i) {
    for (size_t j = 0; j < NR; ++j) {
      int32_t s = load_c ? c[i * ldc + j] : 0;
      for (size_t k = 0; k < kc2; ++k) {
        const uint32_t a = ap[k * MR + i], b = bp[k * NR + j];
        s += static_cast<int16_t>(a & 0xFFFF) * static_cast<int16_t>(b & 0xFFFF) +
             static_cast<int16_t>(a >> 16) * static_cast<int16_t>(b >> 16);
      }
      c[i * ldc + j] = s;
    }
  }
#else
  const hn::ScalableTag<int32_t> d32;
  const hn::Repartition<int16_t, decltype(d32)> d16;
  const hn::RebindToUnsigned<decltype(d32)> du32;
  using V = hn::Vec<decltype(d32)>;
  const size_t N = hn::Lanes(d32);
  const size_t NR = NV * N;
  V acc[MR][NV], odd[MR][NV];
  for (size_t i = 0; i < MR; ++i) {
    for (size_t j = 0; j < NV; ++j) {
      acc[i][j] = load_c ? hn::LoadU(d32, c + i * ldc + j * N) : hn::Zero(d32);
      odd[i][j] = hn::Zero(d32);
    }
  }
  for (size_t k = 0; k < kc2; ++k) {
    hn::Vec<decltype(d16)> b[NV];
    for (size_t j = 0; j < NV; ++j) {
      b[j] = hn::BitCast(d16, hn::Load(du32, bp + k * NR + j * N));
    }
    for (size_t i = 0; i < MR; ++i) {
      const auto a = hn::BitCast(d16, hn::Set(du32, ap[k * MR + i]));
      for (size_t j = 0; j < NV; ++j) {
        acc[i][j] = hn::ReorderWidenMulAccumulate(d32, a, b[j], acc[i][j], odd[i][j]);
      }
    }
  }
  for (size_t i = 0; i < MR; ++i) {
    for (size_t j = 0; j < NV; ++j) {
      hn::StoreU(hn::RearrangeToOddPlusEven(acc[i][j], odd[i][j]), d32,
                 c + i * ldc + j * N);
    }
  }
#endif
}

// ---- bf16 pairs (AVX512-BF16) --------------------------------------------

#if HWY_TARGET == HWY_AVX3
// Whether this CPU has vdpbf16ps (checked once).
inline bool CpuHasAvx512Bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// ap: kc/2 x MR u32 (bf16 pairs); bp: kc/2 x 32 u32 pairs (NR = 32).
// vdpbf16ps adds both products of a pair into the f32 lane; for operands
// whose products are exact in f32 (fp8 values) this is the same as two FMAs.
// Denormal inputs and results are flushed (DAZ/FTZ) by the instruction.
template <size_t MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) HWY_NOINLINE void
MicroBf16Pairs(size_t kc2, const uint32_t* HWY_RESTRICT ap,
               const uint32_t* HWY_RESTRICT bp, float* HWY_RESTRICT c,
               size_t ldc, bool load_c, const float* HWY_RESTRICT row_scale) {
  __m512 acc0[MR], acc1[MR];
  const bool start_from_c = load_c && row_scale == nullptr;
  for (size_t i = 0; i < MR; ++i) {
    acc0[i] = start_from_c ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
    acc1[i] = start_from_c ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
  }
  HWY_UNROLL(2)
  for (size_t k = 0; k < kc2; ++k) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(bp + k * 32);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(bp + k * 32 + 16);
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[k * MR + i]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], a, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], a, b1);
    }
  }
  for (size_t i = 0; i < MR; ++i) {
    float* p = c + i * ldc;
    if (row_scale != nullptr) {
      const __m512 s = _mm512_set1_ps(row_scale[i]);
      if (load_c) {
        _mm512_storeu_ps(p, _mm512_fmadd_ps(s, acc0[i], _mm512_loadu_ps(p)));
        _mm512_storeu_ps(p + 16, _mm512_fmadd_ps(s, acc1[i], _mm512_loadu_ps(p + 16)));
      } else {
        _mm512_storeu_ps(p, _mm512_mul_ps(s, acc0[i]));
        _mm512_storeu_ps(p + 16, _mm512_mul_ps(s, acc1[i]));
      }
    } else {
      _mm512_storeu_ps(p, acc0[i]);
      _mm512_storeu_ps(p + 16, acc1[i]);
    }
  }
}
#else
inline bool CpuHasAvx512Bf16() { return false; }
#endif

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
