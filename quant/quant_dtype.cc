// Quant dtypes, calibration and the scalar quantize / dequantize of one value.
#include <cmath>
#include <cstdlib>
#include <string>

#include "fp8moe/quant.h"

namespace fp8moe {
namespace {

constexpr std::string_view kNames[] = {"e4m3fn", "e4m3fnuz", "e5m2",
                                       "e5m2fnuz", "int8"};

Fp8Format FormatOf(QuantDType d) { return static_cast<Fp8Format>(d); }

}  // namespace

std::string_view QuantDTypeName(QuantDType dtype) {
  return kNames[static_cast<int>(dtype)];
}

Result<QuantDType> ParseQuantDType(std::string_view name) {
  for (int i = 0; i < 5; ++i) {
    if (kNames[i] == name) return static_cast<QuantDType>(i);
  }
  return InvalidArgument("unknown quantization dtype '" + std::string(name) +
                         "'; expected one of: e4m3fn, e4m3fnuz, e5m2, "
                         "e5m2fnuz, int8");
}

float QuantMax(QuantDType dtype) {
  if (dtype == QuantDType::kInt8) return 127.0f;
  return GetFp8Spec(FormatOf(dtype)).max;
}

DType QuantStorageDType(QuantDType dtype) {
  if (dtype == QuantDType::kInt8) return DType::kI8;
  return Fp8FormatDType(FormatOf(dtype));
}

Result<QuantDType> QuantDTypeOf(DType dtype) {
  if (dtype == DType::kI8) return QuantDType::kInt8;
  auto f = Fp8FormatOf(dtype);
  if (!f.ok()) {
    return InvalidArgument("dtype " + std::string(DTypeName(dtype)) +
                           " does not hold quantized codes; expected an fp8 "
                           "dtype or int8");
  }
  return static_cast<QuantDType>(*f);
}

std::string_view ScaleArithmeticName(ScaleArithmetic arithmetic) {
  return arithmetic == ScaleArithmetic::kExactDivide ? "exact_divide"
                                                     : "xla_reciprocal";
}

Result<ScaleArithmetic> ParseScaleArithmetic(std::string_view name) {
  if (name == "exact_divide") return ScaleArithmetic::kExactDivide;
  if (name == "xla_reciprocal") return ScaleArithmetic::kXlaReciprocal;
  return InvalidArgument("unknown scale arithmetic '" + std::string(name) +
                         "'; expected exact_divide (true divisions, the "
                         "default) or xla_reciprocal (what qwix computes "
                         "under jax.jit)");
}

Result<Calibration> Calibration::Parse(std::string_view text) {
  if (text == "absmax") return AbsMax();
  const std::string usage =
      "; expected 'absmax' or 'fixed,a,b' with finite numbers a and b";
  if (text.substr(0, 6) != "fixed,") {
    return InvalidArgument("unknown calibration '" + std::string(text) + "'" +
                           usage);
  }
  const std::string rest(text.substr(6));
  const size_t comma = rest.find(',');
  if (comma == std::string::npos) {
    return InvalidArgument("calibration '" + std::string(text) +
                           "' needs two numbers" + usage);
  }
  float v[2];
  const std::string parts[2] = {rest.substr(0, comma), rest.substr(comma + 1)};
  for (int i = 0; i < 2; ++i) {
    // Decimal only, like every other number of a config (strtof would also
    // take hex, "inf", "nan" and leading blanks).
    const bool decimal = parts[i].find_first_not_of("0123456789+-.eE") == std::string::npos;
    char* end = nullptr;
    v[i] = decimal ? std::strtof(parts[i].c_str(), &end) : 0.0f;
    if (!decimal || parts[i].empty() || end != parts[i].c_str() + parts[i].size() ||
        !std::isfinite(v[i])) {
      return InvalidArgument("calibration '" + std::string(text) +
                             "': '" + parts[i] + "' is not a finite number" +
                             usage);
    }
  }
  if (v[0] == 0.0f && v[1] == 0.0f) {
    return InvalidArgument("calibration '" + std::string(text) +
                           "' has a zero range" + usage);
  }
  return Fixed(v[0], v[1]);
}

std::string Calibration::ToString() const {
  if (kind == Kind::kAbsMax) return "absmax";
  char buf[96];
  std::snprintf(buf, sizeof(buf), "fixed,%g,%g", lo, hi);
  return buf;
}

float Calibration::FixedAmax() const {
  return std::fmax(std::fabs(lo), std::fabs(hi));
}

float ScaleFromAmax(float amax, QuantDType dtype) {
  if (std::isnan(amax)) return amax;
  return std::fmax(amax, 1e-12f) / QuantMax(dtype);
}

float CalibratedScale(float amax, QuantDType dtype, const Calibration& calib) {
  const bool fixed = calib.kind == Calibration::Kind::kFixed;
  if (fixed) amax = calib.FixedAmax();
  if (calib.arithmetic == ScaleArithmetic::kExactDivide) {
    return ScaleFromAmax(amax, dtype);
  }
  // XLA folds a constant amax / fmax exactly and rewrites the division of a
  // computed amax into a multiplication by the folded f32(1 / fmax).
  const float fmax = QuantMax(dtype);
  const float scale = fixed ? amax / fmax : amax * (1.0f / fmax);
  // qwix: jnp.where(scale < sqrt(finfo(f32).tiny), 1, scale); sqrt(2^-126)
  // is 2^-63 exactly. NaN compares false and stays.
  return scale < 0x1p-63f ? 1.0f : scale;
}

uint8_t QuantizeValue(float x, float scale, QuantDType dtype,
                      ScaleArithmetic arithmetic) {
  // A NaN x keeps its own bits (see QuantizeVec): with both operands NaN a
  // product may return either one.
  const float v = arithmetic == ScaleArithmetic::kExactDivide ? x / scale
                  : std::isnan(x)                             ? x
                                                              : x * (1.0f / scale);
  if (dtype == QuantDType::kInt8) {
    return static_cast<uint8_t>(EncodeInt8(v));
  }
  return EncodeFp8(v, FormatOf(dtype), /*saturate=*/true);
}

float DequantizeValue(uint8_t code, float scale, QuantDType dtype) {
  if (dtype == QuantDType::kInt8) {
    return static_cast<float>(static_cast<int8_t>(code)) * scale;
  }
  return DecodeFp8(code, FormatOf(dtype)) * scale;
}

int64_t NumBlocks(int64_t cols, int64_t block_size) {
  if (block_size <= 0) return 1;
  // ceil without cols + block_size - 1, which could overflow.
  return cols / block_size + (cols % block_size != 0 ? 1 : 0);
}

Status CheckGroupSizes(const int32_t* group_sizes, int64_t groups, int64_t m) {
  if (groups < 0) return InvalidArgument("negative number of groups");
  int64_t sum = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (group_sizes[g] < 0) {
      return InvalidArgument("group_sizes[" + std::to_string(g) + "] = " +
                             std::to_string(group_sizes[g]) +
                             " is negative; group sizes count rows and must "
                             "be >= 0");
    }
    sum += group_sizes[g];
  }
  if (sum > m) {
    return InvalidArgument("sum(group_sizes) = " + std::to_string(sum) +
                           " exceeds the buffer's " + std::to_string(m) +
                           " rows; the groups must fit in the buffer");
  }
  return OkStatus();
}

Result<int64_t> NumGroupTiles(const int32_t* group_sizes, int64_t groups,
                              int64_t m, int64_t tile_m) {
  FP8MOE_RETURN_IF_ERROR(CheckGroupSizes(group_sizes, groups, m));
  if (tile_m < 0) {
    return InvalidArgument("tile_m = " + std::to_string(tile_m) +
                           " is negative; use 0 for one tile per group");
  }
  int64_t tiles = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (tile_m == 0) {
      ++tiles;
    } else {
      // ceil without size + tile_m - 1, which overflows for a huge tile_m.
      tiles += group_sizes[g] / tile_m + (group_sizes[g] % tile_m != 0 ? 1 : 0);
    }
  }
  return tiles;
}

}  // namespace fp8moe
