// `fp8moe bench comm` (under mpirun): the bidirectional ring collectives next
// to MPI's own in one run, and the bytes the trainer's gathers move.
//
// Model, before measuring: on one machine the transport is shared memory, so
// every byte a rank sends is one copy (Open MPI's single-copy CMA: read once
// from the sender, written once into the receiver). An all-gather or a
// reduce-scatter of a payload of N bytes (the gathered output, or the
// reduce-scatter's input) makes each rank send (P - 1) / P * N bytes, which
// no algorithm can beat; all P ranks together copy (P - 1) * N bytes, that is
// 2 (P - 1) N bytes of memory traffic. The reduce-scatter also adds what it
// receives to its own data: 3 more bytes of traffic (two reads, one write)
// per byte received. Floor = traffic / the memcpy bandwidth every rank gets
// at once, measured in the same run (all ranks copy together).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_comm.h"
#include "bench/bench_util.h"
#include "distributed/world.h"
#include "fp8moe/communicator.h"
#include "fp8moe/dist.h"

namespace fp8moe::bench {
namespace {

std::string Bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  return Fixed(b, b < 10 && u > 0 ? 1 : 0) + " " + unit[u];
}

// One timed run of fn on every rank: the slowest rank's seconds.
double TimeOnce(Communicator& comm, const std::function<Status()>& fn, Status* error) {
  if (Status s = comm.Barrier(); !s.ok()) *error = s;
  const double t0 = NowSeconds();
  if (Status s = fn(); !s.ok()) *error = s;
  int64_t ns = static_cast<int64_t>((NowSeconds() - t0) * 1e9), slowest = 0;
  if (Status s = comm.AllReduce(&ns, &slowest, 1, DType::kI64, ReduceOp::kMax); !s.ok()) {
    *error = s;
  }
  return static_cast<double>(slowest) * 1e-9;
}

// Best of `reps` runs after a warm-up.
double TimeCollective(Communicator& comm, int reps, const std::function<Status()>& fn,
                      Status* error) {
  TimeOnce(comm, fn, error);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, TimeOnce(comm, fn, error));
  return best;
}

// Best of `reps` of a and of b, run alternately (a, b, a, b, ...) so drift
// on a shared machine hits both alike.
std::pair<double, double> TimePair(Communicator& comm, int reps, const std::function<Status()>& a,
                                   const std::function<Status()>& b, Status* error) {
  TimeOnce(comm, a, error);
  TimeOnce(comm, b, error);
  double best_a = 1e30, best_b = 1e30;
  for (int r = 0; r < reps; ++r) {
    best_a = std::min(best_a, TimeOnce(comm, a, error));
    best_b = std::min(best_b, TimeOnce(comm, b, error));
  }
  return {best_a, best_b};
}

// memcpy GB/s (read + write) of all ranks copying `bytes` each at once.
double AggregateMemcpyGBs(Communicator& comm, size_t bytes, int reps, Status* error) {
  std::vector<uint8_t> src(std::max<size_t>(bytes, 1), 1), dst(src.size(), 2);
  const double t = TimeCollective(comm, reps, [&] {
    std::memcpy(dst.data(), src.data(), bytes);
    return OkStatus();
  }, error);
  return 2.0 * static_cast<double>(bytes) * comm.size() / t / 1e9;
}

// One payload of the ring-vs-MPI table, f32, `payload` bytes rounded down
// to whole blocks of P ranks: an all-gather and a reduce-scatter on both
// communicators, their results compared bit for bit, then timed alternately,
// each next to its memcpy floor. Rows into t and rows; false (after rank 0
// printed why) when ring and MPI differ.
bool ComparePayload(const BenchOptions& opt, Communicator& ring, Communicator& mpi,
                    int64_t payload, std::mt19937& rng, std::uniform_int_distribution<int>& small,
                    Table* t, nlohmann::json* rows, Status* error) {
  const int p = ring.size();
  const bool print = ring.rank() == 0;
  const int64_t count = std::max<int64_t>(1, payload / 4 / p);  // f32 per rank block
  const int64_t total = count * p;
  const double bytes = static_cast<double>(total) * 4;
  // Integer-valued floats: exact sums, so ring and MPI must agree bit for
  // bit on any number of ranks (checked below, every size).
  std::vector<float> full(static_cast<size_t>(total)), block(static_cast<size_t>(count));
  for (float& v : full) v = static_cast<float>(small(rng));
  for (float& v : block) v = static_cast<float>(small(rng));
  std::vector<float> out_a(full.size()), out_b(full.size());
  std::vector<float> rs_a(block.size()), rs_b(block.size());
  for (const bool gather : {true, false}) {
    const int reps = payload <= (int64_t{1} << 20) ? 4 * opt.reps : opt.reps;
    auto run = [&](Communicator& c) -> Status {
      return gather ? c.AllGather(block.data(), (&c == &ring ? out_a : out_b).data(), count,
                                  DType::kF32)
                    : c.ReduceScatter(full.data(), (&c == &ring ? rs_a : rs_b).data(), count,
                                      DType::kF32, ReduceOp::kSum);
    };
    const int64_t sent0 = ring.bytes_sent();
    if (Status s = run(ring); !s.ok()) *error = s;
    const int64_t sent = ring.bytes_sent() - sent0;
    if (Status s = run(mpi); !s.ok()) *error = s;
    const bool same = gather ? out_a == out_b : rs_a == rs_b;
    int64_t bad = same ? 0 : 1, any_bad = 0;
    if (Status s = ring.AllReduce(&bad, &any_bad, 1, DType::kI64, ReduceOp::kMax); !s.ok()) {
      *error = s;
    }
    if (any_bad != 0) {
      if (print) {
        std::fprintf(stderr, "error: ring and MPI %s differ at %s\n",
                     gather ? "all-gather" : "reduce-scatter", Bytes(bytes).c_str());
      }
      return false;
    }
    const auto [ring_s, mpi_s] = TimePair(ring, reps, [&] { return run(ring); },
                                          [&] { return run(mpi); }, error);
    const double moved = bytes * (p - 1) / p;  // per rank, either algorithm
    const double traffic = (gather ? 2.0 : 5.0) * (p - 1) * bytes;
    // The ceiling of this row: every rank copying `moved` bytes at once
    // (the same working set, so the same caches).
    const double copy_gbs = AggregateMemcpyGBs(ring, static_cast<size_t>(moved), reps, error);
    const double floor_s = traffic / (copy_gbs * 1e9);
    const char* name = gather ? "all-gather" : "reduce-scatter";
    if (p == 1) {  // nothing moves: local copies only
      t->rows.push_back({name, Bytes(bytes), "0 B", "-", "-", Fixed(ring_s * 1e3, 3),
                         Fixed(mpi_s * 1e3, 3), Fixed(ring_s / mpi_s, 2), "-", "-", "-"});
      continue;
    }
    t->rows.push_back({name, Bytes(bytes), Bytes(moved), Fixed(copy_gbs, 1),
                       Fixed(floor_s * 1e3, 3),
                       Fixed(ring_s * 1e3, 3), Fixed(mpi_s * 1e3, 3), Fixed(ring_s / mpi_s, 2),
                       Fixed(ring_s / floor_s, 2), Fixed(moved / ring_s / 1e9, 2),
                       Fixed(moved / mpi_s / 1e9, 2)});
    rows->push_back({{"collective", name}, {"payload_bytes", bytes}, {"sent_per_rank", moved},
                     {"ring_bytes_sent_rank0", sent}, {"floor_seconds", floor_s},
                     {"memcpy_gbs", copy_gbs}, {"ring_seconds", ring_s}, {"mpi_seconds", mpi_s},
                     {"ring_over_mpi", ring_s / mpi_s}});
  }
  return true;
}

// Ring vs MPI, f32 payloads from --min-payload to --max-payload (x4 a row):
// the table, its notes and its JSON rows. False when a payload's results
// differ (ComparePayload).
bool CompareRingWithMpi(const BenchOptions& opt, Communicator& ring, Communicator& mpi,
                        const std::string& world, Table* t, nlohmann::json* rows, Status* error) {
  const int p = ring.size();
  t->title = "fp8moe bench comm: " + world + "; f32 payloads, best of " +
             std::to_string(opt.reps) + " (slowest rank)";
  t->columns = {"collective", "payload", "sent/rank", "memcpy GB/s", "floor ms", "ring ms",
                "mpi ms", "ring/mpi", "ring/floor", "ring GB/s", "mpi GB/s"};
  std::mt19937 rng(77 + ring.rank());
  std::uniform_int_distribution<int> small(-8, 8);
  for (int64_t payload = opt.min_payload; payload <= opt.max_payload; payload *= 4) {
    if (!ComparePayload(opt, ring, mpi, payload, rng, small, t, rows, error)) return false;
  }
  if (p == 1) {
    t->notes.push_back("one rank: nothing moves. Start it as `mpirun -np N fp8moe bench comm` "
                       "(as root: --allow-run-as-root; more ranks than cores: --oversubscribe).");
  }
  t->notes.insert(t->notes.end(), {
      "payload: the gathered output (all-gather) or each rank's input (reduce-scatter), N "
      "bytes, rounded down to whole f32 blocks of P ranks (4 P bytes; at least one "
      "element per rank); every rank sends (P-1)/P*N (sent/rank; ring: counted, matches).",
      "floor: (2 (P-1) N bytes of copies, +3 (P-1) N for the reduce-scatter's adds) / "
      "memcpy GB/s, the rate (read + write) of all " + std::to_string(p) +
          " ranks copying sent/rank bytes at once, measured on each row of this run.",
      "GB/s: sent/rank over time (bus bandwidth). Ring and MPI results compared bit for bit "
      "at every size (integer-valued f32) before timing."});
  return true;
}

// What the trainer's gathers move in one step of one MoE layer (experts 8,
// D 512, F 1024; --tokens per rank), bytes sent per rank: the weights in
// bf16 and as gather8 e4m3fn codes with their scales, the tokens in bf16 and
// as e4m3fn with an f32 scale each. Each gather's bytes, counted by the
// communicator, must equal the library's accounting (dist.h): a mismatch
// is printed and left in *error. Rows into g and grows.
void MeasureGathers(const BenchOptions& opt, Communicator& ring, Table* g, nlohmann::json* grows,
                    Status* error) {
  const int p = ring.size(), me = ring.rank();
  const int64_t e = 8, d = 512, f = 1024, tokens = opt.tokens;
  g->title = "per-step gathers of one MoE layer: experts " + std::to_string(e) + ", D " +
             std::to_string(d) + ", F " + std::to_string(f) + " (wi [E,D,2F] + wo [E,F,D]), " +
             std::to_string(tokens) + " tokens per rank";
  g->columns = {"gather", "bytes sent/rank", "of which scales", "x bf16", "ms"};
  const int64_t wi = e * d * 2 * f, wo = e * f * d;
  std::mt19937 wrng(5);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  const ShardRange swi = GetShardRange(wi, p, me), swo = GetShardRange(wo, p, me);
  std::vector<float> shard_wi(static_cast<size_t>(swi.size())), shard_wo(
      static_cast<size_t>(swo.size()));
  for (float& v : shard_wi) v = nd(wrng);
  for (float& v : shard_wo) v = nd(wrng);
  std::vector<uint16_t> bf16(static_cast<size_t>(wi));
  std::vector<uint8_t> codes(static_cast<size_t>(wi));
  std::vector<float> scales(static_cast<size_t>(e * 2 * f));
  std::vector<float> x(static_cast<size_t>(tokens * d));
  for (float& v : x) v = nd(wrng) * 50;
  std::vector<uint16_t> xb(static_cast<size_t>(tokens * d * p));
  std::vector<uint8_t> xq(static_cast<size_t>(tokens * d * p));
  std::vector<float> xs(static_cast<size_t>(tokens * p));
  DistScratch scratch;
  struct Case {
    const char* name;
    std::function<Status()> run;
  };
  const Case cases[] = {
      {"weights bf16", [&]() -> Status {
         FP8MOE_RETURN_IF_ERROR(GatherBf16Weight(ring, shard_wi.data(), wi, bf16.data()));
         return GatherBf16Weight(ring, shard_wo.data(), wo, bf16.data());
       }},
      {"weights gather8 e4m3fn", [&]() -> Status {
         FP8MOE_RETURN_IF_ERROR(GatherFp8Weight(ring, shard_wi.data(), e, d, 2 * f,
                                                QuantDType::kE4M3FN, Calibration::AbsMax(),
                                                codes.data(), scales.data(), scratch));
         return GatherFp8Weight(ring, shard_wo.data(), e, f, d, QuantDType::kE4M3FN,
                                Calibration::AbsMax(), codes.data(), scales.data(), scratch);
       }},
      {"tokens bf16", [&] { return GatherBf16Tokens(ring, x.data(), tokens, d, xb.data()); }},
      {"tokens e4m3fn + f32 scale", [&] {
         return GatherQuantizedTokens(ring, x.data(), tokens, d, QuantDType::kE4M3FN,
                                      Calibration::AbsMax(), xq.data(), xs.data());
       }},
  };
  const GatherTraffic traffic[] = {
      {Bf16WeightGatherTraffic(p, me, wi).total() + Bf16WeightGatherTraffic(p, me, wo).total(), 0},
      {Fp8WeightGatherTraffic(p, me, e, d, 2 * f, true).payload +
           Fp8WeightGatherTraffic(p, me, e, f, d, true).payload,
       Fp8WeightGatherTraffic(p, me, e, d, 2 * f, true).scales +
           Fp8WeightGatherTraffic(p, me, e, f, d, true).scales},
      Bf16TokenGatherTraffic(p, me, tokens, d),
      QuantizedTokenGatherTraffic(p, me, tokens, d)};
  for (int i = 0; i < 4; ++i) {
    const int64_t before = ring.bytes_sent();
    if (Status s = cases[i].run(); !s.ok()) *error = s;
    const int64_t sent = ring.bytes_sent() - before;
    if (sent != traffic[i].total()) {
      std::fprintf(stderr, "error: rank %d: %s sent %lld bytes, accounting says %lld\n", me,
                   cases[i].name, static_cast<long long>(sent),
                   static_cast<long long>(traffic[i].total()));
      *error = Internal("byte accounting mismatch");
    }
    const double s = TimeCollective(ring, opt.reps, cases[i].run, error);
    const double base = static_cast<double>(traffic[i % 2 == 0 ? i : i - 1].total());
    g->rows.push_back({cases[i].name, std::to_string(traffic[i].total()),
                       std::to_string(traffic[i].scales),
                       base > 0 ? Fixed(traffic[i].total() / base, 4) : "-",
                       Fixed(s * 1e3, 2)});
    grows->push_back({{"gather", cases[i].name}, {"bytes_sent", traffic[i].total()},
                      {"scale_bytes", traffic[i].scales}, {"seconds", s}});
  }
  g->notes = {"bytes: counted by the communicator on rank 0 and equal to the library's "
              "accounting (dist.h). gather8: codes are exactly 0.5x the bf16 bytes; scales = "
              "the amax all-reduce (u32 per channel).",
              "tokens: (d + 4) / (2 d) of bf16 = " + Fixed((d + 4.0) / (2.0 * d), 4) +
                  " (d codes + one f32 scale per token)."};
}

}  // namespace

int BenchComm(const BenchOptions& opt) {
  if (opt.min_payload > opt.max_payload) {
    std::fprintf(stderr, "error: --min-payload %lld is above --max-payload %lld: no payload to "
                 "measure; give a range (each row x4 from the smallest)\n",
                 static_cast<long long>(opt.min_payload), static_cast<long long>(opt.max_payload));
    return 2;
  }
  auto world = StartWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "error: %s\n", world.status().ToString().c_str());
    return 1;
  }
  CommOptions options;
  auto ring_or = (*world)->Open(options);
  options.algorithm = CollectiveAlgorithm::kLibrary;
  auto mpi_or = (*world)->Open(options);
  if (!ring_or.ok() || !mpi_or.ok()) {
    std::fprintf(stderr, "error: %s\n",
                 (ring_or.ok() ? mpi_or.status() : ring_or.status()).ToString().c_str());
    return 1;
  }
  Communicator& ring = **ring_or;
  Communicator& mpi = **mpi_or;
  Status error;
  Table t, g;
  nlohmann::json rows = nlohmann::json::array(), grows = nlohmann::json::array();
  if (!CompareRingWithMpi(opt, ring, mpi, (*world)->Describe(), &t, &rows, &error)) return 1;
  MeasureGathers(opt, ring, &g, &grows, &error);
  if (!error.ok()) {
    std::fprintf(stderr, "error: rank %d: %s\n", ring.rank(), error.ToString().c_str());
    return 1;
  }
  if (ring.rank() == 0) {
    if (opt.json) {
      nlohmann::json j = {{"bench", "comm"}, {"ranks", ring.size()},
                          {"collectives", rows}, {"gathers", grows}};
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      t.Print();
      g.Print();
    }
  }
  return 0;
}

}  // namespace fp8moe::bench
