#include <gtest/gtest.h>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  FP8MOE_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(Status, ValuesAndErrors) {
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_EQ(InvalidArgument("bad").ToString(), "invalid argument: bad");
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_FALSE(Quarter(6).ok());
  EXPECT_EQ(Quarter(6).status().message(), "odd");
}

TEST(DType, NamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(DType::kU64); ++i) {
    const DType d = static_cast<DType>(i);
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_FALSE(ParseDType("f33").ok());
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_TRUE(IsFp8(DType::kE5M2FNUZ));
  EXPECT_FALSE(IsFp8(DType::kI8));
}

TEST(Tensor, AlignedAndChecked) {
  auto t = Tensor::Zeros(DType::kF32, {3, 5});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % 64, 0u);
  EXPECT_EQ(t->num_elements(), 15u);
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(t->data_as<float>()[i], 0.0f);
  EXPECT_TRUE(t->Reshape({15}).ok());
  EXPECT_FALSE(t->Reshape({16}).ok());
  EXPECT_FALSE(Tensor::Create(DType::kF32, {-1}).ok());
  EXPECT_FALSE(Tensor::Create(DType::kF32, {1LL << 40, 1LL << 40}).ok());
  auto huge = Tensor::Create(DType::kF32, {1LL << 61});
  EXPECT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace fp8moe
