#include "python/src/gmm_spec.h"

#include "fp8moe/quant.h"

namespace fp8moe::py {

Result<GmmOptions> ToGmmOptions(const GmmSpec& spec) {
  GmmOptions o;
  FP8MOE_ASSIGN_OR_RETURN(o.mode, ParseGmmMode(spec.mode));
  FP8MOE_ASSIGN_OR_RETURN(o.fp8_dtype, ParseQuantDType(spec.fp8_dtype));
  if (spec.epilogue == "none" || spec.epilogue.empty()) {
    o.epilogue = GmmEpilogue::kNone;
  } else if (spec.epilogue == "swiglu") {
    o.epilogue = GmmEpilogue::kSwiGlu;
  } else if (spec.epilogue == "dswiglu") {
    o.epilogue = GmmEpilogue::kDSwiGlu;
  } else {
    return InvalidArgument("unknown epilogue '" + spec.epilogue +
                           "'; expected none, swiglu (gmm) or dswiglu (dlhs)");
  }
  o.lhs_quant_block_size = spec.lhs_quant_block_size;
  FP8MOE_ASSIGN_OR_RETURN(o.lhs_calibration, Calibration::Parse(spec.lhs_calibration));
  FP8MOE_ASSIGN_OR_RETURN(o.lhs_calibration.arithmetic,
                          ParseScaleArithmetic(spec.scale_arithmetic));
  o.tiles.m = spec.tile_m;
  o.tiles.k = spec.tile_k;
  o.tiles.n = spec.tile_n;
  return o;
}

Result<TgmmQuant> ToTgmmQuant(const TgmmSpec& spec) {
  TgmmQuant q;
  if (spec.dout_quant == "e5m2") {
    q.dout_dtype = QuantDType::kE5M2;
  } else if (spec.dout_quant == "e4m3fn" || spec.dout_quant == "e4m3") {
    q.dout_dtype = QuantDType::kE4M3FN;
  } else if (spec.dout_quant != "none" && !spec.dout_quant.empty()) {
    return InvalidArgument("unknown dout_quant '" + spec.dout_quant +
                           "'; expected none, e5m2 or e4m3fn");
  }
  q.per_group = spec.per_group;
  FP8MOE_ASSIGN_OR_RETURN(q.calibration, Calibration::Parse(spec.calibration));
  FP8MOE_ASSIGN_OR_RETURN(q.calibration.arithmetic,
                          ParseScaleArithmetic(spec.scale_arithmetic));
  return q;
}

namespace {
// Dimension i of `s` if it has rank `rank`, else 0.
int64_t Dim(const Shape& s, size_t rank, size_t i) {
  return s.size() == rank ? s[i] : 0;
}
}  // namespace

Shape GmmOutShape(const Shape& lhs, const Shape& rhs, bool swiglu) {
  const int64_t n = Dim(rhs, 3, 2);
  return {Dim(lhs, 2, 0), swiglu ? n / 2 : n};
}

Shape DlhsOutShape(const Shape& dout, const Shape& rhs, bool dswiglu) {
  const int64_t k = Dim(rhs, 3, 1);
  return {Dim(dout, 2, 0), dswiglu ? 2 * k : k};
}

Shape TgmmOutShape(const Shape& lhs, const Shape& dout, const Shape& group_sizes) {
  return {Dim(group_sizes, 1, 0), Dim(lhs, 2, 1), Dim(dout, 2, 1)};
}

}  // namespace fp8moe::py
