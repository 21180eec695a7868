// The Communicator's argument checks (one place for every implementation)
// and the shard rule.
#include "fp8moe/communicator.h"

#include <climits>
#include <cstdlib>
#include <string>

#include "distributed/reduce.h"
#include "distributed/ring.h"
#include "fp8moe/mpi.h"

namespace fp8moe {
namespace {

// MPI counts are ints: one block (the largest message of any algorithm) must
// fit, in bytes, so the byte-counted transports can carry it.
constexpr int64_t kMaxBlockBytes = INT_MAX;

std::string N(int64_t v) { return std::to_string(v); }

Status CheckCount(const char* what, const char* name, int64_t v) {
  if (v < 0) {
    return InvalidArgument(std::string(what) + ": " + name + " = " + N(v) + " is negative");
  }
  return OkStatus();
}

Status CheckBlockBytes(const char* what, int64_t block, DType dtype) {
  const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
  if (block > kMaxBlockBytes / elem) {
    return InvalidArgument(std::string(what) + ": one rank's block of " + N(block) + " " +
                           std::string(DTypeName(dtype)) + " elements exceeds " +
                           N(kMaxBlockBytes) +
                           " bytes (MPI's int count); split the collective into parts");
  }
  return OkStatus();
}

Status CheckReduction(const char* what, DType dtype, ReduceOp op) {
  if (!internal::IsSupportedReduction(dtype, op)) {
    return InvalidArgument(std::string(what) + ": " + std::string(ReduceOpName(op)) + " of " +
                           std::string(DTypeName(dtype)) + " is not supported (supported: " +
                           internal::SupportedReductions() + ")");
  }
  return OkStatus();
}

Status CheckBuffer(const char* what, const char* name, const void* p, int64_t n) {
  if (n > 0 && p == nullptr) {
    return InvalidArgument(std::string(what) + ": " + name + " is null");
  }
  return OkStatus();
}

}  // namespace

std::string_view ReduceOpName(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : "max";
}

std::string_view CollectiveAlgorithmName(CollectiveAlgorithm algorithm) {
  return algorithm == CollectiveAlgorithm::kRing ? "ring" : "mpi";
}

ShardRange GetShardRange(int64_t total, int parts, int index) {
  if (total <= 0 || parts <= 0 || index < 0 || index >= parts) return {};
  const int64_t base = total / parts, extra = total % parts;
  const int64_t begin = index * base + std::min<int64_t>(index, extra);
  return {begin, begin + base + (index < extra ? 1 : 0)};
}

Status Communicator::AllGather(const void* send, void* recv, int64_t count, DType dtype) {
  FP8MOE_RETURN_IF_ERROR(CheckCount("all-gather", "count", count));
  FP8MOE_RETURN_IF_ERROR(CheckBlockBytes("all-gather", count, dtype));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-gather", "send", send, count));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-gather", "recv", recv, count));
  return DoAllGather(send, recv, internal::EqualBlocks(count, size_), dtype);
}

Status Communicator::AllGatherShards(const void* shard, void* full, int64_t total,
                                     DType dtype) {
  FP8MOE_RETURN_IF_ERROR(CheckCount("all-gather", "total", total));
  const ShardRange mine = GetShardRange(total, size_, rank_);
  FP8MOE_RETURN_IF_ERROR(CheckBlockBytes("all-gather", GetShardRange(total, size_, 0).size(),
                                         dtype));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-gather", "shard", shard, mine.size()));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-gather", "full", full, total));
  return DoAllGather(shard, full, internal::ShardBlocks(total, size_), dtype);
}

Status Communicator::ReduceScatter(const void* send, void* recv, int64_t count, DType dtype,
                                   ReduceOp op) {
  FP8MOE_RETURN_IF_ERROR(CheckCount("reduce-scatter", "count", count));
  FP8MOE_RETURN_IF_ERROR(CheckReduction("reduce-scatter", dtype, op));
  FP8MOE_RETURN_IF_ERROR(CheckBlockBytes("reduce-scatter", count, dtype));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter", "send", send, count));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter", "recv", recv, count));
  return DoReduceScatter(send, recv, internal::EqualBlocks(count, size_), dtype, op);
}

Status Communicator::ReduceScatterShards(const void* full, void* shard, int64_t total,
                                         DType dtype, ReduceOp op) {
  FP8MOE_RETURN_IF_ERROR(CheckCount("reduce-scatter", "total", total));
  FP8MOE_RETURN_IF_ERROR(CheckReduction("reduce-scatter", dtype, op));
  FP8MOE_RETURN_IF_ERROR(CheckBlockBytes("reduce-scatter",
                                         GetShardRange(total, size_, 0).size(), dtype));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter", "full", full, total));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter", "shard", shard,
                                     GetShardRange(total, size_, rank_).size()));
  return DoReduceScatter(full, shard, internal::ShardBlocks(total, size_), dtype, op);
}

Status Communicator::AllReduce(const void* send, void* recv, int64_t count, DType dtype,
                               ReduceOp op) {
  FP8MOE_RETURN_IF_ERROR(CheckCount("all-reduce", "count", count));
  FP8MOE_RETURN_IF_ERROR(CheckReduction("all-reduce", dtype, op));
  FP8MOE_RETURN_IF_ERROR(CheckBlockBytes("all-reduce", count, dtype));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-reduce", "send", send, count));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("all-reduce", "recv", recv, count));
  return DoAllReduce(send, recv, count, dtype, op);
}

Status Communicator::Barrier() { return DoBarrier(); }

Result<std::unique_ptr<Communicator>> Communicator::Split(int color, int key) {
  // Every rank learns every (color, key) first, so a bad color is an error
  // on every rank alike, and the thread ranks can form their groups.
  const int64_t mine[2] = {color, key};
  std::vector<int64_t> all(static_cast<size_t>(2 * size_));
  FP8MOE_RETURN_IF_ERROR(AllGather(mine, all.data(), 2, DType::kI64));
  std::vector<int64_t> colors(size_), keys(size_);
  for (int r = 0; r < size_; ++r) {
    colors[r] = all[2 * r];
    keys[r] = all[2 * r + 1];
    if (colors[r] < 0) {
      return InvalidArgument("split: rank " + N(r) + " passed color " + N(colors[r]) +
                             "; colors must be >= 0");
    }
  }
  return DoSplit(color, key, colors, keys);
}

Status Communicator::CheckPeer(int peer, int tag, int64_t bytes, const char* what) const {
  if (peer < 0 || peer >= size_) {
    return InvalidArgument(std::string(what) + ": peer rank " + N(peer) +
                           " is outside [0, " + N(size_) + ")");
  }
  if (tag < 0 || tag >= kMaxUserTag) {
    return InvalidArgument(std::string(what) + ": tag " + N(tag) + " is outside [0, " +
                           N(kMaxUserTag) + ") (tags above are the collectives')");
  }
  if (bytes < 0 || bytes > kMaxBlockBytes) {
    return InvalidArgument(std::string(what) + ": " + N(bytes) +
                           " bytes is outside [0, " + N(kMaxBlockBytes) + "]");
  }
  return OkStatus();
}

Result<CommRequest> Communicator::ISend(const void* buf, int64_t bytes, int peer, int tag) {
  FP8MOE_RETURN_IF_ERROR(CheckPeer(peer, tag, bytes, "send"));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("send", "buffer", buf, bytes));
  CountSent(bytes);
  return DoISend(buf, bytes, peer, tag);
}

Result<CommRequest> Communicator::IRecv(void* buf, int64_t bytes, int peer, int tag) {
  FP8MOE_RETURN_IF_ERROR(CheckPeer(peer, tag, bytes, "receive"));
  FP8MOE_RETURN_IF_ERROR(CheckBuffer("receive", "buffer", buf, bytes));
  return DoIRecv(buf, bytes, peer, tag);
}

Status Communicator::WaitAll(std::span<CommRequest> requests) { return DoWaitAll(requests); }

Status Communicator::Send(const void* buf, int64_t bytes, int peer, int tag) {
  FP8MOE_ASSIGN_OR_RETURN(CommRequest r, ISend(buf, bytes, peer, tag));
  return WaitAll(std::span(&r, 1));
}

Status Communicator::Recv(void* buf, int64_t bytes, int peer, int tag) {
  FP8MOE_ASSIGN_OR_RETURN(CommRequest r, IRecv(buf, bytes, peer, tag));
  return WaitAll(std::span(&r, 1));
}

// Here, in the core library, rather than in fp8moe_mpi: a build without MPI
// asks the same question to refuse a launch by mpirun (cli/world_single.cc).
bool LaunchedByMpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

}  // namespace fp8moe
