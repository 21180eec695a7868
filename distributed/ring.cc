#include "distributed/ring.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "distributed/reduce.h"

namespace fp8moe::internal {
namespace {

using Blocks = CommunicatorAccess::Blocks;

int Mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// Block b's first half (ceil(count / 2) elements at offsets[b]) travels up,
// the rest down. On two ranks up and down are the same peer, so the whole
// block goes as one message (the reduction order is the same either way:
// the other rank's value, then our own).
int64_t FirstHalf(const Blocks& blocks, int b) {
  return blocks.counts.size() == 2 ? blocks.counts[b] : (blocks.counts[b] + 1) / 2;
}
int64_t SecondHalf(const Blocks& blocks, int b) {
  return blocks.counts[b] - FirstHalf(blocks, b);
}

// Pending requests of a collective, waited for all at once or by index.
class Requests {
 public:
  explicit Requests(Communicator& comm, size_t capacity) : comm_(comm) {
    reqs_.reserve(capacity);
  }
  // Posts a send / receive; returns its index, or -1 for an empty message
  // (both ends know the size, so none is sent).
  Result<int> Send(const void* buf, int64_t bytes, int peer, int tag) {
    if (bytes == 0) return -1;
    FP8MOE_ASSIGN_OR_RETURN(CommRequest r, CommunicatorAccess::ISend(comm_, buf, bytes, peer, tag));
    reqs_.push_back(r);
    return static_cast<int>(reqs_.size() - 1);
  }
  Result<int> Recv(void* buf, int64_t bytes, int peer, int tag) {
    if (bytes == 0) return -1;
    FP8MOE_ASSIGN_OR_RETURN(CommRequest r, CommunicatorAccess::IRecv(comm_, buf, bytes, peer, tag));
    reqs_.push_back(r);
    return static_cast<int>(reqs_.size() - 1);
  }
  // Waits for requests a and b (-1: none).
  Status Wait(int a, int b) {
    CommRequest pick[2];
    size_t n = 0;
    if (a >= 0) pick[n++] = reqs_[a];
    if (b >= 0) pick[n++] = reqs_[b];
    if (a >= 0) reqs_[a] = {};
    if (b >= 0) reqs_[b] = {};
    return CommunicatorAccess::WaitAll(comm_, std::span(pick, n));
  }
  Status WaitAll() {
    const Status s = CommunicatorAccess::WaitAll(comm_, reqs_);
    reqs_.clear();
    return s;
  }

 private:
  Communicator& comm_;
  std::vector<CommRequest> reqs_;
};

}  // namespace

Blocks ShardBlocks(int64_t total, int size) {
  Blocks b;
  b.total = total;
  b.counts.resize(size);
  b.offsets.resize(size);
  for (int r = 0; r < size; ++r) {
    const ShardRange range = GetShardRange(total, size, r);
    b.counts[r] = range.size();
    b.offsets[r] = range.begin;
  }
  b.equal = total % size == 0;
  return b;
}

Blocks EqualBlocks(int64_t count, int size) {
  Blocks b;
  b.total = count * size;
  b.counts.assign(size, count);
  b.offsets.resize(size);
  for (int r = 0; r < size; ++r) b.offsets[r] = count * r;
  b.equal = true;
  return b;
}

Status RingAllGather(Communicator& comm, const void* send, void* recv,
                     const Blocks& blocks, DType dtype) {
  const int p = comm.size(), me = comm.rank();
  const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
  uint8_t* out = static_cast<uint8_t*>(recv);
  auto at = [&](int b, int64_t within) { return out + (blocks.offsets[b] + within) * elem; };
  const bool in_place = send == at(me, 0);
  auto copy_own = [&] {
    if (blocks.counts[me] > 0 && !in_place) {
      std::memcpy(at(me, 0), send, static_cast<size_t>(blocks.counts[me] * elem));
    }
  };
  if (p == 1) {
    copy_own();
    return OkStatus();
  }
  // Every receive is posted first, straight into its place in the output, so
  // no message ever waits unexpected; step s then only waits for the two
  // halves it forwards (those that arrived at step s - 1), never for its own
  // earlier sends.
  const int up = Mod(me + 1, p), down = Mod(me - 1, p);
  Requests reqs(comm, static_cast<size_t>(4 * (p - 1)));
  std::vector<int> up_recv(p - 1), dn_recv(p - 1);
  for (int s = 0; s + 1 < p; ++s) {
    const int ub = Mod(me - s - 1, p), db = Mod(me + s + 1, p);
    FP8MOE_ASSIGN_OR_RETURN(up_recv[s], reqs.Recv(at(ub, 0), FirstHalf(blocks, ub) * elem, down,
                                                  kTagRingUp));
    FP8MOE_ASSIGN_OR_RETURN(dn_recv[s], reqs.Recv(at(db, FirstHalf(blocks, db)),
                                                  SecondHalf(blocks, db) * elem, up,
                                                  kTagRingDown));
  }
  // Step 0 sends our own block straight from `send` and only then copies it
  // into the output: the peers read it while we copy, and they read memory
  // we have not just written (reading lines dirty in another core's cache
  // made a 1 MiB two-rank all-gather twice as slow, measured).
  const uint8_t* own = static_cast<const uint8_t*>(send);
  FP8MOE_RETURN_IF_ERROR(
      reqs.Send(own, FirstHalf(blocks, me) * elem, up, kTagRingUp).status());
  FP8MOE_RETURN_IF_ERROR(reqs.Send(own + FirstHalf(blocks, me) * elem,
                                   SecondHalf(blocks, me) * elem, down, kTagRingDown)
                             .status());
  copy_own();
  for (int s = 1; s + 1 < p; ++s) {
    FP8MOE_RETURN_IF_ERROR(reqs.Wait(up_recv[s - 1], dn_recv[s - 1]));
    // Upward ring (first halves): forward the block that arrived last step;
    // downward ring (second halves) likewise.
    const int ub = Mod(me - s, p), db = Mod(me + s, p);
    FP8MOE_RETURN_IF_ERROR(reqs.Send(at(ub, 0), FirstHalf(blocks, ub) * elem, up, kTagRingUp)
                               .status());
    FP8MOE_RETURN_IF_ERROR(reqs.Send(at(db, FirstHalf(blocks, db)), SecondHalf(blocks, db) * elem,
                                     down, kTagRingDown)
                               .status());
  }
  return reqs.WaitAll();
}

Status RingReduceScatter(Communicator& comm, const void* send, void* recv,
                         const Blocks& blocks, DType dtype, ReduceOp op,
                         RingScratch& scratch) {
  const int p = comm.size(), me = comm.rank();
  const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
  const uint8_t* in = static_cast<const uint8_t*>(send);
  uint8_t* out = static_cast<uint8_t*>(recv);
  auto input = [&](int b, int64_t within) { return in + (blocks.offsets[b] + within) * elem; };
  if (p == 1) {
    if (blocks.counts[0] > 0) {
      std::memcpy(out, in, static_cast<size_t>(blocks.counts[0] * elem));
    }
    return OkStatus();
  }
  // Partial sums in flight: two buffers per direction, alternating by step,
  // so the one being sent is never the one being received into.
  int64_t half_max = 0;
  for (int b = 0; b < p; ++b) half_max = std::max(half_max, FirstHalf(blocks, b));
  std::array<std::array<uint8_t*, 2>, 2> partial{};
  for (int d = 0; d < 2; ++d) {
    for (int k = 0; k < 2; ++k) {
      partial[d][k] = scratch.partial[d][k].Get(static_cast<size_t>(std::max<int64_t>(
          half_max * elem, 1)));
      if (partial[d][k] == nullptr) {
        return ResourceExhausted("ring reduce-scatter: out of memory for " +
                                 std::to_string(half_max * elem) + " bytes of scratch");
      }
    }
  }
  const int up = Mod(me + 1, p), down = Mod(me - 1, p);
  // Step s: send the partial of block me-s-1 up (and me+s+1 down), receive
  // the partial of block me-s-2 from below (me+s+2 from above) into
  // partial[.][(s + 1) % 2], add our own contribution, send that next step.
  // The next step's receives are posted before the adds, so a neighbour that
  // finishes its adds first can send at once.
  Requests reqs(comm, 4);
  auto post_recvs = [&](int s, int* r_up, int* r_dn) -> Status {
    const int ub = Mod(me - s - 2, p), db = Mod(me + s + 2, p);
    FP8MOE_ASSIGN_OR_RETURN(*r_up, reqs.Recv(partial[0][(s + 1) % 2],
                                             FirstHalf(blocks, ub) * elem, down, kTagRingUp));
    FP8MOE_ASSIGN_OR_RETURN(*r_dn, reqs.Recv(partial[1][(s + 1) % 2],
                                             SecondHalf(blocks, db) * elem, up, kTagRingDown));
    return OkStatus();
  };
  int r_up = -1, r_dn = -1;
  FP8MOE_RETURN_IF_ERROR(post_recvs(0, &r_up, &r_dn));
  for (int s = 0; s + 1 < p; ++s) {
    const int up_send = Mod(me - s - 1, p), up_recv = Mod(me - s - 2, p);
    const int dn_send = Mod(me + s + 1, p), dn_recv = Mod(me + s + 2, p);
    const void* up_out = s == 0 ? input(up_send, 0) : partial[0][s % 2];
    const void* dn_out =
        s == 0 ? input(dn_send, FirstHalf(blocks, dn_send)) : partial[1][s % 2];
    FP8MOE_RETURN_IF_ERROR(
        reqs.Send(up_out, FirstHalf(blocks, up_send) * elem, up, kTagRingUp).status());
    FP8MOE_RETURN_IF_ERROR(
        reqs.Send(dn_out, SecondHalf(blocks, dn_send) * elem, down, kTagRingDown).status());
    // All four: the receives carry this step's partials, and the sends must
    // be done before their buffers take the next step's receives.
    FP8MOE_RETURN_IF_ERROR(reqs.WaitAll());
    const bool last = s + 2 == p;
    if (!last) FP8MOE_RETURN_IF_ERROR(post_recvs(s + 1, &r_up, &r_dn));
    // Add this rank's contribution; on the last step the block is our own
    // and the sum goes to the output.
    uint8_t* const up_in = partial[0][(s + 1) % 2];
    uint8_t* const dn_in = partial[1][(s + 1) % 2];
    Combine(dtype, op, up_in, input(up_recv, 0), last ? out : up_in,
            FirstHalf(blocks, up_recv));
    Combine(dtype, op, dn_in, input(dn_recv, FirstHalf(blocks, dn_recv)),
            last ? out + FirstHalf(blocks, me) * elem : dn_in, SecondHalf(blocks, dn_recv));
  }
  return OkStatus();
}

Status RingAllReduce(Communicator& comm, const void* send, void* recv, int64_t count,
                     DType dtype, ReduceOp op, RingScratch& scratch) {
  const Blocks blocks = ShardBlocks(count, comm.size());
  const int64_t mine = blocks.counts[comm.rank()];
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(mine, 1)) * DTypeSize(dtype);
  uint8_t* shard = scratch.shard.Get(bytes);
  if (shard == nullptr) {
    return ResourceExhausted("ring all-reduce: out of memory for " + std::to_string(bytes) +
                             " bytes of scratch");
  }
  FP8MOE_RETURN_IF_ERROR(RingReduceScatter(comm, send, shard, blocks, dtype, op, scratch));
  return RingAllGather(comm, shard, recv, blocks, dtype);
}

}  // namespace fp8moe::internal
