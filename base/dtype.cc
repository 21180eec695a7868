#include "fp8moe/dtype.h"

#include <string>

namespace fp8moe {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
};

constexpr DTypeInfo kInfos[] = {
    {DType::kF32, 4, "f32"},         {DType::kF64, 8, "f64"},
    {DType::kF16, 2, "f16"},         {DType::kBF16, 2, "bf16"},
    {DType::kE4M3FN, 1, "e4m3fn"},   {DType::kE4M3FNUZ, 1, "e4m3fnuz"},
    {DType::kE5M2, 1, "e5m2"},       {DType::kE5M2FNUZ, 1, "e5m2fnuz"},
    {DType::kBool, 1, "bool"},       {DType::kI8, 1, "int8"},
    {DType::kU8, 1, "uint8"},        {DType::kI16, 2, "int16"},
    {DType::kU16, 2, "uint16"},      {DType::kI32, 4, "int32"},
    {DType::kU32, 4, "uint32"},      {DType::kI64, 8, "int64"},
    {DType::kU64, 8, "uint64"},
};

struct Alias {
  std::string_view alias;
  DType dtype;
};
constexpr Alias kAliases[] = {
    {"float32", DType::kF32},  {"float64", DType::kF64},
    {"float16", DType::kF16},  {"bfloat16", DType::kBF16},
    {"i8", DType::kI8},        {"u8", DType::kU8},
    {"i32", DType::kI32},      {"i64", DType::kI64},
    {"float8_e4m3fn", DType::kE4M3FN}, {"float8_e4m3fnuz", DType::kE4M3FNUZ},
    {"float8_e5m2", DType::kE5M2},     {"float8_e5m2fnuz", DType::kE5M2FNUZ},
};

const DTypeInfo& Info(DType d) { return kInfos[static_cast<int>(d)]; }

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).name; }

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kInfos) {
    if (info.name == name) return info.dtype;
  }
  for (const Alias& a : kAliases) {
    if (a.alias == name) return a.dtype;
  }
  std::string names;
  for (const DTypeInfo& info : kInfos) {
    if (!names.empty()) names += ", ";
    names += info.name;
  }
  return InvalidArgument("unknown dtype '" + std::string(name) +
                         "'; expected one of: " + names);
}

bool IsFp8(DType d) {
  return d == DType::kE4M3FN || d == DType::kE4M3FNUZ || d == DType::kE5M2 ||
         d == DType::kE5M2FNUZ;
}

}  // namespace fp8moe
