#include "kernels/cpu/pack.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "fp8moe/numerics.h"

namespace fp8moe::internal {
namespace {

// One group's view of a source: row r, columns [c0, c0 + n) converted with
// the SIMD span functions of the numerics layer, so packing costs a fraction
// of a cycle per element.
class RowReader {
 public:
  explicit RowReader(const Operand& op) : s_(*op.src) {
    const int64_t g = op.group;
    esize_ = s_.ElementBytes();
    base_ = static_cast<const uint8_t*>(s_.data) + g * s_.group_stride * esize_;
    col_scale_ = s_.col_scale ? s_.col_scale + g * s_.col_scale_group_stride : nullptr;
  }

  bool scaled() const { return col_scale_ != nullptr; }

  // Row r from column c0 in place when the source already holds f32 (no
  // conversion to make, so no copy through scratch); else nullptr.
  const float* F32InPlace(int64_t r, int64_t c0) const {
    if (s_.kind != SrcKind::kF32) return nullptr;
    return reinterpret_cast<const float*>(base_) + r * s_.ld + c0;
  }

  // Row r, columns [c0, c0 + n) as f32.
  void F32(int64_t r, int64_t c0, int64_t n, float* dst) const {
    const uint8_t* p = base_ + (r * s_.ld + c0) * esize_;
    const size_t un = static_cast<size_t>(n);
    switch (s_.kind) {
      case SrcKind::kF32:
        std::memcpy(dst, p, un * sizeof(float));
        return;
      case SrcKind::kBf16:
        Bf16ToF32Span(reinterpret_cast<const uint16_t*>(p), dst, un);
        return;
      case SrcKind::kI8:
        for (size_t j = 0; j < un; ++j) dst[j] = static_cast<float>(static_cast<const int8_t*>(static_cast<const void*>(p))[j]);
        return;
      case SrcKind::kFp8:
        break;
    }
    DecodeFp8Span(p, dst, un, s_.fp8);
    if (col_scale_ != nullptr) {
      for (size_t j = 0; j < un; ++j) dst[j] *= col_scale_[c0 + static_cast<int64_t>(j)];
    }
    if (s_.round_bf16) {
      for (size_t j = 0; j < un; ++j) dst[j] = Bf16ToF32(F32ToBf16(dst[j]));
    }
  }

  // Row r, columns [c0, c0 + n) as 16-bit lanes: bf16 bits (the planner only
  // asks when the values are bf16-exact) or int16 for integer GEMMs.
  void Half(int64_t r, int64_t c0, int64_t n, uint16_t* dst, float* tmp) const {
    const uint8_t* p = base_ + (r * s_.ld + c0) * esize_;
    const size_t un = static_cast<size_t>(n);
    if (s_.kind == SrcKind::kBf16) {
      std::memcpy(dst, p, un * sizeof(uint16_t));
    } else if (s_.kind == SrcKind::kI8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(p);
      for (size_t j = 0; j < un; ++j) dst[j] = static_cast<uint16_t>(static_cast<int16_t>(q[j]));
    } else if (s_.kind == SrcKind::kFp8 && !scaled()) {
      DecodeFp8ToBf16Span(p, dst, un, s_.fp8);
    } else if (s_.kind == SrcKind::kFp8 && col_scale_ != nullptr && s_.round_bf16) {
      // The fake-QAT copy's values, in one pass.
      DequantizeFp8ToBf16Span(p, col_scale_ + c0, dst, un, s_.fp8);
    } else {
      F32(r, c0, n, tmp);
      F32ToBf16Span(tmp, dst, un);
    }
  }

 private:
  const Source& s_;
  const uint8_t* base_;
  size_t esize_;
  const float* col_scale_;
};

// Per-thread scratch rows for the conversions.
struct Scratch {
  std::vector<float> f32, tmp, zero;
  std::vector<uint16_t> lo, hi;
  std::vector<float> rows;  // several converted rows
  void Reserve(int64_t n) {
    const size_t un = static_cast<size_t>(n);
    if (f32.size() < un) {
      f32.resize(un);
      tmp.resize(un);
      zero.resize(un);
      lo.resize(un);
      hi.resize(un);
    }
  }
  void ReserveRows(int64_t n) {
    if (rows.size() < static_cast<size_t>(n)) rows.resize(static_cast<size_t>(n));
  }
};
thread_local Scratch tls;

uint32_t Pair(uint16_t lo, uint16_t hi) { return lo | static_cast<uint32_t>(hi) << 16; }

// Copies n floats. Panel pieces are one register tile wide (mr or nr floats,
// a few dozen bytes): a constant-size memcpy compiles to a few vector moves,
// where a call to memcpy per piece cost ~15% of a TGMM.
template <int64_t N>
bool CopyIf(float* dst, const float* src, int64_t n) {
  if (n != N) return false;
  std::memcpy(dst, src, N * sizeof(float));
  return true;
}
void CopyFloats(float* dst, const float* src, int64_t n) {
  if (CopyIf<32>(dst, src, n) || CopyIf<16>(dst, src, n) || CopyIf<12>(dst, src, n) ||
      CopyIf<8>(dst, src, n) || CopyIf<6>(dst, src, n) || CopyIf<4>(dst, src, n) ||
      CopyIf<2>(dst, src, n)) {
    return;
  }
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Source rows [first, first + n) over the reduction block [r0, r0 + kc),
// transposed into panel columns: dst[k * ld + t] = row first + t, element
// r0 + k; rows at or past `end` are zero. Several rows at a time so that
// every panel row gets one contiguous store instead of n scattered ones.
constexpr int64_t kMaxTransposeRows = 16;
void TransposeRowsInto(const RowReader& rd, Scratch& s, int64_t first, int64_t n, int64_t end,
                       int64_t r0, int64_t kc, float* dst, int64_t ld) {
  const float* src[kMaxTransposeRows];
  for (int64_t t = 0; t < n; ++t) {
    if (first + t >= end) {
      src[t] = s.zero.data();
      continue;
    }
    src[t] = rd.F32InPlace(first + t, r0);
    if (src[t] == nullptr) {
      float* row = s.rows.data() + t * (kc + 1);
      rd.F32(first + t, r0, kc, row);
      src[t] = row;
    }
  }
  if (n == 8) {  // AVX3 nr blocks and the 8-row direct panels: a fixed-size store
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t t = 0; t < 8; ++t) dst[k * ld + t] = src[t][k];
    }
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t t = 0; t < n; ++t) dst[k * ld + t] = src[t][k];
  }
}

void ReserveTranspose(Scratch& s, int64_t kc) {
  s.ReserveRows(kMaxTransposeRows * (kc + 1));
  std::fill(s.zero.begin(), s.zero.begin() + kc, 0.0f);
}

}  // namespace

void PackA(const Operand& a, PanelKind kind, int64_t i0, int64_t rows,
           int64_t r0, int64_t kc, int64_t mr, void* ap) {
  const RowReader rd(a);
  const int64_t panels = (rows + mr - 1) / mr;
  const int64_t kc2 = (kc + 1) / 2;
  const int64_t step = kind == PanelKind::kF32 ? kc : kc2;  // panel rows
  Scratch& s = tls;
  if (!a.transposed) {
    // A(i, r) = source(i, r): convert each row over the reduction block and
    // scatter it down its panel column.
    s.Reserve(kc + 1);
    if (kind == PanelKind::kF32) {
      ReserveTranspose(s, kc);
      for (int64_t p = 0; p < panels; ++p) {
        for (int64_t b0 = 0; b0 < mr; b0 += kMaxTransposeRows) {
          TransposeRowsInto(rd, s, i0 + p * mr + b0, std::min(kMaxTransposeRows, mr - b0),
                            i0 + rows, r0, kc, static_cast<float*>(ap) + p * step * mr + b0, mr);
        }
      }
      return;
    }
    for (int64_t i = 0; i < panels * mr; ++i) {
      const int64_t p = i / mr, ii = i % mr;
      uint32_t* col = static_cast<uint32_t*>(ap) + p * step * mr + ii;
      if (i < rows) {
        rd.Half(i0 + i, r0, kc, s.lo.data(), s.tmp.data());
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
  s.Reserve(panels * mr);
  for (int64_t k = 0; k < step; ++k) {
    if (kind == PanelKind::kF32) {
      const float* row = rd.F32InPlace(r0 + k, i0);
      if (row == nullptr) {
        rd.F32(r0 + k, i0, rows, s.f32.data());
        row = s.f32.data();
      }
      for (int64_t p = 0; p < panels; ++p) {
        float* dst = static_cast<float*>(ap) + (p * step + k) * mr;
        const int64_t n = std::min(mr, rows - p * mr);
        CopyFloats(dst, row + p * mr, n);
        std::fill(dst + n, dst + mr, 0.0f);
      }
    } else {
      rd.Half(r0 + 2 * k, i0, rows, s.lo.data(), s.tmp.data());
      if (2 * k + 1 < kc) {
        rd.Half(r0 + 2 * k + 1, i0, rows, s.hi.data(), s.tmp.data());
      } else {
        std::fill(s.hi.begin(), s.hi.begin() + rows, uint16_t{0});
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

int64_t PackB(const Operand& b, PanelKind kind, int64_t r0, int64_t kc,
              const ColumnRuns& cols, int64_t nr, void* bp) {
  const RowReader rd(b);
  const int64_t per_run = (cols.count + nr - 1) / nr;
  const int64_t kc2 = (kc + 1) / 2;
  const int64_t step = kind == PanelKind::kF32 ? kc : kc2;
  const int64_t padded = per_run * nr;
  Scratch& s = tls;
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
      s.Reserve(padded);
      for (int64_t k = 0; k < step; ++k) {
        if (kind == PanelKind::kF32) {
          const float* row = rd.F32InPlace(r0 + k, c0);
          if (row == nullptr) {
            rd.F32(r0 + k, c0, cols.count, s.f32.data());
            row = s.f32.data();
          }
          for (int64_t q = 0; q < per_run; ++q) {
            float* dst = panel_f32(q) + k * nr;
            const int64_t n = std::min(nr, cols.count - q * nr);
            CopyFloats(dst, row + q * nr, n);
            std::fill(dst + n, dst + nr, 0.0f);
          }
        } else {
          rd.Half(r0 + 2 * k, c0, cols.count, s.lo.data(), s.tmp.data());
          if (2 * k + 1 < kc) {
            rd.Half(r0 + 2 * k + 1, c0, cols.count, s.hi.data(), s.tmp.data());
          } else {
            std::fill(s.hi.begin(), s.hi.begin() + cols.count, uint16_t{0});
          }
          std::fill(s.lo.begin() + cols.count, s.lo.begin() + padded, uint16_t{0});
          std::fill(s.hi.begin() + cols.count, s.hi.begin() + padded, uint16_t{0});
          const uint16_t* lo = s.lo.data();
          const uint16_t* hi = s.hi.data();
          for (int64_t q = 0; q < per_run; ++q) {
            uint32_t* dst = panel_u32(q) + k * nr;
            for (int64_t jj = 0; jj < nr; ++jj) dst[jj] = Pair(lo[q * nr + jj], hi[q * nr + jj]);
          }
        }
      }
      continue;
    }
    // Transposed (dLHS: B(r, j) = source(c0 + j, r)): each source row is one
    // output column over the reduction block.
    s.Reserve(kc + 1);
    if (kind == PanelKind::kF32) {
      // Eight columns at a time (nr, a power of two, when narrower).
      ReserveTranspose(s, kc);
      const int64_t blk = std::min<int64_t>(8, nr);
      for (int64_t j0 = 0; j0 < padded; j0 += blk) {
        TransposeRowsInto(rd, s, c0 + j0, blk, c0 + cols.count, r0, kc,
                          panel_f32(j0 / nr) + j0 % nr, nr);
      }
      continue;
    }
    for (int64_t j = 0; j < padded; ++j) {
      const int64_t q = j / nr, jj = j % nr;
      const bool valid = j < cols.count;
      uint32_t* col = panel_u32(q) + jj;
      if (valid) {
        rd.Half(c0 + j, r0, kc, s.lo.data(), s.tmp.data());
        s.lo[kc] = 0;
      }
      for (int64_t k = 0; k < kc2; ++k) {
        col[k * nr] = valid ? Pair(s.lo[2 * k], s.lo[2 * k + 1]) : 0u;
      }
    }
  }
  return per_run * cols.runs;
}

}  // namespace fp8moe::internal
