// Ops on the numerics and quantization layers: cast, decode, quantize,
// dequantize. Keys and tensors are documented in docs/ops.md.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "cli/op.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"

namespace fp8moe::cli {
namespace {

const std::vector<std::string> kCastFormats = {"e4m3fn", "e4m3fnuz", "e5m2",
                                               "e5m2fnuz", "bf16"};
const std::vector<std::string> kQuantDTypes = {"e4m3fn", "e4m3fnuz", "e5m2",
                                               "e5m2fnuz", "int8"};

// Largest finite bf16, 0x7F7F.
const float kBf16Max = Bf16ToF32(0x7F7F);

Result<OpWork> Cast(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* x, GetInput("cast", in, "x", {DType::kF32}));
  const std::string& format = keys.GetString("format");
  const bool saturate = keys.GetBool("saturate");
  const DType out_dtype =
      format == "bf16" ? DType::kBF16
                       : (ParseFp8Format(format).ok() ? Fp8FormatDType(*ParseFp8Format(format))
                                                      : DType::kU8);
  std::vector<PlannedTensor> plan = {{"output 'y'", out_dtype, x->shape()}};
  if (format == "bf16" && saturate) plan.push_back({"the clipped copy of 'x'", DType::kF32, x->shape()});
  FP8MOE_RETURN_IF_ERROR(PlanMemory("cast", plan));
  return OpWork([x, format, saturate](SafetensorsFile* out) -> Status {
    const size_t n = x->num_elements();
    const float* xs = x->data_as<float>();
    if (format == "bf16") {
      FP8MOE_ASSIGN_OR_RETURN(Tensor y, Tensor::Create(DType::kBF16, x->shape()));
      if (saturate) {  // clip to the largest finite bf16 first; NaN stays NaN
        FP8MOE_ASSIGN_OR_RETURN(Tensor clipped, Tensor::Create(DType::kF32, x->shape()));
        float* c = clipped.data_as<float>();
        for (size_t i = 0; i < n; ++i) {
          c[i] = std::isnan(xs[i]) ? xs[i] : std::fmin(std::fmax(xs[i], -kBf16Max), kBf16Max);
        }
        F32ToBf16Span(c, y.data_as<uint16_t>(), n);
      } else {
        F32ToBf16Span(xs, y.data_as<uint16_t>(), n);
      }
      return out->Add("y", std::move(y));
    }
    FP8MOE_ASSIGN_OR_RETURN(const Fp8Format f, ParseFp8Format(format));
    FP8MOE_ASSIGN_OR_RETURN(Tensor y, Tensor::Create(Fp8FormatDType(f), x->shape()));
    EncodeFp8Span(xs, y.data_as<uint8_t>(), n, f, saturate);
    return out->Add("y", std::move(y));
  });
}

Result<OpWork> Decode(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(
      const Tensor* y,
      GetInput("decode", in, "y",
               {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2, DType::kE5M2FNUZ,
                DType::kBF16, DType::kU8}));
  const std::string& format = keys.GetString("format");
  std::string have;  // the format the dtype says, if it says one
  if (y->dtype() == DType::kBF16) have = "bf16";
  if (IsFp8(y->dtype())) have = std::string(Fp8FormatName(*Fp8FormatOf(y->dtype())));
  if (have.empty() && format.empty()) {
    return InvalidArgument("op decode: tensor 'y' is U8, which does not say its "
                           "format; pass format=e4m3fn|e4m3fnuz|e5m2|e5m2fnuz");
  }
  if (!have.empty() && !format.empty() && have != format) {
    return InvalidArgument("op decode: format=" + format + " but tensor 'y' is " +
                           have + "; drop the key or pass format=" + have);
  }
  const std::string fmt = have.empty() ? format : have;
  // Every (dtype, format) pair must agree on the byte width, or the decoder
  // would read past the tensor: bf16 takes 2-byte values, fp8 formats 1.
  const size_t width = fmt == "bf16" ? 2 : 1;
  if (DTypeSize(y->dtype()) != width) {
    return InvalidArgument("op decode: format=" + fmt + " reads " + std::to_string(width) +
                           "-byte values but tensor 'y' is " +
                           std::string(DTypeName(y->dtype())) + " (" +
                           std::to_string(DTypeSize(y->dtype())) +
                           "-byte values); store bf16 values as a BF16 tensor, or pass an "
                           "fp8 format (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz) for U8 codes");
  }
  FP8MOE_RETURN_IF_ERROR(PlanMemory("decode", {{"output 'x'", DType::kF32, y->shape()}}));
  return OpWork([y, fmt](SafetensorsFile* out) -> Status {
    FP8MOE_ASSIGN_OR_RETURN(Tensor x, Tensor::Create(DType::kF32, y->shape()));
    if (fmt == "bf16") {
      Bf16ToF32Span(y->data_as<uint16_t>(), x.data_as<float>(), y->num_elements());
    } else {
      FP8MOE_ASSIGN_OR_RETURN(const Fp8Format f, ParseFp8Format(fmt));
      DecodeFp8Span(y->data_as<uint8_t>(), x.data_as<float>(), y->num_elements(), f);
    }
    return out->Add("x", std::move(x));
  });
}

// The layout of a quantize/dequantize request, from the keys and x's shape.
struct QuantLayout {
  std::string granularity;
  int64_t rows = 0, cols = 0, block = 0;  // row
  int64_t experts = 0, k = 0, n = 0;      // channel
  Shape scale_shape;
};

// The keys of a quantize/dequantize request alone (OpDef::check_keys): the
// block size and whether it applies, and the calibration keys.
Status QuantKeys(const std::string& op, const Config& keys) {
  const int64_t block = keys.GetInt("block_size");
  if (block != 0 && block != 128 && block != 512) {
    return InvalidArgument("op " + op + ": block_size=" + std::to_string(block) +
                           " is not supported; use 0 (full row), 128 or 512");
  }
  if (block != 0 && keys.GetString("granularity") != "row") {
    return InvalidArgument("op " + op + ": block_size applies to granularity=row "
                           "only; drop it or set granularity=row");
  }
  return ParseCalibrationKeys(op, keys, "calibration", true, "").status();
}

// The layout from x's shape, for keys that passed QuantKeys.
Result<QuantLayout> Layout(const std::string& op, const Shape& shape,
                           const Config& keys) {
  QuantLayout l;
  l.granularity = keys.GetString("granularity");
  l.block = keys.GetInt("block_size");
  if (l.granularity == "tensor") {
    l.scale_shape = {1};
  } else if (l.granularity == "row") {
    if (shape.size() != 2) {
      return InvalidArgument("op " + op + ": granularity=row needs a rank-2 [R, C] "
                             "tensor; got shape " + ShapeToString(shape));
    }
    l.rows = shape[0];
    l.cols = shape[1];
    l.scale_shape = {l.rows, NumBlocks(l.cols, l.block)};
  } else {  // channel
    if (shape.size() != 3 && shape.size() != 2) {
      return InvalidArgument("op " + op + ": granularity=channel needs a weight "
                             "[E, K, N] (or [K, N]); got shape " + ShapeToString(shape));
    }
    l.experts = shape.size() == 3 ? shape[0] : 1;
    l.k = shape[shape.size() - 2];
    l.n = shape[shape.size() - 1];
    l.scale_shape = {l.experts, l.n};
  }
  return l;
}

// For keys that passed QuantKeys.
Result<OpWork> Quantize(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* x, GetInput("quantize", in, "x", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const QuantDType dt, ParseQuantDType(keys.GetString("dtype")));
  FP8MOE_ASSIGN_OR_RETURN(const Calibration cal,
                          ParseCalibrationKeys("quantize", keys, "calibration", true, ""));
  FP8MOE_ASSIGN_OR_RETURN(const QuantLayout l, Layout("quantize", x->shape(), keys));
  FP8MOE_RETURN_IF_ERROR(PlanMemory("quantize", {{"output 'q'", QuantStorageDType(dt), x->shape()},
                                                 {"output 'scale'", DType::kF32, l.scale_shape}}));
  return OpWork([x, dt, cal, l](SafetensorsFile* out) -> Status {
    FP8MOE_ASSIGN_OR_RETURN(Tensor q, Tensor::Create(QuantStorageDType(dt), x->shape()));
    FP8MOE_ASSIGN_OR_RETURN(Tensor scale, Tensor::Create(DType::kF32, l.scale_shape));
    const float* xs = x->data_as<float>();
    uint8_t* qs = q.data_as<uint8_t>();
    float* ss = scale.data_as<float>();
    if (l.granularity == "tensor") {
      FP8MOE_RETURN_IF_ERROR(QuantizeTensor(xs, static_cast<int64_t>(x->num_elements()),
                                            dt, cal, qs, ss));
    } else if (l.granularity == "row") {
      FP8MOE_RETURN_IF_ERROR(QuantizeRows(xs, l.rows, l.cols, l.rows, l.block, dt, cal, qs, ss));
    } else {
      FP8MOE_RETURN_IF_ERROR(QuantizeChannels(xs, l.experts, l.k, l.n, dt, cal, qs, ss));
    }
    FP8MOE_RETURN_IF_ERROR(out->Add("q", std::move(q)));
    return out->Add("scale", std::move(scale));
  });
}

// For keys that passed QuantKeys (which also checks the calibration keys,
// although the scales already hold them: a misspelled one is an error here
// as in quantize).
Result<OpWork> Dequantize(const SafetensorsFile& in, const Config& keys) {
  FP8MOE_ASSIGN_OR_RETURN(
      const Tensor* q,
      GetInput("dequantize", in, "q",
               {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2, DType::kE5M2FNUZ,
                DType::kI8}));
  FP8MOE_ASSIGN_OR_RETURN(const Tensor* scale,
                          GetInput("dequantize", in, "scale", {DType::kF32}));
  FP8MOE_ASSIGN_OR_RETURN(const QuantDType dt, QuantDTypeOf(q->dtype()));
  if (keys.IsSet("dtype") && keys.GetString("dtype") != QuantDTypeName(dt)) {
    return InvalidArgument("op dequantize: dtype=" + keys.GetString("dtype") +
                           " but tensor 'q' holds " + std::string(QuantDTypeName(dt)) +
                           " codes; drop the key or make them agree");
  }
  FP8MOE_ASSIGN_OR_RETURN(const QuantLayout l, Layout("dequantize", q->shape(), keys));
  if (scale->shape() != l.scale_shape) {
    return InvalidArgument("op dequantize: tensor 'scale' has shape " +
                           ShapeToString(scale->shape()) + "; granularity=" +
                           l.granularity + " of q " + ShapeToString(q->shape()) +
                           " needs " + ShapeToString(l.scale_shape));
  }
  FP8MOE_RETURN_IF_ERROR(PlanMemory("dequantize", {{"output 'x'", DType::kF32, q->shape()}}));
  return OpWork([q, scale, dt, l](SafetensorsFile* out) -> Status {
    FP8MOE_ASSIGN_OR_RETURN(Tensor x, Tensor::Create(DType::kF32, q->shape()));
    const uint8_t* qs = q->data_as<uint8_t>();
    const float* ss = scale->data_as<float>();
    float* xs = x.data_as<float>();
    if (l.granularity == "tensor") {
      DequantizeTensor(qs, static_cast<int64_t>(q->num_elements()), ss[0], dt, xs);
    } else if (l.granularity == "row") {
      DequantizeRows(qs, l.rows, l.cols, l.block, ss, dt, xs);
    } else {
      DequantizeChannels(qs, l.experts, l.k, l.n, ss, dt, xs);
    }
    return out->Add("x", std::move(x));
  });
}

void AddQuantKeys(ConfigSchema* s, bool dtype_required) {
  AddKey(s, {"dtype", FlagType::kString, "e4m3fn",
             dtype_required ? "code dtype" : "code dtype (optional: q's dtype says it)",
             kQuantDTypes});
  AddKey(s, {"granularity", FlagType::kString, "row",
             "one scale per tensor, per row (of [R, C]) or per output channel "
             "(of [E, K, N])",
             {"tensor", "row", "channel"}});
  AddKey(s, {"block_size", FlagType::kInt, "0",
             "row only: 0 = full row, or 128 / 512 columns per scale"});
}

}  // namespace

void RegisterNumericsOps(std::vector<OpDef>* ops) {
  OpDef cast{"cast", "x F32 -> y codes of `format` (round to nearest even)", {}, nullptr, Cast};
  AddKey(&cast.keys, {"format", FlagType::kString, "e4m3fn", "target format", kCastFormats});
  AddKey(&cast.keys, {"saturate", FlagType::kBool, "false",
                      "clip to the format's max first (false: ml_dtypes astype)"});
  ops->push_back(std::move(cast));

  OpDef decode{"decode", "y codes (fp8 / bf16 / U8 with format=) -> x F32", {}, nullptr, Decode};
  std::vector<std::string> fmts = kCastFormats;
  fmts.insert(fmts.begin(), "");
  AddKey(&decode.keys, {"format", FlagType::kString, "",
                        "format of a U8 input (fp8 and bf16 dtypes say it)", fmts});
  ops->push_back(std::move(decode));

  OpDef quantize{"quantize", "x F32 -> q codes, scale F32", {},
                 [](const Config& keys) { return QuantKeys("quantize", keys); }, Quantize};
  AddQuantKeys(&quantize.keys, true);
  AddCalibrationKeys(&quantize.keys, "calibration", "how the scales are found");
  ops->push_back(std::move(quantize));

  OpDef dequantize{"dequantize", "q codes, scale F32 -> x F32", {},
                   [](const Config& keys) { return QuantKeys("dequantize", keys); }, Dequantize};
  AddQuantKeys(&dequantize.keys, false);
  AddCalibrationKeys(&dequantize.keys, "calibration",
                     "accepted and checked so quantize's keys can be reused; the scales "
                     "already hold it");
  ops->push_back(std::move(dequantize));
}

}  // namespace fp8moe::cli
