// The MPI communicator under mpirun (ctest runs it on 1, 2, 3, 4, 5 and 8
// ranks): the ring collectives against MPI's own (MPI_Allgather(v),
// MPI_Reduce_scatter(_block), MPI_Allreduce) bit for bit where the
// arithmetic allows it (communicator.h), against the documented order where
// it does not, and the gathers and the configuration check across processes.
// Every rank runs every test; every rank draws every rank's inputs from one
// seed, so each can compute the expected values itself.
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "distributed/dist_test_util.h"
#include "distributed/reduce.h"
#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"
#include "fp8moe/mpi.h"
#include "fp8moe/quant.h"

namespace fp8moe {
namespace {

using testing_util::FirstDifference;
using testing_util::IntegerValued;
using testing_util::Poison;
using testing_util::RandomElements;

MpiRuntime* g_runtime = nullptr;

// The two communicators every test compares: the ring and the library.
struct Comms {
  std::unique_ptr<Communicator> ring, mpi;
  int rank = 0, size = 1;
  uint32_t seed = 0;  // rank 0's seed, shared
};

Comms& World() {
  static Comms* c = [] {
    auto* comms = new Comms;
    CommOptions o;
    o.timeout_seconds = 60;
    auto ring = g_runtime->World(o);
    o.algorithm = CollectiveAlgorithm::kLibrary;
    auto mpi = g_runtime->World(o);
    if (!ring.ok() || !mpi.ok()) {
      std::fprintf(stderr, "cannot create the communicators\n");
      std::abort();
    }
    comms->ring = std::move(ring).value();
    comms->mpi = std::move(mpi).value();
    comms->rank = comms->ring->rank();
    comms->size = comms->ring->size();
    std::vector<uint32_t> seeds(comms->size);
    const uint32_t mine = testing_util::TestSeed();
    if (!comms->ring->AllGather(&mine, seeds.data(), 1, DType::kU32).ok()) std::abort();
    comms->seed = seeds[0];
    return comms;
  }();
  return *c;
}

// Small sizes and sizes around the rank count (fewer when the ranks
// oversubscribe the cores, where every collective is slow).
std::vector<int64_t> SmallCounts(int p) {
  if (p > 4) return {0, 1, p - 1, p + 1, 1001};
  return {0, 1, 2, 3, p - 1, p + 1, 7, 1001, 3000};
}

// Block sizes past the switch where Open MPI 4.1's tuned component moves
// MPI_Reduce_scatter_block from a butterfly / recursive halving to its basic
// linear algorithm (reduce to rank 0, then scatter): 128 KiB per block on < 4
// ranks, 1 MiB on 4..7 (f32 elements). Run on up to 4 ranks (CI's 2 and 4
// cover both switches); none beyond, to keep the oversubscribed runs short.
std::vector<int64_t> LargeCounts(int p) {
  if (p < 4) return {40000};
  if (p == 4) return {270000};
  return {};
}

std::vector<int64_t> AllCounts(int p) {
  std::vector<int64_t> c = SmallCounts(p);
  for (int64_t n : LargeCounts(p)) c.push_back(n);
  return c;
}

TEST(RingVsMpi, AllGatherBitExact) {
  Comms& w = World();
  const int p = w.size, me = w.rank;
  uint32_t seed = w.seed;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kU8}) {
    for (int64_t count : AllCounts(p)) {
      if (count < 0) continue;
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " count " << count);
      const size_t elem = DTypeSize(dtype);
      seed += 1000;
      // The concatenation is checked on the small sizes (it needs every
      // rank's input); ring == MPI on all.
      const bool concat = count < 10000;
      std::vector<std::vector<uint8_t>> in(p);
      std::vector<uint8_t> expected;
      for (int r = 0; r < p; ++r) {
        if (!concat && r != me) continue;
        std::mt19937 rng(seed + r);
        in[r] = RandomElements(dtype, count, rng, true);
        expected.insert(expected.end(), in[r].begin(), in[r].end());
      }
      std::vector<uint8_t> a(count * p * elem), b(a.size());
      Poison(a);
      Poison(b);
      ASSERT_TRUE(w.ring->AllGather(in[me].data(), a.data(), count, dtype).ok());
      ASSERT_TRUE(w.mpi->AllGather(in[me].data(), b.data(), count, dtype).ok());
      ASSERT_EQ(FirstDifference(a, b, elem), -1);
      if (concat) {
        ASSERT_EQ(FirstDifference(a, expected, elem), -1);
      }
      // Sharded: the total split by the array_split rule (MPI_Allgatherv).
      const int64_t total = count * p + (count % 3);  // often not a multiple of p
      std::mt19937 rng(seed + 999);
      const std::vector<uint8_t> full = RandomElements(dtype, concat ? total : 0, rng, true);
      const ShardRange s = GetShardRange(total, p, me);
      std::vector<uint8_t> shard(s.size() * elem);
      if (concat) {
        std::memcpy(shard.data(), full.data() + s.begin * elem, shard.size());
      } else {
        std::mt19937 own(seed + 500 + me);
        shard = RandomElements(dtype, s.size(), own, true);
      }
      std::vector<uint8_t> c(total * elem), d(total * elem);
      Poison(c);
      Poison(d);
      ASSERT_TRUE(w.ring->AllGatherShards(shard.data(), c.data(), total, dtype).ok());
      ASSERT_TRUE(w.mpi->AllGatherShards(shard.data(), d.data(), total, dtype).ok());
      ASSERT_EQ(FirstDifference(c, d, elem), -1);
      if (concat) {
        ASSERT_EQ(FirstDifference(c, full, elem), -1);
      }
    }
  }
}

struct Reduction {
  DType dtype;
  ReduceOp op;
};
constexpr Reduction kReductions[] = {{DType::kF32, ReduceOp::kSum},
                                     {DType::kBF16, ReduceOp::kSum},
                                     {DType::kI64, ReduceOp::kSum},
                                     {DType::kU32, ReduceOp::kMax},
                                     {DType::kI64, ReduceOp::kMax}};

// Runs reduce-scatter (equal blocks and shards) and all-reduce on both
// communicators; checks ring == MPI bit for bit when `bit_equal`, and, when
// `check_order`, the ring against the documented order (which needs every
// rank's input on every rank).
void CompareReductions(const Reduction& red, int64_t n, bool integers, bool bit_equal,
                       bool check_order, uint32_t seed) {
  Comms& w = World();
  const int p = w.size, me = w.rank;
  const size_t elem = DTypeSize(red.dtype);
  for (int layout = 0; layout < 3; ++layout) {  // 0 blocks, 1 shards, 2 all-reduce
    SCOPED_TRACE(testing::Message() << ReduceOpName(red.op) << " of " << DTypeName(red.dtype)
                                    << " n " << n << (layout == 0   ? " reduce-scatter"
                                                      : layout == 1 ? " sharded"
                                                                    : " all-reduce"));
    const int64_t total = layout == 0 ? n * p : n;
    std::vector<std::vector<uint8_t>> in(p);
    for (int r = 0; r < p; ++r) {
      if (!check_order && r != me) continue;  // only this rank's input is needed
      std::mt19937 rng(seed + 101 * layout + r);
      in[r] = integers ? IntegerValued(red.dtype, total, rng)
                       : RandomElements(red.dtype, total, rng, /*specials=*/false);
    }
    std::vector<int64_t> counts(p);
    for (int r = 0; r < p; ++r) counts[r] = layout == 0 ? n : GetShardRange(total, p, r).size();
    const int64_t out_n = layout == 2 ? total : counts[me];
    std::vector<uint8_t> a(out_n * elem), b(out_n * elem);
    Poison(a);
    Poison(b);
    Status sa, sb;
    if (layout == 0) {
      sa = w.ring->ReduceScatter(in[me].data(), a.data(), n, red.dtype, red.op);
      sb = w.mpi->ReduceScatter(in[me].data(), b.data(), n, red.dtype, red.op);
    } else if (layout == 1) {
      sa = w.ring->ReduceScatterShards(in[me].data(), a.data(), total, red.dtype, red.op);
      sb = w.mpi->ReduceScatterShards(in[me].data(), b.data(), total, red.dtype, red.op);
    } else {
      sa = w.ring->AllReduce(in[me].data(), a.data(), total, red.dtype, red.op);
      sb = w.mpi->AllReduce(in[me].data(), b.data(), total, red.dtype, red.op);
    }
    ASSERT_TRUE(sa.ok()) << sa.ToString();
    ASSERT_TRUE(sb.ok()) << sb.ToString();
    if (bit_equal) {
      ASSERT_EQ(FirstDifference(a, b, elem), -1) << "ring vs MPI";
    }
    if (!check_order) continue;
    std::vector<const void*> ptrs(p);
    for (int r = 0; r < p; ++r) ptrs[r] = in[r].data();
    std::vector<uint8_t> expected(a.size());
    if (layout == 2) {  // all-reduce: the sharded order, shard by shard
      for (int r = 0; r < p; ++r) {
        internal::RingOrderReference(red.dtype, red.op, ptrs.data(), counts.data(), p, r,
                                     expected.data() + GetShardRange(total, p, r).begin * elem);
      }
    } else {
      internal::RingOrderReference(red.dtype, red.op, ptrs.data(), counts.data(), p, me,
                                   expected.data());
    }
    ASSERT_EQ(FirstDifference(a, expected, elem), -1) << "ring vs the documented order";
  }
}

// Integer-valued data: every order gives the same exact sums, so the ring
// equals MPI bit for bit on any number of ranks, for every size (including
// one past Open MPI's algorithm switch).
TEST(RingVsMpi, ReductionsOnExactValuesBitExact) {
  Comms& w = World();
  uint32_t seed = w.seed + 1000;
  for (const Reduction& red : kReductions) {
    for (int64_t n : AllCounts(w.size)) {
      if (n < 0) continue;
      CompareReductions(red, n, /*integers=*/true, /*bit_equal=*/true, /*check_order=*/false,
                        seed += 1000);
    }
  }
}

// Random values (no NaN: MPI_SUM does not canonicalise it): integer
// reductions and two-rank float sums (one addition, which commutes) equal MPI
// bit for bit; on 3+ ranks float sums follow the ring's documented order.
TEST(RingVsMpi, ReductionsOnRandomValues) {
  Comms& w = World();
  uint32_t seed = w.seed + 2000;
  // Two ranks: bit-exact with MPI on both sides of the switch too.
  std::vector<int64_t> counts = w.size <= 2 ? AllCounts(w.size) : SmallCounts(w.size);
  for (const Reduction& red : kReductions) {
    if (red.dtype == DType::kI64 && red.op == ReduceOp::kSum) continue;  // overflow: UB in MPI
    const bool is_float = red.dtype == DType::kF32 || red.dtype == DType::kBF16;
    for (int64_t n : counts) {
      if (n < 0) continue;
      CompareReductions(red, n, /*integers=*/false, /*bit_equal=*/!is_float || w.size <= 2,
                        /*check_order=*/true, seed += 1000);
    }
  }
}

// The same call twice gives the same bits (no dependence on timing).
TEST(RingVsMpi, RingReductionIsDeterministic) {
  Comms& w = World();
  const int64_t n = 100003;
  std::mt19937 rng(w.seed + 3000 + w.rank);
  const std::vector<uint8_t> in = RandomElements(DType::kF32, n, rng, true);
  std::vector<uint8_t> a(n * 4), b(n * 4);
  ASSERT_TRUE(w.ring->AllReduce(in.data(), a.data(), n, DType::kF32, ReduceOp::kSum).ok());
  ASSERT_TRUE(w.ring->AllReduce(in.data(), b.data(), n, DType::kF32, ReduceOp::kSum).ok());
  ASSERT_EQ(a, b);
}

TEST(MpiDist, Gather8EqualsQuantizeChannels) {
  Comms& w = World();
  for (Communicator* c : {w.ring.get(), w.mpi.get()}) {
    for (QuantDType qd : {QuantDType::kE4M3FN, QuantDType::kE5M2, QuantDType::kInt8}) {
      const int64_t e = 3, k = 37, n = 29, total = e * k * n;
      std::mt19937 rng(w.seed + 4000);
      std::vector<float> full = testing_util::RandomF32(total, rng, false);
      for (float& v : full) v = std::isfinite(v) ? std::clamp(v, -1e4f, 1e4f) : 1.0f;
      std::vector<uint8_t> want_q(total), q(total, 0xEE);
      std::vector<float> want_s(e * n), s(e * n, -1.0f);
      ASSERT_TRUE(QuantizeChannels(full.data(), e, k, n, qd, Calibration::AbsMax(),
                                   want_q.data(), want_s.data())
                      .ok());
      DistScratch scratch;
      const ShardRange mine = GetShardRange(total, w.size, w.rank);
      ASSERT_TRUE(GatherFp8Weight(*c, full.data() + mine.begin, e, k, n, qd,
                                  Calibration::AbsMax(), q.data(), s.data(), scratch)
                      .ok());
      EXPECT_EQ(q, want_q) << c->name() << " " << CollectiveAlgorithmName(c->algorithm());
      EXPECT_EQ(0, std::memcmp(s.data(), want_s.data(), s.size() * 4));
    }
  }
}

TEST(MpiDist, QuantizedTokenGatherEqualsQuantizeRows) {
  Comms& w = World();
  const int64_t tokens = 9, d = 64, rows = tokens * w.size;
  std::mt19937 rng(w.seed + 5000);
  const std::vector<float> x = testing_util::RandomF32(rows * d, rng, true);
  std::vector<uint8_t> want_q(rows * d), q(rows * d, 0xEE);
  std::vector<float> want_s(rows), s(rows, -1.0f);
  ASSERT_TRUE(QuantizeRows(x.data(), rows, d, rows, 0, QuantDType::kE4M3FN,
                           Calibration::AbsMax(), want_q.data(), want_s.data())
                  .ok());
  ASSERT_TRUE(GatherQuantizedTokens(*w.ring, x.data() + w.rank * tokens * d, tokens, d,
                                    QuantDType::kE4M3FN, Calibration::AbsMax(), q.data(),
                                    s.data())
                  .ok());
  EXPECT_EQ(q, want_q);
  EXPECT_EQ(0, std::memcmp(s.data(), want_s.data(), s.size() * 4));
}

TEST(MpiDist, ConfigMismatchIsAnErrorOnEveryRank) {
  Comms& w = World();
  auto ok = CheckDistributedConfig(*w.ring, "a: 1\n", w.size, 1);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->fsdp, w.size);
  auto bad = CheckDistributedConfig(*w.ring, "a: 1\n", w.size + 1, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("but the job has " + std::to_string(w.size)),
            std::string::npos)
      << bad.status().ToString();
  if (w.size > 1) {
    auto differs = CheckDistributedConfig(*w.ring, w.rank == 1 ? "a: 2\n" : "a: 1\n", w.size, 1);
    ASSERT_FALSE(differs.ok());
    EXPECT_NE(differs.status().message().find("rank 1 has config fingerprint"),
              std::string::npos)
        << differs.status().ToString();
  }
}

TEST(MpiDist, SplitFormsGroups) {
  Comms& w = World();
  for (Communicator* c : {w.ring.get(), w.mpi.get()}) {
    auto g = c->Split(w.rank % 2, w.rank);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ((*g)->size(), (w.size + 1 - w.rank % 2) / 2);
    EXPECT_EQ((*g)->rank(), w.rank / 2);
    int64_t x = w.rank, sum = 0, want = 0;
    for (int r = w.rank % 2; r < w.size; r += 2) want += r;
    ASSERT_TRUE((*g)->AllReduce(&x, &sum, 1, DType::kI64, ReduceOp::kSum).ok());
    EXPECT_EQ(sum, want);
  }
}

// The failing rank's barrier (cli/train.cc): true once every rank has come,
// false after its bound while the others are elsewhere, without ending the
// job. (After false the caller ends the job; here the other ranks come later
// instead and complete the barrier rank 0 left pending.)
TEST(MpiDist, BarrierWithinWaitsForEveryRankForAtMostItsBound) {
  Comms& w = World();
  ASSERT_TRUE(w.ring->Barrier().ok());
  EXPECT_TRUE(g_runtime->BarrierWithin(30));
  ASSERT_TRUE(w.ring->Barrier().ok());
  const auto start = std::chrono::steady_clock::now();
  if (w.rank == 0) {
    EXPECT_EQ(g_runtime->BarrierWithin(0.2), w.size == 1);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (w.size > 1) {
      EXPECT_GE(took, 0.2);
      EXPECT_LT(took, 1.8);  // the others come at 2 s
    }
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    EXPECT_TRUE(g_runtime->BarrierWithin(30));
  }
  ASSERT_TRUE(w.ring->Barrier().ok());
}

TEST(MpiDist, PointToPointChecksSizes) {
  Comms& w = World();
  if (w.size < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator& c = *w.ring;
  const int next = (w.rank + 1) % w.size, prev = (w.rank + w.size - 1) % w.size;
  int64_t out = w.rank, in = -1;
  CommRequest reqs[2];
  auto r0 = c.IRecv(&in, 8, prev, 3);
  auto r1 = c.ISend(&out, 8, next, 3);
  ASSERT_TRUE(r0.ok() && r1.ok());
  reqs[0] = *r0;
  reqs[1] = *r1;
  ASSERT_TRUE(c.WaitAll(reqs).ok());
  EXPECT_EQ(in, prev);
  // A receive larger than its message is an error naming both sizes.
  if (w.rank == 0) {
    ASSERT_TRUE(c.Send(&out, 4, 1, 4).ok());
  }
  if (w.rank == 1) {
    const Status s = c.Recv(&in, 8, 0, 4);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("matched a message of 4 bytes"), std::string::npos)
        << s.ToString();
  }
  ASSERT_TRUE(c.Barrier().ok());
}

// Only rank 0 prints the progress of the tests; every rank prints failures.
class QuietListener : public testing::EmptyTestEventListener {
 public:
  explicit QuietListener(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "rank %d: %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto runtime = fp8moe::MpiRuntime::Start();
  if (!runtime.ok()) {
    std::fprintf(stderr, "%s\n", runtime.status().ToString().c_str());
    return 1;
  }
  fp8moe::g_runtime = runtime->get();
  const int rank = (*runtime)->world_rank();
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new fp8moe::QuietListener(rank));
  }
  const int failed = RUN_ALL_TESTS();
  // Every rank exits with the same code: failed anywhere is failed.
  int64_t mine = failed, any = 1;
  if (!fp8moe::World()
           .ring->AllReduce(&mine, &any, 1, fp8moe::DType::kI64, fp8moe::ReduceOp::kMax)
           .ok()) {
    any = 1;
  }
  fp8moe::World().ring.reset();
  fp8moe::World().mpi.reset();
  runtime->reset();
  return any != 0 ? 1 : 0;
}
