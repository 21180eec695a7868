// The "cpu" backend (kernels/backend.h). Its GMMs: the pre-passes a mode needs
// (activation quantization over valid rows where the items cannot do it
// themselves, the fake-QAT BF16 weight copy, TGMM gradient quantization),
// the plan of work items, and the hand-off to the per-target executor
// (gemm_exec.cc). Every buffer it needs lives in the
// Context's scratch, so a repeated call allocates nothing. Its other ops:
// kernels/cpu/cpu_ops.h.

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "base/scratch_arena.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/gmm_problem.h"
#include "quant/quant_internal.h"

namespace fp8moe::internal {
namespace {

// Per-shape defaults (see docs/kernels.md for the cache model behind them).
constexpr int64_t kDefaultTileM = 512;   // rows of a GMM / dLHS work item
// The tallest default item in row-block order (ForwardTileM): a train-fill
// group (16384 rows over 8 experts).
constexpr int64_t kRowBlockTileM = 2048;
constexpr int64_t kDefaultTileN = 1024;  // columns of a work item
constexpr int64_t kDefaultKc = 256;      // reduction block
// TGMM: the output tile's f32 partial sums stay in cache while the group's
// rows stream through; 512 x 1024 re-reads lhs and dout half as often as
// 256 x 512 (measured ~10% faster on the train-fill shapes). Shrunk when that
// leaves fewer than four items per thread.
constexpr int64_t kDefaultTgmmTileK = 512;
constexpr int64_t kDefaultTgmmTileN = 1024;
constexpr int64_t kMinTgmmTile = 128;

int64_t EvenUp(int64_t v) { return v + (v & 1); }

// The reduction block for a reduction of `len`: the tile, but no larger than
// the (even-rounded) reduction itself, so a huge tile never sizes packing
// buffers past the data. Tiles are at most kMaxGmmTile (validated), so
// nothing here can overflow; the bits do not depend on the block size.
int64_t ReductionBlock(int64_t tile, int64_t len) {
  return EvenUp(std::min(tile, std::max<int64_t>(len, 1)));
}

template <class T>
T* SharedArray(Context& ctx, SharedSlot slot, int64_t n) {
  return reinterpret_cast<T*>(
      ctx.scratch().Shared(slot, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
}

// A row-major operand of `dtype` with leading dimension ld. Takes the
// pointer and dtype, not a TensorView, so that building one for scratch
// (activation codes, weight copy) constructs no Shape: a call allocates
// nothing.
Source Plain(const void* data, DType dtype, int64_t ld) {
  Source s;
  s.data = data;
  s.ld = ld;
  switch (dtype) {
    case DType::kF32: s.kind = SrcKind::kF32; break;
    case DType::kBF16: s.kind = SrcKind::kBf16; break;
    case DType::kI8: s.kind = SrcKind::kI8; break;
    default:
      s.kind = SrcKind::kFp8;
      s.fp8 = *Fp8FormatOf(dtype);
      break;
  }
  return s;
}
Source Plain(const ConstTensorView& t, int64_t ld) { return Plain(t.data, t.dtype, ld); }

// rhs [e, k, n] as a per-group source with its per-channel scale, if codes.
Source RhsSource(const ConstTensorView& rhs, const ConstTensorView* scale, const GmmProblem& p) {
  Source s = Plain(rhs, p.n);
  s.group_stride = p.k * p.n;
  if (scale != nullptr && s.kind == SrcKind::kFp8) {
    s.col_scale = scale->as<float>();
    s.col_scale_group_stride = p.n;
  }
  return s;
}

// The fake-QAT BF16 weight copy [e, k, n] as the per-group rhs source.
Source Bf16CopySource(const uint16_t* copy, const GmmProblem& p) {
  Source s = Plain(copy, DType::kBF16, p.n);
  s.group_stride = p.k * p.n;
  return s;
}

// Writes zeros to rows [from, rows) of a row-major F32/BF16 matrix.
void ZeroRows(const TensorView& t, int64_t from) {
  const int64_t rows = t.shape[0];
  if (from >= rows) return;
  const size_t row_bytes = static_cast<size_t>(t.shape[1]) * DTypeSize(t.dtype);
  std::memset(static_cast<uint8_t*>(t.data) + static_cast<size_t>(from) * row_bytes, 0,
              static_cast<size_t>(rows - from) * row_bytes);
}

// Work items over the rows of each group x the output columns, and the
// call's item bounds (the tiles clamped to the shape, whatever the group
// sizes). A group taller than tile_m is cut into the fewest items of at most
// tile_m rows, of sizes that differ by at most one row (1100 rows at 1024:
// 550 + 550, not 1024 + 76), so no item is a sliver that packs B for a few
// rows. Steps never pass the end (m + rows <= r1), so no tile size can
// overflow the loop.
void RowGroupItems(const GmmProblem& p, int64_t cols, int64_t red_len, int64_t tile_m,
                   int64_t tile_n, GemmCall* call) {
  call->max_item_rows = std::min(tile_m, p.m);
  call->max_item_cols = std::min(tile_n, cols);
  std::vector<WorkItem>* items = &call->items;
  if (cols <= 0) return;
  for (int64_t g = 0; g < p.e; ++g) {
    const int64_t r0 = p.offsets[g], r1 = p.offsets[g + 1];
    const int64_t parts = (r1 - r0 + tile_m - 1) / tile_m;
    for (int64_t part = 0, m = r0; m < r1; ++part) {
      const int64_t rows = (r1 - r0) / parts + (part < (r1 - r0) % parts ? 1 : 0);
      for (int64_t c = 0; c < cols;) {
        const int64_t width = std::min(tile_n, cols - c);
        items->push_back({static_cast<int32_t>(g), m, rows, c, width, 0, red_len});
        c += width;
      }
      m += rows;
    }
  }
}

// The rows of a forward or dLHS work item when tiles.m is not set. Where
// the executor runs tall packed items in row-block order (B packed once for
// the whole reduction: RowBlockOrderFits), items are whole groups of up to
// kRowBlockTileM rows, halved while that leaves fewer than four items per
// thread (as TGMM's tiles); elsewhere kDefaultTileM, whose C tile the chunk
// order keeps in L2 / L3.
int64_t ForwardTileM(const Context& ctx, const GmmProblem& p, const GemmCall& call,
                     int64_t cols, int64_t red_len, int64_t tile_n) {
  if (!RowBlockOrderFits(call, std::min(tile_n, cols), red_len)) return kDefaultTileM;
  const int64_t col_items = (cols + tile_n - 1) / std::max<int64_t>(tile_n, 1);
  const int64_t want = 4 * static_cast<int64_t>(ctx.threads());
  int64_t tile_m = kRowBlockTileM;
  auto items = [&] {
    int64_t n = 0;
    for (int64_t g = 0; g < p.e; ++g) n += (p.offsets[g + 1] - p.offsets[g] + tile_m - 1) / tile_m;
    return n * col_items;
  };
  while (tile_m > kDefaultTileM && items() < want) tile_m /= 2;
  return tile_m;
}

struct ItemTiles {
  int64_t m, n;  // rows (at most) and columns of a forward or dLHS work item
};

// The tiles of a forward or dLHS work item, the unset ones chosen: n =
// kDefaultTileN, or half of it where B for the whole reduction is over the
// row-block budget at kDefaultTileN columns but fits at half (f32 panels of
// wi's 1024 x 2048 weight, or of its transpose) and some item will then be
// taller than kDefaultTileM rows (row-block order), so that the weight is
// packed (converted, dequantized from codes) once per group instead of once
// per 512 rows; elsewhere narrower items would only pack A twice. m from
// ForwardTileM. Measured (Zen 5, train-fill wi, one process alternating both
// 8 times): 512 columns took dLHS from codes to 0.96 of the time on AVX3 and
// 0.97 on AVX2, fake QAT 0.96 / 0.99, f32 0.97 / 0.98, and from codes no
// slower than fake QAT any more (1.00, was 1.03-1.08: fake QAT dequantizes
// its copy once per call, native dequantized per 512-row item); forward f32
// 0.96 / 0.97, bf16 0.97 / 0.98, fake QAT 0.98 / 0.98, native fp8 0.99 /
// 0.98 (its activation then quantized in a pre-pass: PlanLhsCodes).
ItemTiles ChooseItemTiles(const Context& ctx, const GmmProblem& p, const GemmCall& call,
                          const GmmTiles& tiles, int64_t cols, int64_t red_len) {
  auto rows_for = [&](int64_t tile_n) {
    return tiles.m ? *tiles.m : ForwardTileM(ctx, p, call, cols, red_len, tile_n);
  };
  const int64_t whole = tiles.n.value_or(kDefaultTileN), half = kDefaultTileN / 2;
  if (tiles.n || RowBlockOrderFits(call, std::min(whole, cols), red_len) ||
      !RowBlockOrderFits(call, std::min(half, cols), red_len)) {
    return {rows_for(whole), whole};
  }
  int64_t tallest = 0;
  for (int64_t g = 0; g < p.e; ++g) tallest = std::max(tallest, p.offsets[g + 1] - p.offsets[g]);
  const int64_t rows = rows_for(half);
  if (std::min(rows, tallest) > kDefaultTileM) return {rows, half};
  return {rows_for(whole), whole};
}

// The fake-QAT weight copy w[e,k,n] = bf16(f32(q) * s[e,n]), in the
// context's scratch: a trainer keeps that buffer from step to step (it stays
// allocated: that memory is what fake QAT costs over native).
Result<const uint16_t*> DequantizeToBf16(Context& ctx, const ConstTensorView& codes,
                                         const float* scale, const GmmProblem& p) {
  const int64_t rows = p.e * p.k;
  auto* out = SharedArray<uint16_t>(ctx, SharedSlot::kWeightCopy, rows * p.n);
  if (out == nullptr) return ResourceExhausted("cannot allocate the BF16 weight copy");
  FP8MOE_ASSIGN_OR_RETURN(const Fp8Format f, Fp8FormatOf(codes.dtype));
  const uint8_t* q = codes.as<uint8_t>();
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeFp8ToBf16Span(q + r * p.n, scale + (r / p.k) * p.n, out + r * p.n,
                            static_cast<size_t>(p.n), f);
  }
  return static_cast<const uint16_t*>(out);
}

// Quantizes the valid rows of lhs [m, k] (F32 or BF16) per row (or K-block)
// into codes [valid, k] and scales [valid, blocks], in the context's scratch;
// one flat loop of rows on the context's threads, each row quantized serially
// (QuantizeOneRow opens no nested parallel region: a region per row cost a
// team setup per row). BF16 rows are read as they are (QuantizeOneRowBf16):
// widening each into an f32 row first was a quarter of this pass.
Status QuantizeLhs(Context& ctx, const ConstTensorView& lhs, const GmmProblem& p, int64_t block,
                   QuantDType dtype, const Calibration& calib, uint8_t** codes, float** scales) {
  // Sized by all m rows, not the valid ones, so that the routing of a step
  // never grows them.
  const int64_t rows = p.valid_rows, nb = NumBlocks(p.k, block);
  *codes = SharedArray<uint8_t>(ctx, SharedSlot::kLhsCodes, p.m * p.k);
  *scales = SharedArray<float>(ctx, SharedSlot::kLhsScales, p.m * nb);
  if (*codes == nullptr || *scales == nullptr) {
    return ResourceExhausted("cannot allocate the activation codes of a GMM");
  }
  const bool bf16 = lhs.dtype == DType::kBF16;
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* q = *codes + r * p.k;
    float* s = *scales + r * nb;
    if (bf16) {
      QuantizeOneRowBf16(lhs.as<uint16_t>() + r * p.k, p.k, block, dtype, calib, q, s);
    } else {
      QuantizeOneRow(lhs.as<float>() + r * p.k, p.k, block, dtype, calib, q, s);
    }
  }
  return OkStatus();
}

// Where a native fp8 or int8 forward's activation codes come from, and its
// scales. Item by item (LhsQuantPlan: no codes written to memory) where
// every item holds all the columns of its rows, so that no row is quantized
// twice, and an item quantizes at most 512 rows at once (row-block order
// quantizes 96 at a time); else in a pre-pass over the valid rows.
Status PlanLhsCodes(Context& ctx, const GmmProblem& p, const GmmOptions& o,
                    const ConstTensorView& lhs, int64_t cols, int64_t tile_m, int64_t tile_n,
                    GemmCall* call) {
  const bool int8 = o.mode == GmmMode::kInt8;
  const int64_t block = int8 ? 0 : o.lhs_quant_block_size;
  const QuantDType qd = int8 ? QuantDType::kInt8 : o.fp8_dtype;
  float* sa = nullptr;
  if (tile_n >= cols &&
      (tile_m <= kDefaultTileM || RowBlockOrderFits(*call, std::min(tile_n, cols), p.k))) {
    const int64_t nb = NumBlocks(p.k, block);
    sa = SharedArray<float>(ctx, SharedSlot::kLhsScales, p.m * nb);
    if (sa == nullptr) return ResourceExhausted("cannot allocate the activation scales of a GMM");
    LhsQuantPlan& q = ctx.scratch().Object<LhsQuantPlan>();
    q = LhsQuantPlan{lhs.data, lhs.dtype == DType::kBF16, p.k, block, qd,
                     o.lhs_calibration, sa, nb};
    call->lhs_quant = &q;
  } else {
    uint8_t* qa = nullptr;
    FP8MOE_RETURN_IF_ERROR(QuantizeLhs(ctx, lhs, p, block, qd, o.lhs_calibration, &qa, &sa));
    call->a.data = qa;
  }
  if (block > 0) {
    call->a_block_scale = sa;
  } else {
    call->epi.row_scale = sa;
  }
  return OkStatus();
}

void SetOutput(const TensorView& out, Epilogue* e) {
  e->out = out.data;
  e->out_dtype = out.dtype;
  e->out_ld = out.shape[1];
}

// The planned call, kept in the context so its item list keeps its capacity.
GemmCall& FreshCall(Context& ctx) {
  GemmCall& call = ctx.scratch().Object<GemmCall>();
  std::vector<WorkItem> items = std::move(call.items);
  items.clear();
  call = GemmCall{};
  call.items = std::move(items);
  return call;
}

class CpuBackendImpl final : public OpsBackend<CpuOps> {
 public:
  BackendKind kind() const override { return BackendKind::kCpu; }
  bool Supports(const OpArgs&) const override { return true; }  // every op, every case
  Status Gmm(Context& ctx, const GmmProblem& p, const GmmOptions& o, const ConstTensorView& lhs,
             const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
             const ConstTensorView& group_sizes, const TensorView& out,
             const TensorView* h_out) override;
  Status Dlhs(Context& ctx, const GmmProblem& p, const GmmOptions& o, const ConstTensorView& dout,
              const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
              const ConstTensorView& group_sizes, const TensorView& out,
              const ConstTensorView* h) override;
  Status Tgmm(Context& ctx, const GmmProblem& p, const GmmOptions& o, const TgmmQuant& quant,
              const ConstTensorView& lhs, const ConstTensorView& dout,
              const ConstTensorView& group_sizes, const TensorView& drhs) override;

  // The other ops: OpsBackend<CpuOps> (kernels/cpu/cpu_ops.h).
};

Status CpuBackendImpl::Gmm(Context& ctx, const GmmProblem& p, const GmmOptions& o,
                           const ConstTensorView& lhs, const ConstTensorView& rhs,
                           const ConstTensorView* rhs_scale, const ConstTensorView&,
                           const TensorView& out, const TensorView* h_out) {
  GemmCall& call = FreshCall(ctx);
  call.pass = Pass::kFwd;
  call.kc = ReductionBlock(o.tiles.k.value_or(kDefaultKc), p.k);
  call.a = Plain(lhs, p.k);
  call.b = RhsSource(rhs, rhs_scale, p);
  switch (o.mode) {
    case GmmMode::kF32:
    case GmmMode::kBf16:
      break;
    case GmmMode::kFakeQat: {
      FP8MOE_ASSIGN_OR_RETURN(const uint16_t* const copy,
                              DequantizeToBf16(ctx, rhs, rhs_scale->as<float>(), p));
      call.b = Bf16CopySource(copy, p);
      break;
    }
    case GmmMode::kNativeFp8:
    case GmmMode::kInt8: {
      const bool int8 = o.mode == GmmMode::kInt8;
      const int64_t block = int8 ? 0 : o.lhs_quant_block_size;
      const QuantDType qd = int8 ? QuantDType::kInt8 : o.fp8_dtype;
      call.a = Plain(nullptr, QuantStorageDType(qd), p.k);  // the codes: PlanLhsCodes
      call.b.col_scale = nullptr;  // the weight scale is applied at the end
      call.integer = int8;
      if (block > 0) {
        call.a_block_scale_ld = NumBlocks(p.k, block);
        call.block = block;
      }
      call.epi.col_scale = rhs_scale->as<float>();
      call.epi.col_scale_group_stride = p.n;
      break;
    }
  }
  SetOutput(out, &call.epi);
  const bool swiglu = o.epilogue == GmmEpilogue::kSwiGlu;
  const int64_t cols = swiglu ? p.n / 2 : p.n;
  if (swiglu) {
    call.epi.kind = Epilogue::Kind::kSwiGlu;
    call.epi.half = p.n / 2;
    if (h_out != nullptr) {
      call.epi.h_out = h_out->data;
      call.epi.h_dtype = h_out->dtype;
      call.epi.h_ld = p.n;
      ZeroRows(*h_out, p.valid_rows);
    }
  } else if (out.dtype == DType::kF32 && call.epi.col_scale == nullptr) {
    call.epi.kind = Epilogue::Kind::kAccumulateF32;
  }
  ZeroRows(out, p.valid_rows);
  const ItemTiles t = ChooseItemTiles(ctx, p, call, o.tiles, cols, p.k);
  if (o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8) {
    FP8MOE_RETURN_IF_ERROR(PlanLhsCodes(ctx, p, o, lhs, cols, t.m, t.n, &call));
  }
  RowGroupItems(p, cols, p.k, t.m, t.n, &call);
  return ExecuteGemm(ctx, call);
}

Status CpuBackendImpl::Dlhs(Context& ctx, const GmmProblem& p, const GmmOptions& o,
                            const ConstTensorView& dout, const ConstTensorView& rhs,
                            const ConstTensorView* rhs_scale, const ConstTensorView&,
                            const TensorView& out, const ConstTensorView* h) {
  GemmCall& call = FreshCall(ctx);
  call.pass = Pass::kDlhs;
  call.kc = ReductionBlock(o.tiles.k.value_or(kDefaultKc), p.n);
  call.a = Plain(dout, p.n);
  call.b = RhsSource(rhs, rhs_scale, p);
  if (o.mode == GmmMode::kFakeQat) {
    FP8MOE_ASSIGN_OR_RETURN(const uint16_t* const copy,
                            DequantizeToBf16(ctx, rhs, rhs_scale->as<float>(), p));
    call.b = Bf16CopySource(copy, p);
  } else if (o.mode == GmmMode::kBf16 && p.rhs_codes) {
    call.b.round_bf16 = true;  // per-tile dequantization to the copy's values
  }
  SetOutput(out, &call.epi);
  if (o.epilogue == GmmEpilogue::kDSwiGlu) {
    call.epi.kind = Epilogue::Kind::kDSwiGlu;
    call.epi.half = p.k;
    call.epi.h = h->data;
    call.epi.h_dtype = h->dtype;
    call.epi.h_ld = 2 * p.k;
  } else if (out.dtype == DType::kF32) {
    call.epi.kind = Epilogue::Kind::kAccumulateF32;
  }
  ZeroRows(out, p.valid_rows);
  const ItemTiles t = ChooseItemTiles(ctx, p, call, o.tiles, p.k, p.n);
  RowGroupItems(p, p.k, p.n, t.m, t.n, &call);
  return ExecuteGemm(ctx, call);
}

Status CpuBackendImpl::Tgmm(Context& ctx, const GmmProblem& p, const GmmOptions& o,
                            const TgmmQuant& quant, const ConstTensorView& lhs,
                            const ConstTensorView& dout, const ConstTensorView& group_sizes,
                            const TensorView& drhs) {
  GemmCall& call = FreshCall(ctx);
  call.pass = Pass::kTgmm;
  call.a = Plain(lhs, p.k);
  call.b = Plain(dout, p.n);
  int64_t quant_tile = quant.per_group ? 0 : o.tiles.m.value_or(kTgmmDefaultQuantTile);
  // A tile taller than m cuts every group into one tile, as m does, so it is
  // clamped to m: the reduction block (the tile) then never sizes the packing
  // buffers past the data. Like every bound here it depends on the shapes
  // only, never on the group sizes (sum_g ceil(size_g / tile) <= m / tile + e),
  // so a trainer's steps, other routings of the same shapes, find their
  // scratch allocated by the first step.
  if (quant_tile > 0) quant_tile = std::min(quant_tile, std::max<int64_t>(p.m, 1));
  const int64_t max_tiles = quant_tile == 0 ? p.e : p.m / quant_tile + p.e;
  call.max_reduction_step = quant_tile;
  if (quant.dout_dtype) {
    const int32_t* sizes = group_sizes.as<int32_t>();
    FP8MOE_ASSIGN_OR_RETURN(const int64_t tiles, NumGroupTiles(sizes, p.e, p.m, quant_tile));
    auto* qg = SharedArray<uint8_t>(ctx, SharedSlot::kGradCodes, p.m * p.n);
    FP8MOE_DCHECK(tiles <= max_tiles);
    auto* sg = SharedArray<float>(ctx, SharedSlot::kGradScales, max_tiles * p.n);
    auto* row_tile = SharedArray<int32_t>(ctx, SharedSlot::kRowTile, p.m);
    // The quantizer's own scratch too, so that a training step's TGMM
    // allocates nothing once the arena has grown.
    const int threads = ctx.threads();
    auto* tile_rows = SharedArray<RowTile>(ctx, SharedSlot::kGradTiles, max_tiles);
    auto* amax = SharedArray<int32_t>(ctx, SharedSlot::kGradAmax, threads * p.n);
    auto* inv = SharedArray<float>(ctx, SharedSlot::kGradInv, threads * p.n);
    if (qg == nullptr || sg == nullptr || row_tile == nullptr || tile_rows == nullptr ||
        amax == nullptr || inv == nullptr) {
      return ResourceExhausted("cannot allocate the quantized TGMM gradient");
    }
    QuantizeGroupTileChannelsWith(dout.as<float>(), p.m, p.n, sizes, p.e, quant_tile, tiles,
                                  *quant.dout_dtype, quant.calibration, qg, sg, threads,
                                  tile_rows, amax, inv);
    // The tile of every valid row, in the quantizer's enumeration (group by
    // group, quant_tile rows at a time; one tile per group when 0).
    int32_t t = 0;
    for (int64_t g = 0; g < p.e; ++g) {
      const int64_t size = p.offsets[g + 1] - p.offsets[g];
      const int64_t tile = quant_tile == 0 ? std::max<int64_t>(size, 1) : quant_tile;
      for (int64_t i = 0; i < size; ++i) row_tile[p.offsets[g] + i] = t + static_cast<int32_t>(i / tile);
      t += static_cast<int32_t>(quant_tile == 0 ? 1 : (size + tile - 1) / tile);
    }
    // The codes go in raw (bf16-exact: the pair kernels take them) and the
    // scales are applied to each tile's partial sums, C += s[tile, n] * sum,
    // or once per group: the same product as f32(q) * s summed, regrouped.
    call.b = Plain(qg, QuantStorageDType(*quant.dout_dtype), p.n);
    call.b_col_scale = sg;
    call.b_col_scale_ld = p.n;
    call.b_row_tile = row_tile;
    call.b_block = quant_tile;
  }
  // By the rows of lhs, not the valid ones: the buffers it sizes then do not
  // change with the routing (the bits do not depend on kc).
  call.kc = ReductionBlock(o.tiles.m.value_or(kDefaultKc), p.m);
  call.epi.kind = Epilogue::Kind::kAccumulateF32;
  call.epi.out = drhs.data;
  call.epi.out_ld = p.n;
  call.out_group_stride = p.k * p.n;
  int64_t tile_k = o.tiles.k.value_or(kDefaultTgmmTileK);
  int64_t tile_n = o.tiles.n.value_or(kDefaultTgmmTileN);
  // Before the halving below, which depends on how many groups have rows.
  call.max_item_rows = std::min(tile_k, p.k);
  call.max_item_cols = std::min(tile_n, p.n);
  if (!o.tiles.k && !o.tiles.n) {
    int64_t busy = 0;  // groups with rows
    for (int64_t g = 0; g < p.e; ++g) busy += p.offsets[g + 1] > p.offsets[g] ? 1 : 0;
    auto items = [&] {
      return busy * ((p.k + tile_k - 1) / tile_k) * ((p.n + tile_n - 1) / tile_n);
    };
    const int64_t want = 4 * static_cast<int64_t>(ctx.threads());
    while (items() < want && (tile_k > kMinTgmmTile || tile_n > kMinTgmmTile)) {
      if (tile_n >= tile_k && tile_n > kMinTgmmTile) {
        tile_n /= 2;
      } else {
        tile_k /= 2;
      }
    }
  }
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t k = 0; k < p.k;) {
      const int64_t rows = std::min(tile_k, p.k - k);
      for (int64_t n = 0; n < p.n;) {
        const int64_t cols = std::min(tile_n, p.n - n);
        call.items.push_back({static_cast<int32_t>(g), k, rows, n, cols, p.offsets[g],
                              p.offsets[g + 1] - p.offsets[g]});
        n += cols;
      }
      k += rows;
    }
  }
  return ExecuteGemm(ctx, call);
}

}  // namespace

Backend& CpuBackend() {
  static CpuBackendImpl backend;
  return backend;
}

}  // namespace fp8moe::internal
