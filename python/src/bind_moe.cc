// The MoE layer (include/fp8moe/moe.h) for Python and for XLA: the one file
// to update when the layer's API changes (prepared weights, caller-owned
// gradients are coming). Today's API returns owned Tensors, so
//  - from numpy: they become the returned arrays without a copy;
//  - through XLA FFI: y and the gradients are copied once into XLA's result
//    buffers, and the backward handler reruns the forward first (MoeSaved
//    cannot cross from one XLA call to the next; the forward is deterministic,
//    so the rerun gives the same routing and bits).
// The config arrives as "key=value" flags of configs/base.yml, loaded and
// validated exactly as `fp8moe op moe_forward` does (same messages).
//
// The aux-loss cotangent: MoeBackward returns the gradient of
// sum(y * dy) + aux_loss. aux_loss = w * E * sum_e f_e p_e is linear in
// w = load_balance_loss_weight and only the router backward reads w, so the
// gradient of sum(y * dy) + daux * aux_loss is MoeBackward with w * daux.
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/moe.h"
#include "fp8moe/moe_config.h"
#include "python/src/bind.h"

#ifdef FP8MOE_WITH_XLA_FFI
#include <cstring>

#include "python/src/ffi_util.h"
#endif

namespace fp8moe::py {
namespace {

// The validated config of `flags` ("key=value" each), and its Config.
Result<Config> LoadMoeFlags(const std::vector<std::string>& flags) {
  return LoadConfig(MoeConfigSchema(), "", flags);
}

Result<MoeConfig> MoeConfigOf(const std::vector<std::string>& flags) {
  FP8MOE_ASSIGN_OR_RETURN(const Config c, LoadMoeFlags(flags));
  return MoeConfigFrom(c);
}

// {flag: value} of every flag after validation.
nb::dict MoeConfigDict(const std::vector<std::string>& flags) {
  const char* fn = "moe_config";
  auto c = LoadMoeFlags(flags);
  ThrowIfError(fn, c.status());
  ThrowIfError(fn, MoeConfigFrom(*c).status());
  nb::dict d;
  const ConfigSchema schema = MoeConfigSchema();
  for (const FlagSpec& f : schema.flags()) {
    const char* k = f.name.c_str();
    switch (f.type) {
      case FlagType::kBool: d[k] = c->GetBool(f.name); break;
      case FlagType::kInt: d[k] = c->GetInt(f.name); break;
      case FlagType::kFloat: d[k] = c->GetFloat(f.name); break;
      case FlagType::kString: d[k] = c->GetString(f.name); break;
    }
  }
  return d;
}

struct MoeArrays {
  ConstTensorView x;
  MoeWeights w;
};

MoeArrays Views(const char* fn, const Array& x, const std::string& xd, const Array& router,
                const std::string& rd, const Array& wi, const std::string& wid,
                const Array& wo, const std::string& wod) {
  return {View(fn, "x", x, xd),
          {View(fn, "router", router, rd), View(fn, "wi", wi, wid), View(fn, "wo", wo, wod)}};
}

void AddForward(MoeForwardResult& f, nb::dict& d) {
  d["y"] = Out(Adopt(std::move(f.y)));
  d["group_sizes"] = Out(Adopt(std::move(f.group_sizes)));
  d["aux_loss"] = f.aux_loss;
  d["buffer_rows"] = f.stats.buffer_rows;
  d["dropless_reruns"] = f.stats.dropless_reruns;
}

nb::dict MoeForwardCall(const std::vector<std::string>& flags, const Array& x,
                        const std::string& xd, const Array& router, const std::string& rd,
                        const Array& wi, const std::string& wid, const Array& wo,
                        const std::string& wod) {
  const char* fn = "moe_forward";
  auto cfg = MoeConfigOf(flags);
  ThrowIfError(fn, cfg.status());
  const MoeArrays a = Views(fn, x, xd, router, rd, wi, wid, wo, wod);
  Result<MoeForwardResult> f = Status();
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    f = MoeForward(*cfg, a.x, a.w);
  }
  ThrowIfError(fn, f.status());
  nb::dict d;
  AddForward(*f, d);
  return d;
}

nb::dict MoeBackwardCall(const std::vector<std::string>& flags, const Array& x,
                         const std::string& xd, const Array& router, const std::string& rd,
                         const Array& wi, const std::string& wid, const Array& wo,
                         const std::string& wod, const Array& dy, const std::string& dyd,
                         double daux) {
  const char* fn = "moe_backward";
  auto cfg = MoeConfigOf(flags);
  ThrowIfError(fn, cfg.status());
  const MoeArrays a = Views(fn, x, xd, router, rd, wi, wid, wo, wod);
  const ConstTensorView dyv = View(fn, "dy", dy, dyd);
  Result<MoeForwardResult> f = Status();
  Result<MoeGradients> g = Status();
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    f = MoeForward(*cfg, a.x, a.w);
    if (f.ok()) {
      MoeConfig bwd = *cfg;
      bwd.load_balance_loss_weight *= daux;
      g = MoeBackward(bwd, a.x, a.w, *f, dyv);
    }
  }
  ThrowIfError(fn, f.status());
  ThrowIfError(fn, g.status());
  nb::dict d;
  AddForward(*f, d);
  d["dx"] = Out(Adopt(std::move(g->dx)));
  d["drouter"] = Out(Adopt(std::move(g->drouter)));
  d["dwi"] = Out(Adopt(std::move(g->dwi)));
  d["dwo"] = Out(Adopt(std::move(g->dwo)));
  return d;
}

#ifdef FP8MOE_WITH_XLA_FFI
namespace ffi = ::xla::ffi;
using ffi_util::Arg;
using ffi_util::GetAttr;
using ffi_util::Ret;

// Parsed configs by their flag text ("key=value" lines); called under
// LibraryLock, so the map needs no lock of its own.
Result<MoeConfig> CachedConfig(std::string_view text) {
  static auto* cache = new std::map<std::string, MoeConfig, std::less<>>;
  if (auto it = cache->find(text); it != cache->end()) return it->second;
  std::vector<std::string> flags;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start) flags.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  FP8MOE_ASSIGN_OR_RETURN(MoeConfig c, MoeConfigOf(flags));
  cache->emplace(std::string(text), c);
  return c;
}

Status CopyInto(const Tensor& t, const TensorView& out, const char* name) {
  if (out.dtype != t.dtype() || out.shape != t.shape()) {
    return Internal(std::string(name) + ": the result buffer " + ShapeToString(out.shape) +
                    " does not match the layer's " + ShapeToString(t.shape()));
  }
  if (t.num_bytes() > 0) std::memcpy(out.data, t.data(), t.num_bytes());
  return OkStatus();
}

Status Inputs(const ffi::RemainingArgs& args, ConstTensorView* x, MoeWeights* w) {
  FP8MOE_ASSIGN_OR_RETURN(*x, Arg(args, 0, "x"));
  FP8MOE_ASSIGN_OR_RETURN(w->router, Arg(args, 1, "router"));
  FP8MOE_ASSIGN_OR_RETURN(w->wi, Arg(args, 2, "wi"));
  FP8MOE_ASSIGN_OR_RETURN(w->wo, Arg(args, 3, "wo"));
  return OkStatus();
}

// (x, router, wi, wo) -> (y [T, D], group_sizes [E] int32, aux_loss [] f32)
Status ForwardImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                   const ffi::Dictionary& attrs) {
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view text,
                          GetAttr<std::string_view>(attrs, "config"));
  ConstTensorView x;
  MoeWeights w;
  FP8MOE_RETURN_IF_ERROR(Inputs(args, &x, &w));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView y, Ret(rets, 0, "y"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView gs, Ret(rets, 1, "group_sizes"));
  FP8MOE_ASSIGN_OR_RETURN(const TensorView aux, Ret(rets, 2, "aux_loss"));
  LibraryCall call;
  FP8MOE_ASSIGN_OR_RETURN(const MoeConfig cfg, CachedConfig(text));
  FP8MOE_ASSIGN_OR_RETURN(const MoeForwardResult f, MoeForward(cfg, x, w));
  FP8MOE_RETURN_IF_ERROR(CopyInto(f.y, y, "y"));
  FP8MOE_RETURN_IF_ERROR(CopyInto(f.group_sizes, gs, "group_sizes"));
  *aux.as<float>() = f.aux_loss;
  return OkStatus();
}

// (x, router, wi, wo, dy [T, D], daux [] f32) -> (dx, drouter, dwi, dwo)
Status BackwardImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                    const ffi::Dictionary& attrs) {
  FP8MOE_ASSIGN_OR_RETURN(const std::string_view text,
                          GetAttr<std::string_view>(attrs, "config"));
  ConstTensorView x;
  MoeWeights w;
  FP8MOE_RETURN_IF_ERROR(Inputs(args, &x, &w));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView dy, Arg(args, 4, "dy"));
  FP8MOE_ASSIGN_OR_RETURN(const ConstTensorView daux, Arg(args, 5, "daux"));
  if (daux.dtype != DType::kF32 || daux.num_elements() != 1) {
    return InvalidArgument("daux must be one f32");
  }
  const char* names[] = {"dx", "drouter", "dwi", "dwo"};
  TensorView outs[4];
  for (size_t i = 0; i < 4; ++i) {
    FP8MOE_ASSIGN_OR_RETURN(outs[i], Ret(rets, i, names[i]));
  }
  LibraryCall call;
  FP8MOE_ASSIGN_OR_RETURN(MoeConfig cfg, CachedConfig(text));
  FP8MOE_ASSIGN_OR_RETURN(const MoeForwardResult f, MoeForward(cfg, x, w));
  cfg.load_balance_loss_weight *= *daux.as<float>();
  FP8MOE_ASSIGN_OR_RETURN(const MoeGradients g, MoeBackward(cfg, x, w, f, dy));
  FP8MOE_RETURN_IF_ERROR(CopyInto(g.dx, outs[0], "dx"));
  FP8MOE_RETURN_IF_ERROR(CopyInto(g.drouter, outs[1], "drouter"));
  FP8MOE_RETURN_IF_ERROR(CopyInto(g.dwi, outs[2], "dwi"));
  return CopyInto(g.dwo, outs[3], "dwo");
}

ffi::Error ForwardFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("moe_forward", ForwardImpl(a, r, d));
}
ffi::Error BackwardFfi(ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
  return ffi_util::ToError("moe_backward", BackwardImpl(a, r, d));
}
#endif  // FP8MOE_WITH_XLA_FFI

}  // namespace
}  // namespace fp8moe::py

#ifdef FP8MOE_WITH_XLA_FFI
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeMoeForwardFfi, fp8moe::py::ForwardFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8moeMoeBackwardFfi, fp8moe::py::BackwardFfi,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
#endif

namespace fp8moe::py {

#ifdef FP8MOE_WITH_XLA_FFI
void AddMoeFfiTargets(nb::dict& targets) {
  targets["fp8moe_moe_forward"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeMoeForwardFfi));
  targets["fp8moe_moe_backward"] = nb::capsule(reinterpret_cast<void*>(&Fp8moeMoeBackwardFfi));
}
#endif

void BindMoe(nb::module_& m) {
  m.def("moe_config", &MoeConfigDict, nb::arg("flags"));
  m.def("moe_forward", &MoeForwardCall, nb::arg("flags"), nb::arg("x"), nb::arg("x_dtype"),
        nb::arg("router"), nb::arg("router_dtype"), nb::arg("wi"), nb::arg("wi_dtype"),
        nb::arg("wo"), nb::arg("wo_dtype"));
  m.def("moe_backward", &MoeBackwardCall, nb::arg("flags"), nb::arg("x"), nb::arg("x_dtype"),
        nb::arg("router"), nb::arg("router_dtype"), nb::arg("wi"), nb::arg("wi_dtype"),
        nb::arg("wo"), nb::arg("wo_dtype"), nb::arg("dy"), nb::arg("dy_dtype"),
        nb::arg("daux"));
}

}  // namespace fp8moe::py
