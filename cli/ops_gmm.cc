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
  // The library takes views with a mutable pointer; inputs are only read.
  TensorView view() const {
    return TensorView{const_cast<void*>(in_->data()), in_->dtype(), in_->shape()};
  }

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

// In modes bf16 and fake_qat an F32 operand is rounded to BF16 first.
Result<Operand> FloatOperand(const Tensor* t, GmmMode mode) {
  const bool bf16 = mode == GmmMode::kBf16 || mode == GmmMode::kFakeQat;
  if (!bf16 || t->dtype() != DType::kF32) return Operand(t);
  FP8MOE_ASSIGN_OR_RETURN(Tensor y, ToBf16(*t));
  return Operand(std::move(y));
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

// ---- Memory plans (PlanMemory), from the input shapes before any copy ----

// Dimension i of tensor `name` if it has rank `rank`, else 0 (a wrong shape
// is reported by validation later; the plan just must not overstate it).
int64_t DimOf(const SafetensorsFile& in, const char* name, int rank, int i) {
  const Tensor* t = in.Find(name);
  return t != nullptr && t->rank() == rank ? t->dim(i) : 0;
}

uint64_t U(int64_t v) { return v > 0 ? static_cast<uint64_t>(v) : 0; }

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

// The plan of gmm, dlhs and tgmm: converted operands, outputs, the kernels'
// pre-pass buffers and packing, or the reference twin's dense copies.
Status PlanGmmFamily(const std::string& op, const SafetensorsFile& in, const GmmOptions& o,
                     const Config& keys, bool dout_quant) {
  const bool reference = keys.GetBool("reference");
  const DType out_dt = OutDType(keys);
  const bool bf16_mode = o.mode == GmmMode::kBf16 || o.mode == GmmMode::kFakeQat;
  const char* rhs_name = in.Find("rhs_codes") != nullptr ? "rhs_codes" : "rhs";
  std::vector<PlannedTensor> plan;
  uint64_t scratch = 0;
  int64_t m = 0, k = 0, n = 0, e = 0;
  if (op == "tgmm") {
    m = DimOf(in, "lhs", 2, 0);
    k = DimOf(in, "lhs", 2, 1);
    n = DimOf(in, "dout", 2, 1);
    e = DimOf(in, "group_sizes", 1, 0);
  } else {
    e = DimOf(in, rhs_name, 3, 0);
    k = DimOf(in, rhs_name, 3, 1);
    n = DimOf(in, rhs_name, 3, 2);
    m = op == "gmm" ? DimOf(in, "lhs", 2, 0) : DimOf(in, "dout", 2, 0);
  }
  const Tensor* lhs = in.Find(op == "dlhs" ? "dout" : "lhs");
  if (bf16_mode && lhs != nullptr && lhs->dtype() == DType::kF32) {
    plan.push_back({"the BF16 copy of '" + std::string(op == "dlhs" ? "dout" : "lhs") + "'",
                    DType::kBF16, lhs->shape()});
  }
  const Tensor* dout = in.Find("dout");
  if (op == "tgmm" && bf16_mode && !dout_quant && dout != nullptr &&
      dout->dtype() == DType::kF32) {
    plan.push_back({"the BF16 copy of 'dout'", DType::kBF16, dout->shape()});
  }
  const Tensor* rhs = in.Find("rhs");
  const bool quantize_rhs = o.mode == GmmMode::kFakeQat || o.mode == GmmMode::kNativeFp8 ||
                            o.mode == GmmMode::kInt8;
  if (op != "tgmm" && rhs != nullptr && in.Find("rhs_codes") == nullptr) {
    if (quantize_rhs) {
      plan.push_back({"the F32 copy of 'rhs'", DType::kF32, rhs->shape()});
      plan.push_back({"the codes of 'rhs'", DType::kU8, rhs->shape()});
      plan.push_back({"the scales of 'rhs'", DType::kF32, {e, n}});
    } else if (bf16_mode && rhs->dtype() == DType::kF32) {
      plan.push_back({"the BF16 copy of 'rhs'", DType::kBF16, rhs->shape()});
    }
  }
  if (op == "gmm") {
    const bool swiglu = o.epilogue == GmmEpilogue::kSwiGlu;
    plan.push_back({"output 'out'", out_dt, {m, swiglu ? n / 2 : n}});
    if (swiglu) plan.push_back({"output 'h'", out_dt, {m, n}});
  } else if (op == "dlhs") {
    const int64_t k2 = k > std::numeric_limits<int64_t>::max() / 2
                           ? std::numeric_limits<int64_t>::max()
                           : 2 * k;
    plan.push_back({"output 'dlhs'", out_dt, {m, o.epilogue == GmmEpilogue::kDSwiGlu ? k2 : k}});
  } else {
    plan.push_back({"output 'drhs'", DType::kF32, {e, k, n}});
    if (out_dt == DType::kBF16) plan.push_back({"the BF16 'drhs'", DType::kBF16, {e, k, n}});
  }
  // Working memory, saturating: a few full-size copies at most.
  const uint64_t mk = SatMul(U(m), U(k)), mn = SatMul(U(m), U(n));
  const uint64_t ekn = SatMul(U(e), SatMul(U(k), U(n)));
  if (reference) {
    // The twins hold dense f32 copies of their operands and results.
    scratch = SatAdd(scratch, SatMul(8, SatAdd(SatAdd(mk, mn), ekn)));
  } else {
    if (o.mode == GmmMode::kFakeQat) scratch = SatAdd(scratch, SatMul(2, ekn));
    if (o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8) {
      scratch = SatAdd(scratch, SatMul(5, mk));
    }
    if (dout_quant) scratch = SatAdd(scratch, SatAdd(SatMul(5, mn), SatMul(24, SatAdd(U(m), U(e)))));
    const int64_t out_rows = op == "tgmm" ? k : m;
    const int64_t out_cols = op == "dlhs" ? k : n;
    const int64_t red = op == "gmm" ? k : op == "dlhs" ? n : m;
    scratch = SatAdd(scratch, PackingBytes(o.tiles, out_rows, out_cols, red));
  }
  return PlanMemory(op, plan, scratch);
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

// The weight as the library takes it: `rhs` values, or `rhs_codes` +
// `rhs_scale`. A float `rhs` is converted for the mode: rounded to BF16
// (bf16), or quantized per output channel with absmax to fp8_dtype
// (fake_qat, native_fp8) or int8 (int8).
struct Rhs {
  Operand w;
  std::optional<Operand> scale;
};

Result<Rhs> GetRhs(const std::string& op, const SafetensorsFile& in,
                   const GmmOptions& o, const Config& keys) {
  const Tensor* values = in.Find("rhs");
  const Tensor* codes = in.Find("rhs_codes");
  if (values != nullptr && codes != nullptr) {
    return InvalidArgument("op " + op + ": the input has both 'rhs' and "
                           "'rhs_codes'; give either rhs values or rhs_codes "
                           "+ rhs_scale");
  }
  Rhs rhs;
  if (codes != nullptr) {
    FP8MOE_ASSIGN_OR_RETURN(
        codes, GetInput(op, in, "rhs_codes",
                        {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2,
                         DType::kE5M2FNUZ, DType::kI8}));
    FP8MOE_ASSIGN_OR_RETURN(const Tensor* scale,
                            GetInput(op, in, "rhs_scale", {DType::kF32}));
    if (o.mode == GmmMode::kFakeQat && keys.IsSet("fp8_dtype") &&
        codes->dtype() != QuantStorageDType(o.fp8_dtype)) {
      return InvalidArgument("op " + op + ": fp8_dtype=" +
                             keys.GetString("fp8_dtype") + " but 'rhs_codes' is " +
                             std::string(DTypeName(codes->dtype())) +
                             "; drop the key or make them agree");
    }
    rhs.w = Operand(codes);
    rhs.scale = Operand(scale);
    return rhs;
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
  const bool quantize = o.mode == GmmMode::kFakeQat ||
                        o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8;
  if (!quantize) {
    FP8MOE_ASSIGN_OR_RETURN(rhs.w, FloatOperand(values, o.mode));
    return rhs;
  }
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "rhs", *values, 3, "[E, K, N]"));
  const int64_t e = values->dim(0), k = values->dim(1), n = values->dim(2);
  // BF16 values widen exactly to f32 before quantizing.
  std::vector<float> w(values->num_elements());
  if (values->dtype() == DType::kBF16) {
    Bf16ToF32Span(values->data_as<uint16_t>(), w.data(), w.size());
  } else if (!w.empty()) {
    std::memcpy(w.data(), values->data(), w.size() * sizeof(float));
  }
  const QuantDType qdt = o.mode == GmmMode::kInt8 ? QuantDType::kInt8 : o.fp8_dtype;
  FP8MOE_ASSIGN_OR_RETURN(Tensor q,
                          Tensor::Create(QuantStorageDType(qdt), values->shape()));
  FP8MOE_ASSIGN_OR_RETURN(Tensor s, Tensor::Create(DType::kF32, {e, n}));
  FP8MOE_RETURN_IF_ERROR(QuantizeChannels(w.data(), e, k, n, qdt, Calibration::AbsMax(),
                                          q.data_as<uint8_t>(), s.data_as<float>()));
  rhs.w = Operand(std::move(q));
  rhs.scale = Operand(std::move(s));
  return rhs;
}

Status RunGmm(const SafetensorsFile& in, const Config& keys, SafetensorsFile* out) {
  const std::string op = "gmm";
  FP8MOE_ASSIGN_OR_RETURN(GmmOptions o, ParseOptions(op, keys, true, true));
  o.lhs_quant_block_size = keys.GetInt("lhs_quant_block_size");
  FP8MOE_ASSIGN_OR_RETURN(
      o.lhs_calibration,
      ParseCalibrationKeys(op, keys, "lhs_calibration",
                           o.mode == GmmMode::kNativeFp8 || o.mode == GmmMode::kInt8,
                           "to mode native_fp8 or int8 (they quantize lhs)"));
  const bool reference = keys.GetBool("reference");
  FP8MOE_RETURN_IF_ERROR(PlanGmmFamily(op, in, o, keys, false));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* lhs_in,
                          GetInput(op, in, "lhs", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "lhs", *lhs_in, 2, "[M, K]"));
  // native_fp8 and int8 quantize lhs themselves, from F32 or BF16.
  FP8MOE_ASSIGN_OR_RETURN(const Operand lhs, FloatOperand(lhs_in, o.mode));
  FP8MOE_ASSIGN_OR_RETURN(const Rhs rhs, GetRhs(op, in, o, keys));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "rhs", rhs.w.tensor(), 3, "[E, K, N]"));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* gs,
                          GetInput(op, in, "group_sizes", {DType::kI32}));
  const int64_t m = lhs_in->dim(0), n = rhs.w.tensor().dim(2);
  const bool swiglu = o.epilogue == GmmEpilogue::kSwiGlu;
  FP8MOE_ASSIGN_OR_RETURN(Tensor result,
                          PoisonedOutput(OutDType(keys), {m, swiglu ? n / 2 : n}));
  Tensor h;
  if (swiglu) {
    FP8MOE_ASSIGN_OR_RETURN(h, PoisonedOutput(OutDType(keys), {m, n}));
  }
  const TensorView scale_view = rhs.scale ? rhs.scale->view() : TensorView{};
  const TensorView* scale = rhs.scale ? &scale_view : nullptr;
  const TensorView gs_view = Operand(gs).view(), h_view = h.view();
  const TensorView* h_ptr = swiglu ? &h_view : nullptr;
  const Status s =
      reference ? reference::Gmm(o, lhs.view(), rhs.w.view(), scale, gs_view,
                                 result.view(), h_ptr)
                : Gmm(o, lhs.view(), rhs.w.view(), scale, gs_view, result.view(), h_ptr);
  FP8MOE_RETURN_IF_ERROR(Prefixed(op, s));
  FP8MOE_RETURN_IF_ERROR(out->Add("out", std::move(result)));
  if (swiglu) FP8MOE_RETURN_IF_ERROR(out->Add("h", std::move(h)));
  return OkStatus();
}

Status RunDlhs(const SafetensorsFile& in, const Config& keys, SafetensorsFile* out) {
  const std::string op = "dlhs";
  FP8MOE_ASSIGN_OR_RETURN(const GmmOptions o, ParseOptions(op, keys, true, true));
  const bool reference = keys.GetBool("reference");
  FP8MOE_RETURN_IF_ERROR(PlanGmmFamily(op, in, o, keys, false));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* dout_in,
                          GetInput(op, in, "dout", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "dout", *dout_in, 2, "[M, N]"));
  FP8MOE_ASSIGN_OR_RETURN(const Operand dout, FloatOperand(dout_in, o.mode));
  FP8MOE_ASSIGN_OR_RETURN(const Rhs rhs, GetRhs(op, in, o, keys));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "rhs", rhs.w.tensor(), 3, "[E, K, N]"));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* gs,
                          GetInput(op, in, "group_sizes", {DType::kI32}));
  const Tensor* h = in.Find("h");
  if (h != nullptr) {
    FP8MOE_ASSIGN_OR_RETURN(h, GetInput(op, in, "h", {DType::kF32, DType::kBF16}));
  } else if (o.epilogue == GmmEpilogue::kDSwiGlu) {
    return NotFound("op dlhs: epilogue=dswiglu needs tensor 'h' (F32 or BF16 "
                    "[M, 2K]), the forward's saved pre-activation");
  }
  const int64_t m = dout_in->dim(0), k = rhs.w.tensor().dim(1);
  const bool dswiglu = o.epilogue == GmmEpilogue::kDSwiGlu;
  FP8MOE_ASSIGN_OR_RETURN(Tensor result,
                          PoisonedOutput(OutDType(keys), {m, dswiglu ? 2 * k : k}));
  const TensorView scale_view = rhs.scale ? rhs.scale->view() : TensorView{};
  const TensorView* scale = rhs.scale ? &scale_view : nullptr;
  const TensorView gs_view = Operand(gs).view();
  const TensorView h_view = h != nullptr ? Operand(h).view() : TensorView{};
  const TensorView* h_ptr = h != nullptr ? &h_view : nullptr;
  const Status s =
      reference ? reference::GmmDlhs(o, dout.view(), rhs.w.view(), scale, gs_view,
                                     result.view(), h_ptr)
                : GmmDlhs(o, dout.view(), rhs.w.view(), scale, gs_view,
                          result.view(), h_ptr);
  FP8MOE_RETURN_IF_ERROR(Prefixed(op, s));
  return out->Add("dlhs", std::move(result));
}

Status RunTgmm(const SafetensorsFile& in, const Config& keys, SafetensorsFile* out) {
  const std::string op = "tgmm";
  FP8MOE_ASSIGN_OR_RETURN(const GmmOptions o, ParseOptions(op, keys, false, false));
  const bool reference = keys.GetBool("reference");
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
                          ParseCalibrationKeys(op, keys, "dout_calibration", dq != "none",
                                               "when dout is quantized (dout_quant=e5m2|e4m3)"));
  FP8MOE_ASSIGN_OR_RETURN(
      const Tensor* lhs_in,
      GetInput(op, in, "lhs",
               {DType::kF32, DType::kBF16, DType::kE4M3FN, DType::kE4M3FNUZ,
                DType::kE5M2, DType::kE5M2FNUZ}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "lhs", *lhs_in, 2, "[M, K]"));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* dout_in,
                          GetInput(op, in, "dout", {DType::kF32, DType::kBF16}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "dout", *dout_in, 2, "[M, N]"));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* gs,
                          GetInput(op, in, "group_sizes", {DType::kI32}));
  FP8MOE_RETURN_IF_ERROR(NeedRank(op, "group_sizes", *gs, 1, "[E]"));
  FP8MOE_RETURN_IF_ERROR(PlanGmmFamily(op, in, o, keys, quant.dout_dtype.has_value()));
  FP8MOE_ASSIGN_OR_RETURN(const Operand lhs, FloatOperand(lhs_in, o.mode));
  // A quantized dout is quantized from F32 inside the call: never round it.
  FP8MOE_ASSIGN_OR_RETURN(const Operand dout,
                          quant.dout_dtype ? Result<Operand>(Operand(dout_in))
                                           : FloatOperand(dout_in, o.mode));
  // The library's drhs is F32; out_dtype=bf16 rounds it afterwards.
  FP8MOE_ASSIGN_OR_RETURN(
      Tensor drhs,
      PoisonedOutput(DType::kF32, {gs->dim(0), lhs_in->dim(1), dout_in->dim(1)}));
  const TensorView gs_view = Operand(gs).view();
  const Status s =
      reference ? reference::Tgmm(o, quant, lhs.view(), dout.view(), gs_view, drhs.view())
                : Tgmm(o, quant, lhs.view(), dout.view(), gs_view, drhs.view());
  FP8MOE_RETURN_IF_ERROR(Prefixed(op, s));
  if (OutDType(keys) == DType::kBF16) {
    FP8MOE_ASSIGN_OR_RETURN(Tensor rounded, ToBf16(drhs));
    return out->Add("drhs", std::move(rounded));
  }
  return out->Add("drhs", std::move(drhs));
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
            "-> out [M,N] (swiglu: out [M,N/2], h [M,N])", {}, RunGmm};
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
             "group_sizes (, h) -> dlhs [M,K] (dswiglu: [M,2K])", {}, RunDlhs};
  AddModeKey(&dlhs.keys);
  AddFp8DTypeKey(&dlhs.keys);
  AddKey(&dlhs.keys, {"epilogue", FlagType::kString, "none",
                      "dswiglu: the SwiGLU backward with h [M,2K] = [gate | up]",
                      {"none", "swiglu", "dswiglu"}});
  AddTailKeys(&dlhs.keys);
  ops->push_back(std::move(dlhs));

  OpDef tgmm{"tgmm", "lhs [M,K] (or fp8 codes), dout [M,N], group_sizes "
             "-> drhs [E,K,N]", {}, RunTgmm};
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
