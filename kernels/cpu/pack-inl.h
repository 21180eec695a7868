// Per-target packers (layouts in pack.h). Each source row is converted once
// with the numerics layer's vector code for this target (convert-inl.h) and
// then copied or transposed into panels; a packer is amortised over the
// other operand's extent (A over the item's columns, B over its rows).

#if defined(FP8MOE_KERNELS_CPU_PACK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_PACK_INL_H_
#undef FP8MOE_KERNELS_CPU_PACK_INL_H_
#else
#define FP8MOE_KERNELS_CPU_PACK_INL_H_
#endif

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "fp8moe/numerics.h"
#include "hwy/highway.h"
#include "kernels/cpu/line_walk.h"
#include "kernels/cpu/pack.h"
#include "numerics/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

using internal::ColumnRuns;
using internal::Operand;
using internal::PackScratch;
using internal::PanelKind;
using internal::SrcKind;
namespace hn = hwy::HWY_NAMESPACE;

// One group's view of a source: row r, columns [c0, c0 + n) converted to
// f32 or to 16-bit lanes.
class RowReader {
 public:
  explicit RowReader(const Operand& op) : s_(*op.src) {
    const int64_t g = op.group;
    esize_ = static_cast<int64_t>(s_.ElementBytes());
    base_ = static_cast<const uint8_t*>(s_.data) + g * s_.group_stride * esize_;
    col_scale_ = s_.col_scale ? s_.col_scale + g * s_.col_scale_group_stride : nullptr;
  }

  // Pulls row r, columns [c0, c0 + n) towards L1 (a few rows ahead of the
  // packer: A's row pieces are short, 4-8 lines every ld bytes, which the
  // hardware prefetchers do not follow; measured, the fp8 code loads of
  // native GMMs' A panels stalled the packing).
  void Prefetch(int64_t r, int64_t c0, int64_t n) const {
    if (n <= 0) return;
    internal::PrefetchLines(At(r, c0), static_cast<size_t>(n * esize_));
  }

  // Row r from column c0 in place when the source already holds f32 (no
  // conversion to make, so no copy through scratch); else nullptr.
  const float* F32InPlace(int64_t r, int64_t c0) const {
    if (s_.kind != SrcKind::kF32) return nullptr;
    return reinterpret_cast<const float*>(At(r, c0));
  }

  // Row r from column c0 as bf16 pairs in place, when the source holds bf16
  // and the block is even (nothing to convert, no odd half to zero); else
  // nullptr.
  const uint8_t* PairsInPlace(int64_t r, int64_t c0, int64_t kc) const {
    return s_.kind == SrcKind::kBf16 && kc % 2 == 0 ? At(r, c0) : nullptr;
  }

  // Row r, columns [c0, c0 + n) as f32.
  void F32(int64_t r, int64_t c0, int64_t n, float* dst) const {
    const uint8_t* p = At(r, c0);
    const size_t un = static_cast<size_t>(n);
    switch (s_.kind) {
      case SrcKind::kF32:
        std::memcpy(dst, p, un * sizeof(float));
        return;
      case SrcKind::kBf16:
        Bf16ToF32SpanT<false>(reinterpret_cast<const uint16_t*>(p), dst, un);
        return;
      case SrcKind::kI8: {
        const int8_t* q = reinterpret_cast<const int8_t*>(p);
        for (size_t j = 0; j < un; ++j) dst[j] = static_cast<float>(q[j]);
        return;
      }
      case SrcKind::kFp8:
        break;
    }
    switch (s_.fp8) {
      case Fp8Format::kE4M3FN: return DecodeScaled<Fp8Format::kE4M3FN>(p, c0, un, dst);
      case Fp8Format::kE4M3FNUZ: return DecodeScaled<Fp8Format::kE4M3FNUZ>(p, c0, un, dst);
      case Fp8Format::kE5M2: return DecodeScaled<Fp8Format::kE5M2>(p, c0, un, dst);
      case Fp8Format::kE5M2FNUZ: return DecodeScaled<Fp8Format::kE5M2FNUZ>(p, c0, un, dst);
    }
  }

  // Row r, columns [c0, c0 + n) as 16-bit lanes: bf16 bits (the planner only
  // asks when the values are bf16-exact) or int16 for integer GEMMs.
  void Half(int64_t r, int64_t c0, int64_t n, uint16_t* dst, float* tmp) const {
    const uint8_t* p = At(r, c0);
    const size_t un = static_cast<size_t>(n);
    if (s_.kind == SrcKind::kBf16) {
      std::memcpy(dst, p, un * sizeof(uint16_t));
    } else if (s_.kind == SrcKind::kI8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(p);
      for (size_t j = 0; j < un; ++j) dst[j] = static_cast<uint16_t>(static_cast<int16_t>(q[j]));
    } else if (s_.kind == SrcKind::kFp8 && col_scale_ == nullptr) {
      switch (s_.fp8) {
        case Fp8Format::kE4M3FN: DecodeFp8ToBf16SpanT<Fp8Format::kE4M3FN>(p, dst, un); break;
        case Fp8Format::kE4M3FNUZ: DecodeFp8ToBf16SpanT<Fp8Format::kE4M3FNUZ>(p, dst, un); break;
        case Fp8Format::kE5M2: DecodeFp8ToBf16SpanT<Fp8Format::kE5M2>(p, dst, un); break;
        case Fp8Format::kE5M2FNUZ: DecodeFp8ToBf16SpanT<Fp8Format::kE5M2FNUZ>(p, dst, un); break;
      }
    } else if (s_.kind == SrcKind::kFp8 && s_.round_bf16) {
      // The fake-QAT copy's values, in one pass.
      const float* sc = col_scale_ + c0;
      switch (s_.fp8) {
        case Fp8Format::kE4M3FN: DequantizeFp8ToBf16SpanT<Fp8Format::kE4M3FN>(p, sc, dst, un); break;
        case Fp8Format::kE4M3FNUZ: DequantizeFp8ToBf16SpanT<Fp8Format::kE4M3FNUZ>(p, sc, dst, un); break;
        case Fp8Format::kE5M2: DequantizeFp8ToBf16SpanT<Fp8Format::kE5M2>(p, sc, dst, un); break;
        case Fp8Format::kE5M2FNUZ: DequantizeFp8ToBf16SpanT<Fp8Format::kE5M2FNUZ>(p, sc, dst, un); break;
      }
    } else {
      F32(r, c0, n, tmp);
      F32ToBf16SpanT(tmp, dst, un);
    }
  }

 private:
  const uint8_t* At(int64_t r, int64_t c0) const {
    return base_ + ((r - s_.first_row) * s_.ld + c0) * esize_;
  }

  // n codes at p (columns c0...) as f32: decoded, times the column scale if
  // there is one, rounded to bf16 if asked (dLHS from codes: the fake-QAT
  // copy's values) - one vector pass, as exact as the scalar definition.
  template <Fp8Format kFormat>
  void DecodeScaled(const uint8_t* p, int64_t c0, size_t n, float* dst) const {
    if (col_scale_ == nullptr && !s_.round_bf16) return DecodeFp8SpanT<kFormat, false>(p, dst, n);
    using DF = hn::ScalableTag<float>;
    const DF df;
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<uint8_t, DF> d8;
    const size_t N = hn::Lanes(df);
    const float* scale = col_scale_ != nullptr ? col_scale_ + c0 : nullptr;
    const bool round = s_.round_bf16;
    // Decoded values v: times the scales at sc (if any), rounded, stored at o.
    auto finish = [&](hn::Vec<DF> v, const float* sc, float* o) {
      if (sc != nullptr) v = hn::Mul(v, hn::LoadU(df, sc));
      if (round) v = hn::BitCast(df, hn::ShiftLeft<16>(F32ToBf16Vec(df, v)));
      hn::StoreU(v, df, o);
    };
    auto scale_at = [&](size_t i) { return scale != nullptr ? scale + i : nullptr; };
    size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
    // Two vectors per 16-bit decode (DecodeFp8Bf16Vec: half the operations).
    const hn::Repartition<int16_t, DF> d16;
    const auto table = SubnormalBf16Table<kFormat>(d16);
    for (; i + 2 * N <= n; i += 2 * N) {
      hn::Vec<DF> lo, hi;
      DecodeFp8PairToF32<kFormat>(df, p + i, table, &lo, &hi);
      finish(lo, scale_at(i), dst + i);
      finish(hi, scale_at(i + N), dst + i + N);
    }
#endif
    for (; i + N <= n; i += N) {
      finish(DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::LoadU(d8, p + i))), scale_at(i),
             dst + i);
    }
    if (i < n) {
      HWY_ALIGN uint8_t c[hn::MaxLanes(df)] = {};
      HWY_ALIGN float sc[hn::MaxLanes(df)] = {};
      HWY_ALIGN float o[hn::MaxLanes(df)];
      std::memcpy(c, p + i, n - i);
      if (scale != nullptr) std::memcpy(sc, scale + i, (n - i) * sizeof(float));
      finish(DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::Load(d8, c))),
             scale != nullptr ? sc : nullptr, o);
      std::memcpy(dst + i, o, (n - i) * sizeof(float));
    }
  }

  const internal::Source& s_;
  const uint8_t* base_;
  int64_t esize_;
  const float* col_scale_;
};

inline uint32_t Pair(uint16_t lo, uint16_t hi) { return lo | static_cast<uint32_t>(hi) << 16; }

// Copies n floats. Panel pieces are one register tile wide (mr or nr floats,
// a few dozen bytes): a constant-size memcpy compiles to a few vector moves,
// where a call to memcpy per piece cost ~15% of a TGMM.
template <int64_t N>
HWY_INLINE bool CopyIf(float* dst, const float* src, int64_t n) {
  if (n != N) return false;
  std::memcpy(dst, src, N * sizeof(float));
  return true;
}
HWY_INLINE void CopyFloats(float* dst, const float* src, int64_t n) {
  if (CopyIf<32>(dst, src, n) || CopyIf<16>(dst, src, n) || CopyIf<12>(dst, src, n) ||
      CopyIf<8>(dst, src, n) || CopyIf<6>(dst, src, n) || CopyIf<4>(dst, src, n) ||
      CopyIf<2>(dst, src, n)) {
    return;
  }
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Register transposes of f32 blocks for TransposeRowsInto: 8x8 in 256-bit
// vectors where the target has them (AVX2 and every AVX-512 target: on
// AVX-512 the 8-row blocks and the A panels' rows were moved one scalar at a
// time, ~14% of an f32 dLHS on Zen 5 by perf), 4x4 in 128-bit ones elsewhere
// and for the 4-row remainders (AVX-512's A panels are 12 rows: 8 + 4).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2  // 256-bit vectors
// dst[i * ld + t] = src[t][k + i] for t, i < 8: 24 shuffles for 64 elements
// instead of 64 scalar moves.
HWY_INLINE void Transpose8x8(const float* const* src, int64_t k, float* dst, int64_t ld) {
  const hn::FixedTag<float, 8> d;
  const hn::Repartition<uint64_t, decltype(d)> d64;
  using V = hn::Vec<decltype(d)>;
  V r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = hn::LoadU(d, src[i] + k);
  for (int i = 0; i < 8; i += 2) {  // 32-bit pairs within 128-bit blocks
    t[i] = hn::InterleaveLower(d, r[i], r[i + 1]);
    t[i + 1] = hn::InterleaveUpper(d, r[i], r[i + 1]);
  }
  auto lo64 = [&](V a, V b) {
    return hn::BitCast(d, hn::InterleaveLower(d64, hn::BitCast(d64, a), hn::BitCast(d64, b)));
  };
  auto hi64 = [&](V a, V b) {
    return hn::BitCast(d, hn::InterleaveUpper(d64, hn::BitCast(d64, a), hn::BitCast(d64, b)));
  };
  for (int h = 0; h < 8; h += 4) {  // 64-bit pairs: columns 0,4 | 1,5 | 2,6 | 3,7
    u[h + 0] = lo64(t[h + 0], t[h + 2]);
    u[h + 1] = hi64(t[h + 0], t[h + 2]);
    u[h + 2] = lo64(t[h + 1], t[h + 3]);
    u[h + 3] = hi64(t[h + 1], t[h + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 128-bit halves: rows 0-3 | rows 4-7
    hn::StoreU(hn::ConcatLowerLower(d, u[4 + c], u[c]), d, dst + c * ld);
    hn::StoreU(hn::ConcatUpperUpper(d, u[4 + c], u[c]), d, dst + (c + 4) * ld);
  }
}
#endif

// Four rows of 32-bit words (floats, or bf16 pairs), words k..k+3 of each,
// transposed in 128-bit registers: dst[j * ld + t] = word k + j of row t.
// Byte pointers: a bf16 row read in place is only 2-byte aligned. Eight
// shuffles and four 16-byte stores for 16 words, where a scalar scatter took
// a load and a store per word (for pairs also a shift and an or: it was ~8%
// of a bf16 forward).
#if HWY_TARGET != HWY_SCALAR
HWY_INLINE void Transpose4x4Words(const uint8_t* const* src, int64_t k, uint32_t* dst,
                                  int64_t ld) {
  const hn::FixedTag<uint8_t, 16> d8;
  const hn::FixedTag<uint32_t, 4> d;
  const hn::Repartition<uint64_t, decltype(d)> d64;
  auto row = [&](int t) { return hn::BitCast(d, hn::LoadU(d8, src[t] + 4 * k)); };
  const auto r0 = row(0), r1 = row(1), r2 = row(2), r3 = row(3);
  // t01 = r0[0] r1[0] r0[1] r1[1], ...: then 64-bit halves make the columns.
  const auto a = hn::BitCast(d64, hn::InterleaveLower(d, r0, r1));
  const auto b = hn::BitCast(d64, hn::InterleaveUpper(d, r0, r1));
  const auto c = hn::BitCast(d64, hn::InterleaveLower(d, r2, r3));
  const auto e = hn::BitCast(d64, hn::InterleaveUpper(d, r2, r3));
  hn::StoreU(hn::BitCast(d, hn::InterleaveLower(d64, a, c)), d, dst);
  hn::StoreU(hn::BitCast(d, hn::InterleaveUpper(d64, a, c)), d, dst + ld);
  hn::StoreU(hn::BitCast(d, hn::InterleaveLower(d64, b, e)), d, dst + 2 * ld);
  hn::StoreU(hn::BitCast(d, hn::InterleaveUpper(d64, b, e)), d, dst + 3 * ld);
}
#endif

// Source rows [first, first + n) over the reduction block [r0, r0 + kc),
// transposed into panel columns: dst[k * ld + t] = row first + t, element
// r0 + k; rows at or past `end` are zero. Several rows at a time so that
// every panel row gets contiguous stores instead of n scattered ones: blocks
// of 8 rows, then of 4, by register transposes (above), 8 or 4 reduction
// steps at a time; what is left one element at a time.
inline void TransposeRowsInto(const RowReader& rd, const PackScratch& s, int64_t first, int64_t n,
                              int64_t end, int64_t r0, int64_t kc, float* dst, int64_t ld) {
  FP8MOE_DCHECK(n <= PackScratch::kTransposeRows && kc <= s.kc && kc <= s.width);
  // The next block of rows towards L1 while this one is converted (see
  // RowReader::Prefetch).
  for (int64_t t = 0; t < n && first + n + t < end; ++t) rd.Prefetch(first + n + t, r0, kc);
  const float* src[PackScratch::kTransposeRows];
  for (int64_t t = 0; t < n; ++t) {
    if (first + t >= end) {
      src[t] = s.zero;
      continue;
    }
    src[t] = rd.F32InPlace(first + t, r0);
    if (src[t] == nullptr) {
      float* row = s.rows + t * (kc + 1);
      rd.F32(first + t, r0, kc, row);
      src[t] = row;
    }
  }
  // Rows [t_begin, t_end) from reduction step k0 on, one element at a time:
  // what the register transposes leave.
  auto by_element = [&](int64_t k0, int64_t t_begin, int64_t t_end) {
    for (int64_t k = k0; k < kc; ++k) {
      for (int64_t t = t_begin; t < t_end; ++t) dst[k * ld + t] = src[t][k];
    }
  };
  int64_t t0 = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  for (; t0 + 8 <= n; t0 += 8) {
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) Transpose8x8(src + t0, k, dst + k * ld + t0, ld);
    by_element(k, t0, t0 + 8);
  }
#endif
#if HWY_TARGET != HWY_SCALAR
  for (; t0 + 4 <= n; t0 += 4) {
    const uint8_t* rows[4];
    for (int t = 0; t < 4; ++t) rows[t] = reinterpret_cast<const uint8_t*>(src[t0 + t]);
    int64_t k = 0;
    for (; k + 4 <= kc; k += 4) {
      Transpose4x4Words(rows, k, reinterpret_cast<uint32_t*>(dst + k * ld + t0), ld);
    }
    by_element(k, t0, t0 + 4);
  }
#endif
  by_element(0, t0, n);
}

// Source rows [first, first + n), n <= 4, over the reduction block
// [r0, r0 + kc) as pair columns of a panel: dst[k * ld + t] = pair k (halves
// 2k, 2k + 1) of row first + t; rows at or past `end` are zero. Each row's
// pairs are read in place (bf16) or converted into a scratch row (s.rows:
// kTransposeRows rows of kc + 1 floats hold four of kc + 2 halves), then
// transposed four pairs at a time. A's panels (rows of A) and dLHS's B
// panels (rows of the weight, columns of B) are both made this way.
inline void PairRowsInto(const RowReader& rd, const PackScratch& s, int64_t first, int64_t n,
                         int64_t end, int64_t r0, int64_t kc, uint32_t* dst, int64_t ld) {
  constexpr int64_t kGroup = 4;
  const int64_t kc2 = (kc + 1) / 2, half_stride = kc + 2;
  // Four scratch rows of kc + 2 halves fit in s.rows (kTransposeRows rows of
  // s.kc + 1 floats) whenever kc <= s.kc; the zero row covers kc2 pairs.
  static_assert(kGroup * 2 <= PackScratch::kTransposeRows * 4, "scratch rows of halves fit");
  FP8MOE_DCHECK(n >= 1 && n <= kGroup && kc >= 1 && kc <= s.kc && kc2 <= s.width);
  // The next group towards L1 while this one is converted (see
  // RowReader::Prefetch).
  for (int64_t t = 0; t < kGroup && first + n + t < end; ++t) rd.Prefetch(first + n + t, r0, kc);
  auto* scratch = reinterpret_cast<uint16_t*>(s.rows);
  const auto* zero = reinterpret_cast<const uint8_t*>(s.zero);  // >= kc2 pairs
  const uint8_t* src[kGroup];
  for (int64_t t = 0; t < kGroup; ++t) {
    if (t >= n || first + t >= end) {
      src[t] = zero;
      continue;
    }
    src[t] = rd.PairsInPlace(first + t, r0, kc);
    if (src[t] == nullptr) {
      uint16_t* row = scratch + t * half_stride;
      rd.Half(first + t, r0, kc, row, s.tmp);
      row[kc] = 0;  // odd kc: the last pair's second half
      src[t] = reinterpret_cast<const uint8_t*>(row);
    }
  }
  int64_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  if (n == kGroup) {
    for (; k + 4 <= kc2; k += 4) Transpose4x4Words(src, k, dst + k * ld, ld);
  }
#endif
  for (; k < kc2; ++k) {
    for (int64_t t = 0; t < n; ++t) std::memcpy(dst + k * ld + t, src[t] + 4 * k, 4);
  }
}

// B's column panels (fwd and TGMM) convert source row r0 + k (f32) or rows
// r0 + 2k and r0 + 2k + 1 (pairs) at step k; this pulls the rows of step
// k + 4 towards L1 meanwhile. A row's piece is only `count` elements every
// ld bytes, and perf put the packer's time on its loads: with it, train-fill
// wi forward 3% faster (bf16 on AVX3_SPR, f32 on AVX3; Zen 5, a driver
// alternated 8 and 6 times), AVX2 unchanged. (In TGMM's A panels, which
// are built the same way, it measured nothing: 0.99-1.02, not taken.)
inline void PrefetchStepAhead(const RowReader& rd, PanelKind kind, int64_t r0, int64_t kc,
                              int64_t k, int64_t c0, int64_t count) {
  constexpr int64_t kAhead = 4;
  const int64_t rows_per_step = kind == PanelKind::kF32 ? 1 : 2;
  for (int64_t t = 0; t < rows_per_step; ++t) {
    const int64_t r = (k + kAhead) * rows_per_step + t;
    if (r < kc) rd.Prefetch(r0 + r, c0, count);
  }
}

// Pair row k of a panel whose columns are source columns [c0, c0 + count)
// (B in fwd and TGMM, A in TGMM): source rows r0 + 2k and r0 + 2k + 1 (zero
// past kc) converted into s.lo and s.hi, both zero from count to padded.
inline void TwoRowsAsHalves(const RowReader& rd, const PackScratch& s, int64_t r0, int64_t kc,
                            int64_t k, int64_t c0, int64_t count, int64_t padded) {
  FP8MOE_DCHECK(padded <= s.width);
  rd.Half(r0 + 2 * k, c0, count, s.lo, s.tmp);
  const int64_t hi_count = 2 * k + 1 < kc ? count : 0;
  if (hi_count > 0) rd.Half(r0 + 2 * k + 1, c0, count, s.hi, s.tmp);
  std::fill(s.lo + count, s.lo + padded, uint16_t{0});
  std::fill(s.hi + hi_count, s.hi + padded, uint16_t{0});
}

// dst[j] = Pair(lo[j], hi[j]) for j < n: 128-bit interleaves, eight pairs
// per two loads and two stores.
HWY_INLINE void InterleavePairs(const uint16_t* lo, const uint16_t* hi, int64_t n,
                                uint32_t* dst) {
  int64_t j = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::FixedTag<uint16_t, 8> d16;
  const hn::FixedTag<uint32_t, 4> d32;
  for (; j + 8 <= n; j += 8) {
    const auto l = hn::LoadU(d16, lo + j), h = hn::LoadU(d16, hi + j);
    hn::StoreU(hn::BitCast(d32, hn::InterleaveLower(d16, l, h)), d32, dst + j);
    hn::StoreU(hn::BitCast(d32, hn::InterleaveUpper(d16, l, h)), d32, dst + j + 4);
  }
#endif
  for (; j < n; ++j) dst[j] = Pair(lo[j], hi[j]);
}

// A rows [i0, i0 + rows) x reduction [r0, r0 + kc) into MR panels at ap.
inline void PackAT(const Operand& a, PanelKind kind, int64_t i0, int64_t rows, int64_t r0,
                   int64_t kc, int64_t mr, void* ap, const PackScratch& s) {
  const RowReader rd(a);
  const int64_t panels = (rows + mr - 1) / mr;
  const int64_t kc2 = (kc + 1) / 2;
  const int64_t step = kind == PanelKind::kF32 ? kc : kc2;  // panel rows
  if (!a.transposed) {
    // A(i, r) = source(i, r): each row over the reduction block becomes a
    // panel column (f32: rows transposed kTransposeRows at a time; pairs:
    // PairRowsInto, four at a time).
    FP8MOE_DCHECK(kc + 1 <= s.width);
    if (kind == PanelKind::kF32) {
      for (int64_t p = 0; p < panels; ++p) {
        for (int64_t b0 = 0; b0 < mr; b0 += PackScratch::kTransposeRows) {
          TransposeRowsInto(rd, s, i0 + p * mr + b0,
                            std::min(PackScratch::kTransposeRows, mr - b0), i0 + rows, r0, kc,
                            static_cast<float*>(ap) + p * step * mr + b0, mr);
        }
      }
      return;
    }
    for (int64_t p = 0; p < panels; ++p) {
      uint32_t* panel = static_cast<uint32_t*>(ap) + p * step * mr;
      for (int64_t b0 = 0; b0 < mr; b0 += 4) {
        PairRowsInto(rd, s, i0 + p * mr + b0, std::min<int64_t>(4, mr - b0), i0 + rows, r0, kc,
                     panel + b0, mr);
      }
    }
    return;
  }
  // Transposed (TGMM: A(i, r) = source(r, i)): each source row r holds the
  // panel rows' values contiguously.
  FP8MOE_DCHECK(panels * mr <= s.width);
  for (int64_t k = 0; k < step; ++k) {
    if (kind == PanelKind::kF32) {
      const float* row = rd.F32InPlace(r0 + k, i0);
      if (row == nullptr) {
        rd.F32(r0 + k, i0, rows, s.f32);
        row = s.f32;
      }
      for (int64_t p = 0; p < panels; ++p) {
        float* dst = static_cast<float*>(ap) + (p * step + k) * mr;
        const int64_t n = std::min(mr, rows - p * mr);
        CopyFloats(dst, row + p * mr, n);
        std::fill(dst + n, dst + mr, 0.0f);
      }
    } else {
      TwoRowsAsHalves(rd, s, r0, kc, k, i0, rows, panels * mr);
      for (int64_t p = 0; p < panels; ++p) {
        InterleavePairs(s.lo + p * mr, s.hi + p * mr, mr,
                        static_cast<uint32_t*>(ap) + (p * step + k) * mr);
      }
    }
  }
}

// Transposed B (dLHS: B(r, j) = source(c0 + j, r)) is packed a block of
// columns (source rows) at a time: 8 (f32 register transposes; nr when
// narrower, a power of two) or 4 (pairs; nr is 2 or a multiple of 4).
inline int64_t TransposedBlockColumns(PanelKind kind, int64_t nr) {
  const int64_t blk = std::min<int64_t>(kind == PanelKind::kF32 ? 8 : 4, nr);
  FP8MOE_DCHECK(nr % blk == 0);
  return blk;
}

// Columns [j0, j0 + blk) of a transposed B run whose source columns start
// at c0 (count of them), over the reduction block [r0, r0 + kc), into the
// run's panels at run_bp (panel q of the run at q * panel-rows * nr words).
inline void PackTransposedColumns(const RowReader& rd, PanelKind kind, const PackScratch& s,
                                  int64_t c0, int64_t count, int64_t j0, int64_t blk,
                                  int64_t r0, int64_t kc, uint8_t* run_bp, int64_t nr) {
  FP8MOE_DCHECK(kc + 1 <= s.width);
  if (kind == PanelKind::kF32) {
    TransposeRowsInto(rd, s, c0 + j0, blk, c0 + count, r0, kc,
                      reinterpret_cast<float*>(run_bp) + (j0 / nr) * kc * nr + j0 % nr, nr);
  } else {
    PairRowsInto(rd, s, c0 + j0, blk, c0 + count, r0, kc,
                 reinterpret_cast<uint32_t*>(run_bp) + (j0 / nr) * ((kc + 1) / 2) * nr + j0 % nr,
                 nr);
  }
}

// B reduction [r0, r0 + kc) x the columns of `cols` into NR panels at bp;
// returns the number of panels written.
inline int64_t PackBT(const Operand& b, PanelKind kind, int64_t r0, int64_t kc,
                      const ColumnRuns& cols, int64_t nr, void* bp, const PackScratch& s) {
  const RowReader rd(b);
  const int64_t per_run = (cols.count + nr - 1) / nr;
  const int64_t kc2 = (kc + 1) / 2;
  const int64_t step = kind == PanelKind::kF32 ? kc : kc2;
  const int64_t padded = per_run * nr;
  for (int run = 0; run < cols.runs; ++run) {
    const int64_t c0 = cols.start[run];
    auto panel_f32 = [&](int64_t q) {
      return static_cast<float*>(bp) + (run * per_run + q) * step * nr;
    };
    auto panel_u32 = [&](int64_t q) {
      return static_cast<uint32_t*>(bp) + (run * per_run + q) * step * nr;
    };
    if (!b.transposed) {
      // B(r, j) = source(r, c0 + j): convert each source row (two for pairs)
      // once and copy NR-wide pieces into the panels.
      FP8MOE_DCHECK(padded <= s.width);
      for (int64_t k = 0; k < step; ++k) {
        PrefetchStepAhead(rd, kind, r0, kc, k, c0, cols.count);
        if (kind == PanelKind::kF32) {
          const float* row = rd.F32InPlace(r0 + k, c0);
          if (row == nullptr) {
            rd.F32(r0 + k, c0, cols.count, s.f32);
            row = s.f32;
          }
          for (int64_t q = 0; q < per_run; ++q) {
            float* dst = panel_f32(q) + k * nr;
            const int64_t n = std::min(nr, cols.count - q * nr);
            CopyFloats(dst, row + q * nr, n);
            std::fill(dst + n, dst + nr, 0.0f);
          }
        } else {
          TwoRowsAsHalves(rd, s, r0, kc, k, c0, cols.count, padded);
          for (int64_t q = 0; q < per_run; ++q) {
            InterleavePairs(s.lo + q * nr, s.hi + q * nr, nr, panel_u32(q) + k * nr);
          }
        }
      }
      continue;
    }
    // Transposed (dLHS: B(r, j) = source(c0 + j, r)): each source row is one
    // output column over the reduction block.
    const int64_t blk = TransposedBlockColumns(kind, nr);
    for (int64_t j0 = 0; j0 < padded; j0 += blk) {
      PackTransposedColumns(rd, kind, s, c0, cols.count, j0, blk, r0, kc,
                            static_cast<uint8_t*>(bp) + run * per_run * step * nr * 4, nr);
    }
  }
  return per_run * cols.runs;
}

// B for the whole reduction [red0, red0 + red_len) in blocks of `step`
// reduction rows (the last one shorter), block i's panels at
// bp + i * block_bytes, each as PackBT lays it; returns the panels per
// block. Transposed B (dLHS) in pair panels is packed four source rows at a
// time across all blocks (a weight row's codes are contiguous: one
// sequential pass over the weight) instead of block by block (pieces of
// every row, a row length apart, once per block): perf put the dequantizing
// reads of native dLHS (train-fill wi, AVX3_SPR) at 370-415 samples instead
// of 741-764. f32 panels keep the block order: the same change measured
// 2981 samples against 2441-2491 there (AVX3), as did a panel at a time.
inline int64_t PackBTWhole(const Operand& b, PanelKind kind, int64_t red0, int64_t red_len,
                           int64_t step, const ColumnRuns& cols, int64_t nr, uint8_t* bp,
                           size_t block_bytes, const PackScratch& s) {
  const int64_t red1 = red0 + red_len;
  const int64_t per_run = (cols.count + nr - 1) / nr;
  if (!b.transposed || kind == PanelKind::kF32) {
    for (int64_t r0 = red0, i = 0; r0 < red1; r0 += step, ++i) {
      PackBT(b, kind, r0, std::min(step, red1 - r0), cols, nr, bp + i * block_bytes, s);
    }
    return per_run * cols.runs;
  }
  const RowReader rd(b);
  const int64_t blk = TransposedBlockColumns(kind, nr);
  for (int run = 0; run < cols.runs; ++run) {
    for (int64_t j0 = 0; j0 < per_run * nr; j0 += blk) {
      for (int64_t r0 = red0, i = 0; r0 < red1; r0 += step, ++i) {
        const int64_t kc = std::min(step, red1 - r0);
        PackTransposedColumns(rd, kind, s, cols.start[run], cols.count, j0, blk, r0, kc,
                              bp + i * block_bytes + run * per_run * ((kc + 1) / 2) * nr * 4, nr);
      }
    }
  }
  return per_run * cols.runs;
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
