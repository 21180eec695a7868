// Runs a planned GemmCall (gemm_call.h) on one SIMD target: threads over
// work items, BLIS-style blocking inside an item, the direct path for items
// of few rows (direct-inl.h), the packed path otherwise (pack-inl.h,
// packed-inl.h), and the epilogues (epilogue-inl.h).
//
// Inside a packed item (rows x cols of output, reduction R):
//   for each reduction block of kc:         pack B [kc x cols]   (L2 / L3)
//     for each block of kMC rows:           pack A [kMC x kc]    (L2)
//       for each NR panel of B:             B micro-panel        (L1)
//         for each MR panel of A:           microkernel -> C tile
// A is packed once per (row block, reduction block) and reused over all the
// item's columns; B once per reduction block and reused over all its rows.
// Tall forward and dLHS items whose whole B fits run in row-block order
// instead (RunPackedRowBlocks): B packed for the whole reduction first, then
// per block of kMC rows every reduction block and the block's epilogue.
// A direct item skips packing B: its kernels read the weight rows in place.
//
// Work items never share an output element and each sums its reduction in
// one fixed order, so the bits do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "base/check.h"
#include "base/scratch_arena.h"
#include "fp8moe/context.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/kernel_path.h"
#include "kernels/cpu/pack.h"
#include "quant/quant_internal.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/gemm_exec.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/direct-inl.h"
#include "kernels/cpu/epilogue-inl.h"
#include "kernels/cpu/microkernels-inl.h"
#include "kernels/cpu/pack-inl.h"
#include "kernels/cpu/packed-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

using internal::Epilogue;
using internal::GemmCall;
using internal::KernelPath;
using internal::Operand;
using internal::PackScratch;
using internal::PanelBytes;
using internal::PanelKind;
using internal::RegionOfA;
using internal::RegionOfB;
using internal::Pass;
using internal::ScratchArena;
using internal::WorkerSlot;
using internal::WorkItem;

constexpr int64_t kMC = 96;  // rows per packed A block
// The tallest A panel: the packed kernels' MR or the direct f32 kernel's 8.
constexpr int64_t kMaxMR = static_cast<int64_t>(kMR) > kDirectF32Rows
                               ? static_cast<int64_t>(kMR)
                               : kDirectF32Rows;
// A tile at the edge of an f32 output runs on a local copy this large.
constexpr int64_t kEdgeRows = 16, kEdgeCols = 128;

static_assert(kMC % static_cast<int64_t>(kMR) == 0 && kMC % kDirectF32Rows == 0,
              "row blocks hold whole A panels, so a block never writes C rows past "
              "RoundUp(rows, MR)");
static_assert(kMaxMR <= kEdgeRows, "an MR-tall tile fits the edge copy");
static_assert(hn::MaxLanes(hn::ScalableTag<float>()) * kNV <= static_cast<size_t>(kEdgeCols),
              "an NR-wide tile fits the edge copy and the per-panel scale arrays");
static_assert(hn::MaxLanes(hn::ScalableTag<float>()) * kMaxDirectNV <= static_cast<size_t>(kEdgeCols),
              "the widest direct strip fits the edge copy");

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Row-block order (RunPackedRowBlocks) for packed forward and dLHS items
// taller than kRowBlockMinRows whose B, packed for the whole reduction,
// takes at most kRowBlockBBytes. B is then packed once per item instead of
// once per 512 rows. Measured on Zen 5 (one process alternating both 8
// times, best of each; docs/kernels.md), the planner's whole 2048-row groups
// in row-block order against 512-row items in chunk order: train-fill wi and
// wo forward 0.95-0.97 of the time with bf16 pairs (AVX3_SPR), native dLHS
// from codes 0.94-0.95; wo (a 4 MiB B in f32 panels) 0.96-0.99 on AVX3 and
// AVX2. Against that: f32 panels of wi's 8 MiB B measured 1.03-1.09 (B no
// longer stays in the caches between row blocks), and fine-grained's
// 256-row groups, whose chunk order packs B once already, 1.05; hence both
// limits.
constexpr size_t kRowBlockBBytes = size_t{4} << 20;
constexpr int64_t kRowBlockMinRows = 512;

// The row stride of the C scratch tile for `cols` columns: the smallest odd
// multiple of 64 floats (256 bytes) that holds them. Rows a multiple of 4 KiB
// apart (2048 columns: SwiGLU's gate and up halves of a 1024-column item)
// put a register tile's 12 rows in the same few L1 sets, where they evict
// each other and the B panel; an odd multiple of 256 bytes spreads 16
// consecutive rows over distinct 256-byte offsets of a page. Measured (Zen 5,
// one process alternating both 8-12 times, or two builds 6-8 times):
// train-fill wi forward 0.96-0.98 of the time (f32 on AVX3, bf16 on AVX3_SPR),
// its dLHS from fp8 codes on AVX3_SPR 0.95-0.96.
// C written straight into an f32 output (kAccumulateF32) keeps the output's
// stride: a padded scratch tile copied out at the end measured 0.99-1.03
// there (train-fill wo forward, train-fill wi TGMM), so it was not taken.
int64_t ScratchLdc(int64_t cols) {
  const int64_t blocks = (cols + 63) / 64;
  return (blocks | 1) * 64;
}

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
  if (UseBf16Pairs() && bf16_exact(call.a) && bf16_exact(call.b)) {
    return PanelKind::kBf16Pairs;
  }
  return PanelKind::kF32;
}

// ---- Buffers ---------------------------------------------------------------

// Bytes of B packed for a whole reduction of red_len over `cols` output
// columns: one PanelBytes block per reduction step.
size_t WholeBBytes(const GemmCall& call, PanelKind kind, int64_t cols, int64_t red_len) {
  const int64_t step = std::max(call.ReductionStep(), call.max_reduction_step);
  const int64_t runs = call.epi.kind == Epilogue::Kind::kSwiGlu ? 2 : 1;
  const int64_t chunks = std::max<int64_t>((red_len + step - 1) / step, 1);
  return static_cast<size_t>(chunks * runs) *
         PanelBytes(kind, cols, static_cast<int64_t>(KernelNR()), step);
}

// Whether packed items of this call with up to `cols` columns and a
// reduction of red_len may run in row-block order (TGMM keeps the chunk
// order: its per-group column scale is applied to the whole item's C).
bool RowBlockFits(const GemmCall& call, PanelKind kind, int64_t cols, int64_t red_len) {
  return internal::RowBlockOrderOn() && call.pass != Pass::kTgmm &&
         WholeBBytes(call, kind, cols, red_len) <= kRowBlockBBytes;
}

// Per target: RowBlockFits with the panel kind this target picks.
bool RowBlockFitsT(const GemmCall& call, int64_t cols, int64_t red_len) {
  return RowBlockFits(call, ChooseKind(call), cols, red_len);
}

// What one call's workers need, from the one rule (PanelBytes) for packed
// panels; RunItem checks every pack and tile against these sizes.
struct WorkerSizes {
  int64_t kc = 0;         // the longest reduction block a pack covers
  size_t ap = 0, bp = 0;  // packed A block, packed B panels
  size_t c = 0;           // C scratch tile (0: C lives in the f32 output)
  size_t epilogue = 0;    // epilogue rows
  int64_t pack_width = 0;  // longest row a packer converts
  size_t pack = 0;
  size_t codes = 0;  // an item's (or row block's) activation codes (LhsQuantPlan)
  // Packed items taller than kRowBlockMinRows run in row-block order
  // (RunPackedRowBlocks): bp holds B for a whole reduction.
  bool row_blocks = false;
};

WorkerSizes SizeWorkers(const GemmCall& call, PanelKind kind) {
  WorkerSizes s;
  const int64_t nr = static_cast<int64_t>(KernelNR());
  s.kc = std::max(call.ReductionStep(), call.max_reduction_step);
  int64_t max_rows = call.max_item_rows, max_cols = call.max_item_cols;
  for (const WorkItem& it : call.items) {
    max_rows = std::max(max_rows, it.rows);
    max_cols = std::max(max_cols, it.cols);
  }
  const int64_t runs = call.epi.kind == Epilogue::Kind::kSwiGlu ? 2 : 1;
  // C row stride (>= the columns; ScratchLdc is monotone, so every item's
  // stride fits).
  const int64_t width = ScratchLdc(runs * RoundUp(max_cols, nr));
  s.ap = std::max(PanelBytes(kind, kMC, static_cast<int64_t>(kMR), s.kc),
                  PanelBytes(kind, kDirectF32Rows, kDirectF32Rows, s.kc));
  const size_t chunk = static_cast<size_t>(runs) * PanelBytes(kind, max_cols, nr, s.kc);
  int64_t max_red = 0;
  for (const WorkItem& it : call.items) max_red = std::max(max_red, it.red_len);
  // Sized for row-block order wherever it may run, whatever the item rows
  // (which follow the routing), so that a later call's routing never grows
  // the buffers.
  s.row_blocks = RowBlockFits(call, kind, max_cols, max_red);
  s.bp = s.row_blocks ? WholeBBytes(call, kind, max_cols, max_red) : chunk;
  if (call.epi.kind != Epilogue::Kind::kAccumulateF32) {
    // Rows of C in the scratch: a direct item's tile (at most kMaxMR), a
    // chunk-order item's rows, or a row block.
    const int64_t chunk_rows = s.row_blocks ? std::min(max_rows, kRowBlockMinRows) : max_rows;
    const int64_t rows = std::max(RoundUp(chunk_rows, static_cast<int64_t>(kMR)),
                                  RoundUp(std::min(max_rows, kMaxMR), kDirectF32Rows));
    s.c = static_cast<size_t>(rows * width) * 4;
    s.epilogue = static_cast<size_t>(EpilogueFloats(max_cols)) * sizeof(float);
  }
  if (call.lhs_quant != nullptr) {
    // The rows one quantization covers: a chunk-order or direct item's, or
    // a row block's (at most kRowBlockMinRows either way in row-block order).
    const int64_t rows = s.row_blocks ? std::min(max_rows, kRowBlockMinRows) : max_rows;
    s.codes = static_cast<size_t>(std::max<int64_t>(rows * call.lhs_quant->k, 1)) *
              call.lhs_quant->BufferElementBytes();
  }
  s.pack_width = std::max({s.kc + 1, kMC, RoundUp(max_cols, nr)});
  s.pack = PackScratch::Bytes(s.pack_width, s.kc);
  return s;
}

// One worker thread's buffers for a call.
struct Worker {
  const WorkerSizes* sizes = nullptr;
  uint8_t* ap = nullptr;
  uint8_t* bp = nullptr;
  uint8_t* c = nullptr;
  float* epilogue = nullptr;
  uint8_t* codes = nullptr;
  PackScratch pack;

  // From the context's worker slots; false if the memory is not there.
  bool Get(ScratchArena& arena, int thread, const WorkerSizes& s) {
    sizes = &s;
    ap = arena.Worker(thread, WorkerSlot::kPackA, s.ap);
    bp = arena.Worker(thread, WorkerSlot::kPackB, s.bp);
    uint8_t* rows = arena.Worker(thread, WorkerSlot::kPackRows, s.pack);
    if (s.c > 0) {
      c = arena.Worker(thread, WorkerSlot::kTileC, s.c);
      epilogue = reinterpret_cast<float*>(arena.Worker(thread, WorkerSlot::kEpilogue, s.epilogue));
    }
    if (s.codes > 0) codes = arena.Worker(thread, WorkerSlot::kLhsCodes, s.codes);
    if (ap == nullptr || bp == nullptr || rows == nullptr ||
        (s.c > 0 && (c == nullptr || epilogue == nullptr)) || (s.codes > 0 && codes == nullptr)) {
      return false;
    }
    pack.Carve(rows, s.pack_width, s.kc);
    return true;
  }
};

// ---- One item --------------------------------------------------------------

// How one item runs: its kernels, panel shapes, and where its C tile lives.
struct ItemPlan {
  PanelKind kind;
  Direct direct;
  int64_t nr, mr;
  internal::ColumnRuns runs;  // SwiGLU: the gate and up column runs
  int64_t per_run;            // B panels per run
  DirectF32Shape f32_shape;   // the f32 direct kernel's tile (Direct::kF32)
  DirectPairsShape pairs_shape;  // the pair direct kernels' tile (kPairs, kInt8)
  bool raw_fp8;               // the f32 direct kernel decodes fp8 raw
  int64_t run_stride;         // C columns per run (whole panels)
  bool c_in_output;           // C is the f32 output itself (else scratch)
  uint8_t* c;
  int64_t ldc;
  int64_t kc_step;  // reduction rows per chunk
  internal::Source a;  // A: the call's, or the item's activation codes
};

ItemPlan PlanItem(const GemmCall& call, PanelKind kind, const WorkItem& it, const Worker& w) {
  ItemPlan ip;
  ip.kind = kind;
  ip.a = call.a;
  ip.nr = static_cast<int64_t>(KernelNR());
  ip.direct = ChooseDirect(call, kind, it, ip.nr);
  // A panel as tall as the item's direct tile: the f32 direct kernel's rows
  // (DirectF32Shape), the pair and int8 direct kernels' (DirectPairsShape);
  // packed items take the microkernel's MR.
  ip.f32_shape = DirectF32ShapeFor(it.rows, static_cast<int64_t>(call.b.ElementBytes()));
  ip.pairs_shape = DirectPairsShapeFor(it.rows);
  ip.raw_fp8 = ip.direct == Direct::kF32 && RawFp8(call);
  ip.mr = ip.direct == Direct::kF32                                   ? ip.f32_shape.mr
          : ip.direct != Direct::kNone ? ip.pairs_shape.mr  // kPairs, kInt8
                                       : static_cast<int64_t>(kMR);
  ip.runs.count = it.cols;
  ip.runs.start[0] = it.col0;
  if (call.epi.kind == Epilogue::Kind::kSwiGlu) {
    ip.runs.runs = 2;
    ip.runs.start[1] = call.epi.half + it.col0;
  }
  ip.per_run = (it.cols + ip.nr - 1) / ip.nr;
  ip.run_stride = ip.per_run * ip.nr;
  // C straight in an f32 output when nothing else must happen to it, else
  // the worker's scratch tile, finished by the epilogue.
  ip.c_in_output = call.epi.kind == Epilogue::Kind::kAccumulateF32;
  if (ip.c_in_output) {
    float* out = static_cast<float*>(call.epi.out) + it.group * call.out_group_stride;
    ip.c = reinterpret_cast<uint8_t*>(out + it.row0 * call.epi.out_ld + it.col0);
    ip.ldc = call.epi.out_ld;
  } else {
    ip.c = w.c;
    ip.ldc = ScratchLdc(ip.run_stride * ip.runs.runs);
  }
  ip.kc_step = call.ReductionStep();
  if (ip.direct != Direct::kNone) {
    ip.kc_step = DirectChunkRows(call, it, ip.runs.runs, ip.kc_step);
  }
  FP8MOE_DCHECK(ip.kc_step <= w.sizes->kc && ip.mr <= kMaxMR && ip.nr <= kEdgeCols);
  return ip;
}

// LhsQuantPlan: quantizes the activation rows [row0, row0 + rows) into the
// worker's buffer, writes their scales, and points the item's A there: a
// packed fp8 item's as the bf16 values of the codes (A packed as bf16, no
// decode; the products are the same, as every fp8 value is a bf16 value),
// a direct item's (its kernel decodes A raw with B, RawFp8) and int8's as
// the codes.
bool PacksLhsValues(const GemmCall& call, const ItemPlan& ip) {
  return call.lhs_quant != nullptr && call.lhs_quant->dtype != QuantDType::kInt8 &&
         ip.direct == Direct::kNone;
}

void QuantizeRowsForItem(const GemmCall& call, int64_t row0, int64_t rows, Worker& w,
                         ItemPlan& ip) {
  const internal::LhsQuantPlan& q = *call.lhs_quant;
  const bool values = PacksLhsValues(call, ip);
  FP8MOE_DCHECK(static_cast<size_t>(rows * q.k) * (values ? 2 : 1) <= w.sizes->codes);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = row0 + i;
    float* scales = q.scales + r * q.blocks;
    if (values) {
      uint16_t* v = reinterpret_cast<uint16_t*>(w.codes) + i * q.k;
      if (q.bf16) {
        internal::QuantizeOneRowValues(static_cast<const uint16_t*>(q.x) + r * q.k, q.k,
                                       q.block, q.dtype, q.calib, v, scales);
      } else {
        internal::QuantizeOneRowValues(static_cast<const float*>(q.x) + r * q.k, q.k, q.block,
                                       q.dtype, q.calib, v, scales);
      }
      continue;
    }
    uint8_t* codes = w.codes + i * q.k;
    if (q.bf16) {
      internal::QuantizeOneRowBf16(static_cast<const uint16_t*>(q.x) + r * q.k, q.k, q.block,
                                   q.dtype, q.calib, codes, scales);
    } else {
      internal::QuantizeOneRow(static_cast<const float*>(q.x) + r * q.k, q.k, q.block, q.dtype,
                               q.calib, codes, scales);
    }
  }
  ip.a.kind = values ? internal::SrcKind::kBf16 : call.a.kind;
  ip.a.data = w.codes;
  ip.a.first_row = row0;
}

// An item (or row block) that reduces nothing has a zero tile: its rows of
// C from c.
void ZeroTile(const ItemPlan& ip, const WorkItem& it, uint8_t* c) {
  const int64_t cols = ip.c_in_output ? it.cols : ip.ldc;
  for (int64_t i = 0; i < it.rows; ++i) {
    std::memset(c + i * ip.ldc * 4, 0, static_cast<size_t>(cols) * 4);
  }
}

// Native fp8 with K-blocks: the activation scales of a tile's rows for the
// block at r0 (rows past the item get 0); else nullptr.
const float* TileRowScale(const GemmCall& call, const WorkItem& it, int64_t r0, int64_t row,
                          int64_t mr, int64_t valid_r, float* rs) {
  if (call.a_block_scale == nullptr) return nullptr;
  const int64_t b = r0 / call.block;
  for (int64_t ii = 0; ii < mr; ++ii) {
    rs[ii] = ii < valid_r ? call.a_block_scale[(it.row0 + row + ii) * call.a_block_scale_ld + b]
                          : 0.0f;
  }
  return rs;
}

// TGMM with per-tile gradient scales: the scales of a tile's columns for the
// quantization tile at r0 (columns past the item get 0); else nullptr.
const float* TileColScale(const GemmCall& call, const WorkItem& it, int64_t r0, int64_t jq,
                          int64_t nr, int64_t valid_c, float* cs) {
  if (call.b_col_scale == nullptr || call.b_block == 0) return nullptr;
  const float* src = call.b_col_scale + call.b_row_tile[r0] * call.b_col_scale_ld + it.col0 + jq;
  for (int64_t jj = 0; jj < nr; ++jj) cs[jj] = jj < valid_c ? src[jj] : 0.0f;
  return cs;
}

// Runs kernel(c, ldc) on the C tile [mr x nr] at c: in place where the
// whole tile is writable (the scratch tile has room for whole panels, and
// inside an f32 output), on a copy of its valid part at an output's edge.
template <class Kernel>
HWY_INLINE void OnTile(uint8_t* c, int64_t ldc, int64_t valid_r, int64_t valid_c, bool writable,
                       int64_t mr, int64_t nr, const Kernel& kernel) {
  if (writable || (valid_r == mr && valid_c == nr)) return kernel(c, ldc);
  FP8MOE_DCHECK(mr <= kEdgeRows && nr <= kEdgeCols);
  alignas(64) uint8_t edge[kEdgeRows * kEdgeCols * 4];
  const size_t bytes = static_cast<size_t>(valid_c) * 4;
  for (int64_t i = 0; i < valid_r; ++i) std::memcpy(edge + i * nr * 4, c + i * ldc * 4, bytes);
  kernel(edge, nr);
  for (int64_t i = 0; i < valid_r; ++i) std::memcpy(c + i * ldc * 4, edge + i * nr * 4, bytes);
}

// The direct path's reduction chunk [r0, r0 + kc): pack the item's one A
// panel (direct items have at most MR rows) and run the kernels strip by
// strip over every run's columns, straight from the weight.
// `following`: the next item this thread runs when it is known and direct
// (with its plan), whose first chunk the last chunk prefetches; else null.
void RunDirectChunk(const GemmCall& call, const WorkItem& it, const ItemPlan& ip, int64_t r0,
                    int64_t kc, Worker& w, const WorkItem* following,
                    const ItemPlan* following_plan) {
  FP8MOE_DCHECK(it.rows <= ip.mr && PanelBytes(ip.kind, it.rows, ip.mr, kc) <= w.sizes->ap);
  const bool load_c = r0 != it.red0;
  const bool last = r0 + kc >= it.red0 + it.red_len;
  const Operand opa{&ip.a, it.group, call.pass == Pass::kTgmm};
  PackAT(opa, ip.kind, it.row0, it.rows, r0, kc, ip.mr, w.ap, w.pack);
  float post = 1.0f;
  if (ip.raw_fp8) {  // the raw decode's domain: A * 2^113, products * 2^-7
    const float scale = RawFp8PanelScale(call.b.fp8 == Fp8Format::kE4M3FNUZ);
    float* a = reinterpret_cast<float*>(w.ap);
    for (int64_t i = 0; i < ip.mr * kc; ++i) a[i] *= scale;
    post = call.a_block_scale != nullptr || last ? kRawFp8Post : 1.0f;
  }
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  const int64_t vectors_per_run = ip.per_run * static_cast<int64_t>(kNV);
  const PrefetchTarget target = ChunkPrefetchTarget(
      it, ip.runs, r0, kc, ip.kc_step, following,
      following_plan != nullptr ? &following_plan->runs : nullptr,
      following_plan != nullptr ? following_plan->kc_step : 0);
  const ChunkPrefetch prefetch =
      PlanChunkPrefetch(call, ip.direct, it, ip.runs, vectors_per_run, r0, kc, target);
  alignas(64) float rs[kEdgeRows];
  const float* row_scale = TileRowScale(call, it, r0, 0, ip.mr, it.rows, rs);
  for (int run = 0; run < ip.runs.runs; ++run) {
    int64_t width = 0;
    for (int64_t v = 0; v < vectors_per_run; v += width) {
      width = ip.direct == Direct::kF32     ? DirectF32StripWidth(ip.f32_shape, vectors_per_run - v)
              : DirectPairsStripWidth(ip.pairs_shape, vectors_per_run - v);  // kPairs, kInt8
      const int64_t col = run * ip.run_stride + v * lanes;  // column in C
      const int64_t valid_c = std::min(width * lanes, it.cols - v * lanes);
      FP8MOE_DCHECK(ip.c_in_output ||
                    static_cast<size_t>(((ip.mr - 1) * ip.ldc + col + width * lanes) * 4) <=
                        w.sizes->c);
      OnTile(ip.c + col * 4, ip.ldc, it.rows, valid_c, !ip.c_in_output, ip.mr, width * lanes,
             [&](void* c, int64_t ldc) {
               RunDirectTile(call, ip.direct, it, ip.mr, width, r0, kc, ip.runs.start[run] + v * lanes,
                             w.ap, c, ldc, load_c, row_scale, post, last, it.rows,
                             prefetch.ForStrip(run * vectors_per_run + v, width));
             });
    }
  }
}

// Prefetches a C tile of `rows` rows of `cols` f32 (ldc apart) for writing.
HWY_INLINE void PrefetchTileC(const uint8_t* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    internal::PrefetchLines</*kRw=*/1>(c + i * ldc * 4, static_cast<size_t>(cols) * 4);
  }
}

// The source of the packs that follow a block's tiles (the next A block,
// and at the end of a reduction chunk the next chunk's B), prefetched a few
// source rows per register tile while the tiles run: spread over the block's
// ~100-300 tile calls, the lines arrive in L1/L2 before the packer asks for
// them, at a few GB/s, without a burst of misses that would stall the
// microkernel's own loads. Without it the packers wait on their loads:
// perf put 90% of the bf16-to-f32 row conversion's samples on its load in
// TGMM (AVX3), 9% of the call, for short row pieces (96 values of A, a row
// of x apart) that the hardware prefetchers do not follow far enough ahead.
class PackPrefetch {
 public:
  static constexpr int kMaxRegions = 3;  // A, and B's two SwiGLU runs
  // Spreads the regions added before the first Step over `calls` steps.
  explicit PackPrefetch(int64_t calls) : calls_(std::max<int64_t>(calls, 1)) {}

  void Add(const RowReader* rd, const internal::SourceRegion& r) {
    if (!internal::PackPrefetchOn() || r.r_end <= r.r_begin || r.n <= 0) return;
    FP8MOE_DCHECK(count_ < kMaxRegions);
    regions_[count_++] = {rd, r, r.r_begin, (r.r_end - r.r_begin + calls_ - 1) / calls_};
  }

  // One register tile's share.
  HWY_INLINE void Step() {
    for (int i = 0; i < count_; ++i) {
      Region& g = regions_[i];
      const int64_t end = std::min(g.next + g.per_step, g.src.r_end);
      for (; g.next < end; ++g.next) g.rd->Prefetch(g.next, g.src.c0, g.src.n);
    }
  }

 private:
  struct Region {
    const RowReader* rd;
    internal::SourceRegion src;
    int64_t next, per_step;
  };
  int64_t calls_;
  int count_ = 0;
  Region regions_[kMaxRegions];
};

// The register tiles of one block of rows [m0, m0 + mc) of a packed item
// over the reduction chunk [r0, r0 + kc): every (B panel, A panel) pair, A
// packed at w.ap, B's panels_b panels at bp, C rows from `cblock` (the C of
// the block's first row).
void RunBlockTiles(const GemmCall& call, const WorkItem& it, const ItemPlan& ip, int64_t r0,
                   int64_t kc, int64_t m0, int64_t mc, const uint8_t* bp, int64_t panels_b,
                   uint8_t* cblock, const Worker& w, PackPrefetch& ahead) {
  const bool load_c = r0 != it.red0;
  const size_t bstride = PanelBytes(ip.kind, 1, ip.nr, kc);
  const size_t astride = PanelBytes(ip.kind, 1, ip.mr, kc);
  alignas(64) float rs[kEdgeRows];
  alignas(64) float cs[kEdgeCols];
  const int64_t panels_a = (mc + ip.mr - 1) / ip.mr;
  for (int64_t q = 0; q < panels_b; ++q) {
    const int64_t jq = (q % ip.per_run) * ip.nr;                 // column in the run
    const int64_t col = (q / ip.per_run) * ip.run_stride + jq;  // column in C
    const int64_t valid_c = std::min(ip.nr, it.cols - jq);
    const uint8_t* bpan = bp + q * bstride;
    for (int64_t p = 0; p < panels_a; ++p) {
      const int64_t row = m0 + p * ip.mr;  // in the item
      const int64_t valid_r = std::min(ip.mr, it.rows - row);
      const uint8_t* apan = w.ap + p * astride;
      uint8_t* c = cblock + (p * ip.mr * ip.ldc + col) * 4;
      // The tile below this one in the same columns is the next call's C:
      // rows ldc apart that were last touched a whole sweep of the block
      // ago, and the kernel's first FMA waits on their loads. Fetching them
      // one call early hides that.
      if (p + 1 < panels_a) {
        PrefetchTileC(c + ip.mr * ip.ldc * 4, ip.ldc, std::min(ip.mr, it.rows - row - ip.mr),
                      valid_c);
      }
      ahead.Step();
      const float* row_scale = TileRowScale(call, it, r0, row, ip.mr, valid_r, rs);
      const float* col_scale = TileColScale(call, it, r0, jq, ip.nr, valid_c, cs);
      FP8MOE_DCHECK(ip.c_in_output ||
                    (c - w.c) + static_cast<ptrdiff_t>(((ip.mr - 1) * ip.ldc + ip.nr) * 4) <=
                        static_cast<ptrdiff_t>(w.sizes->c));
      OnTile(c, ip.ldc, valid_r, valid_c, !ip.c_in_output, ip.mr, ip.nr,
             [&](void* ct, int64_t ldc) {
               RunPackedTile(ip.kind, kc, apan, bpan, ct, ldc, load_c, row_scale, col_scale);
             });
    }
  }
}

// The packed path's reduction chunk [r0, r0 + kc): pack B, then per block
// of rows pack A and run its tiles.
void RunPackedChunk(const GemmCall& call, const WorkItem& it, const ItemPlan& ip, int64_t r0,
                    int64_t kc, Worker& w) {
  const Operand opa{&ip.a, it.group, call.pass == Pass::kTgmm};
  const Operand opb{&call.b, it.group, call.pass == Pass::kDlhs};
  FP8MOE_DCHECK(ip.runs.runs * PanelBytes(ip.kind, it.cols, ip.nr, kc) <= w.sizes->bp);
  const int64_t panels_b = PackBT(opb, ip.kind, r0, kc, ip.runs, ip.nr, w.bp, w.pack);
  const RowReader rda(opa), rdb(opb);
  const int64_t r1 = r0 + kc, next_kc = std::min(ip.kc_step, it.red0 + it.red_len - r1);
  for (int64_t m0 = 0; m0 < it.rows; m0 += kMC) {
    const int64_t mc = std::min<int64_t>(kMC, it.rows - m0);
    FP8MOE_DCHECK(PanelBytes(ip.kind, mc, ip.mr, kc) <= w.sizes->ap);
    PackAT(opa, ip.kind, it.row0 + m0, mc, r0, kc, ip.mr, w.ap, w.pack);
    // Ahead: the next block's A, or after the last block the next chunk's
    // B and first A block.
    PackPrefetch ahead(panels_b * ((mc + ip.mr - 1) / ip.mr));
    if (m0 + kMC < it.rows) {
      ahead.Add(&rda, RegionOfA(opa, it.row0 + m0 + kMC, std::min<int64_t>(kMC, it.rows - m0 - kMC),
                                r0, kc));
    } else if (next_kc > 0) {
      for (int run = 0; run < ip.runs.runs; ++run) {
        ahead.Add(&rdb, RegionOfB(opb, r1, next_kc, ip.runs.start[run], it.cols));
      }
      ahead.Add(&rda, RegionOfA(opa, it.row0, std::min<int64_t>(kMC, it.rows), r1, next_kc));
    }
    RunBlockTiles(call, it, ip, r0, kc, m0, mc, w.bp, panels_b, ip.c + m0 * ip.ldc * 4, w, ahead);
  }
}

// A packed item in row-block order: B packed once for the whole reduction,
// then each block of kMC rows runs every reduction chunk and, when C is the
// worker's scratch, its epilogue. The block's C (kMC rows) stays in L2 over
// the chunks where the chunk order sweeps the whole item's C once per chunk,
// and an item can then span many row blocks (a whole group) with B packed
// once. The same chunks in the same order per element: the same bits.
void RunPackedRowBlocks(const GemmCall& call, const WorkItem& it, ItemPlan& ip, Worker& w) {
  const Operand opa{&ip.a, it.group, call.pass == Pass::kTgmm};
  const Operand opb{&call.b, it.group, call.pass == Pass::kDlhs};
  const int64_t red1 = it.red0 + it.red_len;
  // Blocks of kc_step apart, as WholeBBytes sizes them (its larger
  // max_reduction_step is TGMM's, which never runs in row-block order).
  FP8MOE_DCHECK(call.max_reduction_step == 0 && call.pass != Pass::kTgmm);
  const size_t chunk_bytes = ip.runs.runs * PanelBytes(ip.kind, it.cols, ip.nr, ip.kc_step);
  FP8MOE_DCHECK(static_cast<size_t>((it.red_len + ip.kc_step - 1) / ip.kc_step) * chunk_bytes <=
                w.sizes->bp);
  const int64_t panels_b = PackBTWhole(opb, ip.kind, it.red0, it.red_len, ip.kc_step, ip.runs,
                                       ip.nr, w.bp, chunk_bytes, w.pack);
  for (int64_t m0 = 0; m0 < it.rows; m0 += kMC) {
    const int64_t mc = std::min<int64_t>(kMC, it.rows - m0);
    // C of the block: rows of the f32 output, or the scratch's first rows.
    uint8_t* cblock = ip.c_in_output ? ip.c + m0 * ip.ldc * 4 : ip.c;
    const WorkItem block{it.group, it.row0 + m0, mc, it.col0, it.cols, it.red0, it.red_len};
    if (it.red_len == 0) ZeroTile(ip, block, cblock);
    if (call.lhs_quant != nullptr) QuantizeRowsForItem(call, block.row0, mc, w, ip);
    for (int64_t r0 = it.red0, i = 0; r0 < red1; r0 += ip.kc_step, ++i) {
      const int64_t kc = std::min(ip.kc_step, red1 - r0);
      FP8MOE_DCHECK(PanelBytes(ip.kind, mc, ip.mr, kc) <= w.sizes->ap);
      PackAT(opa, ip.kind, it.row0 + m0, mc, r0, kc, ip.mr, w.ap, w.pack);
      // Nothing prefetched ahead: this order's packs of A (a block's rows
      // over the next chunk) measured the same with it (0.97-1.02).
      PackPrefetch none(0);
      RunBlockTiles(call, it, ip, r0, kc, m0, mc, w.bp + i * chunk_bytes, panels_b, cblock, w,
                    none);
    }
    if (!ip.c_in_output) {
      RunEpilogue(call, block, cblock, ip.ldc, ip.run_stride, ip.kind == PanelKind::kI16Pairs,
                  w.epilogue);
    }
  }
}

// `following`: the item this thread runs next, if the executor knows it.
void RunItem(Context& ctx, const GemmCall& call, PanelKind kind, const WorkItem& it, Worker& w,
             const WorkItem* following) {
  ItemPlan ip = PlanItem(call, kind, it, w);
  const bool direct = ip.direct != Direct::kNone;
  // A direct item is weight-bound: its last chunk prefetches the first chunk
  // of a following direct item.
  ItemPlan fp;
  if (direct && following != nullptr) {
    fp = PlanItem(call, kind, *following, w);
    if (fp.direct == Direct::kNone || following->red_len == 0) following = nullptr;
  } else {
    following = nullptr;
  }
  if (following != nullptr && it.red_len > 0) CountKernel(ctx, KernelPath::kDirectNextItemPrefetch);
  CountKernel(ctx, direct ? DirectPath(ip.direct, call, ip.mr) : PackedPath(kind));
  if (call.lhs_quant != nullptr) CountKernel(ctx, KernelPath::kInItemLhsQuant);
  if (PacksLhsValues(call, ip)) CountKernel(ctx, KernelPath::kInItemLhsValues);
  if (!direct && w.sizes->row_blocks && it.rows > kRowBlockMinRows) {
    CountKernel(ctx, KernelPath::kPackedRowBlocks);
    return RunPackedRowBlocks(call, it, ip, w);
  }
  if (it.red_len == 0) ZeroTile(ip, it, ip.c);
  if (call.lhs_quant != nullptr) QuantizeRowsForItem(call, it.row0, it.rows, w, ip);
  const int64_t red1 = it.red0 + it.red_len;
  for (int64_t r0 = it.red0; r0 < red1; r0 += ip.kc_step) {
    const int64_t kc = std::min(ip.kc_step, red1 - r0);
    if (direct) {
      RunDirectChunk(call, it, ip, r0, kc, w, following, following != nullptr ? &fp : nullptr);
    } else {
      RunPackedChunk(call, it, ip, r0, kc, w);
    }
  }
  if (call.b_col_scale != nullptr && call.b_block == 0 && it.red_len > 0) {
    ApplyGroupColScale(call, it, reinterpret_cast<float*>(ip.c), ip.ldc);
  }
  if (!ip.c_in_output) {
    RunEpilogue(call, it, ip.c, ip.ldc, ip.run_stride, kind == PanelKind::kI16Pairs, w.epilogue);
  }
}

// ---- The call ----------------------------------------------------------------

void ExecuteGemmT(Context* ctx, const GemmCall& call, bool* out_of_memory) {
  *out_of_memory = false;
  if (call.items.empty()) return;
  const PanelKind kind = ChooseKind(call);
  const WorkerSizes sizes = SizeWorkers(call, kind);
  const int threads = ctx->threads();
  ScratchArena& arena = ctx->scratch();
  arena.EnsureWorkers(threads);
  const int64_t n_items = static_cast<int64_t>(call.items.size());
  // Only forward items can be direct (ChooseDirect). Which thread runs which
  // item never changes the bits: items share no output and each sums its
  // reduction in one fixed order.
  const bool look_ahead = call.pass == internal::Pass::kFwd;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    Worker w;
    // A thread without its buffers (a few MB) skips its items; the call then
    // reports the failure instead of returning partial results.
    const bool have = w.Get(arena, omp_get_thread_num(), sizes);
    if (!have) {
#pragma omp atomic write
      *out_of_memory = true;
    }
    if (look_ahead) {
      // Dynamic scheduling that takes the next item before running a direct
      // (weight-bound) one, so that its last chunk can prefetch the next
      // one's first. Not in the last `threads` items, where a taken item would
      // wait for its thread while another thread idles.
      // Only a direct item takes its successor ahead: a packed one could not
      // use it, and an idle thread could not take it.
      const int64_t nr = static_cast<int64_t>(KernelNR());
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      while (i < n_items) {
        int64_t j = -1;
        if (next.load(std::memory_order_relaxed) < n_items - threads &&
            ChooseDirect(call, kind, call.items[static_cast<size_t>(i)], nr) != Direct::kNone) {
          j = next.fetch_add(1, std::memory_order_relaxed);
        }
        const WorkItem* following = j >= 0 && j < n_items ? &call.items[static_cast<size_t>(j)] : nullptr;
        if (have) RunItem(*ctx, call, kind, call.items[static_cast<size_t>(i)], w, following);
        i = j >= 0 ? j : next.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n_items; ++i) {
        if (have) RunItem(*ctx, call, kind, call.items[static_cast<size_t>(i)], w, nullptr);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(ExecuteGemmT);
HWY_EXPORT(RowBlockFitsT);

namespace {
std::atomic<bool> g_fp8_byte_tables{true};
std::atomic<bool> g_row_blocks{true};
std::atomic<bool> g_pack_prefetch{true};
}  // namespace
bool Fp8ByteTableDecode() { return g_fp8_byte_tables.load(std::memory_order_relaxed); }
void SetFp8ByteTableDecode(bool on) { g_fp8_byte_tables.store(on); }

bool RowBlockOrderFits(const GemmCall& call, int64_t cols, int64_t red_len) {
  return HWY_DYNAMIC_DISPATCH(RowBlockFitsT)(call, cols, red_len);
}
bool RowBlockOrderOn() { return g_row_blocks.load(std::memory_order_relaxed); }
bool PackPrefetchOn() { return g_pack_prefetch.load(std::memory_order_relaxed); }
void SetPackPrefetch(bool on) { g_pack_prefetch.store(on); }
void SetRowBlockOrder(bool on) { g_row_blocks.store(on); }

Status ExecuteGemm(Context& ctx, const GemmCall& call) {
  bool out_of_memory = false;
  HWY_DYNAMIC_DISPATCH(ExecuteGemmT)(&ctx, call, &out_of_memory);
  if (out_of_memory) {
    return ResourceExhausted("cannot allocate the GMM packing buffers (a few MB per thread)");
  }
  return OkStatus();
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
