// The shard rule, the single-rank communicator, the FP8 weight gather and the
// quantized token all-gather against the single-process computation (on 1..5
// thread ranks), their byte accounting, and the configuration check.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "distributed/dist_test_util.h"
#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"

namespace fp8moe {
namespace {

constexpr QuantDType kQuantDTypes[] = {QuantDType::kE4M3FN, QuantDType::kE4M3FNUZ,
                                       QuantDType::kE5M2, QuantDType::kE5M2FNUZ,
                                       QuantDType::kInt8};

void RunOk(int ranks, const std::function<Status(Communicator&)>& body) {
  CommOptions o;
  o.timeout_seconds = 60;
  const Status s = RunThreadRanks(ranks, body, o);
  ASSERT_TRUE(s.ok()) << s.ToString();
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

TEST(Shard, ArraySplitRule) {
  for (int parts = 1; parts <= 9; ++parts) {
    for (int64_t total = 0; total <= 40; ++total) {
      int64_t next = 0;
      for (int r = 0; r < parts; ++r) {
        const ShardRange s = GetShardRange(total, parts, r);
        EXPECT_EQ(s.begin, next) << total << " over " << parts << " rank " << r;
        EXPECT_EQ(s.size(), total / parts + (r < total % parts ? 1 : 0));
        next = s.end;
      }
      EXPECT_EQ(next, total);
    }
  }
  EXPECT_EQ(GetShardRange(10, 3, 3).size(), 0);  // out of range: empty
  EXPECT_EQ(GetShardRange(10, 0, 0).size(), 0);
}

TEST(SingleRank, CollectivesCopy) {
  auto comm = MakeSingleRankCommunicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->name(), "single");
  std::vector<float> x = {1.5f, -2.0f, 3.25f}, y(3, NAN);
  ASSERT_TRUE(comm->AllGather(x.data(), y.data(), 3, DType::kF32).ok());
  EXPECT_EQ(y, x);
  std::fill(y.begin(), y.end(), NAN);
  ASSERT_TRUE(comm->ReduceScatter(x.data(), y.data(), 3, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_EQ(y, x);
  std::fill(y.begin(), y.end(), NAN);
  ASSERT_TRUE(comm->AllReduce(x.data(), y.data(), 3, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_EQ(y, x);
  ASSERT_TRUE(comm->Barrier().ok());
  EXPECT_EQ(comm->bytes_sent(), 0);
  // A receive nobody sends fails at once instead of hanging.
  float z;
  const Status s = comm->Recv(&z, 4, 0, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no matching send"), std::string::npos) << s.ToString();
  EXPECT_FALSE(comm->ISend(&z, 4, 1, 0).ok());  // no rank 1
}

// Weights with channels of very different magnitudes (some reach the
// subnormal range of the formats), so per-channel scales differ.
std::vector<float> RandomWeight(int64_t e, int64_t k, int64_t n, std::mt19937& rng) {
  std::vector<float> w = testing_util::RandomF32(static_cast<size_t>(e * k * n), rng, false);
  std::uniform_int_distribution<int> ex(-20, 10);
  std::vector<float> channel_scale(static_cast<size_t>(e * n));
  for (auto& s : channel_scale) s = std::ldexp(1.0f, ex(rng));
  for (int64_t i = 0; i < e * k * n; ++i) {
    const float v = w[static_cast<size_t>(i)];
    w[static_cast<size_t>(i)] = std::isfinite(v) ? std::clamp(v, -1e3f, 1e3f) : 0.0f;
    w[static_cast<size_t>(i)] *= channel_scale[static_cast<size_t>((i / (k * n)) * n + i % n)];
  }
  return w;
}

struct WeightShape {
  int64_t e, k, n;
};

TEST(Gather8, EqualsQuantizeChannelsOnTheWholeTensor) {
  std::mt19937 rng(testing_util::TestSeed());
  const WeightShape shapes[] = {{1, 1, 1}, {2, 3, 5}, {3, 17, 10}, {4, 32, 24}, {1, 7, 1},
                                {5, 1, 9}, {0, 4, 4}};
  const Calibration calibs[] = {Calibration::AbsMax(), Calibration::Fixed(-224.0f, 224.0f)};
  for (int p = 1; p <= 5; ++p) {
    for (const WeightShape& sh : shapes) {
      for (QuantDType qd : kQuantDTypes) {
        for (const Calibration& calib : calibs) {
          for (bool with_nan : {false, true}) {
            SCOPED_TRACE(testing::Message()
                         << "ranks " << p << " shape " << sh.e << "x" << sh.k << "x" << sh.n
                         << " " << QuantDTypeName(qd) << " " << calib.ToString()
                         << (with_nan ? " with NaN" : ""));
            const int64_t total = sh.e * sh.k * sh.n;
            std::vector<float> w = RandomWeight(sh.e, sh.k, sh.n, rng);
            if (with_nan && total > 0) w[static_cast<size_t>(total / 2)] = NAN;
            std::vector<uint8_t> want_q(static_cast<size_t>(total));
            std::vector<float> want_s(static_cast<size_t>(sh.e * sh.n));
            ASSERT_TRUE(QuantizeChannels(w.data(), sh.e, sh.k, sh.n, qd, calib, want_q.data(),
                                         want_s.data())
                            .ok());
            std::vector<std::vector<uint8_t>> q(p, std::vector<uint8_t>(total, 0xEE));
            std::vector<std::vector<float>> s(p, std::vector<float>(want_s.size(), -1.0f));
            RunOk(p, [&](Communicator& c) {
              DistScratch scratch;
              const ShardRange mine = GetShardRange(total, p, c.rank());
              std::vector<float> shard(w.begin() + mine.begin, w.begin() + mine.end);
              return GatherFp8Weight(c, shard.data(), sh.e, sh.k, sh.n, qd, calib,
                                     q[c.rank()].data(), s[c.rank()].data(), scratch);
            });
            for (int r = 0; r < p; ++r) {
              ASSERT_EQ(q[r], want_q) << "rank " << r;
              ASSERT_EQ(Bits(s[r]), Bits(want_s)) << "rank " << r;
            }
          }
        }
      }
    }
  }
}

// Shards large enough for the threaded path: the same bits for any thread
// count, equal to QuantizeChannels.
TEST(Gather8, LargeShardsAnyThreadCount) {
  std::mt19937 rng(testing_util::TestSeed() + 5);
  const WeightShape sh{2, 301, 1025};  // 617050 elements: rows split by shards
  const int64_t total = sh.e * sh.k * sh.n;
  const std::vector<float> w = RandomWeight(sh.e, sh.k, sh.n, rng);
  std::vector<uint8_t> want_q(total);
  std::vector<float> want_s(sh.e * sh.n);
  ASSERT_TRUE(QuantizeChannels(w.data(), sh.e, sh.k, sh.n, QuantDType::kE4M3FN,
                               Calibration::AbsMax(), want_q.data(), want_s.data())
                  .ok());
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int p : {1, 2}) {
      std::vector<std::vector<uint8_t>> q(p, std::vector<uint8_t>(total));
      std::vector<std::vector<float>> s(p, std::vector<float>(want_s.size()));
      RunOk(p, [&](Communicator& c) {
        omp_set_num_threads(threads);  // per thread of the process
        DistScratch scratch;
        const ShardRange mine = GetShardRange(total, p, c.rank());
        return GatherFp8Weight(c, w.data() + mine.begin, sh.e, sh.k, sh.n,
                               QuantDType::kE4M3FN, Calibration::AbsMax(), q[c.rank()].data(),
                               s[c.rank()].data(), scratch);
      });
      for (int r = 0; r < p; ++r) {
        ASSERT_EQ(q[r], want_q) << threads << " threads, " << p << " ranks, rank " << r;
        ASSERT_EQ(Bits(s[r]), Bits(want_s));
      }
    }
  }
  omp_set_num_threads(saved);
}

// gather8 sends exactly half the bytes of the bf16 gather for the weight,
// plus the amax all-reduce; both as the traffic functions say.
TEST(Gather8, MovesHalfTheBytesOfBf16) {
  std::mt19937 rng(testing_util::TestSeed() + 1);
  const WeightShape sh{3, 16, 11};
  const int64_t total = sh.e * sh.k * sh.n;
  const std::vector<float> w = RandomWeight(sh.e, sh.k, sh.n, rng);
  for (int p = 1; p <= 5; ++p) {
    std::vector<int64_t> codes_sent(p), bf16_sent(p);
    std::vector<std::vector<uint16_t>> bf16(p, std::vector<uint16_t>(total));
    RunOk(p, [&](Communicator& c) {
      DistScratch scratch;
      const ShardRange mine = GetShardRange(total, p, c.rank());
      std::vector<uint8_t> q(total);
      std::vector<float> s(sh.e * sh.n);
      // Fixed calibration: the codes all-gather alone.
      int64_t before = c.bytes_sent();
      FP8MOE_RETURN_IF_ERROR(GatherFp8Weight(c, w.data() + mine.begin, sh.e, sh.k, sh.n,
                                             QuantDType::kE4M3FN,
                                             Calibration::Fixed(-1.0f, 1.0f), q.data(),
                                             s.data(), scratch));
      codes_sent[c.rank()] = c.bytes_sent() - before;
      before = c.bytes_sent();
      FP8MOE_RETURN_IF_ERROR(GatherBf16Weight(c, w.data() + mine.begin, total,
                                              bf16[c.rank()].data()));
      bf16_sent[c.rank()] = c.bytes_sent() - before;
      // Absmax: codes plus the amax all-reduce.
      before = c.bytes_sent();
      FP8MOE_RETURN_IF_ERROR(GatherFp8Weight(c, w.data() + mine.begin, sh.e, sh.k, sh.n,
                                             QuantDType::kE4M3FN, Calibration::AbsMax(),
                                             q.data(), s.data(), scratch));
      const GatherTraffic t = Fp8WeightGatherTraffic(p, c.rank(), sh.e, sh.k, sh.n, true);
      if (c.bytes_sent() - before != t.total()) {
        return Internal("absmax gather8 sent " + std::to_string(c.bytes_sent() - before) +
                        " bytes, expected " + std::to_string(t.total()));
      }
      return OkStatus();
    });
    for (int r = 0; r < p; ++r) {
      EXPECT_EQ(2 * codes_sent[r], bf16_sent[r]) << "ranks " << p << " rank " << r;
      EXPECT_EQ(codes_sent[r],
                Fp8WeightGatherTraffic(p, r, sh.e, sh.k, sh.n, false).payload);
      EXPECT_EQ(bf16_sent[r], Bf16WeightGatherTraffic(p, r, total).payload);
      if (p > 1) {
        EXPECT_GT(codes_sent[r], 0);
      }
      for (int64_t i = 0; i < total; ++i) {
        ASSERT_EQ(bf16[r][i], F32ToBf16(w[i])) << "rank " << r << " element " << i;
      }
    }
  }
}

TEST(TokenGather, EqualsQuantizeRowsOfAllTokens) {
  std::mt19937 rng(testing_util::TestSeed() + 2);
  for (int p = 1; p <= 5; ++p) {
    for (int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{5}}) {
      for (int64_t d : {int64_t{1}, int64_t{33}, int64_t{128}}) {
        for (QuantDType qd : kQuantDTypes) {
          SCOPED_TRACE(testing::Message() << "ranks " << p << " tokens " << tokens << " d "
                                          << d << " " << QuantDTypeName(qd));
          const int64_t rows = tokens * p;
          std::vector<float> x = testing_util::RandomF32(static_cast<size_t>(rows * d), rng,
                                                         true);
          std::vector<uint8_t> want_q(static_cast<size_t>(rows * d));
          std::vector<float> want_s(static_cast<size_t>(rows));
          ASSERT_TRUE(QuantizeRows(x.data(), rows, d, rows, 0, qd, Calibration::AbsMax(),
                                   want_q.data(), want_s.data())
                          .ok());
          std::vector<std::vector<uint8_t>> q(p, std::vector<uint8_t>(want_q.size(), 0xEE));
          std::vector<std::vector<float>> s(p, std::vector<float>(want_s.size(), -1.0f));
          std::vector<std::vector<uint16_t>> b(p, std::vector<uint16_t>(rows * d, 0xFFFF));
          std::vector<int64_t> q_sent(p), b_sent(p);
          RunOk(p, [&](Communicator& c) {
            const float* mine = x.data() + c.rank() * tokens * d;
            int64_t before = c.bytes_sent();
            FP8MOE_RETURN_IF_ERROR(GatherQuantizedTokens(c, mine, tokens, d, qd,
                                                         Calibration::AbsMax(),
                                                         q[c.rank()].data(), s[c.rank()].data()));
            q_sent[c.rank()] = c.bytes_sent() - before;
            before = c.bytes_sent();
            FP8MOE_RETURN_IF_ERROR(GatherBf16Tokens(c, mine, tokens, d, b[c.rank()].data()));
            b_sent[c.rank()] = c.bytes_sent() - before;
            return OkStatus();
          });
          for (int r = 0; r < p; ++r) {
            ASSERT_EQ(q[r], want_q) << "rank " << r;
            ASSERT_EQ(Bits(s[r]), Bits(want_s)) << "rank " << r;
            for (int64_t i = 0; i < rows * d; ++i) {
              ASSERT_EQ(b[r][i], F32ToBf16(x[i])) << "rank " << r << " element " << i;
            }
            // d bytes of codes + 4 of scale per token, against 2 * d.
            EXPECT_EQ(q_sent[r], (p - 1) * tokens * (d + 4));
            EXPECT_EQ(b_sent[r], (p - 1) * tokens * 2 * d);
            EXPECT_EQ(q_sent[r], QuantizedTokenGatherTraffic(p, r, tokens, d).total());
            EXPECT_EQ(b_sent[r], Bf16TokenGatherTraffic(p, r, tokens, d).total());
          }
        }
      }
    }
  }
}

TEST(DistConfig, FingerprintIsFnv1a) {
  EXPECT_EQ(ConfigFingerprint(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(ConfigFingerprint("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_NE(ConfigFingerprint("steps: 10\n"), ConfigFingerprint("steps: 11\n"));
}

TEST(DistConfig, MatchingConfigGivesTheLayout) {
  std::vector<ParallelLayout> layouts(6);
  RunOk(6, [&](Communicator& c) {
    FP8MOE_ASSIGN_OR_RETURN(layouts[c.rank()], CheckDistributedConfig(c, "x: 1\n", 2, 3));
    return OkStatus();
  });
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(layouts[r].fsdp, 2);
    EXPECT_EQ(layouts[r].expert, 3);
    EXPECT_EQ(layouts[r].expert_index, r % 3);
    EXPECT_EQ(layouts[r].fsdp_index, r / 3);
  }
  // -1: the ranks the other axis leaves.
  RunOk(4, [&](Communicator& c) {
    FP8MOE_ASSIGN_OR_RETURN(ParallelLayout l, CheckDistributedConfig(c, "", -1, 2));
    if (l.fsdp != 2 || l.expert != 2) return Internal("-1 not filled");
    FP8MOE_ASSIGN_OR_RETURN(l, CheckDistributedConfig(c, "", 4, -1));
    if (l.fsdp != 4 || l.expert != 1) return Internal("-1 not filled");
    return OkStatus();
  });
}

// Every rank gets the same clear error before any work.
TEST(DistConfig, MismatchesAreErrorsOnEveryRank) {
  struct Case {
    int ranks;
    int64_t fsdp, expert;
    bool rank1_differs;
    const char* message;
  };
  const Case cases[] = {
      {4, 4, 1, true,
       "ranks 0, 2, 3 have config fingerprint"},
      {4, 4, 1, true, "rank 1 has config fingerprint"},
      {4, 2, 3, false, "ici_fsdp_parallelism=2 * ici_expert_parallelism=3 = 6, but the job "
                       "has 4 ranks: set them so the product is 4"},
      {3, -1, 2, false, "ici_fsdp_parallelism=-1 needs ici_expert_parallelism=2 to divide"},
      {2, 0, 2, false, "ici_fsdp_parallelism=0 is invalid"},
      {2, -1, -1, false, "at most one axis may be -1"},
      {2, int64_t{1} << 40, int64_t{1} << 40, false, "= more than 2, but the job has 2 ranks"},
      {2, 3, 1, false, "ici_fsdp_parallelism=3 * ici_expert_parallelism=1 = 3, but the job has 2"},
  };
  for (const Case& cs : cases) {
    std::vector<Status> got(cs.ranks);
    RunOk(cs.ranks, [&](Communicator& c) {
      const std::string text = cs.rank1_differs && c.rank() == 1 ? "lr: 0.1\n" : "lr: 0.2\n";
      got[c.rank()] = CheckDistributedConfig(c, text, cs.fsdp, cs.expert).status();
      return OkStatus();
    });
    for (int r = 0; r < cs.ranks; ++r) {
      EXPECT_FALSE(got[r].ok()) << cs.message;
      EXPECT_NE(got[r].message().find(cs.message), std::string::npos)
          << "rank " << r << ": " << got[r].ToString();
      // The same message everywhere but for the rank's own value.
      const auto common = [](const std::string& m) { return m.substr(0, m.find("(this rank")); };
      EXPECT_EQ(common(got[r].message()), common(got[0].message()));
    }
  }
}

// Which flag differs: named on every rank, each with its own value; a rank
// whose flags did not parse shows its error, the others name it.
TEST(DistConfig, TheFlagThatDiffersIsNamed) {
  std::vector<Status> got(4);
  RunOk(4, [&](Communicator& c) {
    const std::string text = "# a comment\nsteps: 20\nlearning_rate: " +
                             std::string(c.rank() == 2 ? "0.002" : "0.003") + "\ndtype: f32\n";
    got[c.rank()] = CheckDistributedConfig(c, text, 4, 1).status();
    return OkStatus();
  });
  for (int r = 0; r < 4; ++r) {
    const std::string want = std::string("the first flag that differs is 'learning_rate' ") +
                             "(this rank: learning_rate: " + (r == 2 ? "0.002" : "0.003") + ")";
    EXPECT_NE(got[r].message().find(want), std::string::npos) << got[r].ToString();
  }
  RunOk(3, [&](Communicator& c) {
    const std::string text = c.rank() == 1
                                 ? std::string(kInvalidConfigText) + "unknown key 'stpes'"
                                 : std::string("steps: 20\n");
    got[c.rank()] = CheckDistributedConfig(c, text, 3, 1).status();
    return OkStatus();
  });
  EXPECT_NE(got[1].message().find("this rank's flags are invalid: unknown key 'stpes'"),
            std::string::npos) << got[1].ToString();
  for (int r : {0, 2}) {
    EXPECT_NE(got[r].message().find("rank 1 has flags that are invalid (see its message)"),
              std::string::npos) << got[r].ToString();
  }
}

}  // namespace
}  // namespace fp8moe
