#include "dist/ring.h"

#include <array>
#include <cstring>
#include <string>

#include "dist/reduce.h"

namespace fp8moe::internal {
namespace {

using Blocks = CommunicatorAccess::Blocks;

int Mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// Block b's first half: counts[b] - Second(b) elements at offsets[b].
int64_t FirstHalf(const Blocks& blocks, int b) { return (blocks.counts[b] + 1) / 2; }
int64_t SecondHalf(const Blocks& blocks, int b) {
  return blocks.counts[b] - FirstHalf(blocks, b);
}

// Up to four requests of one ring step (two receives, two sends).
class StepRequests {
 public:
  explicit StepRequests(Communicator& comm) : comm_(comm) {}
  Status Send(const void* buf, int64_t bytes, int peer, int tag) {
    if (bytes == 0) return OkStatus();  // both ends know the size: no message
    FP8MOE_ASSIGN_OR_RETURN(reqs_[n_++],
                            CommunicatorAccess::ISend(comm_, buf, bytes, peer, tag));
    return OkStatus();
  }
  Status Recv(void* buf, int64_t bytes, int peer, int tag) {
    if (bytes == 0) return OkStatus();
    FP8MOE_ASSIGN_OR_RETURN(reqs_[n_++],
                            CommunicatorAccess::IRecv(comm_, buf, bytes, peer, tag));
    return OkStatus();
  }
  Status Wait() {
    const Status s = CommunicatorAccess::WaitAll(comm_, std::span(reqs_.data(), n_));
    n_ = 0;
    return s;
  }

 private:
  Communicator& comm_;
  std::array<CommRequest, 4> reqs_{};
  size_t n_ = 0;
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
  if (blocks.counts[me] > 0 && send != at(me, 0)) {
    std::memcpy(at(me, 0), send, static_cast<size_t>(blocks.counts[me] * elem));
  }
  const int up = Mod(me + 1, p), down = Mod(me - 1, p);
  StepRequests step(comm);
  for (int s = 0; s + 1 < p; ++s) {
    // Upward ring (first halves): forward the block that arrived last step.
    const int up_send = Mod(me - s, p), up_recv = Mod(me - s - 1, p);
    FP8MOE_RETURN_IF_ERROR(step.Recv(at(up_recv, 0), FirstHalf(blocks, up_recv) * elem,
                                     down, kTagRingUp));
    // Downward ring (second halves).
    const int dn_send = Mod(me + s, p), dn_recv = Mod(me + s + 1, p);
    FP8MOE_RETURN_IF_ERROR(step.Recv(at(dn_recv, FirstHalf(blocks, dn_recv)),
                                     SecondHalf(blocks, dn_recv) * elem, up, kTagRingDown));
    FP8MOE_RETURN_IF_ERROR(
        step.Send(at(up_send, 0), FirstHalf(blocks, up_send) * elem, up, kTagRingUp));
    FP8MOE_RETURN_IF_ERROR(step.Send(at(dn_send, FirstHalf(blocks, dn_send)),
                                     SecondHalf(blocks, dn_send) * elem, down,
                                     kTagRingDown));
    FP8MOE_RETURN_IF_ERROR(step.Wait());
  }
  return OkStatus();
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
  StepRequests step(comm);
  for (int s = 0; s + 1 < p; ++s) {
    uint8_t* const up_in = partial[0][(s + 1) % 2];
    uint8_t* const dn_in = partial[1][(s + 1) % 2];
    // Upward ring (first halves): block me-s-1's partial goes up; block
    // me-s-2's partial arrives from below.
    const int up_send = Mod(me - s - 1, p), up_recv = Mod(me - s - 2, p);
    const int dn_send = Mod(me + s + 1, p), dn_recv = Mod(me + s + 2, p);
    const int64_t up_recv_n = FirstHalf(blocks, up_recv);
    const int64_t dn_recv_n = SecondHalf(blocks, dn_recv);
    FP8MOE_RETURN_IF_ERROR(step.Recv(up_in, up_recv_n * elem, down, kTagRingUp));
    FP8MOE_RETURN_IF_ERROR(step.Recv(dn_in, dn_recv_n * elem, up, kTagRingDown));
    const void* up_out = s == 0 ? input(up_send, 0) : partial[0][s % 2];
    const void* dn_out =
        s == 0 ? input(dn_send, FirstHalf(blocks, dn_send)) : partial[1][s % 2];
    FP8MOE_RETURN_IF_ERROR(
        step.Send(up_out, FirstHalf(blocks, up_send) * elem, up, kTagRingUp));
    FP8MOE_RETURN_IF_ERROR(
        step.Send(dn_out, SecondHalf(blocks, dn_send) * elem, down, kTagRingDown));
    FP8MOE_RETURN_IF_ERROR(step.Wait());
    // Add this rank's contribution; on the last step the block is our own
    // and the sum goes to the output.
    const bool last = s + 2 == p;
    Combine(dtype, op, up_in, input(up_recv, 0), last ? out : up_in, up_recv_n);
    Combine(dtype, op, dn_in, input(dn_recv, FirstHalf(blocks, dn_recv)),
            last ? out + FirstHalf(blocks, me) * elem : dn_in, dn_recv_n);
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
