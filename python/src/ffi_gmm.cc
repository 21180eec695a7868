// XLA FFI handlers of the grouped matmuls and the quantizer, for
// fp8moe.jax (python/fp8moe/jax.py registers them with
// jax.ffi.register_ffi_target on the CPU platform). Operands are XLA's
// buffers read in place, results are XLA's buffers written in place; the
// attributes are the options as Python spells them (python/src/gmm_spec.h).
// Every library error comes back as an XLA error with the library's message.
//
//  fp8moe_gmm       (lhs, rhs, [rhs_scale], group_sizes) -> (out, [h])
//  fp8moe_dlhs      (dout, rhs, [rhs_scale], group_sizes, [h]) -> dlhs
//  fp8moe_tgmm      (lhs, dout, group_sizes) -> drhs f32
//  fp8moe_quantize  (x f32) -> (q, scale)   row | channel | tensor
#include <mutex>
#include <optional>
#include <string>

#include "fp8moe/gmm.h"
#include "fp8moe/quant.h"
#include "python/src/bind.h"
#include "python/src/ffi_util.h"
#include "python/src/gmm_spec.h"

namespace fp8moe::py {
namespace {

namespace ffi = ::xla::ffi;
using ffi_util::Arg;
using ffi_util::GetAttr;
using ffi_util::Ret;

// Tiles come as int64 attributes; -1 means unset.
Status ReadTiles(const ffi::Dictionary& attrs, GmmSpec* spec) {
  const std::pair<const char*, std::optional<int64_t>*> tiles[] = {
      {"tile_m", &spec->tile_m}, {"tile_k", &spec->tile_k}, {"tile_n", &spec->tile_n}};
  for (const auto& [name, slot] : tiles) {
    FP8MOE_ASSIGN_OR_RETURN(const int64_t v, GetAttr<int64_t>(attrs, name));
    if (v != -1) *slot = v;
  }
  return OkStatus();
}

Status GmmImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
               const ffi::Dictionary& attrs) {
  GmmSpec spec;
  FP8MOE_ASSIGN_OR_RETURN(spec.mode, GetAttr<std::string_view>(attrs, "mode"));
  FP8MOE_ASSIGN_OR_RETURN(spec.fp8_dtype, GetAttr<std::string_view>(attrs, "fp8_dtype"));
  FP8MOE_ASSIGN_OR_RETURN(spec.epilogue, GetAttr<std::string_view>(attrs, "epilogue"));
  FP8MOE_ASSIGN_OR_RETURN(spec.lhs_quant_block_size,
                          GetAttr<int64_t>(attrs, "lhs_quant_block_size"));
  FP8MOE_ASSIGN_OR_RETURN(spec.lhs_calibration,
                          GetAttr<std::string_view>(attrs, "lhs_calibration"));
  FP8MOE_ASSIGN_OR_RETURN(spec.scale_arithmetic,
                          GetAttr<std::string_view>(attrs, "scale_arithmetic"));
  FP8MOE_RETURN_IF_ERROR(ReadTiles(attrs, &spec));
  FP8MOE_ASSIGN_OR_RETURN(const bool has_scale, GetAttr<bool>(attrs, "has_scale"));
  FP8MOE_ASSIGN_OR_RETURN(const GmmOptions o, ToGmmOptions(spec));
  size_t i = 0;
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView lhs, Arg(args, i++, "lhs"));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView rhs, Arg(args, i++, "rhs"));
  std::optional<ConstTensorView> scale;
  if (has_scale) {
    FP8MOE_ASSIGN_OR_RETURN(scale, Arg(args, i++, "rhs_scale"));
  }
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView gs, Arg(args, i++, "group_sizes"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView out, Ret(rets, 0, "out"));
  std::optional<TensorView> h;
  if (rets.size() > 1) {
    FP8MOE_ASSIGN_OR_RETURN(h, Ret(rets, 1, "h"));
  }
  LibraryCall call;
  return Gmm(o, lhs, rhs, scale ? &*scale : nullptr, gs, out, h ? &*h : nullptr);
}

Status DlhsImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                const ffi::Dictionary& attrs) {
  GmmSpec spec;
  FP8MOE_ASSIGN_OR_RETURN(spec.mode, GetAttr<std::string_view>(attrs, "mode"));
  FP8MOE_ASSIGN_OR_RETURN(spec.fp8_dtype, GetAttr<std::string_view>(attrs, "fp8_dtype"));
  FP8MOE_ASSIGN_OR_RETURN(spec.epilogue, GetAttr<std::string_view>(attrs, "epilogue"));
  FP8MOE_RETURN_IF_ERROR(ReadTiles(attrs, &spec));
  FP8MOE_ASSIGN_OR_RETURN(const bool has_scale, GetAttr<bool>(attrs, "has_scale"));
  FP8MOE_ASSIGN_OR_RETURN(const bool has_h, GetAttr<bool>(attrs, "has_h"));
  FP8MOE_ASSIGN_OR_RETURN(const GmmOptions o, ToGmmOptions(spec));
  size_t i = 0;
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView dout, Arg(args, i++, "dout"));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView rhs, Arg(args, i++, "rhs"));
  std::optional<ConstTensorView> scale, h;
  if (has_scale) {
    FP8MOE_ASSIGN_OR_RETURN(scale, Arg(args, i++, "rhs_scale"));
  }
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView gs, Arg(args, i++, "group_sizes"));
  if (has_h) {
    FP8MOE_ASSIGN_OR_RETURN(h, Arg(args, i++, "h"));
  }
  FP8MOE_ASSIGN_OR_RETURN(const TensorView out, Ret(rets, 0, "dlhs"));
  LibraryCall call;
  return GmmDlhs(o, dout, rhs, scale ? &*scale : nullptr, gs, out, h ? &*h : nullptr);
}

Status TgmmImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                const ffi::Dictionary& attrs) {
  GmmSpec spec;
  FP8MOE_ASSIGN_OR_RETURN(spec.mode, GetAttr<std::string_view>(attrs, "mode"));
  FP8MOE_RETURN_IF_ERROR(ReadTiles(attrs, &spec));
  TgmmSpec ts;
  FP8MOE_ASSIGN_OR_RETURN(ts.dout_quant, GetAttr<std::string_view>(attrs, "dout_quant"));
  FP8MOE_ASSIGN_OR_RETURN(ts.per_group, GetAttr<bool>(attrs, "per_group"));
  FP8MOE_ASSIGN_OR_RETURN(ts.calibration, GetAttr<std::string_view>(attrs, "calibration"));
  FP8MOE_ASSIGN_OR_RETURN(ts.scale_arithmetic,
                          GetAttr<std::string_view>(attrs, "scale_arithmetic"));
  FP8MOE_ASSIGN_OR_RETURN(const GmmOptions o, ToGmmOptions(spec));
  FP8MOE_ASSIGN_OR_RETURN(const TgmmQuant quant, ToTgmmQuant(ts));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView lhs, Arg(args, 0, "lhs"));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView dout, Arg(args, 1, "dout"));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView gs, Arg(args, 2, "group_sizes"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView drhs, Ret(rets, 0, "drhs"));
  LibraryCall call;
  return Tgmm(o, quant, lhs, dout, gs, drhs);
}

// x f32 [R, C] (row), [E, K, N] (channel) or any shape (tensor) -> codes of
// the result's dtype and f32 scales of the granularity's shape.
Status QuantizeImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                    const ffi::Dictionary& attrs) {
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view granularity,
                          GetAttr<std::string_view>(attrs, "granularity"));
  FP8MOE_ASSIGN_OR_RETURN(const int64_t block, GetAttr<int64_t>(attrs, "block_size"));
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view calib_text,
                          GetAttr<std::string_view>(attrs, "calibration"));
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view arith_text,
                          GetAttr<std::string_view>(attrs, "scale_arithmetic"));
  FP8MOE_ASSIGN_OR_RETURN(Calibration cal, Calibration::Parse(calib_text));
  FP8MOE_ASSIGN_OR_RETURN(cal.arithmetic, ParseScaleArithmetic(arith_text));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView x, Arg(args, 0, "x"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView q, Ret(rets, 0, "q"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView s, Ret(rets, 1, "scale"));
  FP8MOE_ASSIGN_OR_RETURN(const QuantDType dt, QuantDTypeOf(q.dtype));
  if (x.dtype != DType::kF32 || q.shape != x.shape || s.dtype != DType::kF32) {
    return InvalidArgument("x must be f32 and q of its shape, scale f32");
  }
  Shape want;
  if (granularity == "tensor") {
    want = {1};
  } else if (granularity == "row" && x.rank() == 2) {
    want = {x.shape[0], NumBlocks(x.shape[1], block)};
  } else if (granularity == "channel" && x.rank() == 3) {
    want = {x.shape[0], x.shape[2]};
  } else {
    return InvalidArgument("granularity " + std::string(granularity) +
                           " does not fit x " + ShapeToString(x.shape) +
                           " (row: [R, C], channel: [E, K, N], or tensor)");
  }
  if (s.shape != want) {
    return InvalidArgument("scale has shape " + ShapeToString(s.shape) + "; expected " +
                           ShapeToString(want));
  }
  LibraryCall call;
  const float* xs = x.as<float>();
  if (granularity == "tensor") {
    return QuantizeTensor(xs, static_cast<int64_t>(x.num_elements()), dt, cal,
                          q.as<uint8_t>(), s.as<float>());
  }
  if (granularity == "row") {
    return QuantizeRows(xs, x.shape[0], x.shape[1], x.shape[0], block, dt, cal,
                        q.as<uint8_t>(), s.as<float>());
  }
  return QuantizeChannels(xs, x.shape[0], x.shape[1], x.shape[2], dt, cal,
                          q.as<uint8_t>(), s.as<float>());
}

ffi::Error GmmFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("gmm", GmmImpl(a, r, d));
}
ffi::Error DlhsFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("dlhs", DlhsImpl(a, r, d));
}
ffi::Error TgmmFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("tgmm", TgmmImpl(a, r, d));
}
ffi::Error QuantizeFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("quantize", QuantizeImpl(a, r, d));
}

}  // namespace
}  // namespace fp8moe::py

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeGmmFfi, fp8moe::py::GmmFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeDlhsFfi, fp8moe::py::DlhsFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeTgmmFfi, fp8moe::py::TgmmFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeQuantizeFfi, fp8moe::py::QuantizeFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

namespace fp8moe::py {

// Adds the GMM and quantize handlers to `targets` (python/src/ffi_moe in
// bind_moe.cc adds the MoE layer's).
void AddGmmFfiTargets(nb::dict& targets) {
  targets["fp8moe_gmm"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeGmmFfi));
  targets["fp8moe_dlhs"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeDlhsFfi));
  targets["fp8moe_tgmm"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeTgmmFfi));
  targets["fp8moe_quantize"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeQuantizeFfi));
}

}  // namespace fp8moe::py
