// FindNonFinite / CheckFinite (finite.h) over every floating dtype, with the
// NaN and Inf codes of each fp8 format taken from DecodeFp8 itself.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "fp8moe/finite.h"
#include "fp8moe/numerics.h"

namespace fp8moe {
namespace {

Tensor Make(DType d, Shape s) { return std::move(Tensor::Zeros(d, std::move(s))).value(); }

TEST(Finite, FloatDTypes) {
  const float inf = std::numeric_limits<float>::infinity();
  Tensor f = Make(DType::kF32, {2, 3});
  EXPECT_EQ(FindNonFinite(f.view()).count, 0);
  EXPECT_TRUE(CheckFinite("x", f.view()).ok());
  f.data_as<float>()[4] = -inf;
  f.data_as<float>()[5] = std::nanf("");
  const NonFinite nf = FindNonFinite(f.view());
  EXPECT_EQ(nf.count, 2);
  EXPECT_EQ(nf.first, 4);
  const Status s = CheckFinite("lhs", f.view());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'lhs' (f32 [2, 3]) holds 2 NaN or Inf values; the first is -inf "
                             "at index 4 [1, 1]"),
            std::string::npos)
      << s.message();

  Tensor d = Make(DType::kF64, {3});
  d.data_as<double>()[2] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(FindNonFinite(d.view()).first, 2);

  Tensor h = Make(DType::kF16, {4});
  h.data_as<uint16_t>()[0] = 0x7BFF;  // 65504, the largest finite f16
  h.data_as<uint16_t>()[1] = 0xFC00;  // -inf
  h.data_as<uint16_t>()[3] = 0x7E00;  // NaN
  EXPECT_EQ(FindNonFinite(h.view()).count, 2);
  EXPECT_EQ(FindNonFinite(h.view()).first, 1);

  Tensor b = Make(DType::kBF16, {2});
  b.data_as<uint16_t>()[1] = 0x7F80;  // +inf
  EXPECT_EQ(FindNonFinite(b.view()).first, 1);
}

TEST(Finite, EveryFp8CodeAgreesWithDecode) {
  for (DType d : {DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2, DType::kE5M2FNUZ}) {
    Tensor t = Make(d, {256});
    int64_t want = 0;
    for (int c = 0; c < 256; ++c) {
      t.data_as<uint8_t>()[c] = static_cast<uint8_t>(c);
      want += std::isfinite(DecodeFp8(static_cast<uint8_t>(c), *Fp8FormatOf(d))) ? 0 : 1;
    }
    EXPECT_GT(want, 0) << DTypeName(d);
    EXPECT_EQ(FindNonFinite(t.view()).count, want) << DTypeName(d);
  }
}

TEST(Finite, IntegersAndEmptyTensorsAreFinite) {
  Tensor i = Make(DType::kI32, {4});
  std::memset(i.data(), 0xFF, i.num_bytes());
  EXPECT_FALSE(IsFloatingDType(DType::kI32));
  EXPECT_TRUE(CheckFinite("g", i.view()).ok());
  Tensor u = Make(DType::kU8, {4});
  std::memset(u.data(), 0x7F, u.num_bytes());  // an e4m3fn NaN, but U8 says nothing
  EXPECT_TRUE(CheckFinite("u", u.view()).ok());
  Tensor e = Make(DType::kF32, {int64_t{1} << 40, 0});
  EXPECT_TRUE(CheckFinite("e", e.view()).ok());
}

}  // namespace
}  // namespace fp8moe
