// Runs a planned GemmCall: threads over work items, BLIS-style blocking
// inside an item, the microkernels of microkernels-inl.h, and the fused
// epilogues (scales, SwiGLU, dSwiGLU, bf16 output).
//
// Inside an item (rows x cols of output, reduction R):
//   for each reduction block of kc:         pack B [kc x cols]   (L2 / L3)
//     for each block of mc rows:            pack A [mc x kc]     (L2)
//       for each NR panel of B:             B micro-panel        (L1)
//         for each MR panel of A:           microkernel -> C tile
// A is packed once per (row block, reduction block) and reused over all the
// item's columns; B once per reduction block and reused over all its rows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fp8moe/numerics.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/pack.h"
#include "kernels/cpu/scratch.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gemm_exec.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/activation-inl.h"
#include "kernels/cpu/microkernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using internal::ColumnRuns;
using internal::Epilogue;
using internal::GemmCall;
using internal::Operand;
using internal::PanelKind;
using internal::Pass;
using internal::WorkItem;

constexpr int64_t kMC = 96;  // rows per packed A block (a multiple of MR)
// Weight bytes per reduction chunk of a direct item (see RunItem): 256 KiB
// measured best for f32, bf16 and fp8 weights on the decode shape (512 KiB
// made f32 40% and bf16 7% slower; 64 KiB costs in C-tile reloads).
constexpr int64_t kDirectChunkBytes = 256 << 10;

using internal::GrowBuffer;

PanelKind ChooseKind(const GemmCall& call) {
  if (call.integer) return PanelKind::kI16Pairs;
  // bf16 pairs only where every operand value is a bf16 value, so the
  // products are those of the f32 kernel (fp8 codes, bf16 data, or scaled
  // codes rounded to bf16).
  auto bf16_exact = [](const internal::Source& s) {
    if (s.kind == internal::SrcKind::kBf16) return true;
    if (s.kind != internal::SrcKind::kFp8) return false;
    return s.round_bf16 || s.col_scale == nullptr;
  };
  if (CpuHasAvx512Bf16() && bf16_exact(call.a) && bf16_exact(call.b)) {
    return PanelKind::kBf16Pairs;
  }
  return PanelKind::kF32;
}

// C tile [MR x NR] at c (ldc) += A panel x B panel over kc.
void RunKernel(PanelKind kind, int64_t kc, const void* ap, const void* bp,
               void* c, int64_t ldc, bool load_c, const float* row_scale,
               const float* col_scale) {
  const size_t ukc = static_cast<size_t>(kc), uldc = static_cast<size_t>(ldc);
  switch (kind) {
    case PanelKind::kF32:
      MicroF32<kMR, kNV>(ukc, static_cast<const float*>(ap),
                         static_cast<const float*>(bp), static_cast<float*>(c),
                         uldc, load_c, row_scale, col_scale);
      return;
    case PanelKind::kI16Pairs:
#if HWY_TARGET == HWY_AVX3
      if (CpuHasAvx512Vnni()) {
        MicroI16Vnni<kMR>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                          static_cast<const uint32_t*>(bp), static_cast<int32_t*>(c),
                          uldc, load_c);
        return;
      }
#endif
      MicroI16<kMR, kNV>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                         static_cast<const uint32_t*>(bp),
                         static_cast<int32_t*>(c), uldc, load_c);
      return;
    case PanelKind::kBf16Pairs:
#if HWY_TARGET == HWY_AVX3
      MicroBf16Pairs<kMR>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                          static_cast<const uint32_t*>(bp),
                          static_cast<float*>(c), uldc, load_c, row_scale, col_scale);
#endif
      return;
  }
}

// ---- Epilogue --------------------------------------------------------------

// Stores n f32 values to an F32 or BF16 row.
void StoreRow(const float* v, int64_t n, void* out, DType dtype) {
  if (dtype == DType::kF32) {
    std::memcpy(out, v, static_cast<size_t>(n) * sizeof(float));
  } else {
    F32ToBf16Span(v, static_cast<uint16_t*>(out), static_cast<size_t>(n));
  }
}

void LoadRow(const void* in, DType dtype, int64_t n, float* v) {
  if (dtype == DType::kF32) {
    std::memcpy(v, in, static_cast<size_t>(n) * sizeof(float));
  } else {
    Bf16ToF32Span(static_cast<const uint16_t*>(in), v, static_cast<size_t>(n));
  }
}

void* RowPtr(void* base, DType dtype, int64_t row, int64_t ld, int64_t col) {
  return static_cast<uint8_t*>(base) + (row * ld + col) * DTypeSize(dtype);
}

// Writes an item's finished tile C [rows x width] (f32 or int32).
void RunEpilogue(const GemmCall& call, const WorkItem& it, const void* cbuf,
                 int64_t ldc, int64_t run_stride, bool c_is_int,
                 std::vector<float>* scratch) {
  const Epilogue& e = call.epi;
  const int64_t w = it.cols;
  scratch->resize(static_cast<size_t>(4 * w));
  float* v0 = scratch->data();   // run 0 (or the only run)
  float* v1 = v0 + w;            // run 1 (SwiGLU up)
  float* t0 = v1 + w;
  float* t1 = t0 + w;
  const float* col_scale =
      e.col_scale ? e.col_scale + it.group * e.col_scale_group_stride : nullptr;
  const int runs = e.kind == Epilogue::Kind::kSwiGlu ? 2 : 1;
  for (int64_t i = 0; i < it.rows; ++i) {
    const int64_t row = it.row0 + i;
    for (int run = 0; run < runs; ++run) {
      float* v = run == 0 ? v0 : v1;
      const int64_t off = i * ldc + run * run_stride;
      if (c_is_int) {
        const int32_t* c = static_cast<const int32_t*>(cbuf) + off;
        for (int64_t j = 0; j < w; ++j) v[j] = static_cast<float>(c[j]);
      } else {
        std::memcpy(v, static_cast<const float*>(cbuf) + off,
                    static_cast<size_t>(w) * sizeof(float));
      }
      if (e.row_scale != nullptr || col_scale != nullptr) {
        const float rs = e.row_scale != nullptr ? e.row_scale[row] : 1.0f;
        const float* cs = col_scale + (run == 0 ? it.col0 : e.half + it.col0);
        for (int64_t j = 0; j < w; ++j) v[j] = v[j] * rs * cs[j];
      }
    }
    switch (e.kind) {
      case Epilogue::Kind::kStore:
      case Epilogue::Kind::kAccumulateF32:
        StoreRow(v0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        break;
      case Epilogue::Kind::kSwiGlu:
        if (e.h != nullptr) {
          StoreRow(v0, w, RowPtr(e.h, e.h_dtype, row, e.h_ld, it.col0), e.h_dtype);
          StoreRow(v1, w, RowPtr(e.h, e.h_dtype, row, e.h_ld, e.half + it.col0), e.h_dtype);
        }
        SiluMulRow(v0, v1, w, t0);
        StoreRow(t0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        break;
      case Epilogue::Kind::kDSwiGlu:
        LoadRow(RowPtr(e.h, e.h_dtype, row, e.h_ld, it.col0), e.h_dtype, w, t0);
        LoadRow(RowPtr(e.h, e.h_dtype, row, e.h_ld, e.half + it.col0), e.h_dtype, w, t1);
        DSiluRow(v0, t0, t1, w, v0, v1);  // in place: v0 is read before written
        StoreRow(v0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        StoreRow(v1, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, e.half + it.col0), e.out_dtype);
        break;
    }
  }
}

// ---- Items -----------------------------------------------------------------

struct ThreadBuffers {
  uint8_t* ap_ptr = nullptr;
  uint8_t* bp_ptr = nullptr;
  uint8_t* c_ptr = nullptr;
  std::vector<float> epi;
};

// Items of few rows use each weight row once, so they read B straight from
// the weight instead of packing it: the bf16-pair kernels on AVX512-BF16
// CPUs (MicroBf16PairsDirect, MicroFp8PairsVbmi; up to MR rows), int8
// weights on AVX512-VNNI (MicroI8PairsDirectVnni; up to MR rows), the f32
// kernel everywhere else (MicroF32Direct; up to 8 rows).
enum class Direct { kNone, kPairs, kF32, kInt8 };

// Sources the direct kernels convert in registers (besides f32).
bool ConvertibleInRegisters(const internal::Source& b) {
  return b.kind == internal::SrcKind::kBf16 ||
         (b.kind == internal::SrcKind::kFp8 && b.col_scale == nullptr && !b.round_bf16 &&
          (b.fp8 == Fp8Format::kE4M3FN || b.fp8 == Fp8Format::kE4M3FNUZ));
}

Direct ChooseDirect(const GemmCall& call, PanelKind kind, const WorkItem& it, int64_t nr) {
  if (call.pass != Pass::kFwd || it.cols % nr != 0) return Direct::kNone;
#if HWY_TARGET == HWY_AVX3
  if (kind == PanelKind::kBf16Pairs && it.rows <= static_cast<int64_t>(kMR) &&
      ConvertibleInRegisters(call.b)) {
    return Direct::kPairs;
  }
  if (kind == PanelKind::kI16Pairs && it.rows <= static_cast<int64_t>(kMR) &&
      call.b.kind == internal::SrcKind::kI8 && nr == 32 && CpuHasAvx512Vnni()) {
    return Direct::kInt8;
  }
#endif
  if (kind == PanelKind::kF32 && it.rows <= 8 &&
      (call.b.kind == internal::SrcKind::kF32 || ConvertibleInRegisters(call.b))) {
    return Direct::kF32;
  }
  return Direct::kNone;
}

// MicroF32Direct on the source's element type.
void RunDirectF32(const internal::Source& b, size_t kc, const float* ap, const uint8_t* src,
                  size_t ldb, float* c, size_t ldc, bool load_c, const float* row_scale,
                  const DirectPrefetch& pf) {
  switch (b.kind) {
    case internal::SrcKind::kF32:
      return MicroF32Direct<8, RowSrc::kF32>(kc, ap, src, ldb, c, ldc, load_c, row_scale, pf);
    case internal::SrcKind::kBf16:
      return MicroF32Direct<8, RowSrc::kBf16>(kc, ap, src, ldb, c, ldc, load_c, row_scale, pf);
    default:
      break;
  }
  if (b.fp8 == Fp8Format::kE4M3FN) {
    return MicroF32Direct<8, RowSrc::kE4M3FN>(kc, ap, src, ldb, c, ldc, load_c, row_scale, pf);
  }
  return MicroF32Direct<8, RowSrc::kE4M3FNUZ>(kc, ap, src, ldb, c, ldc, load_c, row_scale, pf);
}

#if HWY_TARGET == HWY_AVX3
template <size_t MR>
void RunDirect(const internal::Source& b, size_t kc, const uint32_t* ap, const uint8_t* src,
               size_t ldb, float* c, size_t ldc, bool load_c, const float* row_scale,
               bool last, const DirectPrefetch& pf) {
  if (b.kind == internal::SrcKind::kBf16) {
    return MicroBf16PairsDirect<MR, DirectSrc::kBf16>(kc, ap, src, ldb, c, ldc, load_c, row_scale, last, pf);
  }
  if (MR == 8 && CpuHasAvx512Vbmi()) {  // byte-table decode; 8 rows leave room for the tables
    if (b.fp8 == Fp8Format::kE4M3FN) {
      return MicroFp8PairsVbmi<8, Fp8Format::kE4M3FN>(kc, ap, src, ldb, c, ldc, load_c, row_scale, last, pf);
    }
    return MicroFp8PairsVbmi<8, Fp8Format::kE4M3FNUZ>(kc, ap, src, ldb, c, ldc, load_c, row_scale, last, pf);
  }
  if (b.fp8 == Fp8Format::kE4M3FN) {
    return MicroBf16PairsDirect<MR, DirectSrc::kE4M3FN>(kc, ap, src, ldb, c, ldc, load_c, row_scale, last, pf);
  }
  return MicroBf16PairsDirect<MR, DirectSrc::kE4M3FNUZ>(kc, ap, src, ldb, c, ldc, load_c, row_scale, last, pf);
}
#endif

void RunItem(const GemmCall& call, PanelKind kind, const WorkItem& it,
             ThreadBuffers* tb) {
  const int64_t nr = static_cast<int64_t>(KernelNR());
  const Direct direct_kind = ChooseDirect(call, kind, it, nr);
  const bool direct_b = direct_kind != Direct::kNone;
  // A panel as tall as the item: 8 rows when that is enough.
  const int64_t mr = direct_b && it.rows <= 8 ? 8 : static_cast<int64_t>(kMR);
  const bool is_int = kind == PanelKind::kI16Pairs;
  const bool swiglu = call.epi.kind == Epilogue::Kind::kSwiGlu;
  ColumnRuns runs;
  runs.count = it.cols;
  runs.start[0] = it.col0;
  if (swiglu) {
    runs.runs = 2;
    runs.start[1] = call.epi.half + it.col0;
  }
  const int64_t per_run = (it.cols + nr - 1) / nr;
  const int64_t run_stride = per_run * nr;
  const int64_t width = run_stride * runs.runs;  // packed C columns

  // Where C lives: straight in an f32 output when nothing else must happen
  // to it, else a per-thread scratch tile finished by the epilogue.
  const bool direct = call.epi.kind == Epilogue::Kind::kAccumulateF32;
  void* c;
  int64_t ldc;
  if (direct) {
    float* out = static_cast<float*>(call.epi.out) + it.group * call.out_group_stride;
    c = out + it.row0 * call.epi.out_ld + it.col0;
    ldc = call.epi.out_ld;
  } else {
    c = tb->c_ptr;
    ldc = width;
  }
  const int64_t elem = 4;  // f32 or int32

  const Operand opa{&call.a, it.group, call.pass == Pass::kTgmm};
  const Operand opb{&call.b, it.group, call.pass == Pass::kDlhs};
  const int64_t red0 = it.red0, red1 = it.red0 + it.red_len;
  if (red1 == red0) {  // nothing to reduce: the tile is zero
    for (int64_t i = 0; i < it.rows; ++i) {
      std::memset(static_cast<uint8_t*>(c) + i * ldc * elem, 0,
                  static_cast<size_t>((direct ? it.cols : width) * elem));
    }
  }
  int64_t kc_step = call.a_block_scale ? call.block
                    : call.b_block > 0  ? call.b_block
                                        : call.kc;
  if (direct_b && call.a_block_scale == nullptr && call.b_block == 0) {
    // Direct items stream their weight through L2: this chunk and the next
    // (prefetched) must both fit, so a chunk holds at most kDirectChunkBytes
    // of weight. (Without block scales the reduction order, hence the bits,
    // does not depend on the chunk.)
    const int64_t row_bytes = it.cols * runs.runs * static_cast<int64_t>(call.b.ElementBytes());
    const int64_t rows = std::max<int64_t>(16, kDirectChunkBytes / std::max<int64_t>(row_bytes, 1));
    kc_step = std::min(kc_step, rows & ~int64_t{1});
  }
  const bool block_col_scale = call.b_col_scale != nullptr && call.b_block > 0;
  alignas(64) float cs[64];
  alignas(64) uint8_t edge[64 * 64 * 4];
  alignas(64) float rs[64];
  const size_t esize = call.b.ElementBytes();
  DirectPrefetch pf;
  for (int64_t r0 = red0; r0 < red1; r0 += kc_step) {
    const int64_t kc = std::min(kc_step, red1 - r0);
    const bool load_c = r0 != red0;
    [[maybe_unused]] const bool last_chunk = r0 + kc >= red1;  // pair kernels: C to natural order
    // The next chunk's weight lines, shared out over this chunk's panels.
    const uint8_t* next_seg0 = nullptr;
    int64_t ahead_per_panel = 0;
    if (direct_b) {
      pf.cold_rows = r0 == red0 ? 32 : 0;
      pf.per_step = 0;
    }
    if (direct_b && r0 + kc < red1) {
      const int64_t rows_next = std::min(kc_step, red1 - r0 - kc);
      const uint8_t* row0 = static_cast<const uint8_t*>(call.b.data) +
                            (it.group * call.b.group_stride + (r0 + kc) * call.b.ld) * esize;
      auto line_of = [](const uint8_t* p) {
        return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
      };
      const uint8_t* first = row0 + runs.start[0] * esize;
      const uint8_t* last = first + it.cols * esize - 1;
      next_seg0 = line_of(first);
      pf.walk.seg_lines = static_cast<uint32_t>((line_of(last) - line_of(first)) / 64 + 1);
      pf.walk.nseg = static_cast<uint32_t>(runs.runs);
      pf.walk.seg_delta = runs.runs > 1 ? line_of(row0 + runs.start[1] * esize) - next_seg0 : 0;
      pf.walk.ld = static_cast<size_t>(call.b.ld) * esize;
      const int64_t total = rows_next * runs.runs * pf.walk.seg_lines;
      const int64_t panels = runs.runs * per_run;
      ahead_per_panel = (total + panels - 1) / panels;
      const int64_t steps = direct_kind == Direct::kF32 ? kc : (kc + 1) / 2;
      pf.per_step = static_cast<uint32_t>((ahead_per_panel + steps - 1) / steps);
    }
    const int64_t panels_b =
        direct_b ? runs.runs * per_run : internal::PackB(opb, kind, r0, kc, runs, nr, tb->bp_ptr);
    const int64_t bstride = (kind == PanelKind::kF32 ? kc : (kc + 1) / 2) * nr * 4;
    const int64_t astride = (kind == PanelKind::kF32 ? kc : (kc + 1) / 2) * mr * 4;
    for (int64_t m0 = 0; m0 < it.rows; m0 += kMC) {
      const int64_t mc = std::min<int64_t>(kMC, it.rows - m0);
      internal::PackA(opa, kind, it.row0 + m0, mc, r0, kc, mr, tb->ap_ptr);
      const int64_t panels_a = (mc + mr - 1) / mr;
      for (int64_t q = 0; q < panels_b; ++q) {
        const int64_t jq = (q % per_run) * nr;
        const int64_t col = (q / per_run) * run_stride + jq;  // column in C
        const int64_t valid_c = std::min(nr, it.cols - jq);
        const uint8_t* bpan = tb->bp_ptr + q * bstride;
        for (int64_t p = 0; p < panels_a; ++p) {
          const int64_t row = m0 + p * mr;
          const int64_t valid_r = std::min(mr, it.rows - row);
          const uint8_t* apan = tb->ap_ptr + p * astride;
          const float* row_scale = nullptr;
          if (call.a_block_scale != nullptr) {
            const int64_t b = r0 / call.block;
            for (int64_t ii = 0; ii < mr; ++ii) {
              rs[ii] = ii < valid_r
                           ? call.a_block_scale[(it.row0 + row + ii) * call.a_block_scale_ld + b]
                           : 0.0f;
            }
            row_scale = rs;
          }
          const float* col_scale = nullptr;
          if (block_col_scale) {  // this tile's scales of the panel's columns
            const float* src = call.b_col_scale +
                               call.b_row_tile[r0] * call.b_col_scale_ld + it.col0 + jq;
            for (int64_t jj = 0; jj < nr; ++jj) cs[jj] = jj < valid_c ? src[jj] : 0.0f;
            col_scale = cs;
          }
          uint8_t* ct = static_cast<uint8_t*>(c) + (row * ldc + col) * elem;
          // The scratch tile has room for whole panels; an f32 output does not.
          const bool full = !direct || (valid_r == mr && valid_c == nr);
          if (direct_b) {
            // Source columns of this panel: run start + offset in the run.
            const int64_t src_col = runs.start[q / per_run] + jq;
            const uint8_t* src = static_cast<const uint8_t*>(call.b.data) +
                                 (it.group * call.b.group_stride + r0 * call.b.ld + src_col) * esize;
            const size_t ldb = static_cast<size_t>(call.b.ld) * esize;
            float* cdst = reinterpret_cast<float*>(full ? ct : edge);
            const size_t ld = static_cast<size_t>(full ? ldc : nr);
            if (!full) {
              for (int64_t ii = 0; ii < valid_r; ++ii) {
                std::memcpy(edge + ii * nr * elem, ct + ii * ldc * elem,
                            static_cast<size_t>(valid_c * elem));
              }
            }
            // Only the first A panel pulls the next chunk (the rest re-read this one).
            DirectPrefetch this_pf = pf;
            if (p == 0 && pf.per_step != 0) {
              this_pf.walk.Start(next_seg0, q * ahead_per_panel, ahead_per_panel);
            } else {
              this_pf.per_step = 0;
            }
            if (p != 0) this_pf.cold_rows = 0;
            if (direct_kind == Direct::kF32) {
              // kNV vectors of columns, one kernel call each (8 accumulators).
              const size_t lanes = static_cast<size_t>(nr) / kNV;
              for (size_t h = 0; h < kNV; ++h) {
                DirectPrefetch half_pf = this_pf;
                if (h != 0) half_pf.per_step = 0;
                RunDirectF32(call.b, static_cast<size_t>(kc), reinterpret_cast<const float*>(apan),
                             src + h * lanes * esize, ldb, cdst + h * lanes, ld, load_c, row_scale,
                             half_pf);
              }
            }
#if HWY_TARGET == HWY_AVX3
            if (direct_kind == Direct::kPairs && mr == 8) {
              RunDirect<8>(call.b, static_cast<size_t>(kc), reinterpret_cast<const uint32_t*>(apan),
                           src, ldb, cdst, ld, load_c, row_scale, last_chunk, this_pf);
            } else if (direct_kind == Direct::kPairs) {
              RunDirect<kMR>(call.b, static_cast<size_t>(kc), reinterpret_cast<const uint32_t*>(apan),
                             src, ldb, cdst, ld, load_c, row_scale, last_chunk, this_pf);
            } else if (direct_kind == Direct::kInt8 && mr == 8) {
              MicroI8PairsDirectVnni<8>(static_cast<size_t>(kc), reinterpret_cast<const uint32_t*>(apan),
                                        src, ldb, reinterpret_cast<int32_t*>(cdst), ld, load_c,
                                        last_chunk, this_pf);
            } else if (direct_kind == Direct::kInt8) {
              MicroI8PairsDirectVnni<kMR>(static_cast<size_t>(kc), reinterpret_cast<const uint32_t*>(apan),
                                          src, ldb, reinterpret_cast<int32_t*>(cdst), ld, load_c,
                                          last_chunk, this_pf);
            }
#endif
            if (!full) {
              for (int64_t ii = 0; ii < valid_r; ++ii) {
                std::memcpy(ct + ii * ldc * elem, edge + ii * nr * elem,
                            static_cast<size_t>(valid_c * elem));
              }
            }
            continue;
          }
          if (full) {
            RunKernel(kind, kc, apan, bpan, ct, ldc, load_c, row_scale, col_scale);
            continue;
          }
          // Edge tile: run the full tile on a local copy, keep the valid part.
          for (int64_t ii = 0; ii < valid_r; ++ii) {
            std::memcpy(edge + ii * nr * elem, ct + ii * ldc * elem,
                        static_cast<size_t>(valid_c * elem));
          }
          RunKernel(kind, kc, apan, bpan, edge, nr, load_c, row_scale, col_scale);
          for (int64_t ii = 0; ii < valid_r; ++ii) {
            std::memcpy(ct + ii * ldc * elem, edge + ii * nr * elem,
                        static_cast<size_t>(valid_c * elem));
          }
        }
      }
    }
  }
  if (call.b_col_scale != nullptr && call.b_block == 0 && red1 > red0) {
    // One scale per (group, column): applied once to the finished sums.
    const float* s = call.b_col_scale + call.b_row_tile[red0] * call.b_col_scale_ld + it.col0;
    for (int64_t i = 0; i < it.rows; ++i) {
      float* ci = static_cast<float*>(c) + i * ldc;
      for (int64_t j = 0; j < it.cols; ++j) ci[j] *= s[j];
    }
  }
  if (!direct) RunEpilogue(call, it, c, ldc, run_stride, is_int, &tb->epi);
}

void ExecuteGemm(const GemmCall& call, bool* out_of_memory) {
  *out_of_memory = false;
  if (call.items.empty()) return;
  const PanelKind kind = ChooseKind(call);
  const int64_t mr = static_cast<int64_t>(kMR);
  const int64_t nr = static_cast<int64_t>(KernelNR());
  const int64_t kc = call.a_block_scale ? call.block
                     : call.b_block > 0  ? call.b_block
                                         : call.kc;
  int64_t max_rows = 0, max_cols = 0;
  for (const WorkItem& it : call.items) {
    max_rows = std::max(max_rows, it.rows);
    max_cols = std::max(max_cols, it.cols);
  }
  const int runs = call.epi.kind == Epilogue::Kind::kSwiGlu ? 2 : 1;
  const int64_t width = runs * ((max_cols + nr - 1) / nr) * nr;
  const size_t ap_bytes = static_cast<size_t>((kMC + mr) * (kc + 2) * 4);
  const size_t bp_bytes = static_cast<size_t>(width * (kc + 2) * 4);
  const size_t c_bytes = static_cast<size_t>((max_rows + mr) * width * 4);
  const int64_t n_items = static_cast<int64_t>(call.items.size());
#pragma omp parallel
  {
    internal::ThreadScratch& scratch = internal::WorkerScratch();
    ThreadBuffers tb;
    tb.ap_ptr = scratch.ap.Get(ap_bytes);
    tb.bp_ptr = scratch.bp.Get(bp_bytes);
    if (call.epi.kind != Epilogue::Kind::kAccumulateF32) tb.c_ptr = scratch.c.Get(c_bytes);
    // A thread without its packing buffers (a few MB) skips its items; the
    // call then reports the failure instead of returning partial results.
    const bool have = tb.ap_ptr != nullptr && tb.bp_ptr != nullptr &&
                      (call.epi.kind == Epilogue::Kind::kAccumulateF32 || tb.c_ptr != nullptr);
    if (!have) {
#pragma omp atomic write
      *out_of_memory = true;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      if (have) RunItem(call, kind, call.items[static_cast<size_t>(i)], &tb);
    }
  }
}

void KernelShapeOf(bool integer, internal::KernelShape* out) {
  out->mr = static_cast<int64_t>(kMR);
  out->nr = static_cast<int64_t>(KernelNR());
  out->bf16_pairs = !integer && CpuHasAvx512Bf16();
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(ExecuteGemm);
HWY_EXPORT(KernelShapeOf);

Status ExecuteGemm(const GemmCall& call) {
  bool out_of_memory = false;
  HWY_DYNAMIC_DISPATCH(ExecuteGemm)(call, &out_of_memory);
  if (out_of_memory) {
    return ResourceExhausted("cannot allocate the GMM packing buffers (a few MB per thread)");
  }
  return OkStatus();
}

KernelShape GemmKernelShape(bool integer) {
  KernelShape s;
  HWY_DYNAMIC_DISPATCH(KernelShapeOf)(integer, &s);
  return s;
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
