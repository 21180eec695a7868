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
    // Every line the piece touches, from the line of its first byte to that
    // of its last (an unaligned piece spans one line more than bytes / 64).
    const uintptr_t first = reinterpret_cast<uintptr_t>(At(r, c0)) & ~uintptr_t{63};
    const uintptr_t last = reinterpret_cast<uintptr_t>(At(r, c0)) + static_cast<uintptr_t>(n * esize_) - 1;
    for (uintptr_t line = first; line <= last; line += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
    }
  }

  // Row r from column c0 in place when the source already holds f32 (no
  // conversion to make, so no copy through scratch); else nullptr.
  const float* F32InPlace(int64_t r, int64_t c0) const {
    if (s_.kind != SrcKind::kF32) return nullptr;
    return reinterpret_cast<const float*>(base_) + r * s_.ld + c0;
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
  const uint8_t* At(int64_t r, int64_t c0) const { return base_ + (r * s_.ld + c0) * esize_; }

  // n codes at p (columns c0...) as f32: decoded, times the column scale if
  // there is one, rounded to bf16 if asked (dLHS from codes: the fake-QAT
  // copy's values) - one vector pass, as exact as the scalar definition.
  template <Fp8Format kFormat>
  void DecodeScaled(const uint8_t* p, int64_t c0, size_t n, float* dst) const {
    if (col_scale_ == nullptr && !s_.round_bf16) return DecodeFp8SpanT<kFormat, false>(p, dst, n);
    const hn::ScalableTag<float> df;
    const hn::RebindToUnsigned<decltype(df)> du;
    const hn::Rebind<uint8_t, decltype(df)> d8;
    const size_t N = hn::Lanes(df);
    const float* scale = col_scale_ != nullptr ? col_scale_ + c0 : nullptr;
    const bool round = s_.round_bf16;
    auto one = [&](const uint8_t* c, const float* sc, float* o) {
      auto v = DecodeFp8Vec<kFormat>(df, hn::PromoteTo(du, hn::LoadU(d8, c)));
      if (sc != nullptr) v = hn::Mul(v, hn::LoadU(df, sc));
      if (round) v = hn::BitCast(df, hn::ShiftLeft<16>(F32ToBf16Vec(df, v)));
      hn::StoreU(v, df, o);
    };
    size_t i = 0;
    for (; i + N <= n; i += N) one(p + i, scale != nullptr ? scale + i : nullptr, dst + i);
    if (i < n) {
      HWY_ALIGN uint8_t c[hn::MaxLanes(df)] = {};
      HWY_ALIGN float sc[hn::MaxLanes(df)] = {};
      HWY_ALIGN float o[hn::MaxLanes(df)];
      std::memcpy(c, p + i, n - i);
      if (scale != nullptr) std::memcpy(sc, scale + i, (n - i) * sizeof(float));
      one(c, scale != nullptr ? sc : nullptr, o);
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

#if HWY_TARGET == HWY_AVX2
// dst[i * ld + t] = src[t][k + i] for t, i < 8: an 8x8 block transposed in
// registers (AVX2's 8 f32 lanes: 24 shuffles for 64 elements instead of 64
// scalar moves).
template <class D = hn::ScalableTag<float>>
HWY_INLINE void Transpose8x8(const float* const* src, int64_t k, float* dst, int64_t ld) {
  const D d;
  const hn::Repartition<uint64_t, D> d64;
  using V = hn::Vec<D>;
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

// Source rows [first, first + n) over the reduction block [r0, r0 + kc),
// transposed into panel columns: dst[k * ld + t] = row first + t, element
// r0 + k; rows at or past `end` are zero. Several rows at a time so that
// every panel row gets one contiguous store instead of n scattered ones.
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
  if (n == 8) {  // nr blocks and the 8-row direct panels: a fixed-size store
    int64_t k = 0;
#if HWY_TARGET == HWY_AVX2
    for (; k + 8 <= kc; k += 8) Transpose8x8(src, k, dst + k * ld, ld);
#endif
    for (; k < kc; ++k) {
      for (int64_t t = 0; t < 8; ++t) dst[k * ld + t] = src[t][k];
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t t = 0; t < n; ++t) dst[k * ld + t] = src[t][k];
  }
}

// A rows [i0, i0 + rows) x reduction [r0, r0 + kc) into MR panels at ap.
inline void PackAT(const Operand& a, PanelKind kind, int64_t i0, int64_t rows, int64_t r0,
                   int64_t kc, int64_t mr, void* ap, const PackScratch& s) {
  const RowReader rd(a);
  const int64_t panels = (rows + mr - 1) / mr;
  const int64_t kc2 = (kc + 1) / 2;
  const int64_t step = kind == PanelKind::kF32 ? kc : kc2;  // panel rows
  if (!a.transposed) {
    // A(i, r) = source(i, r): convert each row over the reduction block and
    // scatter it down its panel column.
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
    constexpr int64_t kAhead = 4;  // rows
    for (int64_t i = 0; i < std::min(kAhead, rows); ++i) rd.Prefetch(i0 + i, r0, kc);
    for (int64_t i = 0; i < panels * mr; ++i) {
      const int64_t p = i / mr, ii = i % mr;
      uint32_t* col = static_cast<uint32_t*>(ap) + p * step * mr + ii;
      if (i + kAhead < rows) rd.Prefetch(i0 + i + kAhead, r0, kc);
      if (i < rows) {
        rd.Half(i0 + i, r0, kc, s.lo, s.tmp);
        s.lo[kc] = 0;  // odd kc: the last pair's second half
      }
      for (int64_t k = 0; k < kc2; ++k) {
        col[k * mr] = i < rows ? Pair(s.lo[2 * k], s.lo[2 * k + 1]) : 0u;
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
      rd.Half(r0 + 2 * k, i0, rows, s.lo, s.tmp);
      if (2 * k + 1 < kc) {
        rd.Half(r0 + 2 * k + 1, i0, rows, s.hi, s.tmp);
      } else {
        std::fill(s.hi, s.hi + rows, uint16_t{0});
      }
      for (int64_t p = 0; p < panels; ++p) {
        uint32_t* dst = static_cast<uint32_t*>(ap) + (p * step + k) * mr;
        for (int64_t ii = 0; ii < mr; ++ii) {
          const int64_t i = p * mr + ii;
          dst[ii] = i < rows ? Pair(s.lo[i], s.hi[i]) : 0u;
        }
      }
    }
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
          rd.Half(r0 + 2 * k, c0, cols.count, s.lo, s.tmp);
          if (2 * k + 1 < kc) {
            rd.Half(r0 + 2 * k + 1, c0, cols.count, s.hi, s.tmp);
          } else {
            std::fill(s.hi, s.hi + cols.count, uint16_t{0});
          }
          std::fill(s.lo + cols.count, s.lo + padded, uint16_t{0});
          std::fill(s.hi + cols.count, s.hi + padded, uint16_t{0});
          for (int64_t q = 0; q < per_run; ++q) {
            uint32_t* dst = panel_u32(q) + k * nr;
            for (int64_t jj = 0; jj < nr; ++jj) dst[jj] = Pair(s.lo[q * nr + jj], s.hi[q * nr + jj]);
          }
        }
      }
      continue;
    }
    // Transposed (dLHS: B(r, j) = source(c0 + j, r)): each source row is one
    // output column over the reduction block.
    FP8MOE_DCHECK(kc + 1 <= s.width);
    if (kind == PanelKind::kF32) {
      // Eight columns at a time (nr, a power of two, when narrower).
      const int64_t blk = std::min<int64_t>(8, nr);
      FP8MOE_DCHECK(nr % blk == 0);
      for (int64_t j0 = 0; j0 < padded; j0 += blk) {
        TransposeRowsInto(rd, s, c0 + j0, blk, c0 + cols.count, r0, kc,
                          panel_f32(j0 / nr) + j0 % nr, nr);
      }
      continue;
    }
    constexpr int64_t kAhead = 4;  // source rows (columns of B), as PackAT
    for (int64_t j = 0; j < std::min(kAhead, cols.count); ++j) rd.Prefetch(c0 + j, r0, kc);
    for (int64_t j = 0; j < padded; ++j) {
      const int64_t q = j / nr, jj = j % nr;
      const bool valid = j < cols.count;
      uint32_t* col = panel_u32(q) + jj;
      if (j + kAhead < cols.count) rd.Prefetch(c0 + j + kAhead, r0, kc);
      if (valid) {
        rd.Half(c0 + j, r0, kc, s.lo, s.tmp);
        s.lo[kc] = 0;
      }
      for (int64_t k = 0; k < kc2; ++k) {
        col[k * nr] = valid ? Pair(s.lo[2 * k], s.lo[2 * k + 1]) : 0u;
      }
    }
  }
  return per_run * cols.runs;
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
