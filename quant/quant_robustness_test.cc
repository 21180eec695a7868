// Hostile dimensions for the quantizers (fast and reference): zero-width
// buffers of enormous height return at once (the work is bounded by the
// elements, not the dimensions), buffers whose dimensions multiply past the
// int64 range are refused, and tile / block arithmetic never overflows.
#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/quant.h"

namespace fp8moe {
namespace {

constexpr int64_t kHuge = int64_t{1} << 40;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(QuantRobustness, CeilDivisionsDoNotOverflow) {
  EXPECT_EQ(NumBlocks(kMax, 128), kMax / 128 + 1);
  EXPECT_EQ(NumBlocks(kMax, kMax), 1);
  EXPECT_EQ(NumBlocks(0, 128), 0);
  const int32_t sizes[] = {5, 0, std::numeric_limits<int32_t>::max()};
  auto tiles = NumGroupTiles(sizes, 3, int64_t{1} << 32, kMax);
  ASSERT_TRUE(tiles.ok()) << tiles.status().ToString();
  EXPECT_EQ(*tiles, 2);  // one tile per non-empty group
  EXPECT_EQ(*NumGroupTiles(sizes, 3, int64_t{1} << 32, 2), 3 + 0 + 1073741824);
}

// Each runs on null buffers: with no elements nothing may be touched.
TEST(QuantRobustness, ZeroWidthOfHugeHeightReturnsAtOnce) {
  for (bool ref : {false, true}) {
    SCOPED_TRACE(ref ? "reference" : "fast");
    auto channels = ref ? reference::QuantizeChannels : QuantizeChannels;
    auto rows = ref ? reference::QuantizeRows : QuantizeRows;
    auto group = ref ? reference::QuantizeGroupTileChannels : QuantizeGroupTileChannels;
    // x [1, 2^40, 0] per channel: no channels, so no scales and no codes.
    EXPECT_TRUE(channels(nullptr, 1, kHuge, 0, QuantDType::kE4M3FN, {}, nullptr, nullptr).ok());
    // [2^40, 0] rows in blocks of 128: no blocks, no codes.
    EXPECT_TRUE(rows(nullptr, kHuge, 0, kHuge, 128, QuantDType::kE4M3FN, {}, nullptr, nullptr).ok());
    // A group of 2^31 - 1 rows of width 0, one row per tile.
    const int32_t sizes[] = {std::numeric_limits<int32_t>::max()};
    EXPECT_TRUE(group(nullptr, kHuge, 0, sizes, 1, 1, QuantDType::kE5M2, {}, nullptr, nullptr).ok());
    // The other way round (op_fuzz: rhs [0, 28, 2^40] asked for a 4 TiB
    // scratch of one int per channel): [0, 28, 2^40] per channel, and
    // [0, 2^40] rows in no groups, both in xla_reciprocal too.
    for (ScaleArithmetic a : {ScaleArithmetic::kExactDivide, ScaleArithmetic::kXlaReciprocal}) {
      const Calibration cal = Calibration::AbsMax().With(a);
      EXPECT_TRUE(channels(nullptr, 0, 28, kHuge, QuantDType::kE4M3FN, cal, nullptr, nullptr).ok());
      EXPECT_TRUE(group(nullptr, 0, kHuge, nullptr, 0, 0, QuantDType::kE4M3FN, cal, nullptr,
                        nullptr).ok());
    }
  }
  DequantizeChannels(nullptr, kHuge, kHuge, 0, nullptr, QuantDType::kE4M3FN, nullptr);
  DequantizeRows(nullptr, kHuge, 0, 128, nullptr, QuantDType::kE4M3FN, nullptr);
  const int32_t sizes[] = {std::numeric_limits<int32_t>::max()};
  EXPECT_TRUE(DequantizeGroupTileChannels(nullptr, kHuge, 0, sizes, 1, 1, nullptr,
                                          QuantDType::kE5M2, nullptr)
                  .ok());
}

TEST(QuantRobustness, BuffersPastTheInt64RangeAreRefused) {
  for (bool ref : {false, true}) {
    auto channels = ref ? reference::QuantizeChannels : QuantizeChannels;
    auto rows = ref ? reference::QuantizeRows : QuantizeRows;
    const Status c = channels(nullptr, kHuge, kHuge, 0, QuantDType::kE4M3FN, {}, nullptr, nullptr);
    EXPECT_EQ(c.code(), StatusCode::kInvalidArgument) << c.ToString();
    const Status r = rows(nullptr, kHuge, kHuge, 0, 0, QuantDType::kE4M3FN, {}, nullptr, nullptr);
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << r.ToString();
  }
}

TEST(QuantRobustness, ZeroWidthRowsStillGetTheirScale) {
  // [3, 0] per full row: each valid row has one scale (of amax 0), tail 0.
  for (bool ref : {false, true}) {
    auto rows = ref ? reference::QuantizeRows : QuantizeRows;
    std::vector<float> s(3, -1.0f);
    ASSERT_TRUE(rows(nullptr, 3, 0, 2, 0, QuantDType::kE4M3FN, {}, nullptr, s.data()).ok());
    EXPECT_EQ(s[0], ScaleFromAmax(0.0f, QuantDType::kE4M3FN));
    EXPECT_EQ(s[1], s[0]);
    EXPECT_EQ(s[2], 0.0f);
  }
}

}  // namespace
}  // namespace fp8moe
