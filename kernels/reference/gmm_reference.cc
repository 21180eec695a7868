// Plain-loop twins of the grouped matmuls in include/fp8moe/gmm.h: one output
// element at a time, products summed in double, straight from the math in
// gmm.h and docs/design.md §3.3, §4. Slow on purpose: they are the yardstick for the
// fast kernels and for the op tests, so clarity wins over speed everywhere.
//
// Every function validates with the same internal::Check* as the fast kernel,
// reads only the valid rows of lhs / dout / h (tail rows may hold NaN) and
// writes every element of its outputs, tail rows as 0. The same code is the
// "reference" backend (kernels/backend.h): a Context with BackendKind::
// kReference runs every call here, counting KernelPath::kReference.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/cpu/kernel_path.h"
#include "kernels/backend.h"
#include "kernels/gmm_problem.h"
#include "kernels/reference/ops_reference.h"

namespace fp8moe::reference {
namespace {

using internal::GmmProblem;
using internal::KernelPath;

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

// Element i of an F32 tensor, or of a BF16 one (bits) widened exactly.
float FloatAt(const ConstTensorView& t, int64_t i) {
  if (t.dtype == DType::kBF16) return Bf16ToF32(t.as<uint16_t>()[i]);
  return t.as<float>()[i];
}

// Writes the f32 value v to element i of an F32 or BF16 output; BF16 is
// rounded from the f32 value (never from the double before it), as the fast
// kernels round their f32 accumulators.
void Store(const TensorView& t, int64_t i, float v) {
  if (t.dtype == DType::kBF16) {
    t.as<uint16_t>()[i] = F32ToBf16(v);
  } else {
    t.as<float>()[i] = v;
  }
}

float RoundToBf16(float v) { return Bf16ToF32(F32ToBf16(v)); }

// The exact value of one code without any scale: the fp8 value, or the int8
// integer. DequantizeValue with scale 1 is f32(q) * 1, which is exact.
float CodeValue(uint8_t code, QuantDType dtype) {
  return DequantizeValue(code, 1.0f, dtype);
}

// rhs [E, K, N] as the float values a bf16 / f32 GMM multiplies: F32 or BF16
// values as they are, or codes [E, K, N] with rhs_scale [E, N] dequantized to
// the f32 product f32(q) * s, then rounded to bf16 when `to_bf16` (fake QAT's
// BF16 copy; native dLHS's in-kernel tiles, which must match it).
std::vector<float> WeightValues(const GmmProblem& p, const ConstTensorView& rhs,
                                const ConstTensorView* rhs_scale, bool to_bf16) {
  std::vector<float> w(Idx(p.e * p.k * p.n));
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t k = 0; k < p.k; ++k) {
      for (int64_t n = 0; n < p.n; ++n) {
        const int64_t at = (g * p.k + k) * p.n + n;
        float v;
        if (p.rhs_codes) {
          const float s = rhs_scale->as<float>()[g * p.n + n];
          v = DequantizeValue(rhs.as<uint8_t>()[at], s, p.rhs_codes_dtype);
          if (to_bf16) v = RoundToBf16(v);
        } else {
          v = FloatAt(rhs, at);
        }
        w[Idx(at)] = v;
      }
    }
  }
  return w;
}

// The float GMM: h [M, N] = lhs [M, K] x w [E, K, N] per group, each element
// a double sum of f32 products rounded once to f32. Tail rows stay 0.
void FloatProduct(const GmmProblem& p, const ConstTensorView& lhs, const std::vector<float>& w,
                  std::vector<float>* h) {
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t i = p.offsets[Idx(g)]; i < p.offsets[Idx(g) + 1]; ++i) {
      for (int64_t n = 0; n < p.n; ++n) {
        double acc = 0.0;
        for (int64_t k = 0; k < p.k; ++k) {
          acc += static_cast<double>(FloatAt(lhs, i * p.k + k)) *
                 w[Idx((g * p.k + k) * p.n + n)];
        }
        (*h)[Idx(i * p.n + n)] = static_cast<float>(acc);
      }
    }
  }
}

// The quantized GMM (kNativeFp8, kInt8): lhs [M, K] (F32 or BF16) quantized
// per row, per K-block when lhs_quant_block_size > 0, over its valid rows
// only, to codes qa [M, K] + scales sa [M, blocks]; then
// h[i, n] = (sum_b sa[i, b] * sum_{k in b} qa qw) * sw[g, n], in double,
// rounded once to f32. The code sums are exact: int8 in int64, and fp8 in
// double (every e4m3 product is a multiple of 2^-20 below 2^18, so any sum of
// fewer than 2^15 of them fits the 53-bit significand).
Status QuantizedProduct(const GmmOptions& o, const GmmProblem& p, const ConstTensorView& lhs,
                        const ConstTensorView& rhs, const ConstTensorView& rhs_scale,
                        std::vector<float>* h) {
  const bool int8 = o.mode == GmmMode::kInt8;
  const QuantDType qdt = int8 ? QuantDType::kInt8 : o.fp8_dtype;
  const int64_t block = int8 ? 0 : o.lhs_quant_block_size;
  // Only valid rows are copied: QuantizeRows never reads the rest either.
  std::vector<float> x(Idx(p.m * p.k), 0.0f);
  for (int64_t i = 0; i < p.valid_rows; ++i) {
    for (int64_t k = 0; k < p.k; ++k) x[Idx(i * p.k + k)] = FloatAt(lhs, i * p.k + k);
  }
  const int64_t nb = NumBlocks(p.k, block);
  const int64_t bs = block > 0 ? block : p.k;
  std::vector<uint8_t> qa(Idx(p.m * p.k));
  std::vector<float> sa(Idx(p.m * nb));
  // The quantizers' own plain-loop twins, so no SIMD code sits under the
  // reference (they give the same bits as the fast ones; quant_test checks).
  FP8MOE_RETURN_IF_ERROR(fp8moe::reference::QuantizeRows(
      x.data(), p.m, p.k, p.valid_rows, block, qdt, o.lhs_calibration,
      qa.data(), sa.data()));
  const uint8_t* qw = rhs.as<uint8_t>();
  const float* sw = rhs_scale.as<float>();
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t i = p.offsets[Idx(g)]; i < p.offsets[Idx(g) + 1]; ++i) {
      for (int64_t n = 0; n < p.n; ++n) {
        double total = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t k1 = std::min(p.k, (b + 1) * bs);
          double part = 0.0;
          int64_t ipart = 0;
          for (int64_t k = b * bs; k < k1; ++k) {
            const uint8_t a = qa[Idx(i * p.k + k)];
            const uint8_t wq = qw[(g * p.k + k) * p.n + n];
            if (int8) {
              ipart += int64_t{static_cast<int8_t>(a)} * static_cast<int8_t>(wq);
            } else {
              part += static_cast<double>(CodeValue(a, qdt)) * CodeValue(wq, qdt);
            }
          }
          if (int8) part = static_cast<double>(ipart);
          total += part * sa[Idx(i * nb + b)];
        }
        (*h)[Idx(i * p.n + n)] = static_cast<float>(total * sw[g * p.n + n]);
      }
    }
  }
  return OkStatus();
}

// out [M, N] (kSwiGlu: [M, N/2]) = lhs [M, K] x rhs [E, K, N] per group;
// rhs_scale [E, N] with codes; h_out [M, N] (kSwiGlu only). p checked.
Status GmmChecked(const GmmProblem& p, const GmmOptions& options, const ConstTensorView& lhs,
                  const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                  const TensorView& out, const TensorView* h_out) {
  // h [M, N]: the product rounded to f32; tail rows stay 0.
  std::vector<float> h(Idx(p.m * p.n), 0.0f);
  switch (options.mode) {
    case GmmMode::kF32:
    case GmmMode::kBf16:
    case GmmMode::kFakeQat:
      FloatProduct(p, lhs,
                   WeightValues(p, rhs, rhs_scale, options.mode != GmmMode::kF32),
                   &h);
      break;
    case GmmMode::kNativeFp8:
    case GmmMode::kInt8:
      FP8MOE_RETURN_IF_ERROR(QuantizedProduct(options, p, lhs, rhs, *rhs_scale, &h));
      break;
  }
  if (options.epilogue != GmmEpilogue::kSwiGlu) {
    for (int64_t i = 0; i < p.m * p.n; ++i) Store(out, i, h[Idx(i)]);
    return OkStatus();
  }
  // SwiGLU on the f32 pre-activation: gate = h[:, j], up = h[:, F + j].
  const int64_t f = p.n / 2;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < f; ++j) {
      float a = 0.0f;
      if (i < p.valid_rows) {
        const double gate = h[Idx(i * p.n + j)];
        const double up = h[Idx(i * p.n + f + j)];
        a = static_cast<float>(internal::SiluRef(gate) * up);
      }
      Store(out, i * f + j, a);
    }
  }
  if (h_out != nullptr) {
    for (int64_t i = 0; i < p.m * p.n; ++i) Store(*h_out, i, h[Idx(i)]);
  }
  return OkStatus();
}

// out [M, K] (kDSwiGlu: [M, 2K]) = dout [M, N] x rhs[g]^T (rhs [E, K, N]);
// rhs_scale [E, N] with codes; h [M, 2K] (kDSwiGlu only). p checked.
Status DlhsChecked(const GmmProblem& p, const GmmOptions& options, const ConstTensorView& dout,
                   const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                   const TensorView& out, const ConstTensorView* h) {
  // kBf16 and kFakeQat see the same bf16 weight values, so their results are
  // identical by construction, as gmm.h promises for the fast kernels.
  const std::vector<float> w =
      WeightValues(p, rhs, rhs_scale, options.mode != GmmMode::kF32);
  // da [M, K]: the product rounded to f32; tail rows stay 0.
  std::vector<float> da(Idx(p.m * p.k), 0.0f);
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t i = p.offsets[Idx(g)]; i < p.offsets[Idx(g) + 1]; ++i) {
      for (int64_t k = 0; k < p.k; ++k) {
        double acc = 0.0;
        for (int64_t n = 0; n < p.n; ++n) {
          acc += static_cast<double>(FloatAt(dout, i * p.n + n)) *
                 w[Idx((g * p.k + k) * p.n + n)];
        }
        da[Idx(i * p.k + k)] = static_cast<float>(acc);
      }
    }
  }
  if (options.epilogue != GmmEpilogue::kDSwiGlu) {
    for (int64_t i = 0; i < p.m * p.k; ++i) Store(out, i, da[Idx(i)]);
    return OkStatus();
  }
  // dSwiGLU with the saved pre-activation h [M, 2K] = gate | up:
  // dgate = da * up * silu'(gate), dup = da * silu(gate).
  const int64_t k2 = 2 * p.k;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t k = 0; k < p.k; ++k) {
      float dgate = 0.0f, dup = 0.0f;
      if (i < p.valid_rows) {
        const double a = da[Idx(i * p.k + k)];
        const double gate = FloatAt(*h, i * k2 + k);
        const double up = FloatAt(*h, i * k2 + p.k + k);
        dgate = static_cast<float>(a * up * internal::SiluGradRef(gate));
        dup = static_cast<float>(a * internal::SiluRef(gate));
      }
      Store(out, i * k2 + k, dgate);
      Store(out, i * k2 + p.k + k, dup);
    }
  }
  return OkStatus();
}

// drhs [E, K, N] = lhs[rows of g]^T [K, rows] x dout[rows of g] [rows, N];
// lhs [M, K] (F32, BF16 or fp8 codes), dout [M, N], group_sizes [E]. p checked.
Status TgmmChecked(const GmmProblem& p, const GmmOptions& options, const TgmmQuant& quant,
                   const ConstTensorView& lhs, const ConstTensorView& dout,
                   const ConstTensorView& group_sizes, const TensorView& drhs) {
  // a [M, K]: lhs values (codes as their exact values, no scale).
  // b [M, N]: dout values, or dout quantized and dequantized.
  // Tail rows of both stay 0 and are never used.
  std::vector<float> a(Idx(p.m * p.k), 0.0f), b(Idx(p.m * p.n), 0.0f);
  for (int64_t i = 0; i < p.valid_rows; ++i) {
    for (int64_t k = 0; k < p.k; ++k) {
      const int64_t at = i * p.k + k;
      a[Idx(at)] = p.lhs_codes ? CodeValue(lhs.as<uint8_t>()[at], p.lhs_codes_dtype)
                               : FloatAt(lhs, at);
    }
  }
  if (quant.dout_dtype) {
    // One scale per (group, channel), or per (m-tile of a group, channel);
    // scales [tiles, N], tiles in group order; a row's tile is found by
    // walking the groups the same way.
    const int64_t tile_m =
        quant.per_group ? 0 : options.tiles.m.value_or(internal::kTgmmDefaultQuantTile);
    const int32_t* sizes = group_sizes.as<int32_t>();
    FP8MOE_ASSIGN_OR_RETURN(const int64_t tiles,
                            NumGroupTiles(sizes, p.e, p.m, tile_m));
    std::vector<uint8_t> q(Idx(p.m * p.n));
    std::vector<float> scales(Idx(tiles * p.n));
    FP8MOE_RETURN_IF_ERROR(fp8moe::reference::QuantizeGroupTileChannels(
        dout.as<float>(), p.m, p.n, sizes, p.e, tile_m, *quant.dout_dtype,
        quant.calibration, q.data(), scales.data()));
    int64_t tile_base = 0;  // index of group g's first tile
    for (int64_t g = 0; g < p.e; ++g) {
      const int64_t off = p.offsets[Idx(g)], size = sizes[g];
      for (int64_t i = off; i < off + size; ++i) {
        const int64_t t = tile_m == 0 ? g : tile_base + (i - off) / tile_m;
        for (int64_t n = 0; n < p.n; ++n) {
          b[Idx(i * p.n + n)] = DequantizeValue(q[Idx(i * p.n + n)],
                                                scales[Idx(t * p.n + n)],
                                                *quant.dout_dtype);
        }
      }
      tile_base += tile_m == 0 ? 1 : (size + tile_m - 1) / tile_m;
    }
  } else {
    for (int64_t i = 0; i < p.valid_rows * p.n; ++i) b[Idx(i)] = FloatAt(dout, i);
  }
  // An empty group sums nothing and so writes an all-zero slice.
  float* dw = drhs.as<float>();
  for (int64_t g = 0; g < p.e; ++g) {
    for (int64_t k = 0; k < p.k; ++k) {
      for (int64_t n = 0; n < p.n; ++n) {
        double acc = 0.0;
        for (int64_t i = p.offsets[Idx(g)]; i < p.offsets[Idx(g) + 1]; ++i) {
          acc += static_cast<double>(a[Idx(i * p.k + k)]) * b[Idx(i * p.n + n)];
        }
        dw[(g * p.k + k) * p.n + n] = static_cast<float>(acc);
      }
    }
  }
  return OkStatus();
}

// The reference twins as a backend: every GMM call counts once on
// kReference; the other ops are ReferenceOps (kernels/reference/ops_reference.cc).
class ReferenceBackendImpl final : public internal::OpsBackend<internal::ReferenceOps> {
 public:
  BackendKind kind() const override { return BackendKind::kReference; }
  bool Supports(const internal::OpArgs&) const override { return true; }
  Status Gmm(Context& ctx, const GmmProblem& p, const GmmOptions& o, const ConstTensorView& lhs,
             const ConstTensorView& rhs, const ConstTensorView* rhs_scale, const ConstTensorView&,
             const TensorView& out, const TensorView* h_out) override {
    CountKernel(ctx, KernelPath::kReference);
    return GmmChecked(p, o, lhs, rhs, rhs_scale, out, h_out);
  }
  Status Dlhs(Context& ctx, const GmmProblem& p, const GmmOptions& o, const ConstTensorView& dout,
              const ConstTensorView& rhs, const ConstTensorView* rhs_scale, const ConstTensorView&,
              const TensorView& out, const ConstTensorView* h) override {
    CountKernel(ctx, KernelPath::kReference);
    return DlhsChecked(p, o, dout, rhs, rhs_scale, out, h);
  }
  Status Tgmm(Context& ctx, const GmmProblem& p, const GmmOptions& o, const TgmmQuant& quant,
              const ConstTensorView& lhs, const ConstTensorView& dout,
              const ConstTensorView& group_sizes, const TensorView& drhs) override {
    CountKernel(ctx, KernelPath::kReference);
    return TgmmChecked(p, o, quant, lhs, dout, group_sizes, drhs);
  }
};

}  // namespace

Status Gmm(const GmmOptions& options, const ConstTensorView& lhs, const ConstTensorView& rhs,
           const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
           const TensorView& out, const TensorView* h_out) {
  FP8MOE_ASSIGN_OR_RETURN(
      const GmmProblem p,
      internal::CheckGmm(options, lhs, rhs, rhs_scale, group_sizes, out, h_out));
  // No output elements (h_out is empty too): nothing to compute, however
  // large the other dimensions are.
  if (out.num_elements() == 0) return OkStatus();
  return GmmChecked(p, options, lhs, rhs, rhs_scale, out, h_out);
}

Status GmmDlhs(const GmmOptions& options, const ConstTensorView& dout, const ConstTensorView& rhs,
               const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
               const TensorView& out, const ConstTensorView* h) {
  FP8MOE_ASSIGN_OR_RETURN(const GmmProblem p, internal::CheckDlhs(options, dout, rhs, rhs_scale,
                                                                   group_sizes, out, h));
  if (out.num_elements() == 0) return OkStatus();  // nothing to compute
  return DlhsChecked(p, options, dout, rhs, rhs_scale, out, h);
}

Status Tgmm(const GmmOptions& options, const TgmmQuant& quant, const ConstTensorView& lhs,
            const ConstTensorView& dout, const ConstTensorView& group_sizes,
            const TensorView& drhs) {
  FP8MOE_ASSIGN_OR_RETURN(const GmmProblem p, internal::CheckTgmm(options, quant, lhs, dout,
                                                                   group_sizes, drhs));
  if (drhs.num_elements() == 0) return OkStatus();  // nothing to compute
  return TgmmChecked(p, options, quant, lhs, dout, group_sizes, drhs);
}

}  // namespace fp8moe::reference

namespace fp8moe::internal {
Backend& ReferenceBackend() {
  static reference::ReferenceBackendImpl backend;
  return backend;
}
}  // namespace fp8moe::internal
