// The bidirectional ring collectives on a Communicator's point-to-point
// calls. Every rank's block is cut in two halves (the first ceil(count / 2)
// elements and the rest); the first halves travel around the ring towards
// rank + 1, the second halves towards rank - 1, both at once, so each link
// carries traffic both ways and every rank sends and receives (size - 1)
// blocks in size - 1 steps. Reductions combine in the order communicator.h
// states; distributed/reduce.h has its reference.
#ifndef FP8MOE_DISTRIBUTED_RING_H_
#define FP8MOE_DISTRIBUTED_RING_H_

#include <span>

#include "base/scratch_arena.h"
#include "fp8moe/communicator.h"

namespace fp8moe {

// The ring's door into Communicator: point-to-point on the reserved tags
// (counted in bytes_sent) and the Blocks layout type.
struct CommunicatorAccess {
  using Blocks = Communicator::Blocks;
  static Result<CommRequest> ISend(Communicator& comm, const void* buf, int64_t bytes,
                                   int peer, int tag) {
    comm.CountSent(bytes);
    return comm.DoISend(buf, bytes, peer, tag);
  }
  static Result<CommRequest> IRecv(Communicator& comm, void* buf, int64_t bytes, int peer,
                                   int tag) {
    return comm.DoIRecv(buf, bytes, peer, tag);
  }
  static Status WaitAll(Communicator& comm, std::span<CommRequest> requests) {
    return comm.DoWaitAll(requests);
  }
  static void CountSent(Communicator& comm, int64_t bytes) { comm.CountSent(bytes); }
  static Status ReduceScatter(Communicator& comm, const void* send, void* recv,
                              const Blocks& blocks, DType dtype, ReduceOp op) {
    return comm.DoReduceScatter(send, recv, blocks, dtype, op);
  }
  static Status AllGather(Communicator& comm, const void* send, void* recv,
                          const Blocks& blocks, DType dtype) {
    return comm.DoAllGather(send, recv, blocks, dtype);
  }
};

namespace internal {

// Reserved tags of the two directions (above kMaxUserTag, below MPI's
// guaranteed MPI_TAG_UB of 32767).
inline constexpr int kTagRingUp = kMaxUserTag + 1;    // towards rank + 1
inline constexpr int kTagRingDown = kMaxUserTag + 2;  // towards rank - 1

// The blocks of `total` elements split by GetShardRange, or `size` blocks of
// `count` elements.
CommunicatorAccess::Blocks ShardBlocks(int64_t total, int size);
CommunicatorAccess::Blocks EqualBlocks(int64_t count, int size);

// Grow-only buffers a communicator keeps for its reductions.
struct RingScratch {
  internal::GrowBuffer partial[2][2];  // [direction][step parity]
  internal::GrowBuffer shard;          // all-reduce: this rank's reduced shard
};

// send [blocks.counts[rank]] -> recv [blocks.total]. send may be
// recv + offsets[rank] (in place).
Status RingAllGather(Communicator& comm, const void* send, void* recv,
                     const CommunicatorAccess::Blocks& blocks, DType dtype);
// send [blocks.total] -> recv [blocks.counts[rank]]; no overlap.
Status RingReduceScatter(Communicator& comm, const void* send, void* recv,
                         const CommunicatorAccess::Blocks& blocks, DType dtype, ReduceOp op,
                         RingScratch& scratch);
// send [count] -> recv [count]: the sharded reduce-scatter, then the
// all-gather of the shards. send may equal recv.
Status RingAllReduce(Communicator& comm, const void* send, void* recv, int64_t count,
                     DType dtype, ReduceOp op, RingScratch& scratch);

}  // namespace internal
}  // namespace fp8moe

#endif  // FP8MOE_DISTRIBUTED_RING_H_
