// num_moe_token_chunks (moe/moe_chunks.cc): the layer in C chunks against
// the same layer in one, on one rank and on expert rings of thread ranks,
// in every QAT mode, with NaN-poisoned buffer tails and chunks of unequal
// sizes; the errors; the activation health of chunks.
#include <array>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/moe.h"
#include "moe/moe_ring_test_util.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

using test::Compare;
using test::Diff;
using test::LayerInputs;
using test::MakeConfig;
using test::Out;
using test::RunRing;

// The ring tests' modes, and the quantized token all-gather.
std::vector<std::vector<std::string>> ChunkModes() {
  std::vector<std::vector<std::string>> modes = test::Modes();
  modes.push_back({"fp8_moe_fake_quant=true", "moe_quantize_token_all_gather=true"});
  return modes;
}

// y, dx and drouter are per token (the route runs on all T tokens), so with
// P <= 2 they are the bits of the unchunked layer (a ring of two adds two
// values, in either order the same); with P = 4 the ring's f32 sums of y and
// dx depend on where a token sits in its block, within 1e-6. The aux loss is
// the same bits. dwi and dwo are sums over rows, here of C partial sums: in
// f32 within 1e-5 of the largest value. fp8_full quantizes the gradient per
// expert group over its rows (per_group), so a chunk's group has its own
// amax: one e5m2 step of the gradient, at most 2^-2 relative to the amax.
void ExpectChunksClose(const Out& chunked, const Out& one, int P, bool fp8_full,
                       const std::string& what) {
  std::string line = what + ":";
  const std::array<Diff, 5> diffs = test::CompareOuts(chunked, one, &line);
  for (int i = 0; i < 5; ++i) {
    const Diff& d = diffs[i];
    const char* name = test::kOutNames[i];
    if (i < 3) {
      if (P <= 2) {
        EXPECT_EQ(d.differ, 0.0) << what << " " << name;
      } else {
        EXPECT_LE(d.rel, 1e-6) << what << " " << name;
      }
    } else {
      EXPECT_LE(d.rel, fp8_full ? 0.25 : 1e-5) << what << " " << name;
    }
  }
  std::printf("%s\n", line.c_str());
  EXPECT_EQ(chunked.aux, one.aux) << what;
}

TEST(MoeChunks, ChunksKeepTheLayersBitsOnOneRankAndOnRings) {
  for (int P : {1, 2, 4}) {
    // 25 tokens per rank: 2, 3 and 7 chunks of unequal sizes.
    LayerInputs in(301 + P, 25 * P, 32, 16, 8);
    for (const std::vector<std::string>& mode : ChunkModes()) {
      for (int C : {2, 3, 7}) {
        std::vector<std::string> flags = mode;
        flags.push_back("num_experts=8");
        flags.push_back("load_balance_loss_weight=" + std::to_string(0.01 / P));
        const std::string what = "P=" + std::to_string(P) + " C=" + std::to_string(C) + " " +
                                 (mode.empty() ? "bf16" : mode.back());
        SCOPED_TRACE(what);
        const MoeConfig one_cfg = MakeConfig(flags);
        flags.push_back("num_moe_token_chunks=" + std::to_string(C));
        const MoeConfig cfg = MakeConfig(flags);
        Out one(in), chunked(in);
        Status st = RunRing(P, one_cfg, in, &one, /*poison=*/true);
        ASSERT_TRUE(st.ok()) << st.ToString();
        st = RunRing(P, cfg, in, &chunked, /*poison=*/true);
        ASSERT_TRUE(st.ok()) << st.ToString();
        ExpectChunksClose(chunked, one, P, !mode.empty() && mode.front() == "quantization=fp8_full",
                          what);
        // The stats add up over the chunks; every valid row is counted once.
        for (size_t r = 0; r < one.stats.size(); ++r) {
          EXPECT_EQ(chunked.stats[r].valid_rows, one.stats[r].valid_rows) << r;
        }
      }
    }
  }
}

TEST(MoeChunks, MoreChunksThanTokensIsAnError) {
  LayerInputs in(7, 3, 16, 8, 4);
  const MoeConfig cfg = MakeConfig({"num_experts=4", "num_moe_token_chunks=4"});
  Context ctx;
  PreparedMoeWeights p;
  MoeWorkspace ws;
  ASSERT_TRUE(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), &p).ok());
  Tensor y = test::F32(in.x.shape());
  const Status st = MoeForward(ctx, cfg, in.x.view(), in.weights(), p, &ws, y.view(), nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("num_moe_token_chunks=4 exceeds the 3 tokens"), std::string::npos)
      << st.message();
  EXPECT_EQ(MakeConfig({"num_experts=4"}).num_moe_token_chunks, 1);  // the default
}

TEST(MoeChunks, BackwardWithOtherChunksThanItsForwardIsAnError) {
  LayerInputs in(8, 12, 16, 8, 4);
  const MoeConfig fwd = MakeConfig({"num_experts=4", "num_moe_token_chunks=3"});
  const MoeConfig bwd = MakeConfig({"num_experts=4"});
  Context ctx;
  PreparedMoeWeights p;
  MoeWorkspace ws;
  ASSERT_TRUE(PrepareMoeWeights(ctx, fwd, in.wi.view(), in.wo.view(), &p).ok());
  Out out(in);
  ASSERT_TRUE(
      MoeForward(ctx, fwd, in.x.view(), in.weights(), p, &ws, out.y.view(), nullptr).ok());
  const Status st = MoeBackward(ctx, bwd, in.x.view(), in.weights(), p, &ws, in.dy.view(),
                                {out.dx.view(), out.dr.view(), out.dwi.view(), out.dwo.view()});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("ran 3 chunks"), std::string::npos) << st.message();
}

// The activation health of a chunked forward counts every valid row once,
// quantized as the unchunked forward quantizes it (per row): the same counts.
TEST(MoeChunks, ActivationHealthCountsEveryChunksRows) {
  LayerInputs in(9, 40, 32, 16, 8);
  const std::vector<std::vector<std::string>> modes = {
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true"},
      {"quantization=int8"},
  };
  for (const std::vector<std::string>& m : modes) {
    std::vector<std::string> flags = m;
    flags.push_back("num_experts=8");
    const std::string mode = m.back();
    Fp8Health health[2][2];
    for (int chunked = 0; chunked < 2; ++chunked) {
      std::vector<std::string> f = flags;
      if (chunked) f.push_back("num_moe_token_chunks=3");
      const MoeConfig cfg = MakeConfig(f);
      Context ctx;
      PreparedMoeWeights p;
      MoeWorkspace ws;
      ASSERT_TRUE(PrepareMoeWeights(ctx, cfg, in.wi.view(), in.wo.view(), &p).ok());
      Tensor y = test::F32(in.x.shape());
      ASSERT_TRUE(
          MoeForward(ctx, cfg, in.x.view(), in.weights(), p, &ws, y.view(), nullptr).ok());
      ASSERT_TRUE(MoeActivationHealth(ctx, cfg, p, &ws, &health[chunked][0], &health[chunked][1])
                      .ok());
    }
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(health[1][t].values, health[0][t].values) << mode << t;
      EXPECT_GT(health[1][t].values, 0) << mode << t;
      EXPECT_EQ(health[1][t].saturated, health[0][t].saturated) << mode << t;
      EXPECT_EQ(health[1][t].flushed, health[0][t].flushed) << mode << t;
    }
  }
}

}  // namespace
}  // namespace fp8moe
