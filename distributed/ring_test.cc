// The bidirectional ring collectives on in-process thread ranks (1..8 ranks,
// sizes that do not divide by the rank count, every supported dtype), against
// independent expectations: concatenation for all-gather, the documented
// summation order (distributed/reduce.h) and exact integer sums for reductions.
// The same ring code runs under MPI in dist_mpi_test.
#include <bit>
#include <cstring>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "distributed/dist_test_util.h"
#include "distributed/reduce.h"
#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"

namespace fp8moe {
namespace {

using testing_util::FirstDifference;
using testing_util::IntegerValued;
using testing_util::Poison;
using testing_util::RandomElements;

struct Reduction {
  DType dtype;
  ReduceOp op;
};
constexpr Reduction kReductions[] = {{DType::kF32, ReduceOp::kSum},
                                     {DType::kBF16, ReduceOp::kSum},
                                     {DType::kI64, ReduceOp::kSum},
                                     {DType::kU32, ReduceOp::kMax},
                                     {DType::kI64, ReduceOp::kMax}};
constexpr DType kGatherDTypes[] = {DType::kF32, DType::kBF16, DType::kU8};

CommOptions Fast() {
  CommOptions o;
  o.timeout_seconds = 60;
  return o;
}

void RunOk(int ranks, const std::function<Status(Communicator&)>& body) {
  const Status s = RunThreadRanks(ranks, body, Fast());
  ASSERT_TRUE(s.ok()) << s.ToString();
}

// Totals around the multiples of p, and a few odd sizes.
std::vector<int64_t> Totals(int p) {
  return {0, 1, p - 1, p, p + 1, 2 * p + 1, 7, 64, 1001};
}

TEST(Ring, AllGatherEqualsConcatenation) {
  std::mt19937 rng(testing_util::TestSeed());
  for (int p = 1; p <= 8; ++p) {
    for (DType dtype : kGatherDTypes) {
      for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7},
                            int64_t{1001}}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(testing::Message() << "ranks " << p << " " << DTypeName(dtype)
                                          << " count " << count << " in_place " << in_place);
          const size_t elem = DTypeSize(dtype);
          std::vector<std::vector<uint8_t>> in(p), out(p);
          std::vector<uint8_t> expected;
          for (int r = 0; r < p; ++r) {
            in[r] = RandomElements(dtype, count, rng, true);
            expected.insert(expected.end(), in[r].begin(), in[r].end());
            out[r].resize(expected.size() + 0);
          }
          for (int r = 0; r < p; ++r) {
            out[r].resize(static_cast<size_t>(count * p) * elem);
            Poison(out[r]);
          }
          RunOk(p, [&](Communicator& c) {
            uint8_t* dst = out[c.rank()].data();
            const void* src = in[c.rank()].data();
            if (in_place) {
              if (count > 0) std::memcpy(dst + c.rank() * count * elem, src, count * elem);
              src = dst + c.rank() * count * elem;
            }
            return c.AllGather(src, dst, count, dtype);
          });
          for (int r = 0; r < p; ++r) {
            ASSERT_EQ(FirstDifference(out[r], expected, elem), -1) << "rank " << r;
          }
        }
      }
    }
  }
}

TEST(Ring, AllGatherShardsEqualsTheFullTensor) {
  std::mt19937 rng(testing_util::TestSeed() + 1);
  for (int p = 1; p <= 8; ++p) {
    for (DType dtype : kGatherDTypes) {
      for (int64_t total : Totals(p)) {
        SCOPED_TRACE(testing::Message() << "ranks " << p << " " << DTypeName(dtype)
                                        << " total " << total);
        const size_t elem = DTypeSize(dtype);
        const std::vector<uint8_t> full = RandomElements(dtype, total, rng, true);
        std::vector<std::vector<uint8_t>> out(p, std::vector<uint8_t>(full.size()));
        for (auto& o : out) Poison(o);
        std::vector<int64_t> sent(p);
        RunOk(p, [&](Communicator& c) {
          const ShardRange s = GetShardRange(total, p, c.rank());
          const int64_t before = c.bytes_sent();
          const Status st = c.AllGatherShards(full.data() + s.begin * elem,
                                              out[c.rank()].data(), total, dtype);
          sent[c.rank()] = c.bytes_sent() - before;
          return st;
        });
        for (int r = 0; r < p; ++r) {
          ASSERT_EQ(FirstDifference(out[r], full, elem), -1) << "rank " << r;
          EXPECT_EQ(sent[r], RingAllGatherBytes(total, p, r, static_cast<int64_t>(elem)))
              << "rank " << r;
        }
      }
    }
  }
}

// Reduce-scatter in both layouts against the documented order, and the bytes.
TEST(Ring, ReduceScatterFollowsTheDocumentedOrder) {
  std::mt19937 rng(testing_util::TestSeed() + 2);
  for (int p = 1; p <= 8; ++p) {
    for (const Reduction& red : kReductions) {
      for (bool sharded : {false, true}) {
        for (int64_t n : Totals(p)) {
          // n: the total (sharded) or the count per rank (equal blocks).
          const int64_t total = sharded ? n : n * p;
          SCOPED_TRACE(testing::Message()
                       << "ranks " << p << " " << ReduceOpName(red.op) << " of "
                       << DTypeName(red.dtype) << (sharded ? " total " : " count ") << n);
          const size_t elem = DTypeSize(red.dtype);
          std::vector<std::vector<uint8_t>> in(p), out(p);
          std::vector<const void*> ptrs(p);
          for (int r = 0; r < p; ++r) {
            in[r] = RandomElements(red.dtype, total, rng, true);
            ptrs[r] = in[r].data();
          }
          std::vector<int64_t> counts(p);
          for (int r = 0; r < p; ++r) {
            counts[r] = sharded ? GetShardRange(total, p, r).size() : n;
            out[r].resize(static_cast<size_t>(counts[r]) * elem);
            Poison(out[r]);
          }
          std::vector<int64_t> sent(p);
          RunOk(p, [&](Communicator& c) {
            const int64_t before = c.bytes_sent();
            const Status st =
                sharded ? c.ReduceScatterShards(in[c.rank()].data(), out[c.rank()].data(),
                                                total, red.dtype, red.op)
                        : c.ReduceScatter(in[c.rank()].data(), out[c.rank()].data(), n,
                                          red.dtype, red.op);
            sent[c.rank()] = c.bytes_sent() - before;
            return st;
          });
          for (int r = 0; r < p; ++r) {
            std::vector<uint8_t> expected(out[r].size());
            internal::RingOrderReference(red.dtype, red.op, ptrs.data(), counts.data(), p, r,
                                         expected.data());
            const int64_t diff = FirstDifference(out[r], expected, elem);
            ASSERT_EQ(diff, -1) << "rank " << r;
            EXPECT_EQ(sent[r],
                      RingReduceScatterBytes(total, p, r, static_cast<int64_t>(elem)));
          }
        }
      }
    }
  }
}

// The order itself, by hand: four ranks, block 0 of two elements, the same
// values x1 = 2^24, x2 = x3 = 1, x0 = 0 in both. The first element sums x1,
// x2, x3, x0; the second x3, x2, x1, x0, and the order decides the result
// (2^24 + 1 rounds back to 2^24).
TEST(Ring, ReductionOrderByHand) {
  const float big = 16777216.0f;  // 2^24
  // inputs[r] = {element 0, element 1} of block 0 (other blocks: zeros).
  const float x[4][2] = {{0, 0}, {big, big}, {1, 1}, {1, 1}};
  std::vector<std::vector<float>> in(4, std::vector<float>(8, 0.0f));
  for (int r = 0; r < 4; ++r) {
    in[r][0] = x[r][0];
    in[r][1] = x[r][1];
  }
  std::vector<float> out(2, -1.0f);
  RunOk(4, [&](Communicator& c) {
    std::vector<float> mine(2);
    FP8MOE_RETURN_IF_ERROR(
        c.ReduceScatter(in[c.rank()].data(), mine.data(), 2, DType::kF32, ReduceOp::kSum));
    if (c.rank() == 0) out = mine;
    return OkStatus();
  });
  EXPECT_EQ(out[0], big);      // ((2^24 + 1) + 1) + 0
  EXPECT_EQ(out[1], big + 2);  // ((1 + 1) + 2^24) + 0
}

// Without trusting the reference: integer-valued f32 / bf16 sums are exact in
// any order, and on two ranks the one addition commutes.
TEST(Ring, ReduceScatterExactSums) {
  std::mt19937 rng(testing_util::TestSeed() + 3);
  for (int p = 1; p <= 8; ++p) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t total = 1003;
      std::vector<std::vector<uint8_t>> in(p);
      for (int r = 0; r < p; ++r) in[r] = IntegerValued(dtype, total, rng);
      std::vector<std::vector<float>> got(p);
      RunOk(p, [&](Communicator& c) {
        const ShardRange s = GetShardRange(total, p, c.rank());
        std::vector<uint8_t> shard(static_cast<size_t>(s.size()) * DTypeSize(dtype));
        FP8MOE_RETURN_IF_ERROR(c.ReduceScatterShards(in[c.rank()].data(), shard.data(),
                                                     total, dtype, ReduceOp::kSum));
        for (int64_t i = 0; i < s.size(); ++i) {
          float v;
          if (dtype == DType::kF32) {
            std::memcpy(&v, shard.data() + i * 4, 4);
          } else {
            uint16_t b;
            std::memcpy(&b, shard.data() + i * 2, 2);
            v = internal::Bf16Value(b);
          }
          got[c.rank()].push_back(v);
        }
        return OkStatus();
      });
      for (int r = 0; r < p; ++r) {
        const ShardRange s = GetShardRange(total, p, r);
        for (int64_t i = 0; i < s.size(); ++i) {
          double sum = 0;
          for (int q = 0; q < p; ++q) {
            float v;
            if (dtype == DType::kF32) {
              std::memcpy(&v, in[q].data() + (s.begin + i) * 4, 4);
            } else {
              uint16_t b;
              std::memcpy(&b, in[q].data() + (s.begin + i) * 2, 2);
              v = internal::Bf16Value(b);
            }
            sum += v;
          }
          ASSERT_EQ(got[r][i], static_cast<float>(sum)) << "rank " << r << " element " << i;
        }
      }
    }
  }
  // Two ranks, random f32 with specials: a + b, whichever operand comes first.
  std::vector<std::vector<float>> in2(2);
  for (auto& v : in2) v = testing_util::RandomF32(2 * 513, rng, true);
  std::vector<std::vector<float>> out2(2, std::vector<float>(513));
  RunOk(2, [&](Communicator& c) {
    return c.ReduceScatter(in2[c.rank()].data(), out2[c.rank()].data(), 513, DType::kF32,
                           ReduceOp::kSum);
  });
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 513; ++i) {
      const float want = in2[0][r * 513 + i] + in2[1][r * 513 + i];
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out2[r][i]));
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(out2[r][i]), std::bit_cast<uint32_t>(want));
      }
    }
  }
}

TEST(Ring, AllReduceGivesEveryRankTheSameBits) {
  std::mt19937 rng(testing_util::TestSeed() + 4);
  for (int p = 1; p <= 8; ++p) {
    for (const Reduction& red : kReductions) {
      for (int64_t count : Totals(p)) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(testing::Message() << "ranks " << p << " " << ReduceOpName(red.op)
                                          << " of " << DTypeName(red.dtype) << " count "
                                          << count << " in_place " << in_place);
          const size_t elem = DTypeSize(red.dtype);
          std::vector<std::vector<uint8_t>> in(p), out(p);
          std::vector<const void*> ptrs(p);
          for (int r = 0; r < p; ++r) {
            in[r] = RandomElements(red.dtype, count, rng, true);
            ptrs[r] = in[r].data();
            out[r] = in[r];
            if (!in_place) Poison(out[r]);
          }
          std::vector<int64_t> sent(p);
          RunOk(p, [&](Communicator& c) {
            const int64_t before = c.bytes_sent();
            const void* src = in_place ? out[c.rank()].data() : in[c.rank()].data();
            const Status st = c.AllReduce(src, out[c.rank()].data(), count, red.dtype, red.op);
            sent[c.rank()] = c.bytes_sent() - before;
            return st;
          });
          // The expected bits: the sharded reduce-scatter's order per shard.
          std::vector<int64_t> counts(p);
          for (int r = 0; r < p; ++r) counts[r] = GetShardRange(count, p, r).size();
          std::vector<uint8_t> expected(static_cast<size_t>(count) * elem);
          for (int r = 0; r < p; ++r) {
            internal::RingOrderReference(red.dtype, red.op, ptrs.data(), counts.data(), p, r,
                                         expected.data() +
                                             GetShardRange(count, p, r).begin * elem);
          }
          for (int r = 0; r < p; ++r) {
            ASSERT_EQ(FirstDifference(out[r], expected, elem), -1) << "rank " << r;
            EXPECT_EQ(sent[r], RingAllReduceBytes(count, p, r, static_cast<int64_t>(elem)));
          }
        }
      }
    }
  }
}

TEST(Ring, PointToPointKeepsOrderAndChecksSizes) {
  RunOk(3, [](Communicator& c) {
    const int next = (c.rank() + 1) % 3, prev = (c.rank() + 2) % 3;
    // Three messages on one tag arrive in order; a self-message works too.
    int64_t a[3] = {c.rank() * 10 + 0, c.rank() * 10 + 1, c.rank() * 10 + 2};
    int64_t b[3] = {-1, -1, -1}, self = -1, self_in = 42;
    std::vector<CommRequest> reqs;
    for (int i = 0; i < 3; ++i) {
      FP8MOE_ASSIGN_OR_RETURN(CommRequest r, c.IRecv(&b[i], 8, prev, 5));
      reqs.push_back(r);
    }
    for (int i = 0; i < 3; ++i) {
      FP8MOE_ASSIGN_OR_RETURN(CommRequest r, c.ISend(&a[i], 8, next, 5));
      reqs.push_back(r);
    }
    FP8MOE_RETURN_IF_ERROR(c.Send(&self_in, 8, c.rank(), 7));
    FP8MOE_RETURN_IF_ERROR(c.Recv(&self, 8, c.rank(), 7));
    FP8MOE_RETURN_IF_ERROR(c.WaitAll(reqs));
    for (int i = 0; i < 3; ++i) {
      if (b[i] != prev * 10 + i) return Internal("message " + std::to_string(i) + " out of order");
    }
    if (self != 42) return Internal("self message lost");
    for (const CommRequest& r : reqs) {
      if (r.handle != 0) return Internal("WaitAll did not reset a request");
    }
    // A receive of the wrong size is an error, not a silent truncation.
    int32_t small = 0;
    if (c.rank() == 0) FP8MOE_RETURN_IF_ERROR(c.Send(&a[0], 8, 1, 9));
    if (c.rank() == 1) {
      const Status s = c.Recv(&small, 4, 0, 9);
      if (s.ok() || s.message().find("8 bytes") == std::string::npos) {
        return Internal("size mismatch not reported: " + s.ToString());
      }
    }
    return c.Barrier();
  });
}

TEST(Ring, BadArgumentsAreClearErrors) {
  RunOk(2, [](Communicator& c) {
    uint8_t buf[16] = {};
    const Status u8sum = c.AllReduce(buf, buf, 4, DType::kU8, ReduceOp::kSum);
    if (u8sum.code() != StatusCode::kInvalidArgument ||
        u8sum.message().find("sum of uint8 is not supported") == std::string::npos) {
      return Internal("u8 sum: " + u8sum.ToString());
    }
    if (c.AllGather(buf, buf, -1, DType::kU8).ok()) return Internal("negative count accepted");
    if (c.ISend(buf, 1, 2, 0).ok()) return Internal("peer 2 of 2 accepted");
    if (c.ISend(buf, 1, 0, kMaxUserTag).ok()) return Internal("reserved tag accepted");
    if (c.AllGather(nullptr, buf, 1, DType::kU8).ok()) return Internal("null send accepted");
    return OkStatus();
  });
}

// Split: groups by color, ranked by (key, rank); collectives stay inside.
TEST(Ring, SplitFormsGroups) {
  const int p = 7;
  std::vector<int> sizes(p), ranks(p);
  std::vector<int64_t> sums(p), inner(p);
  RunOk(p, [&](Communicator& c) {
    // Colors 0 (even ranks) and 1 (odd); key reverses the order.
    FP8MOE_ASSIGN_OR_RETURN(auto g, c.Split(c.rank() % 2, -c.rank()));
    sizes[c.rank()] = g->size();
    ranks[c.rank()] = g->rank();
    int64_t x = c.rank(), sum = 0;
    FP8MOE_RETURN_IF_ERROR(g->AllReduce(&x, &sum, 1, DType::kI64, ReduceOp::kSum));
    sums[c.rank()] = sum;
    // A split of a split, then the parent still works.
    FP8MOE_ASSIGN_OR_RETURN(auto h, g->Split(0, g->rank()));
    int64_t one = 1;
    FP8MOE_RETURN_IF_ERROR(h->AllReduce(&one, &inner[c.rank()], 1, DType::kI64, ReduceOp::kSum));
    return c.Barrier();
  });
  for (int r = 0; r < p; ++r) {
    const int group_size = r % 2 == 0 ? 4 : 3;
    EXPECT_EQ(sizes[r], group_size) << r;
    EXPECT_EQ(sums[r], r % 2 == 0 ? 0 + 2 + 4 + 6 : 1 + 3 + 5) << r;
    EXPECT_EQ(inner[r], group_size) << r;
  }
  // Reversed keys: the highest parent rank is rank 0 of its group.
  EXPECT_EQ(ranks[6], 0);
  EXPECT_EQ(ranks[0], 3);
  EXPECT_EQ(ranks[5], 0);
  EXPECT_EQ(ranks[1], 2);
  // A negative color is an error on every rank.
  const Status bad = RunThreadRanks(2, [](Communicator& c) -> Status {
    return c.Split(c.rank() == 1 ? -1 : 0, 0).status();
  });
  EXPECT_NE(bad.message().find("rank 1 passed color -1"), std::string::npos) << bad.ToString();
}

// A rank that leaves early makes its peers fail after the timeout, with a
// message that says so, instead of hanging.
TEST(Ring, AMissingRankTimesOut) {
  CommOptions o;
  o.timeout_seconds = 0.3;
  const Status s = RunThreadRanks(3, [](Communicator& c) -> Status {
    if (c.rank() == 1) return Internal("rank 1 gave up");
    float x[3] = {1, 2, 3}, y[3];
    return c.AllReduce(x, y, 3, DType::kF32, ReduceOp::kSum);
  }, o);
  ASSERT_FALSE(s.ok());
  // Rank 0's error comes first: its wait timed out.
  EXPECT_NE(s.message().find("did not complete within"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("rank 0/3"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace fp8moe
