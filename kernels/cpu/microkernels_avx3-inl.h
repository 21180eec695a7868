// AVX-512 microkernels (Highway target AVX3), raw intrinsics where Highway
// 1.0.3 has no such op: bf16 pairs (vdpbf16ps, AVX512-BF16 CPUs only), the
// direct kernels that read bf16 / fp8 / int8 weight rows in place, and int16
// pairs with vpdpwssd (AVX512-VNNI). Included by microkernels-inl.h; on every
// other target it only says that these features are absent.

#if defined(FP8MOE_KERNELS_CPU_MICROKERNELS_AVX3_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_MICROKERNELS_AVX3_INL_H_
#undef FP8MOE_KERNELS_CPU_MICROKERNELS_AVX3_INL_H_
#else
#define FP8MOE_KERNELS_CPU_MICROKERNELS_AVX3_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/line_walk.h"

#if HWY_TARGET == HWY_AVX3
#include <immintrin.h>

#include "fp8moe/numerics.h"
#include "kernels/cpu/gemm_call.h"
#include "numerics/convert-inl.h"
#include "numerics/fp8_spec.h"
#ifndef FP8MOE_AVX512BF16
#define FP8MOE_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif
#endif

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
using internal::DirectPrefetch;

// ---- bf16 pairs (AVX512-BF16) --------------------------------------------

#if HWY_TARGET == HWY_AVX3
// Whether the kernels use vdpbf16ps: the CPU has it, the target is AVX3_SPR,
// not plain AVX3, and its dot products beat f32 FMA here (numerics.h).
inline bool UseBf16Pairs() { return UseBf16DotProducts(); }

// ap: kc/2 x MR u32 (bf16 pairs); bp: kc/2 x 32 u32 pairs (NR = 32).
// vdpbf16ps adds both products of a pair into the f32 lane; for operands
// whose products are exact in f32 (fp8 values) this is the same as two FMAs.
// Denormal inputs and results are flushed (DAZ/FTZ) by the instruction.
template <size_t MR>
FP8MOE_AVX512BF16 HWY_NOINLINE void
MicroBf16Pairs(size_t kc2, const uint32_t* HWY_RESTRICT ap,
               const uint32_t* HWY_RESTRICT bp, float* HWY_RESTRICT c,
               size_t ldc, bool load_c, const float* HWY_RESTRICT row_scale,
               const float* HWY_RESTRICT col_scale) {
  __m512 acc0[MR], acc1[MR];
  const bool scaled = row_scale != nullptr || col_scale != nullptr;
  const bool start_from_c = load_c && !scaled;
  HWY_UNROLL(16)
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
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    float* p = c + i * ldc;
    if (scaled) {
      const __m512 s0 = row_scale != nullptr ? _mm512_set1_ps(row_scale[i]) : _mm512_loadu_ps(col_scale);
      const __m512 s1 = row_scale != nullptr ? s0 : _mm512_loadu_ps(col_scale + 16);
      if (load_c) {
        _mm512_storeu_ps(p, _mm512_fmadd_ps(s0, acc0[i], _mm512_loadu_ps(p)));
        _mm512_storeu_ps(p + 16, _mm512_fmadd_ps(s1, acc1[i], _mm512_loadu_ps(p + 16)));
      } else {
        _mm512_storeu_ps(p, _mm512_mul_ps(s0, acc0[i]));
        _mm512_storeu_ps(p + 16, _mm512_mul_ps(s1, acc1[i]));
      }
    } else {
      _mm512_storeu_ps(p, acc0[i]);
      _mm512_storeu_ps(p + 16, acc1[i]);
    }
  }
}
// ---- bf16 pairs straight from the weight (no packed B panel) -----------------
//
// For items with at most MR rows every B element is used by one A panel only,
// so packing B (write a panel, read it back) costs more than it saves: these
// kernels read 32 columns of two reduction rows straight from the source, turn
// them into bf16 in registers (fp8 codes are decoded; bf16 is used as is),
// interleave the rows into (k, k+1) pairs and multiply. unpacklo/hi_epi16 work
// within 128-bit lanes, so the accumulators hold the columns in the order
// {0-3, 8-11, 16-19, 24-27} | {4-7, 12-15, 20-23, 28-31}; two permutes per row
// restore it when C is loaded or stored.

// 32 fp8 codes (ymm) -> 32 bf16 (zmm of u16), exact, no f32 subnormals.
template <Fp8Format kFormat>
FP8MOE_AVX512BF16 HWY_INLINE __m512i
DecodeFp8ToBf16x32(__m256i codes8) {
  constexpr Fp8Spec s = SpecOf(kFormat);
  const __m512i c = _mm512_cvtepu8_epi16(codes8);
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
  // Normal: exponent and mantissa into place, exponent re-biased by an add.
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 7 - s.mantissa_bits),
                               _mm512_set1_epi16(static_cast<short>((127 - s.bias) << 7)));
  // Subnormal mantissas m (m < 2^mantissa_bits): bf16 of m * 2^(1-bias-man)
  // from a small table.
  alignas(64) static const uint16_t kSub[32] = {
      0,
      F32ToBf16Const(1.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(2.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(3.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(4.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(5.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(6.0f * kPow2(1 - s.bias - s.mantissa_bits)),
      F32ToBf16Const(7.0f * kPow2(1 - s.bias - s.mantissa_bits))};
  const __mmask32 is_sub =
      _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(1 << s.mantissa_bits));
  v = _mm512_mask_permutexvar_epi16(v, is_sub, mag, _mm512_load_si512(kSub));
  v = _mm512_or_si512(v, sign);
  if constexpr (s.fnuz) {
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(c, _mm512_set1_epi16(0x80));
    v = _mm512_mask_mov_epi16(v, nan, _mm512_set1_epi16(static_cast<short>(0xFFC0)));
  } else if constexpr (s.has_inf) {
    const __mmask32 special = _mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(0x7C));
    const __mmask32 inf = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7C));
    v = _mm512_mask_mov_epi16(v, special, _mm512_or_si512(sign, _mm512_set1_epi16(0x7FC0)));
    v = _mm512_mask_mov_epi16(v, inf, _mm512_or_si512(sign, _mm512_set1_epi16(0x7F80)));
  } else {
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F));
    v = _mm512_mask_mov_epi16(v, nan, _mm512_or_si512(sign, _mm512_set1_epi16(0x7FC0)));
  }
  return v;
}

// Source kinds of the direct kernel.
// (The fp8 weights of native GMMs are e4m3fn or e4m3fnuz.)
enum class DirectSrc { kBf16, kE4M3FN, kE4M3FNUZ };

template <DirectSrc kSrc>
FP8MOE_AVX512BF16 HWY_INLINE __m512i
LoadBf16x32(const uint8_t* p) {
  if constexpr (kSrc == DirectSrc::kBf16) {
    return _mm512_loadu_si512(p);
  } else {
    constexpr Fp8Format f = static_cast<Fp8Format>(static_cast<int>(kSrc) - 1);
    return DecodeFp8ToBf16x32<f>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// The 32 columns of a direct kernel's accumulator pair (v0, v1), in the order
// the in-lane unpacks produce, put back in natural column order.
__attribute__((target("avx512f"))) HWY_INLINE void PermuteToNatural(__m512i& v0, __m512i& v1) {
  const __m512i to_natural0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i to_natural1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512i n0 = _mm512_permutex2var_epi32(v0, to_natural0, v1);
  v1 = _mm512_permutex2var_epi32(v0, to_natural1, v1);
  v0 = n0;
}

// The C tile [MR x 32 NB] of the direct kernels (NB blocks of 32 columns),
// held in the accumulator column order the in-lane unpacks produce. Between
// the reduction chunks of a work item C stays in that order in memory (nobody
// reads it until the item is done), so only the item's last chunk permutes it
// to the natural order: permutes share the shuffle pipes with the fp8 decode.
// Everything is inlined and unrolled, so the arrays live in registers.
//
// Why NB: every accumulator is a chain of dependent vdpbf16ps (latency ~5-6
// cycles), so a tile needs about 8 accumulators to issue one per cycle. An
// item of one row (decode with one token per expert) gets them from 4 blocks
// of columns, not from 8 rows of which 7 would be padding: 8x fewer dot
// products per weight byte, which is what bounded the decode shapes.
template <size_t MR, size_t NB = 1>
struct PermutedTile {
  __m512 acc[MR][2 * NB];

  // acc = C as a previous chunk left it (accumulator order), or zero.
  FP8MOE_AVX512BF16 HWY_INLINE void Load(const float* c, size_t ldc, bool from_c) {
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      HWY_UNROLL(8)
      for (size_t v = 0; v < 2 * NB; ++v) {
        acc[i][v] = from_c ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
      }
    }
  }

  // acc[i] += pairs of A row i (a[i]) . the B pair vectors of every block
  // (lo[j], hi[j]: block j's two accumulator halves).
  FP8MOE_AVX512BF16 HWY_INLINE void Dot(const uint32_t* a, const __m512bh* lo,
                                        const __m512bh* hi) {
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i]));
      HWY_UNROLL(4)
      for (size_t j = 0; j < NB; ++j) {
        acc[i][2 * j] = _mm512_dpbf16_ps(acc[i][2 * j], av, lo[j]);
        acc[i][2 * j + 1] = _mm512_dpbf16_ps(acc[i][2 * j + 1], av, hi[j]);
      }
    }
  }

  // C = acc, or with row_scale C = s * acc (+ C when load_c, which is in
  // accumulator order); in the natural column order when `last`.
  FP8MOE_AVX512BF16 HWY_INLINE void Store(float* c, size_t ldc, bool load_c,
                                          const float* row_scale, bool last) {
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      HWY_UNROLL(4)
      for (size_t j = 0; j < NB; ++j) {
        float* p = c + i * ldc + 32 * j;
        __m512 v0 = acc[i][2 * j], v1 = acc[i][2 * j + 1];
        if (row_scale != nullptr) {
          const __m512 s = _mm512_set1_ps(row_scale[i]);
          v0 = load_c ? _mm512_fmadd_ps(s, v0, _mm512_loadu_ps(p)) : _mm512_mul_ps(s, v0);
          v1 = load_c ? _mm512_fmadd_ps(s, v1, _mm512_loadu_ps(p + 16)) : _mm512_mul_ps(s, v1);
        }
        __m512i b0 = _mm512_castps_si512(v0), b1 = _mm512_castps_si512(v1);
        if (last) PermuteToNatural(b0, b1);
        _mm512_storeu_si512(p, b0);
        _mm512_storeu_si512(p + 16, b1);
      }
    }
  }
};

// C[MR x 32 NB] (+)= A panel (kc2 x MR pairs) x B rows [r, r + 2*kc2) of
// the source at b (ldb bytes per row), columns [0, 32 NB). kc odd: the last
// pair's second row is not read (zero).
template <size_t MR, size_t NB, DirectSrc kSrc>
FP8MOE_AVX512BF16 HWY_NOINLINE void
MicroBf16PairsDirect(size_t kc, const uint32_t* HWY_RESTRICT ap,
                     const uint8_t* HWY_RESTRICT b, size_t ldb,
                     float* HWY_RESTRICT c, size_t ldc, bool load_c,
                     const float* HWY_RESTRICT row_scale, bool last, DirectPrefetch pf) {
  constexpr size_t kBlockBytes = kSrc == DirectSrc::kBf16 ? 64 : 32;  // 32 columns
  PermutedTile<MR, NB> tile;
  tile.Load(c, ldc, load_c && row_scale == nullptr);
  // Rows (row0, row1) of every block into (k, k+1) pairs, then the dots.
  auto step = [&](const uint32_t* a, const uint8_t* row0, const uint8_t* row1)
                  FP8MOE_AVX512BF16 {
    __m512bh lo[NB], hi[NB];
    HWY_UNROLL(4)
    for (size_t j = 0; j < NB; ++j) {
      const __m512i x0 = LoadBf16x32<kSrc>(row0 + j * kBlockBytes);
      const __m512i x1 =
          row1 != nullptr ? LoadBf16x32<kSrc>(row1 + j * kBlockBytes) : _mm512_setzero_si512();
      lo[j] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
      hi[j] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    }
    tile.Dot(a, lo, hi);
  };
  const size_t kc2 = kc / 2;
  HWY_UNROLL(2)
  for (size_t k = 0; k < kc2; ++k) {
    const uint8_t* row = b + 2 * k * ldb;
    pf.Step(row, ldb, 2, NB * kBlockBytes);
    step(ap + k * MR, row, row + ldb);
  }
  if (kc % 2 != 0) step(ap + kc2 * MR, b + 2 * kc2 * ldb, nullptr);
  tile.Store(c, ldc, load_c, row_scale, last);
}

// ---- fp8 weight pairs by byte tables (AVX512-VBMI) --------------------------
//
// Decoding row by row costs ~12 vector ops per 32 codes and dominated the
// decode shape. With byte permutes: put 32 codes of row k and 32 of row k+1
// side by side, interleave them (a0 b0 a1 b1 ..., one vpermb), look up the low
// and the high byte of every code's bf16 in two 128-entry tables (vpermi2b
// on the 7 magnitude bits; the sign is OR-ed into the high byte), and
// interleave low and high bytes: the u16 lanes are then bf16(a0), bf16(b0),
// bf16(a1), ..., i.e. exactly the (k, k+1) pairs, in the same lane order as
// the u16 path. About 8 ops per 64 codes.

#ifndef FP8MOE_AVX512VBMI
#define FP8MOE_AVX512VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
#endif

// Whether the direct kernels decode fp8 with byte tables (convert-inl.h):
// the CPU has AVX512-VBMI, the extensions are on, and no test turned the
// tables off.
inline bool CpuHasAvx512Vbmi() {
  return UseFp8ByteTables() && internal::Fp8ByteTableDecode();
}

template <size_t MR, size_t NB, Fp8Format kFormat>
FP8MOE_AVX512VBMI HWY_NOINLINE void MicroFp8PairsVbmi(
    size_t kc, const uint32_t* HWY_RESTRICT ap, const uint8_t* HWY_RESTRICT b,
    size_t ldb, float* HWY_RESTRICT c, size_t ldc, bool load_c,
    const float* HWY_RESTRICT row_scale, bool last, DirectPrefetch pf) {
  const Fp8TableRegs t = LoadFp8Tables<kFormat>();
  alignas(64) static const uint8_t kInterleave[64] = {
      0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
      8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  PermutedTile<MR, NB> tile;
  tile.Load(c, ldc, load_c && row_scale == nullptr);
  // 32 codes of rows (row0, row1) per block -> (k, k+1) bf16 pairs; row1
  // nullptr: code 0 (the odd tail).
  auto step = [&](const uint32_t* a, const uint8_t* row0, const uint8_t* row1)
                  FP8MOE_AVX512VBMI {
    __m512bh lo_pairs[NB], hi_pairs[NB];
    HWY_UNROLL(4)
    for (size_t j = 0; j < NB; ++j) {
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + 32 * j));
      const __m256i r1 = row1 != nullptr
                             ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1 + 32 * j))
                             : _mm256_setzero_si256();
      __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
      x = _mm512_permutexvar_epi8(interleave, x);
      __m512i lo, hi;
      Fp8BytesToBf16Bytes<kFormat>(x, t, lo, hi);
      lo_pairs[j] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
      hi_pairs[j] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
    }
    tile.Dot(a, lo_pairs, hi_pairs);
  };
  const size_t kc2 = kc / 2;
  HWY_UNROLL(2)
  for (size_t k = 0; k < kc2; ++k) {
    const uint8_t* row = b + 2 * k * ldb;
    pf.Step(row, ldb, 2, NB * 32);
    step(ap + k * MR, row, row + ldb);
  }
  if (kc % 2 != 0) step(ap + kc2 * MR, b + 2 * kc2 * ldb, nullptr);  // second row: code 0
  tile.Store(c, ldc, load_c, row_scale, last);
}

// Whether this CPU has vpdpwssd (AVX512-VNNI).
inline bool CpuHasAvx512Vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has && Avx512ExtensionsEnabled();
}

// The I16 kernel with vpdpwssd: the pair multiply-add and the accumulate in
// one instruction (vpmaddwd + vpaddd otherwise). Exact int32 arithmetic, so
// the bits equal MicroI16's.
template <size_t MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) HWY_NOINLINE void
MicroI16Vnni(size_t kc2, const uint32_t* HWY_RESTRICT ap,
             const uint32_t* HWY_RESTRICT bp, int32_t* HWY_RESTRICT c,
             size_t ldc, bool load_c) {
  __m512i acc0[MR], acc1[MR];
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    acc0[i] = load_c ? _mm512_loadu_si512(c + i * ldc) : _mm512_setzero_si512();
    acc1[i] = load_c ? _mm512_loadu_si512(c + i * ldc + 16) : _mm512_setzero_si512();
  }
  HWY_UNROLL(2)
  for (size_t k = 0; k < kc2; ++k) {
    const __m512i b0 = _mm512_load_si512(bp + k * 32);
    const __m512i b1 = _mm512_load_si512(bp + k * 32 + 16);
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(ap[k * MR + i]));
      acc0[i] = _mm512_dpwssd_epi32(acc0[i], a, b0);
      acc1[i] = _mm512_dpwssd_epi32(acc1[i], a, b1);
    }
  }
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    _mm512_storeu_si512(c + i * ldc, acc0[i]);
    _mm512_storeu_si512(c + i * ldc + 16, acc1[i]);
  }
}
// int8 weights of items of at most MR rows, read straight from the weight
// (int8 decode): 32 columns of rows k and k+1 per block sign-extended to
// int16 and interleaved into pairs in registers, vpdpwssd against the packed
// int16 A pairs. The same exact int32 sums as MicroI16Vnni on packed panels.
// C is an int32 tile [MR x 32 NB] (NB blocks: PermutedTile says why), kept
// in the unpacks' column order between reduction chunks like PermutedTile's
// and put in natural order by the last chunk.
template <size_t MR, size_t NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) HWY_NOINLINE void
MicroI8PairsDirectVnni(size_t kc, const uint32_t* HWY_RESTRICT ap,
                       const uint8_t* HWY_RESTRICT b, size_t ldb, int32_t* HWY_RESTRICT c,
                       size_t ldc, bool load_c, bool last, DirectPrefetch pf) {
  __m512i acc[MR][2 * NB];
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(8)
    for (size_t v = 0; v < 2 * NB; ++v) {
      acc[i][v] = load_c ? _mm512_loadu_si512(c + i * ldc + 16 * v) : _mm512_setzero_si512();
    }
  }
  auto row16 = [](const uint8_t* p) __attribute__((target("avx512f,avx512bw,avx512vl"))) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  // Rows (row0, row1; row1 nullptr: zero, the odd tail) of every block into
  // pairs, then the dot products.
  auto step = [&](const uint32_t* a, const uint8_t* row0, const uint8_t* row1)
                  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) {
    __m512i lo[NB], hi[NB];
    HWY_UNROLL(4)
    for (size_t j = 0; j < NB; ++j) {
      const __m512i x0 = row16(row0 + 32 * j);
      const __m512i x1 = row1 != nullptr ? row16(row1 + 32 * j) : _mm512_setzero_si512();
      lo[j] = _mm512_unpacklo_epi16(x0, x1);
      hi[j] = _mm512_unpackhi_epi16(x0, x1);
    }
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a[i]));
      HWY_UNROLL(4)
      for (size_t j = 0; j < NB; ++j) {
        acc[i][2 * j] = _mm512_dpwssd_epi32(acc[i][2 * j], av, lo[j]);
        acc[i][2 * j + 1] = _mm512_dpwssd_epi32(acc[i][2 * j + 1], av, hi[j]);
      }
    }
  };
  const size_t kc2 = kc / 2;
  HWY_UNROLL(2)
  for (size_t k = 0; k < kc2; ++k) {
    const uint8_t* row = b + 2 * k * ldb;
    pf.Step(row, ldb, 2, NB * 32);
    step(ap + k * MR, row, row + ldb);
  }
  if (kc % 2 != 0) step(ap + kc2 * MR, b + 2 * kc2 * ldb, nullptr);
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
    for (size_t j = 0; j < NB; ++j) {
      __m512i v0 = acc[i][2 * j], v1 = acc[i][2 * j + 1];
      if (last) PermuteToNatural(v0, v1);
      _mm512_storeu_si512(c + i * ldc + 32 * j, v0);
      _mm512_storeu_si512(c + i * ldc + 32 * j + 16, v1);
    }
  }
}
#else
inline bool UseBf16Pairs() { return false; }
inline bool CpuHasAvx512Vnni() { return false; }
#endif

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
