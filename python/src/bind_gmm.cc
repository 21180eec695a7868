// _core.gmm, dlhs, tgmm: include/fp8moe/gmm.h on numpy arrays. Inputs are
// read in place; outputs are new arrays the kernels write directly. The
// library validates every argument (the messages `fp8moe op gmm` prints).
#include <optional>
#include <string>

#include "fp8moe/gmm.h"
#include "python/src/bind.h"
#include "python/src/gmm_spec.h"

namespace fp8moe::py {
namespace {

DType OutDType(std::string_view fn, const std::string& name) {
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  throw nb::value_error((std::string(fn) + ": out_dtype '" + name +
                         "' is not supported; use float32 or bfloat16").c_str());
}

GmmOptions Options(std::string_view fn, const GmmSpec& spec) {
  auto o = ToGmmOptions(spec);
  ThrowIfError(fn, o.status());
  return *o;
}

// An optional (array, dtype) pair as an optional view.
std::optional<ConstTensorView> Maybe(std::string_view fn, const char* name,
                                     const std::optional<Array>& a,
                                     const std::optional<std::string>& dtype) {
  if (!a) return std::nullopt;
  return View(fn, name, *a, dtype.value_or(""));
}

GmmSpec Spec(const std::string& mode, const std::string& fp8_dtype,
             const std::string& epilogue, std::optional<int64_t> tile_m,
             std::optional<int64_t> tile_k, std::optional<int64_t> tile_n) {
  GmmSpec s;
  s.mode = mode;
  s.fp8_dtype = fp8_dtype;
  s.epilogue = epilogue;
  s.tile_m = tile_m;
  s.tile_k = tile_k;
  s.tile_n = tile_n;
  return s;
}

// out [M, N] (swiglu: [M, N/2], and h [M, N] if return_h).
nb::tuple GmmCall(const Array& lhs, const std::string& lhs_dtype, const Array& rhs,
                  const std::string& rhs_dtype, std::optional<Array> rhs_scale,
                  std::optional<std::string> rhs_scale_dtype, const Array& group_sizes,
                  const std::string& gs_dtype, const std::string& mode,
                  const std::string& fp8_dtype, int64_t lhs_quant_block_size,
                  const std::string& lhs_calibration, const std::string& scale_arithmetic,
                  const std::string& epilogue, const std::string& out_dtype, bool return_h,
                  std::optional<int64_t> tile_m, std::optional<int64_t> tile_k,
                  std::optional<int64_t> tile_n, bool reference) {
  const char* fn = "gmm";
  GmmSpec spec = Spec(mode, fp8_dtype, epilogue, tile_m, tile_k, tile_n);
  spec.lhs_quant_block_size = lhs_quant_block_size;
  spec.lhs_calibration = lhs_calibration;
  spec.scale_arithmetic = scale_arithmetic;
  const GmmOptions o = Options(fn, spec);
  const ConstTensorView l = View(fn, "lhs", lhs, lhs_dtype);
  const ConstTensorView r = View(fn, "rhs", rhs, rhs_dtype);
  const auto s = Maybe(fn, "rhs_scale", rhs_scale, rhs_scale_dtype);
  const ConstTensorView gs = View(fn, "group_sizes", group_sizes, gs_dtype);
  const bool swiglu = o.epilogue == GmmEpilogue::kSwiGlu;
  const DType od = OutDType(fn, out_dtype);
  NewArray out = MakeArray(fn, od, GmmOutShape(l.shape, r.shape, swiglu));
  std::optional<NewArray> h;
  if (return_h) {
    if (!swiglu) throw nb::value_error("gmm: return_h needs epilogue='swiglu'");
    h = MakeArray(fn, od, GmmOutShape(l.shape, r.shape, false));
  }
  Status st;
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    const ConstTensorView* sp = s ? &*s : nullptr;
    const TensorView* hp = h ? &h->view : nullptr;
    st = reference ? reference::Gmm(o, l, r, sp, gs, out.view, hp)
                   : Gmm(o, l, r, sp, gs, out.view, hp);
  }
  ThrowIfError(fn, st);
  return nb::make_tuple(Out(out), h ? nb::object(Out(*h)) : nb::none());
}

// dlhs [M, K] (dswiglu: dh [M, 2K]).
nb::tuple DlhsCall(const Array& dout, const std::string& dout_dtype, const Array& rhs,
                   const std::string& rhs_dtype, std::optional<Array> rhs_scale,
                   std::optional<std::string> rhs_scale_dtype, const Array& group_sizes,
                   const std::string& gs_dtype, std::optional<Array> h,
                   std::optional<std::string> h_dtype, const std::string& mode,
                   const std::string& fp8_dtype, const std::string& epilogue,
                   const std::string& out_dtype, std::optional<int64_t> tile_m,
                   std::optional<int64_t> tile_k, std::optional<int64_t> tile_n,
                   bool reference) {
  const char* fn = "dlhs";
  const GmmOptions o = Options(fn, Spec(mode, fp8_dtype, epilogue, tile_m, tile_k, tile_n));
  const ConstTensorView d = View(fn, "dout", dout, dout_dtype);
  const ConstTensorView r = View(fn, "rhs", rhs, rhs_dtype);
  const auto s = Maybe(fn, "rhs_scale", rhs_scale, rhs_scale_dtype);
  const auto hv = Maybe(fn, "h", h, h_dtype);
  const ConstTensorView gs = View(fn, "group_sizes", group_sizes, gs_dtype);
  NewArray out = MakeArray(fn, OutDType(fn, out_dtype),
                           DlhsOutShape(d.shape, r.shape, o.epilogue == GmmEpilogue::kDSwiGlu));
  Status st;
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    const ConstTensorView* sp = s ? &*s : nullptr;
    const ConstTensorView* hp = hv ? &*hv : nullptr;
    st = reference ? reference::GmmDlhs(o, d, r, sp, gs, out.view, hp)
                   : GmmDlhs(o, d, r, sp, gs, out.view, hp);
  }
  ThrowIfError(fn, st);
  return Out(out);
}

// drhs [E, K, N] f32.
nb::tuple TgmmCall(const Array& lhs, const std::string& lhs_dtype, const Array& dout,
                   const std::string& dout_dtype, const Array& group_sizes,
                   const std::string& gs_dtype, const std::string& mode,
                   const std::string& dout_quant, bool per_group,
                   const std::string& calibration, const std::string& scale_arithmetic,
                   std::optional<int64_t> tile_m, std::optional<int64_t> tile_k,
                   std::optional<int64_t> tile_n, bool reference) {
  const char* fn = "tgmm";
  const GmmOptions o = Options(fn, Spec(mode, "e4m3fn", "none", tile_m, tile_k, tile_n));
  TgmmSpec ts;
  ts.dout_quant = dout_quant;
  ts.per_group = per_group;
  ts.calibration = calibration;
  ts.scale_arithmetic = scale_arithmetic;
  auto quant = ToTgmmQuant(ts);
  ThrowIfError(fn, quant.status());
  const ConstTensorView l = View(fn, "lhs", lhs, lhs_dtype);
  const ConstTensorView d = View(fn, "dout", dout, dout_dtype);
  const ConstTensorView gs = View(fn, "group_sizes", group_sizes, gs_dtype);
  NewArray out = MakeArray(fn, DType::kF32, TgmmOutShape(l.shape, d.shape, gs.shape));
  Status st;
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    st = reference ? reference::Tgmm(o, *quant, l, d, gs, out.view)
                   : Tgmm(o, *quant, l, d, gs, out.view);
  }
  ThrowIfError(fn, st);
  return Out(out);
}

}  // namespace

void BindGmm(nb::module_& m) {
  m.def("gmm", &GmmCall, nb::arg("lhs"), nb::arg("lhs_dtype"), nb::arg("rhs"),
        nb::arg("rhs_dtype"), nb::arg("rhs_scale").none(), nb::arg("rhs_scale_dtype").none(),
        nb::arg("group_sizes"), nb::arg("gs_dtype"), nb::arg("mode"), nb::arg("fp8_dtype"),
        nb::arg("lhs_quant_block_size"), nb::arg("lhs_calibration"),
        nb::arg("scale_arithmetic"), nb::arg("epilogue"), nb::arg("out_dtype"),
        nb::arg("return_h"), nb::arg("tile_m").none(), nb::arg("tile_k").none(),
        nb::arg("tile_n").none(), nb::arg("reference"));
  m.def("dlhs", &DlhsCall, nb::arg("dout"), nb::arg("dout_dtype"), nb::arg("rhs"),
        nb::arg("rhs_dtype"), nb::arg("rhs_scale").none(), nb::arg("rhs_scale_dtype").none(),
        nb::arg("group_sizes"), nb::arg("gs_dtype"), nb::arg("h").none(),
        nb::arg("h_dtype").none(), nb::arg("mode"), nb::arg("fp8_dtype"),
        nb::arg("epilogue"), nb::arg("out_dtype"), nb::arg("tile_m").none(),
        nb::arg("tile_k").none(), nb::arg("tile_n").none(), nb::arg("reference"));
  m.def("tgmm", &TgmmCall, nb::arg("lhs"), nb::arg("lhs_dtype"), nb::arg("dout"),
        nb::arg("dout_dtype"), nb::arg("group_sizes"), nb::arg("gs_dtype"),
        nb::arg("mode"), nb::arg("dout_quant"), nb::arg("per_group"),
        nb::arg("calibration"), nb::arg("scale_arithmetic"), nb::arg("tile_m").none(),
        nb::arg("tile_k").none(), nb::arg("tile_n").none(), nb::arg("reference"));
}

}  // namespace fp8moe::py
