#include "kernels/cpu/pack.h"

#include <cstring>

#include "fp8moe/numerics.h"

namespace fp8moe::internal {
namespace {

// Decoded values of all 256 codes of a format, as f32 and as bf16 bits
// (exact: every fp8 value is a bf16 value).
struct Fp8Table {
  float f32[256];
  uint16_t bf16[256];
  explicit Fp8Table(Fp8Format f) {
    for (int c = 0; c < 256; ++c) {
      f32[c] = DecodeFp8(static_cast<uint8_t>(c), f);
      bf16[c] = F32ToBf16(f32[c]);
    }
  }
};

const Fp8Table& TableFor(Fp8Format f) {
  static const Fp8Table tables[4] = {Fp8Table(Fp8Format::kE4M3FN),
                                     Fp8Table(Fp8Format::kE4M3FNUZ),
                                     Fp8Table(Fp8Format::kE5M2),
                                     Fp8Table(Fp8Format::kE5M2FNUZ)};
  return tables[static_cast<int>(f)];
}

// Element (row, col) of one group's source, converted. K is the source kind.
template <SrcKind K>
struct Reader {
  const void* base;
  int64_t ld;
  const float* col_scale;  // already offset to the group
  const int32_t* row_tile;
  const float* tile_scale;
  int64_t tile_ld;
  bool round_bf16;
  const Fp8Table* table;

  explicit Reader(const Operand& op) {
    const Source& s = *op.src;
    const int64_t g = op.group;
    const size_t esize = K == SrcKind::kF32 ? 4 : K == SrcKind::kBf16 ? 2 : 1;
    base = static_cast<const uint8_t*>(s.data) + g * s.group_stride * esize;
    ld = s.ld;
    col_scale = s.col_scale ? s.col_scale + g * s.col_scale_group_stride : nullptr;
    row_tile = s.row_tile;
    tile_scale = s.tile_scale;
    tile_ld = s.tile_scale_ld;
    round_bf16 = s.round_bf16;
    table = K == SrcKind::kFp8 ? &TableFor(s.fp8) : nullptr;
  }

  float F32(int64_t r, int64_t c) const {
    const int64_t at = r * ld + c;
    if constexpr (K == SrcKind::kF32) {
      return static_cast<const float*>(base)[at];
    } else if constexpr (K == SrcKind::kBf16) {
      return Bf16ToF32(static_cast<const uint16_t*>(base)[at]);
    } else if constexpr (K == SrcKind::kFp8) {
      float v = table->f32[static_cast<const uint8_t*>(base)[at]];
      if (col_scale != nullptr) {
        v *= col_scale[c];
      } else if (tile_scale != nullptr) {
        v *= tile_scale[row_tile[r] * tile_ld + c];
      }
      return round_bf16 ? Bf16ToF32(F32ToBf16(v)) : v;
    } else {
      return static_cast<float>(static_cast<const int8_t*>(base)[at]);
    }
  }

  // The 16-bit lane of a pair: bf16 bits, or int16 for integer GEMMs. The
  // planner only asks for bf16 when the values are bf16-exact.
  uint16_t Half(int64_t r, int64_t c) const {
    const int64_t at = r * ld + c;
    if constexpr (K == SrcKind::kBf16) {
      return static_cast<const uint16_t*>(base)[at];
    } else if constexpr (K == SrcKind::kI8) {
      return static_cast<uint16_t>(
          static_cast<int16_t>(static_cast<const int8_t*>(base)[at]));
    } else if constexpr (K == SrcKind::kFp8) {
      if (col_scale == nullptr && tile_scale == nullptr) {
        return table->bf16[static_cast<const uint8_t*>(base)[at]];
      }
      return F32ToBf16(F32(r, c));
    } else {
      return F32ToBf16(F32(r, c));
    }
  }
};

// Element (i, r) of A or (r, j) of B as the source's (row, col).
struct At {
  bool transposed;
  int64_t Row(int64_t x, int64_t y) const { return transposed ? y : x; }
  int64_t Col(int64_t x, int64_t y) const { return transposed ? x : y; }
};

template <SrcKind K>
void PackAT(const Operand& op, PanelKind kind, int64_t i0, int64_t rows,
            int64_t r0, int64_t kc, int64_t mr, void* ap) {
  const Reader<K> rd(op);
  const At at{op.transposed};
  const int64_t panels = (rows + mr - 1) / mr;
  if (kind == PanelKind::kF32) {
    float* out = static_cast<float*>(ap);
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = out + p * kc * mr;
      for (int64_t ii = 0; ii < mr; ++ii) {
        const int64_t i = p * mr + ii;
        if (i >= rows) {
          for (int64_t k = 0; k < kc; ++k) panel[k * mr + ii] = 0.0f;
          continue;
        }
        for (int64_t k = 0; k < kc; ++k) {
          panel[k * mr + ii] = rd.F32(at.Row(i0 + i, r0 + k), at.Col(i0 + i, r0 + k));
        }
      }
    }
    return;
  }
  const int64_t kc2 = (kc + 1) / 2;
  uint32_t* out = static_cast<uint32_t*>(ap);
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* panel = out + p * kc2 * mr;
    for (int64_t ii = 0; ii < mr; ++ii) {
      const int64_t i = p * mr + ii;
      if (i >= rows) {
        for (int64_t k = 0; k < kc2; ++k) panel[k * mr + ii] = 0;
        continue;
      }
      const int64_t ia = i0 + i;
      for (int64_t k = 0; k < kc2; ++k) {
        const int64_t r = r0 + 2 * k;
        const uint32_t lo = rd.Half(at.Row(ia, r), at.Col(ia, r));
        const uint32_t hi =
            2 * k + 1 < kc ? rd.Half(at.Row(ia, r + 1), at.Col(ia, r + 1)) : 0u;
        panel[k * mr + ii] = lo | hi << 16;
      }
    }
  }
}

template <SrcKind K>
int64_t PackBT(const Operand& op, PanelKind kind, int64_t r0, int64_t kc,
               const ColumnRuns& cols, int64_t nr, void* bp) {
  const Reader<K> rd(op);
  const At at{op.transposed};
  const int64_t per_run = (cols.count + nr - 1) / nr;
  const int64_t kc2 = (kc + 1) / 2;
  for (int run = 0; run < cols.runs; ++run) {
    for (int64_t q = 0; q < per_run; ++q) {
      const int64_t panel_index = run * per_run + q;
      const int64_t j0 = q * nr;
      const int64_t valid = std::min(nr, cols.count - j0);
      const int64_t c0 = cols.start[run] + j0;
      if (kind == PanelKind::kF32) {
        float* panel = static_cast<float*>(bp) + panel_index * kc * nr;
        if (op.transposed) {  // read along the source row, write strided
          for (int64_t jj = 0; jj < nr; ++jj) {
            for (int64_t k = 0; k < kc; ++k) {
              panel[k * nr + jj] = jj < valid ? rd.F32(c0 + jj, r0 + k) : 0.0f;
            }
          }
        } else {
          for (int64_t k = 0; k < kc; ++k) {
            for (int64_t jj = 0; jj < valid; ++jj) panel[k * nr + jj] = rd.F32(r0 + k, c0 + jj);
            for (int64_t jj = valid; jj < nr; ++jj) panel[k * nr + jj] = 0.0f;
          }
        }
        continue;
      }
      uint32_t* panel = static_cast<uint32_t*>(bp) + panel_index * kc2 * nr;
      for (int64_t k = 0; k < kc2; ++k) {
        const int64_t r = r0 + 2 * k;
        const bool has_hi = 2 * k + 1 < kc;
        for (int64_t jj = 0; jj < valid; ++jj) {
          const int64_t c = c0 + jj;
          const uint32_t lo = rd.Half(at.Row(r, c), at.Col(r, c));
          const uint32_t hi = has_hi ? rd.Half(at.Row(r + 1, c), at.Col(r + 1, c)) : 0u;
          panel[k * nr + jj] = lo | hi << 16;
        }
        for (int64_t jj = valid; jj < nr; ++jj) panel[k * nr + jj] = 0;
      }
    }
  }
  return per_run * cols.runs;
}

}  // namespace

void PackA(const Operand& a, PanelKind kind, int64_t i0, int64_t rows,
           int64_t r0, int64_t kc, int64_t mr, void* ap) {
  switch (a.src->kind) {
    case SrcKind::kF32: return PackAT<SrcKind::kF32>(a, kind, i0, rows, r0, kc, mr, ap);
    case SrcKind::kBf16: return PackAT<SrcKind::kBf16>(a, kind, i0, rows, r0, kc, mr, ap);
    case SrcKind::kFp8: return PackAT<SrcKind::kFp8>(a, kind, i0, rows, r0, kc, mr, ap);
    case SrcKind::kI8: return PackAT<SrcKind::kI8>(a, kind, i0, rows, r0, kc, mr, ap);
  }
}

int64_t PackB(const Operand& b, PanelKind kind, int64_t r0, int64_t kc,
              const ColumnRuns& cols, int64_t nr, void* bp) {
  switch (b.src->kind) {
    case SrcKind::kF32: return PackBT<SrcKind::kF32>(b, kind, r0, kc, cols, nr, bp);
    case SrcKind::kBf16: return PackBT<SrcKind::kBf16>(b, kind, r0, kc, cols, nr, bp);
    case SrcKind::kFp8: return PackBT<SrcKind::kFp8>(b, kind, r0, kc, cols, nr, bp);
    case SrcKind::kI8: return PackBT<SrcKind::kI8>(b, kind, r0, kc, cols, nr, bp);
  }
  return 0;
}

}  // namespace fp8moe::internal
