// Hostile MoE configurations and shapes: the validator bounds tiles, the
// expert count and ragged_buffer_factor (1e18 and 1e300 included, which
// overflowed the buffer size or were undefined to convert); tiles at the
// bound give the default's bits; a zero-width layer (x [T, 0]) runs forward
// and backward without undefined behaviour (the ASan + UBSan build checks).
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/moe.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

Result<MoeConfig> From(const std::vector<std::string>& flags) {
  auto c = LoadConfig(MoeConfigSchema(), "", flags);
  if (!c.ok()) return c.status();
  return MoeConfigFrom(*c);
}

void ExpectRefused(const std::vector<std::string>& flags, const std::string& needle) {
  auto m = From(flags);
  ASSERT_FALSE(m.ok()) << flags.back();
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status().message();
}

TEST(MoeRobustness, TileFlagsAreBounded) {
  for (const char* flag : {"wi_tile_fwd_batch_seq", "wi_tile_drhs_batch_seq", "wo_tile_dlhs_mlp_dim",
                           "wo_tile_fwd_embed_dim", "wi_tile_fwd_embed_dim"}) {
    for (const char* v : {"9223372036854775807", "4611686018427387904", "100000000", "1048578"}) {
      ExpectRefused({"num_experts=4", std::string(flag) + "=" + v}, "1048576");
    }
    EXPECT_TRUE(From({"num_experts=4", std::string(flag) + "=1048576"}).ok()) << flag;
  }
}

TEST(MoeRobustness, RaggedBufferFactorIsBounded) {
  for (const char* v : {"1e18", "1e300", "1.7976931348623157e308", "1024.5"}) {
    ExpectRefused({std::string("ragged_buffer_factor=") + v}, "ragged_buffer_factor");
  }
  for (const char* v : {"1024", "1", "0.25", "0", "-1", "-1e300"}) {
    EXPECT_TRUE(From({std::string("ragged_buffer_factor=") + v}).ok()) << v;
  }
  // Through the struct too (NaN cannot come from the parser, but can from code).
  MoeConfig c;
  c.ragged_buffer_factor = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(ValidateMoeConfig(c).ok());
  c.ragged_buffer_factor = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(ValidateMoeConfig(c).ok());
}

TEST(MoeRobustness, ExpertCountIsBounded) {
  ExpectRefused({"num_experts=2147483648", "num_experts_per_tok=1"}, "2147483647");
  EXPECT_TRUE(From({"num_experts=2147483647", "num_experts_per_tok=1"}).ok());
}

TEST(MoeRobustness, TilesAtTheBoundGiveTheDefaultBits) {
  const test::LayerInputs in(7, 24, 16, 12, 4);
  const MoeConfig def = test::MakeConfig({"num_experts=4", "dtype=float32"});
  std::vector<std::string> flags = {"num_experts=4", "dtype=float32"};
  for (const char* w : {"wi", "wo"}) {
    for (const char* p : {"fwd", "dlhs", "drhs"}) {
      for (const char* d : {"batch_seq", "embed_dim", "mlp_dim"}) {
        flags.push_back(std::string(w) + "_tile_" + p + "_" + d + "=1048576");
      }
    }
  }
  const MoeConfig big = test::MakeConfig(flags);
  auto a = MoeForward(def, in.x.view(), in.weights());
  auto b = MoeForward(big, in.x.view(), in.weights());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(a->y.data(), b->y.data(), a->y.num_bytes()), 0);
  auto ga = MoeBackward(def, in.x.view(), in.weights(), *a, in.dy.view());
  auto gb = MoeBackward(big, in.x.view(), in.weights(), *b, in.dy.view());
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_EQ(std::memcmp(ga->dwi.data(), gb->dwi.data(), ga->dwi.num_bytes()), 0);
  EXPECT_EQ(std::memcmp(ga->dx.data(), gb->dx.data(), ga->dx.num_bytes()), 0);
}

TEST(MoeRobustness, ZeroWidthLayerRunsWithoutUndefinedBehaviour) {
  // x [3, 0]: D = 0, so every row copy is zero bytes from or to a buffer
  // that may be null (memcpy must not see it; UBSan checks in the ASan run).
  for (const char* dtype : {"dtype=float32", "dtype=bfloat16"}) {
    const test::LayerInputs in(3, 3, 0, 2, 2);
    const MoeConfig cfg = test::MakeConfig({"num_experts=2", dtype});
    auto f = MoeForward(cfg, in.x.view(), in.weights());
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->y.shape(), (Shape{3, 0}));
    auto g = MoeBackward(cfg, in.x.view(), in.weights(), *f, in.dy.view());
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->dwi.shape(), (Shape{2, 0, 4}));
  }
}

}  // namespace
}  // namespace fp8moe
