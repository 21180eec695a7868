// Register-tiled microkernels: C[MR, NR] (+)= Ap[kc, MR] x Bp[kc, NR] on
// packed panels (pack-inl.h). Three kinds:
//   F32   f32 panels, one FMA per product (every target).
//   Pairs bf16 pairs along the reduction, vdpbf16ps (AVX512-BF16 CPUs only,
//         raw intrinsics: Highway 1.0.3 has no such op; in
//         microkernels_avx3-inl.h with the other AVX-512 kernels).
//   I16   int16 pairs along the reduction, int32 accumulation
//         (ReorderWidenMulAccumulate: vpmaddwd on x86).
//
// Register budget (AVX-512, 32 zmm): MR=12 x NV=2 -> 24 accumulators + 2 B
// vectors + 1 broadcast. AVX2 (16 ymm): 6 x 2 -> 12 + 2 + 1, the BLIS
// Haswell tile. Per reduction step the kernel loads NV vectors of B and MR
// broadcasts of A for MR*NV FMAs, well inside two loads per cycle.
//
// Every loop over the tile is fully unrolled (HWY_UNROLL), including the
// ones that load and store C: a loop left rolled keeps the accumulator array
// addressable and GCC then spills all of it every reduction step.
//
// Summation order: with load_c the accumulators start from C, so C ends up
// holding the products added strictly in reduction order no matter how the
// reduction was cut into blocks (tile k never changes the bits). With a
// row_scale (native fp8 K-blocks) or a col_scale (TGMM with a quantized
// gradient: one scale per reduction tile and column) the block's sum starts at
// zero and is added as C += scale * sum.

#if defined(FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#undef FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#else
#define FP8MOE_KERNELS_CPU_MICROKERNELS_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/line_walk.h"
#include "kernels/cpu/microkernels_avx3-inl.h"
#include "numerics/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using internal::DirectPrefetch;

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
                           const float* HWY_RESTRICT row_scale,
                           const float* HWY_RESTRICT col_scale) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const size_t N = hn::Lanes(d);
  const size_t NR = NV * N;
  V acc[MR][NV];
  const bool scaled = row_scale != nullptr || col_scale != nullptr;
  const bool start_from_c = load_c && !scaled;
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
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
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
    for (size_t j = 0; j < NV; ++j) {
      float* p = c + i * ldc + j * N;
      if (scaled) {
        const V s = row_scale != nullptr ? hn::Set(d, row_scale[i])
                                         : hn::LoadU(d, col_scale + j * N);
        hn::StoreU(load_c ? hn::MulAdd(s, acc[i][j], hn::LoadU(d, p))
                          : hn::Mul(s, acc[i][j]),
                   d, p);
      } else {
        hn::StoreU(acc[i][j], d, p);
      }
    }
  }
}

// ---- F32 straight from the weight (small groups, every target) -------------
//
// Items of at most 8 rows use each weight row once, so packing it (convert,
// write a panel, read it back) costs more than the arithmetic: on targets
// without bf16 dot products a decode-shape GMM spent most of its time
// packing. This kernel reads NV vectors of columns of each weight row
// straight from the source, converts them to f32 in registers, and does MR
// FMAs with each. MR x NV = 8 accumulators cover the FMA latency whatever the
// rows (1 row: 8 vectors of columns; 8 rows: 1 vector; AVX-512 holds 16 and
// takes 8 x 2, and 4 x 4 for fp8: DirectF32ShapeFor), so one row per expert
// costs one FMA per weight vector, not eight. The products and their
// order are those of MicroF32 (one FMA per product, strictly in reduction
// order from C or zero), so the bits are the packed path's.
//
// Sources: f32; bf16 (a shift); e4m3fn / e4m3fnuz by DecodeFp8Vec (exact,
// ~14 ops per vector); and the same codes decoded "raw" (3 ops: sign-extend,
// shift, mask), see LoadRowAsF32.

enum class RowSrc {
  kF32,
  kBf16,
  // fp8 codes of a native fp8 GMM (A holds the activation's codes, |a| <=
  // 448), decoded raw: the code's 7 magnitude bits land at f32 bits 26..20
  // and its sign at bit 31 with the exponent not re-biased, which is the fp8
  // value times 2^-120 (e4m3fn; 2^-119 e4m3fnuz), exactly (codes of exponent
  // 0 become f32 subnormals, which FMA takes exactly). The caller scales the
  // A panel by 2^113 (2^112), so every product is the exact product times
  // 2^-7 and every partial sum the packed path's times 2^-7 (power-of-two
  // scaling commutes with rounding while nothing under- or overflows:
  // products of e4m3 values are multiples of 2^-18), and C is multiplied by
  // 2^7 where it is finished. NaN codes come out finite: the kernel watches
  // the code bytes and says so, and the caller sets the columns they hit to
  // NaN (direct-inl.h), as the exact decode would have made them.
  kRawE4M3FN,
  kRawE4M3FNUZ,
};

constexpr bool IsRawFp8(RowSrc s) { return s == RowSrc::kRawE4M3FN || s == RowSrc::kRawE4M3FNUZ; }
constexpr size_t ElementBytesOf(RowSrc s) {
  return s == RowSrc::kF32 ? 4 : s == RowSrc::kBf16 ? 2 : 1;
}
// The power of two that scales the A panel of a raw fp8 kernel (the exact
// product times 2^-7 is what the kernel sums), and the one C is multiplied
// by where it is finished.
inline float RawFp8PanelScale(bool fnuz) { return fnuz ? 0x1p112f : 0x1p113f; }
constexpr float kRawFp8Post = 0x1p7f;
// What the raw decode keeps of a sign-extended code shifted to bits 27..20:
// the sign at bit 31 and the 7 magnitude bits at 26..20.
constexpr int32_t kRawFp8Mask = static_cast<int32_t>(0x87F00000u);

template <RowSrc kSrc, class DF>
HWY_INLINE hn::Vec<DF> LoadRowAsF32(DF df, const uint8_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  (void)du, (void)di;
  if constexpr (kSrc == RowSrc::kF32) {
    return hn::LoadU(df, reinterpret_cast<const float*>(p));
  } else if constexpr (kSrc == RowSrc::kBf16) {
    return LoadBf16AsF32(df, reinterpret_cast<const uint16_t*>(p));
  } else {
    static_assert(IsRawFp8(kSrc));
    const hn::Rebind<int8_t, DF> d8;
    // Sign-extended, the sign fills bits 31..27 after the shift; the mask
    // keeps bit 31 and the magnitude at bits 26..20.
    const auto codes = hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p)));
    return hn::BitCast(df, hn::And(hn::ShiftLeft<20>(codes),
                                   hn::Set(di, kRawFp8Mask)));
  }
}

// Watches fp8 codes for a NaN code of kSrc's format (the raw decode turns
// those into finite numbers), 2 ops per u8 vector of kCodes codes (a CappedTag:
// fewer lanes on narrow targets). e4m3fn's NaNs are the codes whose low 7 bits
// are all set (0x7F, 0xFF): the running unsigned max of code | 0x80 reaches
// 0xFF exactly when one was seen. e4m3fnuz's only NaN is 0x80, the smallest
// int8: the running signed min reaches it exactly when one was seen. (An OR
// of compare masks took 3 ops; in an isolated AVX2 decode loop, where the
// watch is an eighth of the ops, this one is 4% faster.)
template <RowSrc kSrc, size_t kCodes>
struct NaNCodeWatch {
  static constexpr bool kFnuz = kSrc == RowSrc::kRawE4M3FNUZ;
  using T = std::conditional_t<kFnuz, int8_t, uint8_t>;
  hn::CappedTag<T, kCodes> d8;
  hn::Vec<hn::CappedTag<T, kCodes>> seen;

  HWY_INLINE NaNCodeWatch() : seen(hn::Zero(d8)) {}

  HWY_INLINE size_t Lanes() const { return hn::Lanes(d8); }
  HWY_INLINE void Add(const uint8_t* HWY_RESTRICT p) {
    const auto v = hn::LoadU(d8, reinterpret_cast<const T*>(p));
    if constexpr (kFnuz) {
      seen = hn::Min(seen, v);
    } else {
      seen = hn::Max(seen, hn::Or(v, hn::Set(d8, static_cast<T>(0x80))));
    }
  }
  HWY_INLINE bool Seen() const {
    const T nan = static_cast<T>(kFnuz ? -128 : 0xFF);
    return !hn::AllFalse(d8, hn::Eq(seen, hn::Set(d8, nan)));
  }
};

// 2N fp8 codes at p, decoded raw (as LoadRowAsF32) into two f32 vectors:
// even = codes 0, 2, ..., 2N-2, odd = codes 1, 3, ..., 2N-1. One sign
// extension to 16 bits covers both: each 32-bit lane then holds code 2i in
// its low half and 2i+1 in its high half, sign-extended, and a shift by 20
// (even) or 4 (odd) puts that code's 7 magnitude bits at 26..20 with copies
// of its sign above; the mask keeps bit 31 and 26..20 (and clears the other
// code's bits below). 5 ops per 2N codes where LoadRowAsF32 takes 6, and 1
// shuffle instead of 2. UnpairRawFp8 / PairRawFp8 convert between this
// column order and the natural one (256-bit vectors of two 128-bit blocks).
template <class DF>
HWY_INLINE void LoadRawFp8Pair(DF df, const uint8_t* HWY_RESTRICT p, hn::Vec<DF>& even,
                               hn::Vec<DF>& odd) {
  const hn::RebindToSigned<DF> di;
  const hn::Repartition<int16_t, decltype(di)> d16;
  const hn::Rebind<int8_t, decltype(d16)> d8;
  const auto codes = hn::LoadU(d8, reinterpret_cast<const int8_t*>(p));
  const auto w = hn::BitCast(di, hn::PromoteTo(d16, codes));
  const auto mask = hn::Set(di, kRawFp8Mask);
  even = hn::BitCast(df, hn::And(hn::ShiftLeft<20>(w), mask));
  odd = hn::BitCast(df, hn::And(hn::ShiftLeft<4>(w), mask));
}
#if HWY_TARGET == HWY_AVX2
// (even, odd) of LoadRawFp8Pair -> columns [0, N), [N, 2N).
template <class DF>
HWY_INLINE void UnpairRawFp8(DF df, hn::Vec<DF>& a, hn::Vec<DF>& b) {
  const auto lo = hn::InterleaveLower(df, a, b);  // columns 0..3 | 8..11
  const auto hi = hn::InterleaveUpper(df, a, b);  // columns 4..7 | 12..15
  a = hn::ConcatLowerLower(df, hi, lo);
  b = hn::ConcatUpperUpper(df, hi, lo);
}
// Columns [0, N), [N, 2N) -> (even, odd) as LoadRawFp8Pair gives them.
template <class DF>
HWY_INLINE void PairRawFp8(DF df, hn::Vec<DF>& a, hn::Vec<DF>& b) {
  const auto even = hn::ConcatEven(df, b, a), odd = hn::ConcatOdd(df, b, a);
  a = even;
  b = odd;
}
#else
// Declared only: kPaired is false elsewhere, so nothing calls them.
template <class DF>
void UnpairRawFp8(DF df, hn::Vec<DF>& a, hn::Vec<DF>& b);
template <class DF>
void PairRawFp8(DF df, hn::Vec<DF>& a, hn::Vec<DF>& b);
#endif

// C[MR x NV*N] (+)= A panel (kc x MR f32) x source rows [0, kc) at b (ldb
// bytes apart), columns [0, NV*N). With row_scale (native fp8 K-blocks):
// C = s * sum (+ C). post: a power of two C is multiplied by as it is stored
// (the raw fp8 kernels' 2^7 on an item's last chunk, and with row_scale on
// every chunk; 1 otherwise). Returns whether a raw fp8 kernel met a NaN
// code (the caller then sets the columns it hit to NaN).
template <size_t MR, size_t NV, RowSrc kSrc>
HWY_NOINLINE bool MicroF32Direct(size_t kc, const float* HWY_RESTRICT ap,
                                 const uint8_t* HWY_RESTRICT b, size_t ldb,
                                 float* HWY_RESTRICT c, size_t ldc, bool load_c,
                                 const float* HWY_RESTRICT row_scale, float post,
                                 DirectPrefetch pf) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const size_t N = hn::Lanes(d);
  constexpr size_t kEsize = ElementBytesOf(kSrc);
  constexpr bool kWatchNaN = IsRawFp8(kSrc);
  // AVX2 raw fp8 decodes two vectors at a time (LoadRawFp8Pair): the
  // accumulators of columns j, j+1 hold the even and odd columns of their
  // 2N, put back in order before C is stored. Why: the decode GEMV (one row
  // per expert) runs out of vector ops before memory on AVX2 (~3.7 ops per
  // cycle, 8 per 16 codes). The 1 x 8 tile's loop in intrinsics on an
  // L2-resident strip: 23.6 GB/s of codes per thread, 25.9 paired, 27.8
  // paired with NaNCodeWatch's max (docs/kernels.md, "Small groups"). In `bench gmm`
  // decode e64 (2 threads): 37-39 -> 42-44 GB/s where the streaming read did
  // 57-61, the same (38-40) where it did 45-48. AVX-512 decodes fp8 with byte
  // tables where it can (microkernels_avx3-inl.h), and its 4 blocks per
  // vector would need another unpairing.
  constexpr bool kPaired = IsRawFp8(kSrc) && HWY_TARGET == HWY_AVX2 && NV % 2 == 0;
  // The NaN watch covers a row's NV * N codes in u8 vectors of up to 32.
  constexpr size_t kRowCodes = NV * hn::MaxLanes(hn::ScalableTag<float>());
  constexpr size_t kWatch = kRowCodes < 32 ? kRowCodes : 32;
  [[maybe_unused]] NaNCodeWatch<kSrc, kWatch> watch;
  V acc[MR][NV];
  const bool start_from_c = load_c && row_scale == nullptr;
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(8)
    for (size_t j = 0; j < NV; ++j) {
      acc[i][j] = start_from_c ? hn::LoadU(d, c + i * ldc + j * N) : hn::Zero(d);
    }
    if constexpr (kPaired) {
      if (start_from_c) {
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; j += 2) PairRawFp8(d, acc[i][j], acc[i][j + 1]);
      }
    }
  }
  for (size_t k = 0; k < kc; ++k) {
    const uint8_t* row = b + k * ldb;
    pf.Step(row, ldb, 1);
    if constexpr (kWatchNaN) {
      // Step by the u8 vector's real width: a CappedTag holds at most kWatch
      // lanes but fewer on narrow targets (1 on SCALAR, 16 on SSE4),
      // and stepping by kWatch there skipped columns.
      for (size_t w = 0; w < NV * N; w += watch.Lanes()) watch.Add(row + w);
    }
    if constexpr (MR == 1 && HWY_TARGET >= HWY_AVX2) {
      // One row (decode) on targets with 16 vector registers: each converted
      // vector goes straight into its FMA. Converting all NV first kept NV
      // more vectors live beside the NV accumulators, which on AVX2 spilled
      // accumulators to the stack inside this loop (fp8 decode e64 at 30 GB/s
      // where bf16 read 38; 37 after). AVX-512's 32 registers hold both, and
      // there the loads issued first measured 2-3% faster. Same products in
      // the same order.
      const V a = hn::Set(d, ap[k]);
      if constexpr (kPaired) {
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; j += 2) {
          V even, odd;
          LoadRawFp8Pair(d, row + j * N, even, odd);
          acc[0][j] = hn::MulAdd(a, even, acc[0][j]);
          acc[0][j + 1] = hn::MulAdd(a, odd, acc[0][j + 1]);
        }
      } else {
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; ++j) {
          acc[0][j] = hn::MulAdd(a, LoadRowAsF32<kSrc>(d, row + j * N * kEsize), acc[0][j]);
        }
      }
    } else {
      V bv[NV];
      if constexpr (kPaired) {
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; j += 2) LoadRawFp8Pair(d, row + j * N, bv[j], bv[j + 1]);
      } else {
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; ++j) bv[j] = LoadRowAsF32<kSrc>(d, row + j * N * kEsize);
      }
      HWY_UNROLL(16)
      for (size_t i = 0; i < MR; ++i) {
        const V a = hn::Set(d, ap[k * MR + i]);
        HWY_UNROLL(8)
        for (size_t j = 0; j < NV; ++j) acc[i][j] = hn::MulAdd(a, bv[j], acc[i][j]);
      }
    }
  }
  const V vpost = hn::Set(d, post);
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    if constexpr (kPaired) {
      HWY_UNROLL(8)
      for (size_t j = 0; j < NV; j += 2) UnpairRawFp8(d, acc[i][j], acc[i][j + 1]);
    }
    HWY_UNROLL(8)
    for (size_t j = 0; j < NV; ++j) {
      float* p = c + i * ldc + j * N;
      if (row_scale != nullptr) {
        const V s = hn::Mul(hn::Set(d, row_scale[i]), vpost);
        hn::StoreU(load_c ? hn::MulAdd(s, acc[i][j], hn::LoadU(d, p)) : hn::Mul(s, acc[i][j]), d, p);
      } else if (post != 1.0f) {
        hn::StoreU(hn::Mul(acc[i][j], vpost), d, p);
      } else {
        hn::StoreU(acc[i][j], d, p);
      }
    }
  }
  if constexpr (kWatchNaN) return watch.Seen();
  return false;
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
  HWY_UNROLL(16)
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
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
    for (size_t j = 0; j < NV; ++j) {
      acc[i][j] = load_c ? hn::LoadU(d32, c + i * ldc + j * N) : hn::Zero(d32);
      odd[i][j] = hn::Zero(d32);
    }
  }
  for (size_t k = 0; k < kc2; ++k) {
    hn::Vec<decltype(d16)> b[NV];
    HWY_UNROLL(4)
    for (size_t j = 0; j < NV; ++j) {
      b[j] = hn::BitCast(d16, hn::Load(du32, bp + k * NR + j * N));
    }
    HWY_UNROLL(16)
    for (size_t i = 0; i < MR; ++i) {
      const auto a = hn::BitCast(d16, hn::Set(du32, ap[k * MR + i]));
      HWY_UNROLL(4)
      for (size_t j = 0; j < NV; ++j) {
        acc[i][j] = hn::ReorderWidenMulAccumulate(d32, a, b[j], acc[i][j], odd[i][j]);
      }
    }
  }
  HWY_UNROLL(16)
  for (size_t i = 0; i < MR; ++i) {
    HWY_UNROLL(4)
    for (size_t j = 0; j < NV; ++j) {
      hn::StoreU(hn::RearrangeToOddPlusEven(acc[i][j], odd[i][j]), d32,
                 c + i * ldc + j * N);
    }
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
