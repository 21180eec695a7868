// The memory cap (memory.h) and the shape rule of CheckedNumElements: a
// request past the cap is refused before anything is allocated, with the
// bytes and the cap in the message; zero-element shapes whose other
// dimensions multiply past the limit are refused.
#include <cstdint>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "base/test_util.h"
#include "fp8moe/memory.h"
#include "fp8moe/tensor.h"

namespace fp8moe {
namespace {

bool Has(const Status& s, const std::string& needle) {
  return s.message().find(needle) != std::string::npos;
}

using test::CapGuard;

TEST(MemoryCap, DefaultIsAvailableMemoryOrEnv) {
  // Whatever the default is, it is a real limit, and it says where it is from.
  EXPECT_GT(MemoryCap(), 0u);
  EXPECT_FALSE(MemoryCapSource().empty());
}

TEST(MemoryCap, RefusesBeforeAllocating) {
  CapGuard guard;
  SetMemoryCap(uint64_t{1} << 20, "the test");
  const int64_t allocations = GetMemoryStats().allocations;
  auto big = Tensor::Create(DType::kF32, {1024, 1024});  // 4 MiB > 1 MiB
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(big.status(), "4194304 bytes")) << big.status().ToString();
  EXPECT_TRUE(Has(big.status(), "memory cap is 1048576 bytes")) << big.status().ToString();
  EXPECT_TRUE(Has(big.status(), "the test")) << big.status().ToString();
  EXPECT_TRUE(Has(big.status(), "f32 [1024, 1024]")) << big.status().ToString();
  EXPECT_EQ(GetMemoryStats().allocations, allocations) << "refused after allocating";
  // Under the cap it works, and what is held counts against the cap.
  auto small = Tensor::Create(DType::kF32, {128, 1024});  // 512 KiB
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  auto second = Tensor::Create(DType::kF32, {160, 1024});  // 640 KiB: over with the first
  EXPECT_FALSE(second.ok());
  // 0 means no cap.
  SetMemoryCap(0);
  EXPECT_TRUE(Tensor::Create(DType::kF32, {1024, 1024}).ok());
}

TEST(MemoryCap, CheckMemoryRequestNamesTheRequest) {
  CapGuard guard;
  SetMemoryCap(1000, "--memory-cap");
  EXPECT_TRUE(CheckMemoryRequest("x", 0).ok());
  const Status s = CheckMemoryRequest("output 'out' f32 [10, 10000]", 400000);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(s, "output 'out' f32 [10, 10000] needs 400000 bytes")) << s.message();
  EXPECT_TRUE(Has(s, "--memory-cap")) << s.message();
  // No overflow at the top of the range.
  EXPECT_FALSE(CheckMemoryRequest("huge", std::numeric_limits<uint64_t>::max()).ok());
}

TEST(MemoryCap, ParseByteSize) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("123"), 123u);
  EXPECT_EQ(*ParseByteSize("123B"), 123u);
  EXPECT_EQ(*ParseByteSize("8k"), 8u << 10);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512u << 20);
  EXPECT_EQ(*ParseByteSize("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseByteSize("3TB"), uint64_t{3} << 40);
  for (const char* bad : {"", "x", "-1", "1.5G", "8 G", "1Q", "G", "99999999999999999999",
                          "17179869184T"}) {
    const auto r = ParseByteSize(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_TRUE(Has(r.status(), "byte size")) << r.status().message();
    }
  }
}

TEST(MemoryCap, FormatBytes) {
  EXPECT_EQ(FormatBytes(10), "10 bytes");
  EXPECT_EQ(FormatBytes(uint64_t{16} << 30), "17179869184 bytes (16 GiB)");
  EXPECT_EQ(FormatBytes(1536), "1536 bytes (1.5 KiB)");
}

TEST(Shape, ZeroElementShapesMustStillMultiplyInRange) {
  // A zero makes the tensor empty, but the other dimensions must multiply to
  // a size that fits (so strides and offsets computed from them cannot
  // overflow): [2^40, 0] is fine, [2^40, 2^40, 0] is not, in any order.
  EXPECT_EQ(*CheckedNumElements({int64_t{1} << 40, 0}, 4), 0u);
  EXPECT_EQ(*CheckedNumElements({0, int64_t{1} << 60}, 4), 0u);
  for (const Shape& s : {Shape{int64_t{1} << 40, int64_t{1} << 40, 0},
                         Shape{0, int64_t{1} << 40, int64_t{1} << 40},
                         Shape{int64_t{1} << 40, 0, int64_t{1} << 40},
                         Shape{0, std::numeric_limits<int64_t>::max()}}) {
    const auto n = CheckedNumElements(s, 4);
    ASSERT_FALSE(n.ok()) << ShapeToString(s);
    EXPECT_EQ(n.status().code(), StatusCode::kResourceExhausted);
    EXPECT_TRUE(Has(n.status(), "nonzero dimensions")) << n.status().message();
    EXPECT_FALSE(Tensor::Create(DType::kF32, s).ok());
  }
  // Negative dimensions stay an invalid argument, zero or not.
  EXPECT_EQ(CheckedNumElements({0, -1}, 4).status().code(), StatusCode::kInvalidArgument);
  // An empty tensor with a large dimension is created without touching memory
  // proportional to that dimension.
  auto t = Tensor::Create(DType::kF32, {int64_t{1} << 40, 0});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->num_bytes(), 0u);
}

}  // namespace
}  // namespace fp8moe
