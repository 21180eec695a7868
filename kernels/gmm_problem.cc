#include "kernels/gmm_problem.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>

namespace fp8moe::internal {
namespace {

std::string Str(const Shape& s) { return ShapeToString(s); }

// Compares in place: a Shape is built only for the error message, so a
// valid call allocates nothing.
Status NeedShape(const char* what, const ConstTensorView& t, std::initializer_list<int64_t> want) {
  if (!std::equal(t.shape.begin(), t.shape.end(), want.begin(), want.end())) {
    return InvalidArgument(std::string(what) + " has shape " + Str(t.shape) +
                           "; expected " + Str(Shape(want)));
  }
  return OkStatus();
}

Status NeedDType(const char* what, const ConstTensorView& t, std::initializer_list<DType> ok,
                 const char* why) {
  for (DType d : ok) {
    if (t.dtype == d) return OkStatus();
  }
  std::string names;
  for (DType d : ok) names += (names.empty() ? "" : " or ") + std::string(DTypeName(d));
  return InvalidArgument(std::string(what) + " has dtype " +
                         std::string(DTypeName(t.dtype)) + "; " + why +
                         " needs " + names);
}

Status CheckRank(const char* what, const ConstTensorView& t, int rank) {
  if (t.rank() != rank) {
    return InvalidArgument(std::string(what) + " has shape " + Str(t.shape) +
                           "; expected rank " + std::to_string(rank));
  }
  // A view is not checked when it is made: a negative dimension, or nonzero
  // dimensions whose product overflows (even beside a zero), would break the
  // index arithmetic below, so such views are refused like such tensors.
  if (const auto n = CheckedNumElements(t.shape, DTypeSize(t.dtype)); !n.ok()) {
    return InvalidArgument(std::string(what) + ": " + n.status().message());
  }
  if (t.data == nullptr && t.num_elements() > 0) {
    return InvalidArgument(std::string(what) + " has no data");
  }
  return OkStatus();
}

Status CheckTiles(const GmmTiles& t) {
  auto one = [](const char* name, const std::optional<int64_t>& v) -> Status {
    if (v && *v <= 0) {
      return InvalidArgument(std::string("tile ") + name + " = " + std::to_string(*v) +
                             " is invalid; tiles must be positive (leave it "
                             "unset for the per-shape default)");
    }
    if (v && *v > kMaxGmmTile) {
      return InvalidArgument(std::string("tile ") + name + " = " + std::to_string(*v) +
                             " exceeds the largest tile, " + std::to_string(kMaxGmmTile) +
                             " (2^20); a tile at least as large as its dimension "
                             "already covers it whole, so use at most " +
                             std::to_string(kMaxGmmTile) + " (or leave it unset)");
    }
    return OkStatus();
  };
  FP8MOE_RETURN_IF_ERROR(one("m", t.m));
  FP8MOE_RETURN_IF_ERROR(one("k", t.k));
  FP8MOE_RETURN_IF_ERROR(one("n", t.n));
  if (t.k && *t.k % 2 != 0) {
    return InvalidArgument("tile k = " + std::to_string(*t.k) +
                           " is odd; the kernels reduce k in pairs, so tile k "
                           "must be a multiple of 2");
  }
  return OkStatus();
}

// Group sizes: I32 [e], none negative, sum <= m.
Status CheckGroups(const ConstTensorView& gs, int64_t e, int64_t m, GmmProblem* p) {
  FP8MOE_RETURN_IF_ERROR(CheckRank("group_sizes", gs, 1));
  FP8MOE_RETURN_IF_ERROR(NeedDType("group_sizes", gs, {DType::kI32}, "a group count"));
  if (gs.shape[0] != e) {
    return InvalidArgument("group_sizes has " + std::to_string(gs.shape[0]) +
                           " entries but there are " + std::to_string(e) +
                           " experts (groups)");
  }
  const int32_t* s = gs.as<int32_t>();
  FP8MOE_RETURN_IF_ERROR(CheckGroupSizes(s, e, m));
  p->offsets.assign(static_cast<size_t>(e) + 1, 0);
  for (int64_t g = 0; g < e; ++g) p->offsets[g + 1] = p->offsets[g] + s[g];
  p->valid_rows = p->offsets[e];
  return OkStatus();
}

// rhs [e, k, n] of the mode, with rhs_scale [e, n] exactly when it holds codes.
Status CheckRhs(GmmMode mode, const GmmOptions& o, const ConstTensorView& rhs,
                const ConstTensorView* scale, bool allow_codes_in_float_modes, GmmProblem* p) {
  FP8MOE_RETURN_IF_ERROR(CheckRank("rhs", rhs, 3));
  p->e = rhs.shape[0];
  p->k = rhs.shape[1];
  p->n = rhs.shape[2];
  const bool codes = IsFp8(rhs.dtype) || rhs.dtype == DType::kI8;
  switch (mode) {
    case GmmMode::kF32:
      if (!(allow_codes_in_float_modes && IsFp8(rhs.dtype))) {
        FP8MOE_RETURN_IF_ERROR(NeedDType("rhs", rhs, {DType::kF32}, "mode f32"));
      }
      break;
    case GmmMode::kBf16:
      if (!(allow_codes_in_float_modes && IsFp8(rhs.dtype))) {
        FP8MOE_RETURN_IF_ERROR(NeedDType("rhs", rhs, {DType::kBF16}, "mode bf16"));
      }
      break;
    case GmmMode::kFakeQat:
      if (!IsFp8(rhs.dtype)) {
        return InvalidArgument("rhs has dtype " + std::string(DTypeName(rhs.dtype)) +
                               "; mode fake_qat needs fp8 codes (with rhs_scale)");
      }
      break;
    case GmmMode::kNativeFp8:
      if (rhs.dtype != QuantStorageDType(o.fp8_dtype)) {
        return InvalidArgument(
            "rhs has dtype " + std::string(DTypeName(rhs.dtype)) +
            "; mode native_fp8 with fp8_dtype " +
            std::string(QuantDTypeName(o.fp8_dtype)) + " needs " +
            std::string(DTypeName(QuantStorageDType(o.fp8_dtype))) + " codes");
      }
      break;
    case GmmMode::kInt8:
      FP8MOE_RETURN_IF_ERROR(NeedDType("rhs", rhs, {DType::kI8}, "mode int8"));
      break;
  }
  p->rhs_codes = codes;
  if (codes) {
    p->rhs_codes_dtype = *QuantDTypeOf(rhs.dtype);
    if (scale == nullptr) {
      return InvalidArgument("rhs holds " + std::string(DTypeName(rhs.dtype)) +
                             " codes but no rhs_scale [E, N] was given");
    }
    FP8MOE_RETURN_IF_ERROR(CheckRank("rhs_scale", *scale, 2));
    FP8MOE_RETURN_IF_ERROR(NeedDType("rhs_scale", *scale, {DType::kF32}, "a scale"));
    FP8MOE_RETURN_IF_ERROR(NeedShape("rhs_scale", *scale, {p->e, p->n}));
  } else if (scale != nullptr) {
    return InvalidArgument("rhs_scale was given but rhs holds " +
                           std::string(DTypeName(rhs.dtype)) +
                           " values, not codes; drop rhs_scale");
  }
  return OkStatus();
}

}  // namespace

Status CheckGmm(const GmmOptions& o, const ConstTensorView& lhs, const ConstTensorView& rhs,
                const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                const TensorView& out, const TensorView* h_out, GmmProblem* pp) {
  GmmProblem& p = *pp;
  p.Reset();
  FP8MOE_RETURN_IF_ERROR(CheckTiles(o.tiles));
  FP8MOE_RETURN_IF_ERROR(CheckRhs(o.mode, o, rhs, rhs_scale, false, &p));
  FP8MOE_RETURN_IF_ERROR(CheckRank("lhs", lhs, 2));
  switch (o.mode) {
    case GmmMode::kF32:
      FP8MOE_RETURN_IF_ERROR(NeedDType("lhs", lhs, {DType::kF32}, "mode f32"));
      break;
    case GmmMode::kBf16:
    case GmmMode::kFakeQat:
      FP8MOE_RETURN_IF_ERROR(NeedDType("lhs", lhs, {DType::kBF16}, "a bf16 GMM"));
      break;
    case GmmMode::kNativeFp8:
    case GmmMode::kInt8:
      FP8MOE_RETURN_IF_ERROR(NeedDType("lhs", lhs, {DType::kF32, DType::kBF16},
                                       "quantizing inside the GMM"));
      break;
  }
  p.m = lhs.shape[0];
  if (lhs.shape[1] != p.k) {
    return InvalidArgument("lhs has shape " + Str(lhs.shape) + " but rhs is " +
                           Str(rhs.shape) + ": lhs columns must equal rhs's K = " +
                           std::to_string(p.k));
  }
  if (o.mode == GmmMode::kNativeFp8) {
    if (o.fp8_dtype != QuantDType::kE4M3FN && o.fp8_dtype != QuantDType::kE4M3FNUZ) {
      return InvalidArgument("native_fp8 takes fp8_dtype e4m3fn or e4m3fnuz, not " +
                             std::string(QuantDTypeName(o.fp8_dtype)));
    }
    const int64_t b = o.lhs_quant_block_size;
    if (b != 0 && b != 128 && b != 512) {
      return InvalidArgument("lhs_quant_block_size = " + std::to_string(b) +
                             " is not supported; use 0 (full K), 128 or 512");
    }
  } else if (o.lhs_quant_block_size != 0) {
    return InvalidArgument("lhs_quant_block_size applies to mode native_fp8 only");
  }
  if (o.epilogue == GmmEpilogue::kDSwiGlu) {
    return InvalidArgument("epilogue dswiglu belongs to the dLHS GMM (GmmDlhs)");
  }
  const bool swiglu = o.epilogue == GmmEpilogue::kSwiGlu;
  if (swiglu && p.n % 2 != 0) {
    return InvalidArgument("epilogue swiglu needs an even number of rhs columns "
                           "(gate | up); rhs is " + Str(rhs.shape));
  }
  FP8MOE_RETURN_IF_ERROR(CheckGroups(group_sizes, p.e, p.m, &p));
  FP8MOE_RETURN_IF_ERROR(CheckRank("out", out, 2));
  FP8MOE_RETURN_IF_ERROR(NeedDType("out", out, {DType::kF32, DType::kBF16}, "an output"));
  FP8MOE_RETURN_IF_ERROR(NeedShape("out", out, {p.m, swiglu ? p.n / 2 : p.n}));
  if (h_out != nullptr) {
    if (!swiglu) return InvalidArgument("h_out is only written by epilogue swiglu");
    FP8MOE_RETURN_IF_ERROR(CheckRank("h_out", *h_out, 2));
    FP8MOE_RETURN_IF_ERROR(NeedDType("h_out", *h_out, {DType::kF32, DType::kBF16}, "an output"));
    FP8MOE_RETURN_IF_ERROR(NeedShape("h_out", *h_out, {p.m, p.n}));
  }
  return OkStatus();
}

Status CheckDlhs(const GmmOptions& o, const ConstTensorView& dout, const ConstTensorView& rhs,
                 const ConstTensorView* rhs_scale, const ConstTensorView& group_sizes,
                 const TensorView& out, const ConstTensorView* h, GmmProblem* pp) {
  GmmProblem& p = *pp;
  p.Reset();
  FP8MOE_RETURN_IF_ERROR(CheckTiles(o.tiles));
  if (o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8) {
    return InvalidArgument("dlhs runs in mode f32, bf16 or fake_qat (native "
                           "dLHS is mode bf16 with rhs codes + rhs_scale)");
  }
  FP8MOE_RETURN_IF_ERROR(CheckRhs(o.mode, o, rhs, rhs_scale, true, &p));
  FP8MOE_RETURN_IF_ERROR(CheckRank("dout", dout, 2));
  FP8MOE_RETURN_IF_ERROR(NeedDType("dout", dout,
                                   {o.mode == GmmMode::kF32 ? DType::kF32 : DType::kBF16},
                                   o.mode == GmmMode::kF32 ? "mode f32" : "a bf16 dlhs"));
  p.m = dout.shape[0];
  if (dout.shape[1] != p.n) {
    return InvalidArgument("dout has shape " + Str(dout.shape) + " but rhs is " +
                           Str(rhs.shape) + ": dout columns must equal rhs's N = " +
                           std::to_string(p.n));
  }
  if (o.lhs_quant_block_size != 0) {
    return InvalidArgument("lhs_quant_block_size applies to mode native_fp8 only");
  }
  if (o.epilogue == GmmEpilogue::kSwiGlu) {
    return InvalidArgument("epilogue swiglu belongs to the forward GMM; the "
                           "dLHS one is dswiglu");
  }
  FP8MOE_RETURN_IF_ERROR(CheckGroups(group_sizes, p.e, p.m, &p));
  const bool dswiglu = o.epilogue == GmmEpilogue::kDSwiGlu;
  FP8MOE_RETURN_IF_ERROR(CheckRank("out", out, 2));
  FP8MOE_RETURN_IF_ERROR(NeedDType("out", out, {DType::kF32, DType::kBF16}, "an output"));
  FP8MOE_RETURN_IF_ERROR(NeedShape("out", out, {p.m, dswiglu ? 2 * p.k : p.k}));
  if (dswiglu) {
    if (h == nullptr) {
      return InvalidArgument("epilogue dswiglu needs h, the forward's saved "
                             "pre-activation [M, 2K]");
    }
    FP8MOE_RETURN_IF_ERROR(CheckRank("h", *h, 2));
    FP8MOE_RETURN_IF_ERROR(NeedDType("h", *h, {DType::kF32, DType::kBF16}, "the pre-activation"));
    FP8MOE_RETURN_IF_ERROR(NeedShape("h", *h, {p.m, 2 * p.k}));
  } else if (h != nullptr) {
    return InvalidArgument("h is only read by epilogue dswiglu");
  }
  return OkStatus();
}

Status CheckTgmm(const GmmOptions& o, const TgmmQuant& quant, const ConstTensorView& lhs,
                 const ConstTensorView& dout, const ConstTensorView& group_sizes,
                 const TensorView& drhs, GmmProblem* pp) {
  GmmProblem& p = *pp;
  p.Reset();
  FP8MOE_RETURN_IF_ERROR(CheckTiles(o.tiles));
  if (o.mode != GmmMode::kF32 && o.mode != GmmMode::kBf16) {
    return InvalidArgument("tgmm runs in mode f32 or bf16 (quantized operands "
                           "come as lhs codes and TgmmQuant)");
  }
  if (o.epilogue != GmmEpilogue::kNone || o.lhs_quant_block_size != 0) {
    return InvalidArgument("tgmm takes no epilogue and no lhs_quant_block_size");
  }
  FP8MOE_RETURN_IF_ERROR(CheckRank("lhs", lhs, 2));
  FP8MOE_RETURN_IF_ERROR(CheckRank("dout", dout, 2));
  const DType fdt = o.mode == GmmMode::kF32 ? DType::kF32 : DType::kBF16;
  p.lhs_codes = IsFp8(lhs.dtype);
  if (p.lhs_codes) {
    p.lhs_codes_dtype = *QuantDTypeOf(lhs.dtype);
  } else {
    FP8MOE_RETURN_IF_ERROR(NeedDType("lhs", lhs, {fdt}, o.mode == GmmMode::kF32 ? "mode f32" : "mode bf16"));
  }
  if (quant.dout_dtype) {
    if (*quant.dout_dtype != QuantDType::kE5M2 && *quant.dout_dtype != QuantDType::kE4M3FN) {
      return InvalidArgument("the tgmm gradient dtype must be e5m2 or e4m3fn, not " +
                             std::string(QuantDTypeName(*quant.dout_dtype)));
    }
    FP8MOE_RETURN_IF_ERROR(NeedDType("dout", dout, {DType::kF32}, "quantizing dout"));
  } else {
    FP8MOE_RETURN_IF_ERROR(NeedDType("dout", dout, {fdt}, o.mode == GmmMode::kF32 ? "mode f32" : "mode bf16"));
  }
  p.m = lhs.shape[0];
  p.k = lhs.shape[1];
  p.n = dout.shape[1];
  if (dout.shape[0] != p.m) {
    return InvalidArgument("dout has " + std::to_string(dout.shape[0]) +
                           " rows but lhs has " + std::to_string(p.m));
  }
  FP8MOE_RETURN_IF_ERROR(CheckRank("drhs", drhs, 3));
  FP8MOE_RETURN_IF_ERROR(NeedDType("drhs", drhs, {DType::kF32}, "the weight gradient"));
  p.e = drhs.shape[0];
  FP8MOE_RETURN_IF_ERROR(NeedShape("drhs", drhs, {p.e, p.k, p.n}));
  FP8MOE_RETURN_IF_ERROR(CheckGroups(group_sizes, p.e, p.m, &p));
  return OkStatus();
}

Result<GmmProblem> CheckGmm(const GmmOptions& o, const ConstTensorView& lhs,
                            const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                            const ConstTensorView& group_sizes, const TensorView& out,
                            const TensorView* h_out) {
  GmmProblem p;
  FP8MOE_RETURN_IF_ERROR(CheckGmm(o, lhs, rhs, rhs_scale, group_sizes, out, h_out, &p));
  return p;
}

Result<GmmProblem> CheckDlhs(const GmmOptions& o, const ConstTensorView& dout,
                             const ConstTensorView& rhs, const ConstTensorView* rhs_scale,
                             const ConstTensorView& group_sizes, const TensorView& out,
                             const ConstTensorView* h) {
  GmmProblem p;
  FP8MOE_RETURN_IF_ERROR(CheckDlhs(o, dout, rhs, rhs_scale, group_sizes, out, h, &p));
  return p;
}

Result<GmmProblem> CheckTgmm(const GmmOptions& o, const TgmmQuant& quant,
                             const ConstTensorView& lhs, const ConstTensorView& dout,
                             const ConstTensorView& group_sizes, const TensorView& drhs) {
  GmmProblem p;
  FP8MOE_RETURN_IF_ERROR(CheckTgmm(o, quant, lhs, dout, group_sizes, drhs, &p));
  return p;
}

double SigmoidRef(double x) {
  if (std::isnan(x)) return x;
  return 1.0 / (1.0 + std::exp(-x));  // exp overflow gives 1 / inf = +0
}

double SiluRef(double x) {
  if (x == -std::numeric_limits<double>::infinity()) return -0.0;  // the limit
  return x * SigmoidRef(x);
}

double SiluGradRef(double x) {
  if (std::isinf(x)) return x > 0 ? 1.0 : -0.0;  // the limits
  const double s = SigmoidRef(x);
  return s * (1.0 + x * (1.0 - s));
}

}  // namespace fp8moe::internal

namespace fp8moe {
namespace {
constexpr std::string_view kModeNames[] = {"f32", "bf16", "fake_qat", "native_fp8", "int8"};
}  // namespace

std::string_view GmmModeName(GmmMode mode) {
  return kModeNames[static_cast<int>(mode)];
}

Result<GmmMode> ParseGmmMode(std::string_view name) {
  for (int i = 0; i < 5; ++i) {
    if (kModeNames[i] == name) return static_cast<GmmMode>(i);
  }
  return InvalidArgument("unknown gmm mode '" + std::string(name) +
                         "'; expected f32, bf16, fake_qat, native_fp8 or int8");
}

}  // namespace fp8moe
