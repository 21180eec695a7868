// The direct path of gemm_exec.cc, per target: items of few rows use each
// weight element once, so instead of packing B (convert, write a panel, read
// it back) their kernels read the weight rows in place and convert them in
// registers (microkernels-inl.h):
//   kPairs  AVX512-BF16 CPUs, up to MR rows: MicroBf16PairsDirect, or
//           MicroFp8PairsVbmi (byte tables) for fp8 up to 8 rows on VBMI
//           CPUs, in a tile of MR rows x NB blocks of 32 columns (1 x 4,
//           2 x 2, 4 x 1, 8 x 1, MR x 1; DirectPairsShapeFor)
//   kInt8   int8 weights on AVX512-VNNI CPUs, up to MR rows (the same tiles)
//   kF32    every other target (and f32 weights everywhere), up to 8 rows:
//           MicroF32Direct in a tile of MR rows x NV vectors of columns with
//           MR x NV = 8 (1 row x 8 vectors ... 8 rows x 1 vector); on
//           AVX-512 8 x 2, and 4 x 4 for fp8 (DirectF32ShapeFor); native
//           fp8 weights decoded raw (3 ops per vector, RowSrc::kRawE4M3FN)
// Each kernel call walks a strip of columns down a reduction chunk and
// prefetches its share of the next chunk in memory order (line_walk.h).

#if defined(FP8MOE_KERNELS_CPU_DIRECT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_DIRECT_INL_H_
#undef FP8MOE_KERNELS_CPU_DIRECT_INL_H_
#else
#define FP8MOE_KERNELS_CPU_DIRECT_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "base/check.h"
#include "fp8moe/context.h"
#include "hwy/highway.h"
#include "kernels/cpu/kernel_path.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/line_walk.h"
#include "kernels/cpu/microkernels-inl.h"
#include "kernels/cpu/pack.h"
#include "kernels/cpu/prefetch_target.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

using internal::ChunkPrefetchTarget;
using internal::ColumnRuns;
using internal::DirectPrefetch;
using internal::GemmCall;
using internal::PanelKind;
using internal::PrefetchTarget;
using internal::WorkItem;

// Items of at most this many rows take the f32 direct kernel.
constexpr int64_t kDirectF32Rows = 8;
// The widest strip a direct kernel call covers, in vectors of columns.
constexpr int64_t kMaxDirectNV = 8;

// The f32 direct kernel's tile for an item of `rows` rows of a weight of
// `esize`-byte elements: MR rows (the A panel's height) x NV vectors of
// columns, so that an item of one row (decode, one row per expert) does one
// FMA per weight vector. 8 accumulators cover the FMA latency; targets with
// 16 vector registers hold no more. A call walks its strip down the chunk's
// weight rows, and rows 4 KiB apart all fall in one L1 set, so a line a call
// reads only part of is gone before the next call that shares it comes by:
// AVX-512's 32 registers hold 16 accumulators, and there a tile reads a whole
// line of each row where 8 would read less (8 rows: 8 x 2, 32 columns, where
// 8 x 1 read a quarter line of fp8 codes; 4 rows of fp8: 4 x 4). Wider than a
// line measured slower (Zen 5, AVX3, a driver alternated 8 times: 2 rows of
// fp8 as 2 x 8 1.11x the time of 2 x 4, 4 rows of bf16 as 4 x 4 1.10x of
// 4 x 2); decode (8 rows per expert): native 5.67 -> 2.83 ms, bf16 6.05 ->
// 3.40 ms with 8 x 2.
struct DirectF32Shape {
  int64_t mr, nv;
};
constexpr DirectF32Shape DirectF32ShapeFor(int64_t rows, int64_t esize) {
  if (rows <= 1) return {1, 8};
  if (rows <= 2) return {2, 4};
#if HWY_TARGET <= HWY_AVX3
  if (rows <= 4) return {4, esize == 1 ? 4 : 2};
  return {8, 2};
#else
  (void)esize;
  if (rows <= 4) return {4, 2};
  return {8, 1};
#endif
}
// The accumulators a direct tile may hold: 16 of AVX-512's 32 vector
// registers, 8 of the 16 elsewhere (the rest hold the weight vectors and the
// broadcast).
constexpr int64_t kDirectF32MaxAccumulators = HWY_TARGET <= HWY_AVX3 ? 16 : 8;
// Every tile covers its item's rows, fits the widest strip the edge copy and
// the prefetch plan take (kMaxDirectNV) and the target's registers.
constexpr bool DirectF32ShapesFit() {
  for (int64_t rows = 1; rows <= kDirectF32Rows; ++rows) {
    for (int64_t esize : {1, 2, 4}) {
      const DirectF32Shape t = DirectF32ShapeFor(rows, esize);
      if (t.mr < rows || t.nv > kMaxDirectNV || t.mr * t.nv > kDirectF32MaxAccumulators) {
        return false;
      }
    }
  }
  return true;
}
static_assert(DirectF32ShapesFit());

// Native fp8 (A holds the activation's e4m3 codes, B e4m3 codes without a
// scale): the direct kernel decodes B raw (microkernels-inl.h, RowSrc).
inline bool RawFp8(const GemmCall& call) {
  return call.a.kind == internal::SrcKind::kFp8 && call.a.col_scale == nullptr &&
         call.b.kind == internal::SrcKind::kFp8 && call.b.col_scale == nullptr &&
         !call.b.round_bf16 && call.a.fp8 == call.b.fp8 &&
         (call.b.fp8 == Fp8Format::kE4M3FN || call.b.fp8 == Fp8Format::kE4M3FNUZ);
}
// Weight bytes per reduction chunk of a direct item: 256 KiB measured best
// for f32, bf16 and fp8 weights on the decode shape (512 KiB made f32 40%
// and bf16 7% slower; 64 KiB costs in C-tile reloads). The chunk being read
// and the next one (prefetched) must both fit in L2.
constexpr int64_t kDirectChunkBytes = 256 << 10;

enum class Direct { kNone, kPairs, kF32, kInt8 };

// Sources the direct kernels convert in registers (besides f32).
inline bool ConvertibleInRegisters(const internal::Source& b) {
  return b.kind == internal::SrcKind::kBf16 ||
         (b.kind == internal::SrcKind::kFp8 && b.col_scale == nullptr && !b.round_bf16 &&
          (b.fp8 == Fp8Format::kE4M3FN || b.fp8 == Fp8Format::kE4M3FNUZ));
}

inline Direct ChooseDirect(const GemmCall& call, PanelKind kind, const WorkItem& it, int64_t nr) {
  if (call.pass != internal::Pass::kFwd || it.cols % nr != 0) return Direct::kNone;
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
  if (kind == PanelKind::kF32 && it.rows <= kDirectF32Rows &&
      (call.b.kind == internal::SrcKind::kF32 || call.b.kind == internal::SrcKind::kBf16 ||
       RawFp8(call))) {
    return Direct::kF32;
  }
  return Direct::kNone;
}

// The kernel path a direct item takes (the KernelPath counters).
inline internal::KernelPath DirectPath(Direct d, const GemmCall& call, int64_t mr) {
  [[maybe_unused]] const internal::Source& b = call.b;
  switch (d) {
    case Direct::kF32:
      return RawFp8(call) ? internal::KernelPath::kDirectRawFp8 : internal::KernelPath::kDirectF32;
    case Direct::kInt8: return internal::KernelPath::kDirectI8Vnni;
    default: break;
  }
#if HWY_TARGET == HWY_AVX3
  if (b.kind == internal::SrcKind::kFp8 && mr <= 8 && CpuHasAvx512Vbmi()) {
    return internal::KernelPath::kDirectFp8Vbmi;
  }
#endif
  return internal::KernelPath::kDirectBf16Pairs;
}

// Reduction rows per chunk: at most kDirectChunkBytes of weight, even.
// (Without block scales the reduction order, hence the bits, does not
// depend on the chunk.)
inline int64_t DirectChunkRows(const GemmCall& call, const WorkItem& it, int runs,
                               int64_t kc_step) {
  if (call.a_block_scale != nullptr || call.b_block != 0) return kc_step;
  const int64_t row_bytes = it.cols * runs * static_cast<int64_t>(call.b.ElementBytes());
  const int64_t rows = std::max<int64_t>(16, kDirectChunkBytes / std::max<int64_t>(row_bytes, 1));
  return std::min(kc_step, rows & ~int64_t{1});
}

// The look-ahead prefetch of one reduction chunk [r0, r0 + kc): the next
// chunk's weight lines (its first `rows_next` rows, every run's columns), in
// memory order, shared out over the chunk's strips by width.
struct ChunkPrefetch {
  DirectPrefetch pf;  // per_step = 0: nothing to pull
  const uint8_t* next_seg0 = nullptr;
  int64_t ahead_per_vector = 0;  // lines per vector of columns
  int64_t steps = 1;             // kernel steps of this chunk

  // The prefetch of the strip of `width` vectors starting at vector `first`
  // (counted over all runs).
  DirectPrefetch ForStrip(int64_t first, int64_t width) const {
    DirectPrefetch out = pf;
    if (pf.per_step != 0) {
      const int64_t lines = width * ahead_per_vector;
      out.walk.Start(next_seg0, first * ahead_per_vector, lines);
      out.per_step = static_cast<uint32_t>((lines + steps - 1) / steps);
    }
    return out;
  }
};

inline ChunkPrefetch PlanChunkPrefetch(const GemmCall& call, Direct kind, const WorkItem& it,
                                       const ColumnRuns& runs, int64_t vectors_per_run,
                                       int64_t r0, int64_t kc, const PrefetchTarget& target) {
  ChunkPrefetch c;
  // Only an item's first chunk may have nothing in flight: its calls pull
  // their own rows ahead into L1 (cheap when the lines are already in L2).
  c.pf.cold_rows = r0 == it.red0 ? 32 : 0;
  c.pf.per_step = 0;
  if (target.item == nullptr) return c;
  const WorkItem& t = *target.item;
  const ColumnRuns& truns = *target.runs;
  const size_t esize = call.b.ElementBytes();
  const uint8_t* row0 = static_cast<const uint8_t*>(call.b.data) +
                        (t.group * call.b.group_stride + target.r0 * call.b.ld) *
                            static_cast<int64_t>(esize);
  auto line_of = [](const uint8_t* p) {
    return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  };
  const uint8_t* first = row0 + truns.start[0] * static_cast<int64_t>(esize);
  const uint8_t* last = first + t.cols * static_cast<int64_t>(esize) - 1;
  c.next_seg0 = line_of(first);
  c.pf.walk.seg_lines = static_cast<uint32_t>((line_of(last) - line_of(first)) / 64 + 1);
  c.pf.walk.nseg = static_cast<uint32_t>(truns.runs);
  c.pf.walk.seg_delta =
      truns.runs > 1 ? line_of(row0 + truns.start[1] * static_cast<int64_t>(esize)) - c.next_seg0 : 0;
  c.pf.walk.ld = static_cast<size_t>(call.b.ld) * esize;
  const int64_t total = target.rows * truns.runs * c.pf.walk.seg_lines;
  // Shared out over this chunk's strips (its own runs and vectors).
  const int64_t vectors = runs.runs * vectors_per_run;
  c.ahead_per_vector = (total + vectors - 1) / vectors;
  c.steps = kind == Direct::kF32 ? kc : (kc + 1) / 2;
  c.pf.per_step = 1;  // nonzero: ForStrip sizes it per strip
  return c;
}

// MicroF32Direct in the tile shape (mr, nv) on one source kind. Returns
// whether a raw fp8 kernel met a NaN code.
template <RowSrc kSrc>
bool RunDirectF32(int64_t mr, int64_t nv, size_t kc, const float* ap, const uint8_t* src,
                  size_t ldb, float* c, size_t ldc, bool load_c, const float* row_scale,
                  float post, const DirectPrefetch& pf) {
  // The tiles DirectF32ShapeFor gives and, where a run has fewer vectors
  // left than the tile's NV, the kNV-wide strips DirectF32StripWidth falls
  // back to.
  switch (mr * 16 + nv) {
    case 1 * 16 + 8:
      return MicroF32Direct<1, 8, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
    case 1 * 16 + 2:
      return MicroF32Direct<1, 2, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
    case 2 * 16 + 4:
      return MicroF32Direct<2, 4, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
    case 2 * 16 + 2:
      return MicroF32Direct<2, 2, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
    case 4 * 16 + 2:
      return MicroF32Direct<4, 2, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
#if HWY_TARGET <= HWY_AVX3
    case 4 * 16 + 4:
      return MicroF32Direct<4, 4, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
    default:
      FP8MOE_DCHECK(mr == 8 && nv == 2);
      return MicroF32Direct<8, 2, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
#else
    default:
      FP8MOE_DCHECK(mr == 8 && nv == 1);
      return MicroF32Direct<8, 1, kSrc>(kc, ap, src, ldb, c, ldc, load_c, row_scale, post, pf);
#endif
  }
}

// The strip widths (in vectors) an f32 direct item of tile shape s uses: s.nv
// while it fits in what is left of a run, then kNV (runs hold whole NR
// panels, so what is left is a multiple of kNV).
inline int64_t DirectF32StripWidth(const DirectF32Shape& s, int64_t vectors_left) {
  return vectors_left >= s.nv ? s.nv : static_cast<int64_t>(kNV);
}

// The pair direct kernels' tile for an item of `rows` rows: MR rows x NB
// blocks of 32 columns, about 8 accumulators (PermutedTile says why); a strip
// where NB blocks do not fit in what is left of a run takes 1.
struct DirectPairsShape {
  int64_t mr, nb;
};
inline DirectPairsShape DirectPairsShapeFor(int64_t rows) {
  if (rows <= 1) return {1, 4};
  if (rows <= 2) return {2, 2};
  if (rows <= 4) return {4, 1};
  if (rows <= 8) return {8, 1};
  return {static_cast<int64_t>(kMR), 1};
}

// The strip width (in vectors) of a pair direct item of tile shape s: nb
// blocks while they fit in what is left of a run, else one (runs hold whole
// NR = kNV-vector panels).
inline int64_t DirectPairsStripWidth(const DirectPairsShape& s, int64_t vectors_left) {
  const int64_t nb_vectors = s.nb * static_cast<int64_t>(kNV);
  return vectors_left >= nb_vectors ? nb_vectors : static_cast<int64_t>(kNV);
}

#if HWY_TARGET == HWY_AVX3
template <size_t MR, size_t NB>
void RunDirectPairsT(const internal::Source& b, size_t kc, const uint32_t* ap, const uint8_t* src,
                     size_t ldb, float* c, size_t ldc, bool load_c, const float* row_scale,
                     bool last, const DirectPrefetch& pf) {
  if (b.kind == internal::SrcKind::kBf16) {
    return MicroBf16PairsDirect<MR, NB, DirectSrc::kBf16>(kc, ap, src, ldb, c, ldc, load_c,
                                                          row_scale, last, pf);
  }
  if constexpr (MR <= 8) {  // byte-table decode; up to 8 rows leave room for the tables
    if (CpuHasAvx512Vbmi()) {
      if (b.fp8 == Fp8Format::kE4M3FN) {
        return MicroFp8PairsVbmi<MR, NB, Fp8Format::kE4M3FN>(kc, ap, src, ldb, c, ldc, load_c,
                                                             row_scale, last, pf);
      }
      return MicroFp8PairsVbmi<MR, NB, Fp8Format::kE4M3FNUZ>(kc, ap, src, ldb, c, ldc, load_c,
                                                             row_scale, last, pf);
    }
  }
  if (b.fp8 == Fp8Format::kE4M3FN) {
    return MicroBf16PairsDirect<MR, NB, DirectSrc::kE4M3FN>(kc, ap, src, ldb, c, ldc, load_c,
                                                            row_scale, last, pf);
  }
  return MicroBf16PairsDirect<MR, NB, DirectSrc::kE4M3FNUZ>(kc, ap, src, ldb, c, ldc, load_c,
                                                            row_scale, last, pf);
}

// Calls f(MR, NB) with the tile (mr, nb) as integral constants: a
// DirectPairsShape, or nb 1 (a one-block strip). The one list of the tiles
// the pair and the int8 direct kernels are instantiated for.
template <class F>
HWY_INLINE void WithDirectPairsTile(int64_t mr, int64_t nb, const F& f) {
  using std::integral_constant;
  switch (mr * 16 + nb) {
    case 1 * 16 + 4: return f(integral_constant<size_t, 1>{}, integral_constant<size_t, 4>{});
    case 1 * 16 + 1: return f(integral_constant<size_t, 1>{}, integral_constant<size_t, 1>{});
    case 2 * 16 + 2: return f(integral_constant<size_t, 2>{}, integral_constant<size_t, 2>{});
    case 2 * 16 + 1: return f(integral_constant<size_t, 2>{}, integral_constant<size_t, 1>{});
    case 4 * 16 + 1: return f(integral_constant<size_t, 4>{}, integral_constant<size_t, 1>{});
    case 8 * 16 + 1: return f(integral_constant<size_t, 8>{}, integral_constant<size_t, 1>{});
    default:
      FP8MOE_DCHECK(mr == static_cast<int64_t>(kMR) && nb == 1);
      return f(integral_constant<size_t, kMR>{}, integral_constant<size_t, 1>{});
  }
}
#endif

// Sets to NaN the columns [0, width) of a C tile [rows x width] at c (ldc)
// whose fp8 codes in rows [0, kc) at src (ldb bytes apart) hold a NaN code:
// what the exact decode gives (NaN times anything is NaN, and stays NaN
// through every later chunk and the epilogue) where the raw decode saw a
// finite number. Rare: runs only when the kernel reported a NaN code.
inline void SetNaNColumns(bool fnuz, const uint8_t* src, size_t ldb, int64_t kc, int64_t width,
                          float* c, size_t ldc, int64_t rows) {
  for (int64_t j = 0; j < width; ++j) {
    bool nan = false;
    for (int64_t k = 0; k < kc && !nan; ++k) {
      const uint8_t q = src[static_cast<size_t>(k) * ldb + static_cast<size_t>(j)];
      nan = fnuz ? q == 0x80 : (q & 0x7F) == 0x7F;
    }
    if (!nan) continue;
    for (int64_t i = 0; i < rows; ++i) c[static_cast<size_t>(i) * ldc + static_cast<size_t>(j)] = NAN;
  }
}

// One direct kernel call: the C tile [mr x width vectors] at c (ldc) (+)=
// the A panel (kc reduction steps) x the weight rows [r0, r0 + kc) of
// columns [src_col, src_col + width * N) of group it.group. post: see
// MicroF32Direct. last: the item's last chunk (the pair kernels put C back in
// natural column order). rows: the tile's valid rows (NaN columns).
inline void RunDirectTile(const GemmCall& call, Direct kind, const WorkItem& it, int64_t mr,
                          int64_t width, int64_t r0, int64_t kc, int64_t src_col,
                          const uint8_t* apan, void* c, int64_t ldc, bool load_c,
                          const float* row_scale, float post, bool last, int64_t rows,
                          const DirectPrefetch& pf) {
  const int64_t esize = static_cast<int64_t>(call.b.ElementBytes());
  const uint8_t* src = static_cast<const uint8_t*>(call.b.data) +
                       (it.group * call.b.group_stride + r0 * call.b.ld + src_col) * esize;
  const size_t ldb = static_cast<size_t>(call.b.ld * esize);
  const size_t ukc = static_cast<size_t>(kc), uldc = static_cast<size_t>(ldc);
  float* cf = static_cast<float*>(c);
  if (kind == Direct::kF32) {
    const float* ap = reinterpret_cast<const float*>(apan);
#if HWY_TARGET > HWY_AVX3
    if (mr == 8) {
      // One vector per call (8 x 1, 8 accumulators) over the kNV-wide strip;
      // the first call pulls the prefetch.
      const size_t lanes = hn::Lanes(hn::ScalableTag<float>());
      for (int64_t h = 0; h < width; ++h) {
        DirectPrefetch one = pf;
        if (h != 0) one.per_step = 0;
        const size_t off = static_cast<size_t>(h) * lanes;
        bool nan = false;
        switch (call.b.kind) {
          case internal::SrcKind::kF32:
            RunDirectF32<RowSrc::kF32>(8, 1, ukc, ap, src + off * 4, ldb, cf + off, uldc, load_c, row_scale, post, one);
            break;
          case internal::SrcKind::kBf16:
            RunDirectF32<RowSrc::kBf16>(8, 1, ukc, ap, src + off * 2, ldb, cf + off, uldc, load_c, row_scale, post, one);
            break;
          default:
            nan = call.b.fp8 == Fp8Format::kE4M3FN
                      ? RunDirectF32<RowSrc::kRawE4M3FN>(8, 1, ukc, ap, src + off, ldb, cf + off, uldc, load_c, row_scale, post, one)
                      : RunDirectF32<RowSrc::kRawE4M3FNUZ>(8, 1, ukc, ap, src + off, ldb, cf + off, uldc, load_c, row_scale, post, one);
            if (nan) {
              SetNaNColumns(call.b.fp8 == Fp8Format::kE4M3FNUZ, src + off, ldb, kc,
                            static_cast<int64_t>(lanes), cf + off, uldc, rows);
            }
            break;
        }
      }
      return;
    }
#endif
    const int64_t nv = width;
    switch (call.b.kind) {
      case internal::SrcKind::kF32:
        RunDirectF32<RowSrc::kF32>(mr, nv, ukc, ap, src, ldb, cf, uldc, load_c, row_scale, post, pf);
        return;
      case internal::SrcKind::kBf16:
        RunDirectF32<RowSrc::kBf16>(mr, nv, ukc, ap, src, ldb, cf, uldc, load_c, row_scale, post, pf);
        return;
      default:
        break;
    }
    const bool fnuz = call.b.fp8 == Fp8Format::kE4M3FNUZ;
    const bool nan =
        fnuz ? RunDirectF32<RowSrc::kRawE4M3FNUZ>(mr, nv, ukc, ap, src, ldb, cf, uldc, load_c, row_scale, post, pf)
             : RunDirectF32<RowSrc::kRawE4M3FN>(mr, nv, ukc, ap, src, ldb, cf, uldc, load_c, row_scale, post, pf);
    if (nan) {
      SetNaNColumns(fnuz, src, ldb, kc, nv * static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>())),
                    cf, uldc, rows);
    }
    return;
  }
#if HWY_TARGET == HWY_AVX3
  const uint32_t* ap = reinterpret_cast<const uint32_t*>(apan);
  const int64_t nb = width / static_cast<int64_t>(kNV);  // blocks of 32 columns
  if (kind == Direct::kPairs) {
    return WithDirectPairsTile(mr, nb, [&](auto MR, auto NB) {
      RunDirectPairsT<decltype(MR)::value, decltype(NB)::value>(call.b, ukc, ap, src, ldb, cf,
                                                                uldc, load_c, row_scale, last, pf);
    });
  }
  int32_t* ci = static_cast<int32_t*>(c);
  return WithDirectPairsTile(mr, nb, [&](auto MR, auto NB) {
    MicroI8PairsDirectVnni<decltype(MR)::value, decltype(NB)::value>(ukc, ap, src, ldb, ci, uldc,
                                                                      load_c, last, pf);
  });
#else
  (void)last, (void)post;  // kPairs and kInt8 exist on AVX3 only (ChooseDirect)
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
