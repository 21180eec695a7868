// The fast GMM, dLHS and TGMM: validate, run the pre-passes a mode needs
// (activation quantization over valid rows, the fake-QAT BF16 weight copy,
// TGMM gradient quantization), plan work items, and hand the call to the
// per-target executor (gemm_exec.cc). Reference twins: reference/.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/scratch.h"
#include "kernels/gmm_problem.h"
#include "quant/quant_internal.h"

namespace fp8moe {
namespace {

using internal::Epilogue;
using internal::GemmCall;
using internal::GmmProblem;
using internal::Pass;
using internal::Source;
using internal::SrcKind;
using internal::WorkItem;

// Per-shape defaults (see docs/kernels.md for the cache model behind them).
constexpr int64_t kDefaultTileM = 512;   // rows of a GMM / dLHS work item
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

Source Plain(const TensorView& t, int64_t ld) {
  Source s;
  s.data = t.data;
  s.ld = ld;
  switch (t.dtype) {
    case DType::kF32: s.kind = SrcKind::kF32; break;
    case DType::kBF16: s.kind = SrcKind::kBf16; break;
    case DType::kI8: s.kind = SrcKind::kI8; break;
    default:
      s.kind = SrcKind::kFp8;
      s.fp8 = *Fp8FormatOf(t.dtype);
      break;
  }
  return s;
}

// rhs [e, k, n] as a per-group source with its per-channel scale, if codes.
Source RhsSource(const TensorView& rhs, const TensorView* scale,
                 const GmmProblem& p) {
  Source s = Plain(rhs, p.n);
  s.group_stride = p.k * p.n;
  if (scale != nullptr && s.kind == SrcKind::kFp8) {
    s.col_scale = scale->as<float>();
    s.col_scale_group_stride = p.n;
  }
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

// Work items over the rows of each group x the output columns. Steps never
// pass the end (m + rows <= r1), so no tile size can overflow the loop.
void RowGroupItems(const GmmProblem& p, int64_t cols, int64_t red_len,
                   int64_t tile_m, int64_t tile_n, std::vector<WorkItem>* items) {
  if (cols <= 0) return;
  for (int64_t g = 0; g < p.e; ++g) {
    const int64_t r0 = p.offsets[g], r1 = p.offsets[g + 1];
    for (int64_t m = r0; m < r1;) {
      const int64_t rows = std::min(tile_m, r1 - m);
      for (int64_t c = 0; c < cols;) {
        const int64_t width = std::min(tile_n, cols - c);
        items->push_back({static_cast<int32_t>(g), m, rows, c, width, 0, red_len});
        c += width;
      }
      m += rows;
    }
  }
}

// The fake-QAT weight copy w[e,k,n] = bf16(f32(q) * s[e,n]), written into a
// buffer the calling thread keeps across calls, as a trainer keeps the copy's
// buffer from step to step (it stays allocated: that memory is what fake QAT
// costs over native).
thread_local internal::GrowBuffer tls_weight_copy;

Result<TensorView> DequantizeToBf16(const TensorView& codes, const float* scale,
                                    const GmmProblem& p) {
  const int64_t rows = p.e * p.k;
  auto* out = reinterpret_cast<uint16_t*>(
      tls_weight_copy.Get(static_cast<size_t>(std::max<int64_t>(rows * p.n, 1)) * 2));
  if (out == nullptr) return ResourceExhausted("cannot allocate the BF16 weight copy");
  FP8MOE_ASSIGN_OR_RETURN(const Fp8Format f, Fp8FormatOf(codes.dtype));
  const uint8_t* q = codes.as<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeFp8ToBf16Span(q + r * p.n, scale + (r / p.k) * p.n, out + r * p.n,
                            static_cast<size_t>(p.n), f);
  }
  return TensorView{out, DType::kBF16, {p.e, p.k, p.n}};
}

// Codes and scales of the activation, kept by the calling thread across
// calls (see scratch.h).
struct LhsQuant {
  internal::GrowBuffer codes, scales;
};
thread_local LhsQuant tls_lhs;

// Quantizes the valid rows of lhs [m, k] (F32 or BF16) per row (or K-block)
// into codes [valid, k] and scales [valid, blocks] (thread-local scratch).
Status QuantizeLhs(const TensorView& lhs, const GmmProblem& p, int64_t block,
                   QuantDType dtype, const Calibration& calib, uint8_t** codes,
                   float** scales) {
  const int64_t rows = p.valid_rows, nb = NumBlocks(p.k, block);
  *codes = tls_lhs.codes.Get(static_cast<size_t>(std::max<int64_t>(rows * p.k, 1)));
  *scales = reinterpret_cast<float*>(
      tls_lhs.scales.Get(static_cast<size_t>(std::max<int64_t>(rows * nb, 1)) * 4));
  if (*codes == nullptr || *scales == nullptr) {
    return ResourceExhausted("cannot allocate the activation codes of a GMM");
  }
  if (lhs.dtype == DType::kF32) {
    return QuantizeRows(lhs.as<float>(), rows, p.k, rows, block, dtype, calib, *codes,
                        *scales);
  }
  // BF16 rows: widen one row at a time (exact) and quantize it, rows in
  // parallel; no f32 copy of the whole activation is made.
  const uint16_t* src = lhs.as<uint16_t>();
  Status status;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(p.k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      Bf16ToF32Span(src + r * p.k, row.data(), static_cast<size_t>(p.k));
      const Status s = QuantizeRows(row.data(), 1, p.k, 1, block, dtype, calib,
                                    *codes + r * p.k, *scales + r * nb);
      if (!s.ok()) {
#pragma omp critical
        status = s;
      }
    }
  }
  return status;
}

void SetOutput(const TensorView& out, Epilogue* e) {
  e->out = out.data;
  e->out_dtype = out.dtype;
  e->out_ld = out.shape[1];
}

}  // namespace

namespace internal {

ThreadScratch& WorkerScratch() {
  thread_local ThreadScratch scratch;
  return scratch;
}

void ReleaseAllScratch() {
  tls_lhs.codes.Release();
  tls_lhs.scales.Release();
  tls_weight_copy.Release();
#pragma omp parallel
  {
    ThreadScratch& s = WorkerScratch();
    s.ap.Release();
    s.bp.Release();
    s.c.Release();
  }
}

}  // namespace internal

void ReleaseGmmScratch() { internal::ReleaseAllScratch(); }

Status Gmm(const GmmOptions& o, const TensorView& lhs, const TensorView& rhs,
           const TensorView* rhs_scale, const TensorView& group_sizes,
           const TensorView& out, const TensorView* h_out) {
  FP8MOE_ASSIGN_OR_RETURN(const GmmProblem p,
                          internal::CheckGmm(o, lhs, rhs, rhs_scale, group_sizes, out, h_out));
  // Nothing to write (h_out is empty too): return before any pre-pass, so a
  // zero-element call costs nothing whatever its other dimensions.
  if (out.num_elements() == 0) return OkStatus();
  GemmCall call;
  call.pass = Pass::kFwd;
  call.red_len = p.k;
  call.kc = ReductionBlock(o.tiles.k.value_or(kDefaultKc), p.k);
  call.a = Plain(lhs, p.k);
  call.b = RhsSource(rhs, rhs_scale, p);
  uint8_t* qa = nullptr;
  float* sa = nullptr;
  switch (o.mode) {
    case GmmMode::kF32:
    case GmmMode::kBf16:
      break;
    case GmmMode::kFakeQat: {
      FP8MOE_ASSIGN_OR_RETURN(const TensorView copy,
                              DequantizeToBf16(rhs, rhs_scale->as<float>(), p));
      call.b = RhsSource(copy, nullptr, p);
      break;
    }
    case GmmMode::kNativeFp8:
    case GmmMode::kInt8: {
      const bool int8 = o.mode == GmmMode::kInt8;
      const int64_t block = int8 ? 0 : o.lhs_quant_block_size;
      const QuantDType qd = int8 ? QuantDType::kInt8 : o.fp8_dtype;
      FP8MOE_RETURN_IF_ERROR(QuantizeLhs(lhs, p, block, qd, o.lhs_calibration, &qa, &sa));
      call.a = Plain(TensorView{qa, QuantStorageDType(qd), {p.valid_rows, p.k}}, p.k);
      call.b.col_scale = nullptr;  // the weight scale is applied at the end
      call.integer = int8;
      if (block > 0) {
        call.a_block_scale = sa;
        call.a_block_scale_ld = NumBlocks(p.k, block);
        call.block = block;
      } else {
        call.epi.row_scale = sa;
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
      call.epi.h = h_out->data;
      call.epi.h_dtype = h_out->dtype;
      call.epi.h_ld = p.n;
      ZeroRows(*h_out, p.valid_rows);
    }
  } else if (out.dtype == DType::kF32 && call.epi.col_scale == nullptr) {
    call.epi.kind = Epilogue::Kind::kAccumulateF32;
  }
  ZeroRows(out, p.valid_rows);
  RowGroupItems(p, cols, p.k, o.tiles.m.value_or(kDefaultTileM),
                o.tiles.n.value_or(kDefaultTileN), &call.items);
  return internal::ExecuteGemm(call);
}

Status GmmDlhs(const GmmOptions& o, const TensorView& dout, const TensorView& rhs,
               const TensorView* rhs_scale, const TensorView& group_sizes,
               const TensorView& out, const TensorView* h) {
  FP8MOE_ASSIGN_OR_RETURN(const GmmProblem p,
                          internal::CheckDlhs(o, dout, rhs, rhs_scale, group_sizes, out, h));
  if (out.num_elements() == 0) return OkStatus();  // nothing to write
  GemmCall call;
  call.pass = Pass::kDlhs;
  call.red_len = p.n;
  call.kc = ReductionBlock(o.tiles.k.value_or(kDefaultKc), p.n);
  call.a = Plain(dout, p.n);
  call.b = RhsSource(rhs, rhs_scale, p);
  if (o.mode == GmmMode::kFakeQat) {
    FP8MOE_ASSIGN_OR_RETURN(const TensorView copy,
                            DequantizeToBf16(rhs, rhs_scale->as<float>(), p));
    call.b = RhsSource(copy, nullptr, p);
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
  RowGroupItems(p, p.k, p.n, o.tiles.m.value_or(kDefaultTileM),
                o.tiles.n.value_or(kDefaultTileN), &call.items);
  return internal::ExecuteGemm(call);
}

Status Tgmm(const GmmOptions& o, const TgmmQuant& quant, const TensorView& lhs,
            const TensorView& dout, const TensorView& group_sizes,
            const TensorView& drhs) {
  FP8MOE_ASSIGN_OR_RETURN(const GmmProblem p,
                          internal::CheckTgmm(o, quant, lhs, dout, group_sizes, drhs));
  if (drhs.num_elements() == 0) return OkStatus();  // nothing to write
  GemmCall call;
  call.pass = Pass::kTgmm;
  call.a = Plain(lhs, p.k);
  call.b = Plain(dout, p.n);
  Tensor qg, sg;
  std::vector<int32_t> row_tile;
  int64_t quant_tile =
      quant.per_group ? 0 : o.tiles.m.value_or(internal::kTgmmDefaultQuantTile);
  if (quant_tile > 0) {
    // A tile at least as tall as the largest group cuts every group into one
    // tile, exactly as that largest size does; clamping keeps the reduction
    // block (the tile) from sizing packing buffers past the data.
    int64_t largest = 1;
    for (int64_t g = 0; g < p.e; ++g) largest = std::max(largest, p.offsets[g + 1] - p.offsets[g]);
    quant_tile = std::min(quant_tile, largest);
  }
  if (quant.dout_dtype) {
    const int32_t* sizes = group_sizes.as<int32_t>();
    FP8MOE_ASSIGN_OR_RETURN(const int64_t tiles, NumGroupTiles(sizes, p.e, p.m, quant_tile));
    FP8MOE_ASSIGN_OR_RETURN(qg, Tensor::Create(QuantStorageDType(*quant.dout_dtype), {p.m, p.n}));
    FP8MOE_ASSIGN_OR_RETURN(sg, Tensor::Create(DType::kF32, {std::max<int64_t>(tiles, 1), p.n}));
    FP8MOE_RETURN_IF_ERROR(QuantizeGroupTileChannels(
        dout.as<float>(), p.m, p.n, sizes, p.e, quant_tile, *quant.dout_dtype,
        quant.calibration, qg.data_as<uint8_t>(), sg.data_as<float>()));
    // The tile of every valid row, from the same enumeration the quantizer uses.
    row_tile.assign(static_cast<size_t>(std::max<int64_t>(p.valid_rows, 1)), 0);
    const auto group_tiles = internal::GroupTiles(sizes, p.e, quant_tile);
    for (size_t t = 0; t < group_tiles.size(); ++t) {
      const internal::RowTile& rt = group_tiles[t];
      std::fill(row_tile.begin() + rt.first, row_tile.begin() + rt.first + rt.rows,
                static_cast<int32_t>(t));
    }
    // The codes go in raw (bf16-exact: the pair kernels take them) and the
    // scales are applied to each tile's partial sums, C += s[tile, n] * sum,
    // or once per group: the same product as f32(q) * s summed, regrouped.
    call.b = Plain(qg.view(), p.n);
    call.b_col_scale = sg.data_as<float>();
    call.b_col_scale_ld = p.n;
    call.b_row_tile = row_tile.data();
    call.b_block = quant_tile;
  }
  call.kc = ReductionBlock(o.tiles.m.value_or(kDefaultKc), p.valid_rows);
  call.epi.kind = Epilogue::Kind::kAccumulateF32;
  call.epi.out = drhs.data;
  call.epi.out_ld = p.n;
  call.out_group_stride = p.k * p.n;
  int64_t tile_k = o.tiles.k.value_or(kDefaultTgmmTileK);
  int64_t tile_n = o.tiles.n.value_or(kDefaultTgmmTileN);
  if (!o.tiles.k && !o.tiles.n) {
    int64_t busy = 0;  // groups with rows
    for (int64_t g = 0; g < p.e; ++g) busy += p.offsets[g + 1] > p.offsets[g] ? 1 : 0;
    auto items = [&] { return busy * ((p.k + tile_k - 1) / tile_k) * ((p.n + tile_n - 1) / tile_n); };
    const int64_t want = 4 * static_cast<int64_t>(omp_get_max_threads());
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
  return internal::ExecuteGemm(call);
}

}  // namespace fp8moe
