#include "python/src/ffi_util.h"

namespace fp8moe::py::ffi_util {

std::optional<DType> FromXla(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F64: return DType::kF64;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F8E4M3FN: return DType::kE4M3FN;
    case ffi::DataType::F8E4M3FNUZ: return DType::kE4M3FNUZ;
    case ffi::DataType::F8E5M2: return DType::kE5M2;
    case ffi::DataType::F8E5M2FNUZ: return DType::kE5M2FNUZ;
    case ffi::DataType::PRED: return DType::kBool;
    case ffi::DataType::S8: return DType::kI8;
    case ffi::DataType::U8: return DType::kU8;
    case ffi::DataType::S16: return DType::kI16;
    case ffi::DataType::U16: return DType::kU16;
    case ffi::DataType::S32: return DType::kI32;
    case ffi::DataType::U32: return DType::kU32;
    case ffi::DataType::S64: return DType::kI64;
    case ffi::DataType::U64: return DType::kU64;
    default: return std::nullopt;
  }
}

Result<TensorView> ToView(std::string_view name, const ffi::AnyBuffer& b) {
  const auto dtype = FromXla(b.element_type());
  if (!dtype) {
    return InvalidArgument(std::string(name) + " has XLA element type " +
                           std::to_string(static_cast<int>(b.element_type())) +
                           ", which fp8moe does not support");
  }
  if (b.dimensions().size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgument(std::string(name) + " has " + std::to_string(b.dimensions().size()) +
                           " dimensions; fp8moe takes at most " + std::to_string(kMaxRank));
  }
  TensorView v;
  v.data = b.untyped_data();
  v.dtype = *dtype;
  for (int64_t d : b.dimensions()) v.shape.push_back(d);
  return v;
}

ffi::Error ToError(std::string_view fn, const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (s.code()) {
    case StatusCode::kInvalidArgument: code = ffi::ErrorCode::kInvalidArgument; break;
    case StatusCode::kNotFound: code = ffi::ErrorCode::kNotFound; break;
    case StatusCode::kOutOfRange: code = ffi::ErrorCode::kOutOfRange; break;
    case StatusCode::kFailedPrecondition: code = ffi::ErrorCode::kFailedPrecondition; break;
    case StatusCode::kResourceExhausted: code = ffi::ErrorCode::kResourceExhausted; break;
    case StatusCode::kDataLoss: code = ffi::ErrorCode::kDataLoss; break;
    default: break;
  }
  return ffi::Error(code, std::string(fn) + ": " + s.message());
}

Result<ConstTensorView> Arg(const ffi::RemainingArgs& args, size_t i, std::string_view name) {
  auto b = args.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) {
    return InvalidArgument("operand " + std::to_string(i) + " (" + std::string(name) +
                           "): " + b.error().message());
  }
  FP8MOE_ASSIGN_OR_RETURN(const TensorView v, ToView(name, *b));
  return ConstTensorView(v);
}

Result<TensorView> Ret(const ffi::RemainingRets& rets, size_t i, std::string_view name) {
  auto b = rets.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) {
    return InvalidArgument("result " + std::to_string(i) + " (" + std::string(name) +
                           "): " + b.error().message());
  }
  return ToView(name, **b);
}

}  // namespace fp8moe::py::ffi_util
