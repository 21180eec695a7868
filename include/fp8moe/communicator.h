// Communicator: the ranks of a distributed job and the collectives between
// them (docs/design.md §6, §7.4). Layers above (the trainer, the MoE stages) take a
// Communicator& and never know which implementation runs:
//  - MakeSingleRankCommunicator(): one rank, collectives are copies. Always
//    available, so the library works without MPI.
//  - RunThreadRanks(): N ranks as threads of this process (tests, and N-rank
//    vs 1-rank checks without mpirun; also under AddressSanitizer).
//  - MPI (include/fp8moe/mpi.h, library fp8moe::mpi): one rank per process
//    under mpirun, built when Open MPI is found.
//
// Collectives follow MPI's semantics; every rank calls the same collectives
// in the same order with the same count and dtype. The ring algorithm
// (CollectiveAlgorithm::kRing, the default everywhere) runs on the
// point-to-point calls below: a bidirectional ring in which the first half of
// every rank's block travels to rank+1 and the second half to rank-1, both
// directions at once (docs/distributed.md). Its results are deterministic:
//  - all-gather only moves bytes, so it equals MPI_Allgather(v) bit for bit;
//  - a reduction combines the ranks' contributions in a fixed order, the
//    same on every run: for the block owned by rank j, the first half is
//    ((x[j+1] + x[j+2]) + ...) + x[j] and the second half
//    ((x[j-1] + x[j-2]) + ...) + x[j] (ranks mod size). Integer sums and
//    maxima do not depend on order; neither do f32 or bf16 sums of two ranks
//    (IEEE addition commutes), so those equal MPI_Reduce_scatter bit for bit.
//    For three or more ranks and f32 / bf16 the order is this one, which is
//    not the order Open MPI uses (its order depends on its algorithm choice
//    by message size; docs/distributed.md).
//
// Uneven sizes: a tensor of `total` elements is split over the ranks by
// GetShardRange (numpy.array_split's rule: the first total % size ranks hold one
// element more). The *Shards collectives work on that layout directly, so
// FSDP needs no padding.
#ifndef FP8MOE_COMMUNICATOR_H_
#define FP8MOE_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "fp8moe/dtype.h"
#include "fp8moe/status.h"

namespace fp8moe {

// Supported reductions: sum of f32, bf16 (each addition in f32, rounded to
// bf16 to nearest even), int64 (wrapping); max of uint32, int64. A sum that is
// NaN is the canonical quiet NaN (0x7FC00000; bf16 0x7FC0), whatever the NaN
// inputs were, so the bits never depend on operand order. An f32 amax is
// reduced as the uint32 bits of |x| (order-preserving, NaN largest), exactly
// as quant/ finds an amax.
enum class ReduceOp : uint8_t { kSum, kMax };
std::string_view ReduceOpName(ReduceOp op);  // "sum", "max"

enum class CollectiveAlgorithm : uint8_t {
  kRing,     // the bidirectional ring on point-to-point messages (default)
  kLibrary,  // the MPI library's own collective (MPI only; the reference)
};
std::string_view CollectiveAlgorithmName(CollectiveAlgorithm algorithm);  // "ring", "mpi"

struct CommOptions {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kRing;
  // A rank that waits longer than this in one call (a collective, WaitAll,
  // Barrier) decides a peer died or hangs: MPI ends the whole job with a
  // message on every rank; the thread ranks return an error. <= 0: no limit.
  double timeout_seconds = 600;
};

// Elements [begin, end) of a tensor of `total` elements held by shard
// `index` of `parts`: numpy.array_split's rule.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange GetShardRange(int64_t total, int parts, int index);

// A pending point-to-point operation (opaque; 0 is none).
struct CommRequest {
  uint64_t handle = 0;
};

// Tags available to callers of ISend / IRecv: [0, kMaxUserTag). The ring
// collectives use tags above it.
inline constexpr int kMaxUserTag = 30000;

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "single", "threads" or "mpi".
  virtual std::string_view name() const = 0;
  CollectiveAlgorithm algorithm() const { return algorithm_; }

  // ---- Collectives (every rank, same order, same count and dtype) ----

  // send [count] -> recv [size * count], rank r's block at r * count
  // (MPI_Allgather). send may be recv + rank * count (in place).
  Status AllGather(const void* send, void* recv, int64_t count, DType dtype);
  // shard [GetShardRange(total, size, rank).size()] -> full [total]
  // (MPI_Allgatherv). shard may be full + range.begin (in place).
  Status AllGatherShards(const void* shard, void* full, int64_t total, DType dtype);
  // send [size * count] -> recv [count]: op over the ranks of block `rank`
  // (MPI_Reduce_scatter_block). send and recv must not overlap.
  Status ReduceScatter(const void* send, void* recv, int64_t count, DType dtype,
                       ReduceOp op);
  // full [total] -> shard [GetShardRange(total, size, rank).size()]: op over
  // the ranks of this rank's range (MPI_Reduce_scatter). No overlap.
  Status ReduceScatterShards(const void* full, void* shard, int64_t total, DType dtype,
                             ReduceOp op);
  // send [count] -> recv [count] = op over the ranks (MPI_Allreduce); every
  // rank gets the same bits. send may equal recv. The ring runs a sharded
  // reduce-scatter then an all-gather.
  Status AllReduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op);
  Status Barrier();

  // ---- Point-to-point ----
  // Non-blocking send / receive of `bytes` bytes to / from rank `peer` with
  // `tag` in [0, kMaxUserTag). Messages between two ranks with the same tag
  // arrive in the order sent (MPI's rule); a receive must name the exact
  // size of its message. Buffers stay untouched until WaitAll returns.
  Result<CommRequest> ISend(const void* buf, int64_t bytes, int peer, int tag);
  Result<CommRequest> IRecv(void* buf, int64_t bytes, int peer, int tag);
  // Waits for all `requests` and resets them to none.
  Status WaitAll(std::span<CommRequest> requests);
  Status Send(const void* buf, int64_t bytes, int peer, int tag);
  Status Recv(void* buf, int64_t bytes, int peer, int tag);

  // ---- Groups ----
  // A communicator over the ranks that pass the same `color` (>= 0), ranked
  // by (key, rank here) (MPI_Comm_split). Collective: every rank calls it,
  // in the same order. The trainer's FSDP groups and expert rings are splits
  // of the world (docs/distributed.md). Same algorithm and timeout.
  Result<std::unique_ptr<Communicator>> Split(int color, int key);

  // Ends the whole job: prints "fp8moe rank R/N: MESSAGE" to stderr and
  // exits every rank with `exit_code` (MPI_Abort under MPI).
  [[noreturn]] virtual void Abort(int exit_code, std::string_view message) = 0;

  // Bytes this rank has handed to the transport since it was created: every
  // point-to-point send, the ring's included. For the library's own
  // collectives (kLibrary) the bytes a bandwidth-optimal algorithm sends are
  // counted ((size - 1) blocks per all-gather or reduce-scatter).
  int64_t bytes_sent() const { return bytes_sent_; }

 protected:
  Communicator(int rank, int size, CollectiveAlgorithm algorithm)
      : rank_(rank), size_(size), algorithm_(algorithm) {}

  // Element counts and offsets of each rank's block, in elements.
  struct Blocks {
    std::vector<int64_t> counts, offsets;
    int64_t total = 0;
    bool equal = false;  // every block has counts[0] elements
  };

  // The implementations; arguments are already checked.
  virtual Status DoAllGather(const void* send, void* recv, const Blocks& blocks,
                             DType dtype) = 0;
  virtual Status DoReduceScatter(const void* send, void* recv, const Blocks& blocks,
                                 DType dtype, ReduceOp op) = 0;
  virtual Status DoAllReduce(const void* send, void* recv, int64_t count, DType dtype,
                             ReduceOp op) = 0;
  virtual Status DoBarrier() = 0;
  virtual Result<CommRequest> DoISend(const void* buf, int64_t bytes, int peer, int tag) = 0;
  virtual Result<CommRequest> DoIRecv(void* buf, int64_t bytes, int peer, int tag) = 0;
  virtual Status DoWaitAll(std::span<CommRequest> requests) = 0;
  // colors / keys: every rank's, gathered by Split.
  virtual Result<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                        const std::vector<int64_t>& colors,
                                                        const std::vector<int64_t>& keys) = 0;

  void CountSent(int64_t bytes) { bytes_sent_ += bytes; }

 private:
  friend struct CommunicatorAccess;  // the ring (distributed/ring.cc) sends on reserved tags
  Status CheckPeer(int peer, int tag, int64_t bytes, const char* what) const;

  int rank_;
  int size_;
  CollectiveAlgorithm algorithm_;
  int64_t bytes_sent_ = 0;
};

// One rank; collectives copy, point-to-point calls are errors (there is no
// peer), Abort exits the process.
std::unique_ptr<Communicator> MakeSingleRankCommunicator();

// Runs body(comm) on `ranks` threads, each with its own Communicator of a
// group of `ranks` in-process ranks (messages are copied between threads;
// collectives use the ring; options.algorithm must be kRing). Returns the
// first error by rank order, or ok. A rank whose body returns early leaves
// its peers waiting: their waits fail after options.timeout_seconds (<= 0:
// they wait forever).
Status RunThreadRanks(int ranks, const std::function<Status(Communicator&)>& body,
                      const CommOptions& options = {});

}  // namespace fp8moe

#endif  // FP8MOE_COMMUNICATOR_H_
