// The MoE layer on an expert ring (MoeRanks::expert_ring) against the
// single-rank layer on the whole batch: P thread ranks, each with its own
// T tokens and E / P experts, must give each token the output and gradients
// the single-rank layer gives it, and their weight gradients must be the
// single-rank ones' slices. Also the collective overflow decision of the
// ragged buffer and the errors.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"
#include "fp8moe/moe.h"
#include "fp8moe/quant.h"
#include "moe/moe_ring_test_util.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

using test::LayerInputs;
using test::MakeConfig;
using test::Out;
using test::RunRing;
using test::RunWhole;
using test::Compare;
using test::Diff;
using test::F32;
using test::Rows;
using test::Modes;

// Every QAT mode: the ring changes only the order of the f32 additions that
// sum each token's partial outputs over the ranks (combine, dx) and of the
// router gradient's shares, never what a GMM sees.

// y, dx, drouter within 1e-6 of the largest value (measured: at most 3e-7);
// dwi and dwo bit for bit (each expert sees the same rows in the same order,
// so its GMMs get the same operands); y bit for bit when k <= 2 (a token's
// partials are one or two non-zero values among zeros: any order of their
// sum rounds once, as the single-rank combine does).
void ExpectClose(const Out& ring, const Out& whole, int k, const std::string& what) {
  std::string line = what + ":";
  const std::array<Diff, 5> diffs = test::CompareOuts(ring, whole, &line);
  for (int i = 0; i < 5; ++i) {
    const Diff& d = diffs[i];
    const char* name = test::kOutNames[i];
    EXPECT_LE(d.rel, 1e-6) << what << " " << name;
    if (i >= 3 || (i == 0 && k <= 2)) {
      EXPECT_EQ(d.differ, 0.0) << what << " " << name;
    }
  }
  std::printf("%s aux %.1e\n", line.c_str(), std::fabs(ring.aux - whole.aux) / std::fabs(whole.aux));
  EXPECT_NEAR(ring.aux, whole.aux, 1e-6 * std::fabs(whole.aux)) << what;
}

// A ring of P = 2, 4 ranks against one rank, k = 2, 3, in every mode, with
// `routing` added to every config.
void ExpectRingsMatchTheSingleRank(const std::vector<std::string>& routing) {
  for (int P : {2, 4}) {
    for (int k : {2, 3}) {
      LayerInputs in(71 + P + k, 24 * P, 32, 16, 8);
      if (std::find(routing.begin(), routing.end(), "routed_bias=true") != routing.end()) {
        in.SetBias(71 + P + k);
      }
      for (const std::vector<std::string>& mode : Modes()) {
        std::vector<std::string> flags = mode;
        flags.insert(flags.end(), routing.begin(), routing.end());
        flags.push_back("num_experts=8");
        flags.push_back("num_experts_per_tok=" + std::to_string(k));
        const MoeConfig cfg = MakeConfig(flags);
        const std::string what = "P=" + std::to_string(P) + " k=" + std::to_string(k) + " " +
                                 (mode.empty() ? "bf16" : mode.back());
        SCOPED_TRACE(what);
        flags.push_back("load_balance_loss_weight=" + std::to_string(0.01 / P));
        const MoeConfig ring_cfg = MakeConfig(flags);
        Out whole(in), ring(in);
        ASSERT_TRUE(RunWhole(cfg, in, &whole).ok());
        const Status st = RunRing(P, ring_cfg, in, &ring, /*poison=*/true);
        ASSERT_TRUE(st.ok()) << st.ToString();
        ExpectClose(ring, whole, k, what);
      }
    }
  }
}

TEST(MoeRing, RanksMatchTheSingleRankLayerInEveryMode) { ExpectRingsMatchTheSingleRank({}); }

// DeepSeek-V3's routing on the ring: sigmoid scores, 4 groups of 2 experts
// with 2 kept, renormalised and scaled weights.
TEST(MoeRing, RoutingFunctionsMatchTheSingleRankLayerInEveryMode) {
  ExpectRingsMatchTheSingleRank({"routed_score_func=sigmoid", "norm_topk_prob=true",
                                 "routed_scaling_factor=2.5", "n_routing_groups=4",
                                 "topk_routing_group=2"});
}

// routed_bias on the ring: every rank routes its tokens with the same choice
// bias [E] (MoeWeights::route_bias), so the ring matches the single-rank layer
// as for the other routing functions.
TEST(MoeRing, RoutedBiasMatchesTheSingleRankLayerInEveryMode) {
  ExpectRingsMatchTheSingleRank({"routed_score_func=sigmoid", "routed_bias=true",
                                 "n_routing_groups=4", "topk_routing_group=2"});
}

// The static buffer is ragged_buffer_factor x T*k rows on every rank. When
// one rank's experts need more, every rank reruns dropless with the ring's
// largest count, and the results are those of the dropless run, bit for bit.
TEST(MoeRing, OneRankOverflowingMakesEveryRankRerunDropless) {
  const int P = 4;
  const int64_t T = 24, k = 2;
  LayerInputs in(5, T * P, 32, 16, 8);
  const MoeConfig dropless = MakeConfig({"dtype=float32", "num_experts=8"});
  Out base(in);
  ASSERT_TRUE(RunRing(P, dropless, in, &base).ok());
  int64_t lo = base.stats[0].valid_rows, hi = lo;
  for (const MoeStats& s : base.stats) {
    EXPECT_EQ(s.dropless_reruns, 0);
    lo = std::min(lo, s.valid_rows);
    hi = std::max(hi, s.valid_rows);
  }
  // Some rank fits the static buffer alone, another does not.
  ASSERT_LT(lo, hi - 1) << "the test's routing is too balanced to overflow one rank only";
  // hi - 1.5 rows: the factor's 6 printed decimals cannot round it up to hi.
  const double one_short = (static_cast<double>(hi) - 1.5) / static_cast<double>(T * k);
  for (double factor : {one_short, 0.05, 3.0}) {
    SCOPED_TRACE(factor);
    const MoeConfig cfg = MakeConfig(
        {"dtype=float32", "num_experts=8", "ragged_buffer_factor=" + std::to_string(factor)});
    const int64_t rows = static_cast<int64_t>(std::ceil(cfg.ragged_buffer_factor * T * k));
    if (factor == one_short) {
      ASSERT_EQ(rows, hi - 1) << "the buffer must be one row short";
    }
    Out ring(in);
    ASSERT_TRUE(RunRing(P, cfg, in, &ring, /*poison=*/true).ok());
    const bool overflow = hi > rows;
    for (int r = 0; r < P; ++r) {
      const MoeStats& s = ring.stats[static_cast<size_t>(r)];
      EXPECT_EQ(s.valid_rows, base.stats[static_cast<size_t>(r)].valid_rows);
      EXPECT_EQ(s.dropless_reruns, overflow ? 1 : 0) << "rank " << r;
      EXPECT_EQ(s.buffer_rows, overflow ? hi : rows) << "rank " << r;
    }
    for (auto [a, b] : {std::pair{&ring.y, &base.y}, {&ring.dx, &base.dx}, {&ring.dr, &base.dr},
                        {&ring.dwi, &base.dwi}, {&ring.dwo, &base.dwo}}) {
      EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->num_bytes()));
    }
  }
}

// The one-call API on a ring of thread ranks: each call runs on a context of
// its own (the default context's mutex, held across the ring's collectives,
// deadlocked the ranks), and gives the Context overload's bits.
TEST(MoeRing, OneCallApiRunsOnARingOfThreadRanks) {
  const int P = 2;
  const int64_t T = 16;
  LayerInputs in(13, T * P, 32, 16, 8);
  const MoeConfig cfg = MakeConfig({"dtype=float32", "num_experts=8"});
  Out ring(in);
  ASSERT_TRUE(RunRing(P, cfg, in, &ring).ok());
  Tensor y = F32(in.x.shape()), dx = F32(in.x.shape());
  CommOptions co;
  co.timeout_seconds = 60;  // a regression fails here instead of waiting forever
  const Status st = RunThreadRanks(P, [&](Communicator& comm) -> Status {
    const int r = comm.rank();
    MoeOptions o;
    o.ranks.expert_ring = &comm;
    o.ranks.batch = &comm;  // as RunRing
    const MoeWeights w{in.router.view(), Rows(in.wi, r * 4, 4), Rows(in.wo, r * 4, 4)};
    const ConstTensorView x = Rows(in.x, r * T, T);
    FP8MOE_ASSIGN_OR_RETURN(MoeForwardResult f, MoeForward(cfg, x, w, o));
    FP8MOE_ASSIGN_OR_RETURN(MoeGradients g, MoeBackward(cfg, x, w, f, Rows(in.dy, r * T, T), o));
    std::memcpy(Rows(y, r * T, T).data, f.y.data(), f.y.num_bytes());
    std::memcpy(Rows(dx, r * T, T).data, g.dx.data(), g.dx.num_bytes());
    return OkStatus();
  }, co);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(0, std::memcmp(y.data(), ring.y.data(), y.num_bytes()));
  EXPECT_EQ(0, std::memcmp(dx.data(), ring.dx.data(), dx.num_bytes()));
}

// Bad input on one rank only (a token count unlike its peers', a router of
// the wrong shape) is an error on every rank at once, not a wait until the
// communicator's timeout.
TEST(MoeRing, InputThatDiffersBetweenRanksIsAnErrorOnEveryRank) {
  const int P = 2;
  const int64_t T = 16;
  LayerInputs in(17, T * P, 32, 16, 8);
  const MoeConfig cfg = MakeConfig({"dtype=float32", "num_experts=8"});
  Tensor bad_router = F32({16, 8});
  for (int which : {0, 1, 2}) {  // 0: fewer tokens on rank 1; 1: bad router on rank 0; 2: one-call API
    SCOPED_TRACE(which);
    std::mutex mu;
    std::vector<std::string> errors(P);
    CommOptions co;
    co.timeout_seconds = 60;
    const auto start = std::chrono::steady_clock::now();
    const Status st = RunThreadRanks(P, [&](Communicator& comm) -> Status {
      const int r = comm.rank();
      Context ctx;
      MoeOptions o;
      o.ranks.expert_ring = &comm;
      const ConstTensorView router = which == 1 && r == 0 ? bad_router.view() : in.router.view();
      const MoeWeights w{router, Rows(in.wi, r * 4, 4), Rows(in.wo, r * 4, 4)};
      const int64_t t = which == 0 && r == 1 ? T - 1 : T;
      const ConstTensorView x = Rows(in.x, r * T, t);
      Status s;
      if (which == 2) {
        const ConstTensorView bad_x = r == 1 ? Rows(in.x, r * T, T - 3) : x;
        s = MoeForward(cfg, bad_x, w, o).status();
      } else {
        PreparedMoeWeights p;
        MoeWorkspace ws;
        Tensor y = F32({t, 32});
        s = PrepareMoeWeights(ctx, cfg, w.wi, w.wo, &p);
        if (s.ok()) s = MoeForward(ctx, cfg, x, w, p, &ws, y.view(), nullptr, o);
      }
      std::lock_guard<std::mutex> lock(mu);
      errors[static_cast<size_t>(r)] = s.ToString();
      return OkStatus();
    }, co);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    for (int r = 0; r < P; ++r) {
      const std::string& e = errors[static_cast<size_t>(r)];
      if (which == 1 && r == 0) {
        EXPECT_NE(e.find("router must be F32 [D, E]"), std::string::npos) << e;
      } else if (which == 1) {
        EXPECT_NE(e.find("another rank of the expert ring refused its input"), std::string::npos) << e;
      } else {
        EXPECT_NE(e.find("the ranks of the expert ring give x of different shapes"), std::string::npos)
            << e;
      }
    }
  }
}

TEST(MoeRing, ExpertsThatDoNotDivideOverTheRingAreAnError) {
  LayerInputs in(9, 8 * 4, 16, 8, 6);
  const MoeConfig cfg = MakeConfig({"dtype=float32", "num_experts=6"});
  std::mutex mu;
  std::vector<std::string> errors;
  const Status st = RunThreadRanks(4, [&](Communicator& comm) -> Status {
    Context ctx;
    MoeOptions o;
    o.ranks.expert_ring = &comm;
    PreparedMoeWeights p;
    MoeWorkspace ws;
    Tensor y = F32({8, 16});
    const ConstTensorView x = Rows(in.x, comm.rank() * 8, 8);
    const ConstTensorView wi = Rows(in.wi, 0, 1), wo = Rows(in.wo, 0, 1);
    Status s = PrepareMoeWeights(ctx, cfg, wi, wo, &p);
    if (s.ok()) s = MoeForward(ctx, cfg, x, {in.router.view(), wi, wo}, p, &ws, y.view(), nullptr, o);
    std::lock_guard<std::mutex> lock(mu);
    errors.push_back(s.ToString());
    return OkStatus();
  });
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(errors.size(), 4u);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("num_experts=6 does not divide over an expert ring of 4"), std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

// moe_quantize_token_all_gather: the ring gathers e4m3fn codes + per-token
// scales. (1) Against the single-rank layer with the same flag (which runs
// the same quantization round trip): the same bounds as without it. (2)
// Against the single-rank layer *without* the flag fed x = deq(q(x0)),
// tokens the quantizer maps to themselves: the forward is bit for bit and so
// are dwi, dwo (k = 2), i.e. the flag changes the numerics by exactly one
// quantization of x. (3) The bytes the dispatch saves are the traffic
// functions' difference, on every rank.
TEST(MoeRing, QuantizedTokenAllGather) {
  for (int P : {2, 4}) {
    const int64_t T = 24, D = 32;
    LayerInputs in(91 + P, T * P, D, 16, 8);
    // (1) on tokens the quantization changes: the ring against one rank,
    // both with the flag; and the flag really changes the output.
    for (const std::vector<std::string>& mode : Modes()) {
      std::vector<std::string> flags = mode;
      flags.push_back("num_experts=8");
      const std::string what = "P=" + std::to_string(P) + " " + (mode.empty() ? "bf16" : mode.back());
      SCOPED_TRACE(what);
      const MoeConfig plain = MakeConfig(flags);
      flags.push_back("moe_quantize_token_all_gather=true");
      const MoeConfig quant_whole = MakeConfig(flags);
      flags.push_back("load_balance_loss_weight=" + std::to_string(0.01 / P));
      const MoeConfig quant_ring = MakeConfig(flags);
      Out whole_plain(in), whole_quant(in), ring(in);
      ASSERT_TRUE(RunWhole(plain, in, &whole_plain).ok());
      ASSERT_TRUE(RunWhole(quant_whole, in, &whole_quant).ok());
      ASSERT_TRUE(RunRing(P, quant_ring, in, &ring, /*poison=*/true).ok());
      ExpectClose(ring, whole_quant, 2, what + " raw x, quantized tokens vs 1 rank quantized");
      EXPECT_GT(Compare(whole_quant.y, whole_plain.y).rel, 1e-3);
    }
    // (2) x = deq(q(x0)), and check that q(x) gives x back.
    {
      Tensor codes = std::move(Tensor::Create(DType::kU8, {T * P, D})).value();
      Tensor scales = F32({T * P});
      Tensor back = F32({T * P, D});
      for (int pass = 0; pass < 2; ++pass) {
        ASSERT_TRUE(QuantizeRows(in.x.data_as<float>(), T * P, D, T * P, 0, QuantDType::kE4M3FN,
                                 Calibration{}, codes.data_as<uint8_t>(),
                                 scales.data_as<float>()).ok());
        DequantizeRows(codes.data_as<uint8_t>(), T * P, D, 0, scales.data_as<float>(),
                       QuantDType::kE4M3FN, back.data_as<float>());
        if (pass == 1) {
          ASSERT_EQ(0, std::memcmp(back.data(), in.x.data(), in.x.num_bytes()))
              << "deq(q(x)) is not a fixed point of the quantizer for this data";
        }
        std::memcpy(in.x.data(), back.data(), in.x.num_bytes());
      }
    }
    for (const std::vector<std::string>& mode : Modes()) {
      std::vector<std::string> flags = mode;
      flags.push_back("num_experts=8");
      const std::string what = "P=" + std::to_string(P) + " " + (mode.empty() ? "bf16" : mode.back());
      SCOPED_TRACE(what);
      const MoeConfig plain = MakeConfig(flags);
      flags.push_back("moe_quantize_token_all_gather=true");
      const MoeConfig quant_whole = MakeConfig(flags);
      flags.push_back("load_balance_loss_weight=" + std::to_string(0.01 / P));
      const MoeConfig quant_ring = MakeConfig(flags);
      Out whole_plain(in), whole_quant(in), ring(in);
      ASSERT_TRUE(RunWhole(plain, in, &whole_plain).ok());
      ASSERT_TRUE(RunWhole(quant_whole, in, &whole_quant).ok());
      const Status st = RunRing(P, quant_ring, in, &ring, /*poison=*/true);
      ASSERT_TRUE(st.ok()) << st.ToString();
      ExpectClose(ring, whole_quant, 2, what + " quantized tokens vs 1 rank quantized");
      ExpectClose(ring, whole_plain, 2, what + " quantized tokens vs 1 rank fed deq(q(x))");
    }
  }
}

// Forward only: the dispatch's token bytes with and without the flag, per
// rank, as the traffic functions count them.
// (3) On tokens the quantization does change: the ring with the flag on x0
// against one rank without it fed deq(q(x0)). A zero router makes the
// routing independent of x (uniform logits, the same top-k), so the experts
// of both see exactly deq(q(x0)): y, dwi and dwo must be equal bit for bit
// (k = 2), i.e. the flag changes the layer by one quantization of x, no more.
TEST(MoeRing, QuantizedTokenAllGatherIsOneQuantizationOfX) {
  const int P = 2;
  const int64_t T = 24, D = 32;
  LayerInputs in(7, T * P, D, 16, 8);
  std::memset(in.router.data(), 0, in.router.num_bytes());
  LayerInputs deq(7, T * P, D, 16, 8);
  std::memcpy(deq.router.data(), in.router.data(), in.router.num_bytes());
  std::memcpy(deq.wi.data(), in.wi.data(), in.wi.num_bytes());
  std::memcpy(deq.wo.data(), in.wo.data(), in.wo.num_bytes());
  std::memcpy(deq.dy.data(), in.dy.data(), in.dy.num_bytes());
  Tensor codes = std::move(Tensor::Create(DType::kU8, {T * P, D})).value();
  Tensor scales = F32({T * P});
  ASSERT_TRUE(QuantizeRows(in.x.data_as<float>(), T * P, D, T * P, 0, QuantDType::kE4M3FN,
                           Calibration{}, codes.data_as<uint8_t>(), scales.data_as<float>())
                  .ok());
  DequantizeRows(codes.data_as<uint8_t>(), T * P, D, 0, scales.data_as<float>(),
                 QuantDType::kE4M3FN, deq.x.data_as<float>());
  ASSERT_NE(0, std::memcmp(deq.x.data(), in.x.data(), in.x.num_bytes()))
      << "the test needs tokens the quantization changes";
  for (const std::vector<std::string>& mode : Modes()) {
    std::vector<std::string> flags = mode;
    flags.push_back("num_experts=8");
    SCOPED_TRACE(mode.empty() ? "bf16" : mode.back());
    const MoeConfig plain = MakeConfig(flags);
    flags.push_back("moe_quantize_token_all_gather=true");
    flags.push_back("load_balance_loss_weight=" + std::to_string(0.01 / P));
    const MoeConfig quant_ring = MakeConfig(flags);
    Out whole(deq), ring(in);
    ASSERT_TRUE(RunWhole(plain, deq, &whole).ok());
    const Status st = RunRing(P, quant_ring, in, &ring, /*poison=*/true);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(0, std::memcmp(ring.y.data(), whole.y.data(), ring.y.num_bytes()));
    EXPECT_EQ(0, std::memcmp(ring.dwi.data(), whole.dwi.data(), ring.dwi.num_bytes()));
    EXPECT_EQ(0, std::memcmp(ring.dwo.data(), whole.dwo.data(), ring.dwo.num_bytes()));
    EXPECT_LT(Compare(ring.dx, whole.dx).rel, 1e-6);
  }
}

TEST(MoeRing, QuantizedTokenAllGatherSendsTheCountedBytes) {
  const int P = 4;
  const int64_t T = 24, D = 32;
  LayerInputs in(7, T * P, D, 16, 8);
  std::vector<int64_t> sent[2];
  for (int quant = 0; quant < 2; ++quant) {
    std::vector<std::string> flags = {"num_experts=8"};
    if (quant) flags.push_back("moe_quantize_token_all_gather=true");
    const MoeConfig cfg = MakeConfig(flags);
    sent[quant].assign(P, 0);
    ASSERT_TRUE(RunThreadRanks(P, [&](Communicator& comm) -> Status {
      Context ctx;
      MoeOptions o;
      o.ranks.expert_ring = &comm;
      const int64_t El = 8 / P, r = comm.rank();
      const ConstTensorView wi = Rows(in.wi, r * El, El), wo = Rows(in.wo, r * El, El);
      PreparedMoeWeights p;
      MoeWorkspace ws;
      Tensor y = F32({T, D});
      FP8MOE_RETURN_IF_ERROR(PrepareMoeWeights(ctx, cfg, wi, wo, &p));
      const int64_t before = comm.bytes_sent();
      FP8MOE_RETURN_IF_ERROR(MoeForward(ctx, cfg, Rows(in.x, r * T, T),
                                        {in.router.view(), wi, wo}, p, &ws, y.view(), nullptr, o));
      sent[quant][static_cast<size_t>(r)] = comm.bytes_sent() - before;
      return OkStatus();
    }).ok());
  }
  for (int r = 0; r < P; ++r) {
    const int64_t saved = Bf16TokenGatherTraffic(P, r, T, D).total() -
                          QuantizedTokenGatherTraffic(P, r, T, D).total();
    EXPECT_EQ(sent[0][static_cast<size_t>(r)] - sent[1][static_cast<size_t>(r)], saved) << r;
    std::printf("rank %d: forward sent %lld bytes with bf16 tokens, %lld with e4m3fn codes + "
                "scales (tokens: %lld vs %lld)\n", r,
                static_cast<long long>(sent[0][static_cast<size_t>(r)]),
                static_cast<long long>(sent[1][static_cast<size_t>(r)]),
                static_cast<long long>(Bf16TokenGatherTraffic(P, r, T, D).total()),
                static_cast<long long>(QuantizedTokenGatherTraffic(P, r, T, D).total()));
  }
}

}  // namespace
}  // namespace fp8moe
