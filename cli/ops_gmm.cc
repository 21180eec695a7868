// Ops on the grouped matmuls (include/fp8moe/gmm.h): gmm, dlhs, tgmm. They
// run the fast kernels, or with reference=true their plain-loop twins, so
// other languages can cross-check either. Keys, tensors and the convenience
// conversions (F32 inputs rounded to BF16 or quantized per channel for the
// mode) are documented in docs/ops.md.
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include "cli/op.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/gmm_problem.h"

namespace fp8moe::cli {
namespace {

const std::vector<std::string> kModes = {"f32", "bf16", "fake_qat", "native_fp8",
                                         "int8"};

// A tensor of the input file, or a converted copy owned here so the views
// handed to the library stay valid for the call.
class Operand {
 public:
  Operand() = default;
  explicit Operand(const Tensor* in) : in_(in) {}
  explicit Operand(Tensor owned) : owned_(std::move(owned)), in_(&owned_) {}
  Operand(Operand&& o) noexcept { *this = std::move(o); }
  Operand& operator=(Operand&& o) noexcept {
    const bool owns = o.in_ == &o.owned_;
    owned_ = std::move(o.owned_);
    in_ = owns ? &owned_ : o.in_;
    return *this;
  }

  const Tensor& tensor() const { return *in_; }
  // What the library reads.
  ConstTensorView view() const { return in_->view(); }

 private:
  Tensor owned_;
  const Tensor* in_ = nullptr;
};

Status Prefixed(const std::string& op, const Status& s) {
  if (s.ok()) return s;
  return Status(s.code(), "op " + op + ": " + s.message());
}

Status NeedRank(const std::string& op, const std::string& name, const Tensor& t,
                int rank, const char* dims) {
  if (t.rank() == rank) return OkStatus();
  return InvalidArgument("op " + op + ": tensor '" + name + "' has shape " +
                         ShapeToString(t.shape()) + "; expected rank " +
                         std::to_string(rank) + " " + dims);
}

// An F32 tensor rounded to BF16 (round to nearest even).
Result<Tensor> ToBf16(const Tensor& x) {
  FP8MOE_ASSIGN_OR_RETURN(Tensor y, Tensor::Create(DType::kBF16, x.shape()));
  F32ToBf16Span(x.data_as<float>(), y.data_as<uint16_t>(), x.num_elements());
  return y;
}

// An output poisoned with NaN, so an element the kernel fails to write shows
// up in the tests instead of passing as whatever the allocator left there.
Result<Tensor> PoisonedOutput(DType dtype, Shape shape) {
  FP8MOE_ASSIGN_OR_RETURN(Tensor t, Tensor::Create(dtype, std::move(shape)));
  if (dtype == DType::kBF16) {
    uint16_t* p = t.data_as<uint16_t>();
    for (size_t i = 0; i < t.num_elements(); ++i) p[i] = 0x7FC0;
  } else {
    float* p = t.data_as<float>();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i < t.num_elements(); ++i) p[i] = nan;
  }
  return t;
}

DType OutDType(const Config& keys) {
  return keys.GetString("out_dtype") == "bf16" ? DType::kBF16 : DType::kF32;
}

// Tile keys default to -1 (unset, the kernel picks per shape); any explicit
// value must be positive, so a typed 0 is an error rather than "unset".
Result<GmmTiles> ParseTiles(const std::string& op, const Config& keys) {
  GmmTiles tiles;
  const std::pair<const char*, std::optional<int64_t>*> slots[] = {
      {"tile_m", &tiles.m}, {"tile_k", &tiles.k}, {"tile_n", &tiles.n}};
  for (const auto& [name, slot] : slots) {
    if (!keys.IsSet(name)) continue;
    const int64_t v = keys.GetInt(name);
    if (v <= 0) {
      return InvalidArgument("op " + op + ": " + name + "=" + std::to_string(v) +
                             " is invalid; tiles must be positive (omit the "
                             "key for the per-shape default)");
    }
    if (v > kMaxGmmTile) {
      return InvalidArgument("op " + op + ": " + name + "=" + std::to_string(v) +
                             " exceeds the largest tile, " + std::to_string(kMaxGmmTile) +
                             " (2^20); a tile as large as its dimension already covers it "
                             "whole, so use at most " + std::to_string(kMaxGmmTile) +
                             " (or omit the key)");
    }
    *slot = v;
  }
  return tiles;
}

// mode, tiles and (where the op has them) fp8_dtype and epilogue.
Result<GmmOptions> ParseOptions(const std::string& op, const Config& keys,
                                bool has_fp8_dtype, bool has_epilogue) {
  GmmOptions o;
  FP8MOE_ASSIGN_OR_RETURN(o.mode, ParseGmmMode(keys.GetString("mode")));
  FP8MOE_ASSIGN_OR_RETURN(o.tiles, ParseTiles(op, keys));
  if (has_fp8_dtype) {
    FP8MOE_ASSIGN_OR_RETURN(o.fp8_dtype, ParseQuantDType(keys.GetString("fp8_dtype")));
    // fp8_dtype means something only where fp8 codes are made or read as
    // that dtype; set anywhere else it would be silently ignored.
    if (keys.IsSet("fp8_dtype") && o.mode != GmmMode::kNativeFp8 &&
        o.mode != GmmMode::kFakeQat) {
      return InvalidArgument("op " + op + ": fp8_dtype applies to mode native_fp8 "
                             "or fake_qat only; mode is " +
                             keys.GetString("mode"));
    }
  }
  if (has_epilogue) {
    const std::string& e = keys.GetString("epilogue");
    o.epilogue = e == "swiglu"    ? GmmEpilogue::kSwiGlu
                 : e == "dswiglu" ? GmmEpilogue::kDSwiGlu
                                  : GmmEpilogue::kNone;
  }
  return o;
}

// The keys of each op as options, checked without the tensors
// (OpDef::check_keys).
Result<GmmOptions> GmmKeys(const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(GmmOptions o, ParseOptions("gmm", keys, true, true));
  o.lhs_quant_block_size = keys.GetInt("lhs_quant_block_size");
  FP8MOE_ASSIGN_OR_RETURN(
      o.lhs_calibration,
      ParseCalibrationKeys("gmm", keys, "lhs_calibration",
                           o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8,
                           "to mode native_fp8 or int8 (they quantize lhs)"));
  return o;
}

Result<TgmmQuant> TgmmKeys(const Config& keys) {
  FP8MOE_RETURN_IF_ERROR(ParseOptions("tgmm", keys, false, false).status());
  TgmmQuant quant;
  const std::string& dq = keys.GetString("dout_quant");
  if (dq != "none") {
    quant.dout_dtype = dq == "e5m2" ? QuantDType::kE5M2 : QuantDType::kE4M3FN;
    quant.per_group = keys.GetString("dout_quant_granularity") == "group";
  } else if (keys.IsSet("dout_quant_granularity")) {
    return InvalidArgument("op tgmm: dout_quant_granularity applies only when "
                           "dout is quantized; set dout_quant=e5m2|e4m3 or drop it");
  }
  FP8MOE_ASSIGN_OR_RETURN(quant.calibration,
                          ParseCalibrationKeys("tgmm", keys, "dout_calibration", dq != "none",
                                               "when dout is quantized (dout_quant=e5m2|e4m3)"));
  return quant;
}

// ---- Requests: every tensor checked and every conversion decided before
// ---- anything is copied or allocated

// An input tensor and the conversion the op applies to it for the mode
// (docs/ops.md, "Convenience conversions").
enum class Conversion {
  kNone,
  kToBf16,            // an F32 operand of modes bf16 and fake_qat
  kQuantizeChannels,  // a float rhs of modes fake_qat, native_fp8, int8
};

struct Input {
  const Tensor* tensor = nullptr;
  Conversion conversion = Conversion::kNone;
  DType dtype = DType::kF32;  // as the library gets it, after the conversion

  // The operand as the library will get it, for the library's checks only:
  // data points at the input's bytes (non-null when there are elements, as
  // the checks require) and is never read through.
  ConstTensorView CheckView() const {
    return ConstTensorView{tensor->data(), dtype, tensor->shape()};
  }
};

// A view with a dtype and shape only, for the library's checks of an output
// or a converted operand that does not exist yet: they refuse a view with
// elements and no data, and never read or write through it.
TensorView ShapeOnly(DType dtype, Shape shape) {
  static char placeholder;
  return TensorView{&placeholder, dtype, std::move(shape)};
}

// In modes bf16 and fake_qat an F32 operand is rounded to BF16 first.
Input FloatInput(const Tensor* t, GmmMode mode) {
  const bool bf16 = mode == GmmMode::kBf16 || mode == GmmMode::kFakeQat;
  if (bf16 && t->dtype() == DType::kF32) return {t, Conversion::kToBf16, DType::kBF16};
  return {t, Conversion::kNone, t->dtype()};
}

Result<Operand> Convert(const Input& in) {
  if (in.conversion == Conversion::kNone) return Operand(in.tensor);
  FP8MOE_ASSIGN_OR_RETURN(Tensor y, ToBf16(*in.tensor));
  return Operand(std::move(y));
}

// One call of gmm, dlhs or tgmm, checked: the operands, the conversions, the
// keys as options and the shapes the library's checks found.
struct GmmRequest {
  std::string op;
  GmmOptions o;
  TgmmQuant quant;  // tgmm
  bool reference = false;
  DType out_dtype = DType::kF32;
  Input lhs;   // gmm and tgmm: lhs; dlhs: dout
  Input rhs;   // gmm and dlhs: values or codes
  const Tensor* rhs_scale = nullptr;  // the scales of given codes
  Input dout;  // tgmm
  const Tensor* group_sizes = nullptr;
  const Tensor* h = nullptr;  // dlhs
  internal::GmmProblem problem;
};

// The weight: `rhs` values, or `rhs_codes` + `rhs_scale`. A float `rhs` is
// converted for the mode: rounded to BF16 (bf16), or quantized per output
// channel with absmax to fp8_dtype (fake_qat, native_fp8) or int8 (int8).
Status ResolveRhs(const SafetensorsFile& in, const Config& keys, GmmRequest* r) {
  const std::string& op = r->op;
  const Tensor* values = in.Find("rhs");
  const Tensor* codes = in.Find("rhs_codes");
  if (values != nullptr && codes != nullptr) {
    return InvalidArgument("op " + op + ": the input has both 'rhs' and "
                           "'rhs_codes'; give either rhs values or rhs_codes "
                           "+ rhs_scale");
  }
  if (codes != nullptr) {
    FP8MOE_ASSIGN_OR_RETURN(
        codes, GetInput(op, in, "rhs_codes",
                        {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2,
                         DType::kE5M2FNUZ, DType::kI8}));
    FP8MOE_ASSIGN_OR_RETURN(r->rhs_scale, GetInput(op, in, "rhs_scale", {DType::kF32}));
    if (r->o.mode == GmmMode::kFakeQat && keys.IsSet("fp8_dtype") &&
        codes->dtype() != QuantStorageDType(r->o.fp8_dtype)) {
      return InvalidArgument("op " + op + ": fp8_dtype=" +
                             keys.GetString("fp8_dtype") + " but 'rhs_codes' is " +
                             std::string(DTypeName(codes->dtype())) +
                             "; drop the key or make them agree");
    }
    r->rhs = {codes, Conversion::kNone, codes->dtype()};
    return OkStatus();
  }
  if (in.Find("rhs_scale") != nullptr) {
    return InvalidArgument("op " + op + ": 'rhs_scale' was given without "
                           "'rhs_codes'; float 'rhs' values take no scale");
  }
  if (values == nullptr) {
    std::string have;
    for (const auto& [n, unused] : in.tensors) have += (have.empty() ? "" : ", ") + n;
    return NotFound("op " + op + ": the input file has neither 'rhs' (F32 or "
                    "BF16 [E, K, N]) nor 'rhs_codes' + 'rhs_scale'; it has: " +
                    (have.empty() ? "no tensors" : have));
  }
  FP8MOE_ASSIGN_OR_RETURN(values, GetInput(op, in, "rhs", {DType::kF32, DType::kBF16}));
  const GmmMode mode = r->o.mode;
  if (mode != GmmMode::kFakeQat && mode != GmmMode::kNativeFp8 && mode != GmmMode::kInt8) {
    r->rhs = FloatInput(values, mode);
    return OkStatus();
  }
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "rhs", *values, 3, "[E, K, N]"));
  const QuantDType qdt = mode == GmmMode::kInt8 ? QuantDType::kInt8 : r->o.fp8_dtype;
  r->rhs = {values, Conversion::kQuantizeChannels, QuantStorageDType(qdt)};
  return OkStatus();
}

// The rhs operand (and its scale) of a checked request, converted.
struct Rhs {
  Operand w;
  std::optional<Operand> scale;
};

Result<Rhs> ConvertRhs(const GmmRequest& r) {
  Rhs rhs;
  if (r.rhs.conversion != Conversion::kQuantizeChannels) {
    FP8MOE_ASSIGN_OR_RETURN(rhs.w, Convert(r.rhs));
    if (r.rhs_scale != nullptr) rhs.scale = Operand(r.rhs_scale);
    return rhs;
  }
  const Tensor& values = *r.rhs.tensor;
  const int64_t e = values.dim(0), k = values.dim(1), n = values.dim(2);
  // BF16 values widen exactly to f32 before quantizing.
  std::vector<float> w(values.num_elements());
  if (values.dtype() == DType::kBF16) {
    Bf16ToF32Span(values.data_as<uint16_t>(), w.data(), w.size());
  } else if (!w.empty()) {
    std::memcpy(w.data(), values.data(), w.size() * sizeof(float));
  }
  const QuantDType qdt = r.o.mode == GmmMode::kInt8 ? QuantDType::kInt8 : r.o.fp8_dtype;
  FP8MOE_ASSIGN_OR_RETURN(Tensor q, Tensor::Create(QuantStorageDType(qdt), values.shape()));
  FP8MOE_ASSIGN_OR_RETURN(Tensor s, Tensor::Create(DType::kF32, {e, n}));
  FP8MOE_RETURN_IF_ERROR(QuantizeChannels(w.data(), e, k, n, qdt, Calibration::AbsMax(),
                                          q.data_as<uint8_t>(), s.data_as<float>()));
  rhs.w = Operand(std::move(q));
  rhs.scale = Operand(std::move(s));
  return rhs;
}

// The scale view of the checks: given, made by the quantization, or none.
std::optional<ConstTensorView> CheckScaleView(const GmmRequest& r) {
  if (r.rhs_scale != nullptr) return r.rhs_scale->view();
  if (r.rhs.conversion == Conversion::kQuantizeChannels) {
    const Tensor& v = *r.rhs.tensor;
    return ShapeOnly(DType::kF32, {v.dim(0), v.dim(2)});
  }
  return std::nullopt;
}

// ---- Memory plans (PlanMemory), from the checked request ----

uint64_t U(int64_t v) { return v > 0 ? static_cast<uint64_t>(v) : 0; }

// 2 * v, saturating: the dswiglu output's width, planned before anything
// computes with it.
int64_t Twice(int64_t v) {
  return v > std::numeric_limits<int64_t>::max() / 2 ? std::numeric_limits<int64_t>::max()
                                                     : 2 * v;
}

// Per-thread packing buffers of the fast kernels for an output of rows x cols
// and a reduction of `red`, with the tiles as the kernels clamp them.
uint64_t PackingBytes(const GmmTiles& t, int64_t rows, int64_t cols, int64_t red) {
  const uint64_t kc = std::min(U(t.k.value_or(256)), U(red)) + 2;
  const uint64_t width = std::min(U(t.n.value_or(1024)), U(cols)) + 32;
  const uint64_t m = std::min(U(t.m.value_or(512)), U(rows)) + 16;
  const uint64_t per_thread =
      SatAdd(SatAdd(SatMul(112 * 4, kc), SatMul(8 * width, kc)), SatMul(8 * m, width));
  return SatMul(per_thread, U(omp_get_max_threads()));
}

// The outputs of a request, from its operands' shapes (ranks checked).
std::vector<PlannedTensor> PlannedOutputs(const GmmRequest& r) {
  const Tensor& lhs = *r.lhs.tensor;
  if (r.op == "gmm") {
    const int64_t m = lhs.dim(0), n = r.rhs.tensor->dim(2);
    if (r.o.epilogue != GmmEpilogue::kSwiGlu) return {{"output 'out'", r.out_dtype, {m, n}}};
    return {{"output 'out'", r.out_dtype, {m, n / 2}}, {"output 'h'", r.out_dtype, {m, n}}};
  }
  if (r.op == "dlhs") {
    const int64_t m = lhs.dim(0), k = r.rhs.tensor->dim(1);
    return {{"output 'dlhs'", r.out_dtype,
             {m, r.o.epilogue == GmmEpilogue::kDSwiGlu ? Twice(k) : k}}};
  }
  const Shape drhs = {r.group_sizes->dim(0), lhs.dim(1), r.dout.tensor->dim(1)};
  std::vector<PlannedTensor> out = {{"output 'drhs'", DType::kF32, drhs}};
  if (r.out_dtype == DType::kBF16) out.push_back({"the BF16 'drhs'", DType::kBF16, drhs});
  return out;
}

// The plan of gmm, dlhs and tgmm: converted operands, outputs, the kernels'
// pre-pass buffers and packing, or the reference twin's dense copies.
Status PlanGmmFamily(const GmmRequest& r) {
  const std::string& op = r.op;
  const GmmOptions& o = r.o;
  const internal::GmmProblem& p = r.problem;
  std::vector<PlannedTensor> plan;
  auto copy = [&](const Input& in, const std::string& name) {
    if (in.conversion == Conversion::kToBf16) {
      plan.push_back({"the BF16 copy of '" + name + "'", DType::kBF16, in.tensor->shape()});
    } else if (in.conversion == Conversion::kQuantizeChannels) {
      plan.push_back({"the F32 copy of '" + name + "'", DType::kF32, in.tensor->shape()});
      plan.push_back({"the codes of '" + name + "'", DType::kU8, in.tensor->shape()});
      plan.push_back({"the scales of '" + name + "'", DType::kF32, {p.e, p.n}});
    }
  };
  copy(r.lhs, op == "dlhs" ? "dout" : "lhs");
  if (op == "tgmm") {
    copy(r.dout, "dout");
  } else {
    copy(r.rhs, "rhs");
  }
  for (PlannedTensor& t : PlannedOutputs(r)) plan.push_back(std::move(t));
  // Working memory, saturating: a few full-size copies at most.
  const int64_t m = p.m, k = p.k, n = p.n;
  const uint64_t mk = SatMul(U(m), U(k)), mn = SatMul(U(m), U(n));
  const uint64_t ekn = SatMul(U(p.e), SatMul(U(k), U(n)));
  uint64_t scratch = 0;
  if (r.reference) {
    // The twins hold dense f32 copies of their operands and results.
    scratch = SatAdd(scratch, SatMul(8, SatAdd(SatAdd(mk, mn), ekn)));
  } else {
    if (o.mode == GmmMode::kFakeQat) scratch = SatAdd(scratch, SatMul(2, ekn));
    if (o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8) {
      scratch = SatAdd(scratch, SatMul(5, mk));
    }
    if (r.quant.dout_dtype) {
      scratch = SatAdd(scratch, SatAdd(SatMul(5, mn), SatMul(24, SatAdd(U(m), U(p.e)))));
    }
    const int64_t out_rows = op == "tgmm" ? k : m;
    const int64_t out_cols = op == "dlhs" ? k : n;
    const int64_t red = op == "gmm" ? k : op == "dlhs" ? n : m;
    scratch = SatAdd(scratch, PackingBytes(o.tiles, out_rows, out_cols, red));
  }
  return PlanMemory(op, plan, scratch);
}

// The last checks of a request whose tensors are found and ranked: the
// planned outputs' shapes, then the library's own checks of the call
// (kernels/gmm_problem.h, the ones Gmm / GmmDlhs / Tgmm run first, on views
// of the operands as converted and of the outputs), then the memory plan.
Status CheckCall(GmmRequest* r) {
  const std::vector<PlannedTensor> outputs = PlannedOutputs(*r);
  FP8MOE_RETURN_IF_ERROR(CheckPlannedShapes(r->op, outputs));
  const TensorView out = ShapeOnly(outputs[0].dtype, outputs[0].shape);
  const ConstTensorView gs = r->group_sizes->view();
  Status s;
  if (r->op == "tgmm") {
    s = internal::CheckTgmm(r->o, r->quant, r->lhs.CheckView(), r->dout.CheckView(), gs, out,
                            &r->problem);
  } else {
    const std::optional<ConstTensorView> scale = CheckScaleView(*r);
    const ConstTensorView* scale_ptr = scale ? &*scale : nullptr;
    if (r->op == "gmm") {
      const TensorView h = outputs.size() > 1 ? ShapeOnly(outputs[1].dtype, outputs[1].shape)
                                              : TensorView{};
      s = internal::CheckGmm(r->o, r->lhs.CheckView(), r->rhs.CheckView(), scale_ptr, gs, out,
                             outputs.size() > 1 ? &h : nullptr, &r->problem);
    } else {
      const ConstTensorView h = r->h != nullptr ? r->h->view() : ConstTensorView{};
      s = internal::CheckDlhs(r->o, r->lhs.CheckView(), r->rhs.CheckView(), scale_ptr, gs, out,
                              r->h != nullptr ? &h : nullptr, &r->problem);
    }
  }
  FP8MOE_RETURN_IF_ERROR(Prefixed(r->op, s));
  return PlanGmmFamily(*r);
}

// ---- The ops ----

Result<GmmRequest> GmmCheck(const SafetensorsFile& in, const Config& keys) {
  GmmRequest r;
  r.op = "gmm";
  FP8MOE_ASSIGN_OR_RETURN(r.o, GmmKeys(keys));
  r.reference = keys.GetBool("reference");
  r.out_dtype = OutDType(keys);
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* lhs, GetInput(r.op, in, "lhs", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "lhs", *lhs, 2, "[M, K]"));
  // native_fp8 and int8 quantize lhs themselves, from F32 or BF16.
  r.lhs = FloatInput(lhs, r.o.mode);
  FP8MOE_RETURN_IF_ERROR(ResolveRhs(in, keys, &r));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "rhs", *r.rhs.tensor, 3, "[E, K, N]"));
  FP8MOE_ASSIGN_OR_RETURN(r.group_sizes, GetInput(r.op, in, "group_sizes", {DType::kI32}));
  FP8MOE_RETURN_IF_ERROR(CheckCall(&r));
  return r;
}

Status GmmWork(const GmmRequest& r, SafetensorsFile* out) {
  FP8MOE_ASSIGN_OR_RETURN(const Operand lhs, Convert(r.lhs));
  FP8MOE_ASSIGN_OR_RETURN(const Rhs rhs, ConvertRhs(r));
  const std::vector<PlannedTensor> outputs = PlannedOutputs(r);
  const bool swiglu = outputs.size() > 1;
  FP8MOE_ASSIGN_OR_RETURN(Tensor result, PoisonedOutput(r.out_dtype, outputs[0].shape));
  Tensor h;
  if (swiglu) {
    FP8MOE_ASSIGN_OR_RETURN(h, PoisonedOutput(r.out_dtype, outputs[1].shape));
  }
  const ConstTensorView scale_view = rhs.scale ? rhs.scale->view() : ConstTensorView{};
  const ConstTensorView* scale = rhs.scale ? &scale_view : nullptr;
  const ConstTensorView gs_view = Operand(r.group_sizes).view();
  const TensorView h_view = h.view();
  const TensorView* h_ptr = swiglu ? &h_view : nullptr;
  const Status s =
      r.reference ? reference::Gmm(r.o, lhs.view(), rhs.w.view(), scale, gs_view,
                                   result.view(), h_ptr)
                  : Gmm(r.o, lhs.view(), rhs.w.view(), scale, gs_view, result.view(), h_ptr);
  FP8MOE_RETURN_IF_ERROR(Prefixed(r.op, s));
  FP8MOE_RETURN_IF_ERROR(out->Add("out", std::move(result)));
  if (swiglu) FP8MOE_RETURN_IF_ERROR(out->Add("h", std::move(h)));
  return OkStatus();
}

Result<GmmRequest> DlhsCheck(const SafetensorsFile& in, const Config& keys) {
  GmmRequest r;
  r.op = "dlhs";
  FP8MOE_ASSIGN_OR_RETURN(r.o, ParseOptions(r.op, keys, true, true));
  r.reference = keys.GetBool("reference");
  r.out_dtype = OutDType(keys);
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* dout,
                          GetInput(r.op, in, "dout", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "dout", *dout, 2, "[M, N]"));
  r.lhs = FloatInput(dout, r.o.mode);
  FP8MOE_RETURN_IF_ERROR(ResolveRhs(in, keys, &r));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "rhs", *r.rhs.tensor, 3, "[E, K, N]"));
  FP8MOE_ASSIGN_OR_RETURN(r.group_sizes, GetInput(r.op, in, "group_sizes", {DType::kI32}));
  if (in.Find("h") != nullptr) {
    FP8MOE_ASSIGN_OR_RETURN(r.h, GetInput(r.op, in, "h", {DType::kF32, DType::kBF16}));
  } else if (r.o.epilogue == GmmEpilogue::kDSwiGlu) {
    return NotFound("op dlhs: epilogue=dswiglu needs tensor 'h' (F32 or BF16 "
                    "[M, 2K]), the forward's saved pre-activation");
  }
  FP8MOE_RETURN_IF_ERROR(CheckCall(&r));
  return r;
}

Status DlhsWork(const GmmRequest& r, SafetensorsFile* out) {
  FP8MOE_ASSIGN_OR_RETURN(const Operand dout, Convert(r.lhs));
  FP8MOE_ASSIGN_OR_RETURN(const Rhs rhs, ConvertRhs(r));
  FP8MOE_ASSIGN_OR_RETURN(Tensor result, PoisonedOutput(r.out_dtype, PlannedOutputs(r)[0].shape));
  const ConstTensorView scale_view = rhs.scale ? rhs.scale->view() : ConstTensorView{};
  const ConstTensorView* scale = rhs.scale ? &scale_view : nullptr;
  const ConstTensorView gs_view = Operand(r.group_sizes).view();
  const ConstTensorView h_view = r.h != nullptr ? Operand(r.h).view() : ConstTensorView{};
  const ConstTensorView* h_ptr = r.h != nullptr ? &h_view : nullptr;
  const Status s =
      r.reference ? reference::GmmDlhs(r.o, dout.view(), rhs.w.view(), scale, gs_view,
                                       result.view(), h_ptr)
                  : GmmDlhs(r.o, dout.view(), rhs.w.view(), scale, gs_view, result.view(),
                            h_ptr);
  FP8MOE_RETURN_IF_ERROR(Prefixed(r.op, s));
  return out->Add("dlhs", std::move(result));
}

Result<GmmRequest> TgmmCheck(const SafetensorsFile& in, const Config& keys) {
  GmmRequest r;
  r.op = "tgmm";
  FP8MOE_ASSIGN_OR_RETURN(r.o, ParseOptions(r.op, keys, false, false));
  FP8MOE_ASSIGN_OR_RETURN(r.quant, TgmmKeys(keys));
  r.reference = keys.GetBool("reference");
  r.out_dtype = OutDType(keys);
  FP8MOE_ASSIGN_OR_RETURN(
      const Tensor* lhs,
      GetInput(r.op, in, "lhs",
               {DType::kF32, DType::kBF16, DType::kE4M3FN, DType::kE4M3FNUZ,
                DType::kE5M2, DType::kE5M2FNUZ}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "lhs", *lhs, 2, "[M, K]"));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* dout,
                          GetInput(r.op, in, "dout", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "dout", *dout, 2, "[M, N]"));
  FP8MOE_ASSIGN_OR_RETURN(r.group_sizes, GetInput(r.op, in, "group_sizes", {DType::kI32}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(r.op, "group_sizes", *r.group_sizes, 1, "[E]"));
  r.lhs = FloatInput(lhs, r.o.mode);
  // A quantized dout is quantized from F32 inside the call: never round it.
  r.dout = r.quant.dout_dtype ? Input{dout, Conversion::kNone, dout->dtype()}
                              : FloatInput(dout, r.o.mode);
  FP8MOE_RETURN_IF_ERROR(CheckCall(&r));
  return r;
}

Status TgmmWork(const GmmRequest& r, SafetensorsFile* out) {
  FP8MOE_ASSIGN_OR_RETURN(const Operand lhs, Convert(r.lhs));
  FP8MOE_ASSIGN_OR_RETURN(const Operand dout, Convert(r.dout));
  // The library's drhs is F32; out_dtype=bf16 rounds it afterwards.
  FP8MOE_ASSIGN_OR_RETURN(Tensor drhs, PoisonedOutput(DType::kF32, PlannedOutputs(r)[0].shape));
  const ConstTensorView gs_view = Operand(r.group_sizes).view();
  const Status s =
      r.reference
          ? reference::Tgmm(r.o, r.quant, lhs.view(), dout.view(), gs_view, drhs.view())
          : Tgmm(r.o, r.quant, lhs.view(), dout.view(), gs_view, drhs.view());
  FP8MOE_RETURN_IF_ERROR(Prefixed(r.op, s));
  if (r.out_dtype == DType::kBF16) {
    FP8MOE_ASSIGN_OR_RETURN(Tensor rounded, ToBf16(drhs));
    return out->Add("drhs", std::move(rounded));
  }
  return out->Add("drhs", std::move(drhs));
}

// OpDef::prepare of an op from its check and its work.
template <typename Check, typename Work>
auto Prepare(Check check, Work work) {
  return [check, work](const SafetensorsFile& in, const Config& keys) -> Result<OpWork> {
    FP8MOE_ASSIGN_OR_RETURN(GmmRequest r, check(in, keys));
    return OpWork([work, r = std::move(r)](SafetensorsFile* out) { return work(r, out); });
  };
}

// The first key of every GMM op.
void AddModeKey(ConfigSchema* s) {
  AddKey(s, {"mode", FlagType::kString, "bf16",
             "operand mode (gmm.h GmmMode): f32, bf16, fake_qat, native_fp8, int8",
             kModes});
}

// The last keys of every GMM op: out_dtype, the three tiles, reference.
void AddTailKeys(ConfigSchema* s) {
  AddKey(s, {"out_dtype", FlagType::kString, "f32", "dtype of the outputs",
             {"f32", "bf16"}});
  for (const char* t : {"tile_m", "tile_k", "tile_n"}) {
    AddKey(s, {t, FlagType::kInt, "-1",
               "tile size; omit for the per-shape default, else positive "
               "(tile_k even)"});
  }
  AddKey(s, {"reference", FlagType::kBool, "false",
             "run the plain-loop reference twin instead of the fast kernel"});
}

void AddFp8DTypeKey(ConfigSchema* s) {
  AddKey(s, {"fp8_dtype", FlagType::kString, "e4m3fn",
             "native_fp8: the code dtype of lhs and rhs; fake_qat / native_fp8: "
             "the dtype an F32 rhs is quantized to",
             {"e4m3fn", "e4m3fnuz"}});
}

}  // namespace

void RegisterGmmOps(std::vector<OpDef>* ops) {
  OpDef gmm{"gmm", "lhs [M,K], rhs [E,K,N] or rhs_codes + rhs_scale, group_sizes "
            "-> out [M,N] (swiglu: out [M,N/2], h [M,N])", {},
            [](const Config& keys) { return GmmKeys(keys).status(); },
            Prepare(GmmCheck, GmmWork)};
  AddModeKey(&gmm.keys);
  AddFp8DTypeKey(&gmm.keys);
  AddKey(&gmm.keys, {"lhs_quant_block_size", FlagType::kInt, "0",
                     "native_fp8: lhs scale per row over the full K (0) or per "
                     "128 / 512 columns"});
  AddCalibrationKeys(&gmm.keys, "lhs_calibration",
                     "native_fp8, int8: how lhs's scales are found");
  AddKey(&gmm.keys, {"epilogue", FlagType::kString, "none",
                     "swiglu: out = silu(gate) * up of the [gate | up] columns",
                     {"none", "swiglu", "dswiglu"}});
  AddTailKeys(&gmm.keys);
  ops->push_back(std::move(gmm));

  OpDef dlhs{"dlhs", "dout [M,N], rhs [E,K,N] or rhs_codes + rhs_scale, "
             "group_sizes (, h) -> dlhs [M,K] (dswiglu: [M,2K])", {},
             [](const Config& keys) { return ParseOptions("dlhs", keys, true, true).status(); },
             Prepare(DlhsCheck, DlhsWork)};
  AddModeKey(&dlhs.keys);
  AddFp8DTypeKey(&dlhs.keys);
  AddKey(&dlhs.keys, {"epilogue", FlagType::kString, "none",
                      "dswiglu: the SwiGLU backward with h [M,2K] = [gate | up]",
                      {"none", "swiglu", "dswiglu"}});
  AddTailKeys(&dlhs.keys);
  ops->push_back(std::move(dlhs));

  OpDef tgmm{"tgmm", "lhs [M,K] (or fp8 codes), dout [M,N], group_sizes "
             "-> drhs [E,K,N]", {},
             [](const Config& keys) { return TgmmKeys(keys).status(); },
             Prepare(TgmmCheck, TgmmWork)};
  AddModeKey(&tgmm.keys);
  AddKey(&tgmm.keys, {"dout_quant", FlagType::kString, "none",
                      "quantize the F32 dout inside the call (fp8_full recipe)",
                      {"none", "e5m2", "e4m3"}});
  AddKey(&tgmm.keys, {"dout_quant_granularity", FlagType::kString, "group",
                      "a dout scale per (group, channel), or per (m-tile of a "
                      "group, channel) with the m-tile tile_m (default 512)",
                      {"group", "tile"}});
  AddCalibrationKeys(&tgmm.keys, "dout_calibration",
                     "with dout_quant: how dout's scales are found");
  AddTailKeys(&tgmm.keys);
  ops->push_back(std::move(tgmm));
}

}  // namespace fp8moe::cli
