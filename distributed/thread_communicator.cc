// In-process ranks: a group of Communicators, one per thread, that pass
// messages by copying them under one mutex. MPI's matching rules: receives
// match messages of the same (source, tag) in the order both were posted.
// Sends are eager (the data is copied at ISend), so a send never blocks.
// The single-rank communicator is a group of one.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "distributed/ring.h"
#include "fp8moe/communicator.h"

namespace fp8moe {
namespace {

using Clock = std::chrono::steady_clock;

struct PostedRecv {
  void* buf = nullptr;
  int64_t bytes = 0;
  int source = 0, tag = 0;
  bool done = false;
  Status status;
};

struct Group {
  Group(int n, double timeout) : size(n), timeout_seconds(timeout) {}
  const int size;
  const double timeout_seconds;
  std::mutex mu;
  std::condition_variable cv;
  using Key = std::tuple<int, int, int>;  // destination, source, tag
  std::map<Key, std::deque<std::vector<uint8_t>>> unexpected;
  std::map<Key, std::deque<std::shared_ptr<PostedRecv>>> posted;
  int barrier_arrived = 0;
  uint64_t barrier_generation = 0;
  // Groups being formed by Split: (split number, color) -> the new group and
  // how many of its members have taken it.
  struct Child {
    std::shared_ptr<Group> group;
    int taken = 0;
  };
  std::map<std::pair<uint64_t, int64_t>, Child> children;
};

// Delivers `data` into a posted receive (the sizes must match).
void Deliver(const uint8_t* data, int64_t bytes, PostedRecv& r) {
  if (bytes != r.bytes) {
    r.status = InvalidArgument("receive of " + std::to_string(r.bytes) + " bytes from rank " +
                               std::to_string(r.source) + " (tag " + std::to_string(r.tag) +
                               ") matched a message of " + std::to_string(bytes) + " bytes");
  } else if (bytes > 0) {
    std::memcpy(r.buf, data, static_cast<size_t>(bytes));
  }
  r.done = true;
}

constexpr uint64_t kCompletedSend = 1;

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> group, int rank, std::string name)
      : Communicator(rank, group->size, CollectiveAlgorithm::kRing),
        group_(std::move(group)),
        name_(std::move(name)) {}

  std::string_view name() const override { return name_; }

  [[noreturn]] void Abort(int exit_code, std::string_view message) override {
    std::fprintf(stderr, "fp8moe rank %d/%d: %.*s\n", rank(), size(),
                 static_cast<int>(message.size()), message.data());
    std::fflush(stderr);
    std::_Exit(exit_code);
  }

 protected:
  Status DoAllGather(const void* send, void* recv, const Blocks& blocks,
                     DType dtype) override {
    return internal::RingAllGather(*this, send, recv, blocks, dtype);
  }
  Status DoReduceScatter(const void* send, void* recv, const Blocks& blocks, DType dtype,
                         ReduceOp op) override {
    return internal::RingReduceScatter(*this, send, recv, blocks, dtype, op, scratch_);
  }
  Status DoAllReduce(const void* send, void* recv, int64_t count, DType dtype,
                     ReduceOp op) override {
    return internal::RingAllReduce(*this, send, recv, count, dtype, op, scratch_);
  }

  Status DoBarrier() override {
    std::unique_lock lock(group_->mu);
    const uint64_t generation = group_->barrier_generation;
    if (++group_->barrier_arrived == group_->size) {
      group_->barrier_arrived = 0;
      ++group_->barrier_generation;
      group_->cv.notify_all();
      return OkStatus();
    }
    if (!WaitUntil(lock, [&] { return group_->barrier_generation != generation; })) {
      return TimedOut("barrier");
    }
    return OkStatus();
  }

  Result<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                const std::vector<int64_t>& colors,
                                                const std::vector<int64_t>& keys) override {
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of my color
    for (int r = 0; r < size(); ++r) {
      if (colors[r] == color) members.emplace_back(keys[r], r);
    }
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    while (members[static_cast<size_t>(new_rank)].second != rank()) ++new_rank;
    const int new_size = static_cast<int>(members.size());
    std::shared_ptr<Group> child;
    {
      std::lock_guard lock(group_->mu);
      auto& entry = group_->children[{splits_, color}];
      if (!entry.group) entry.group = std::make_shared<Group>(new_size, group_->timeout_seconds);
      child = entry.group;
      if (++entry.taken == new_size) group_->children.erase({splits_, color});
    }
    ++splits_;
    (void)key;
    return std::unique_ptr<Communicator>(new ThreadCommunicator(child, new_rank, name_));
  }

  Result<CommRequest> DoISend(const void* buf, int64_t bytes, int peer, int tag) override {
    const uint8_t* data = static_cast<const uint8_t*>(buf);
    std::lock_guard lock(group_->mu);
    auto& waiting = group_->posted[{peer, rank(), tag}];
    if (!waiting.empty()) {
      Deliver(data, bytes, *waiting.front());
      waiting.pop_front();
      group_->cv.notify_all();
    } else {
      group_->unexpected[{peer, rank(), tag}].emplace_back(data, data + bytes);
    }
    return CommRequest{kCompletedSend};
  }

  Result<CommRequest> DoIRecv(void* buf, int64_t bytes, int peer, int tag) override {
    auto r = std::make_shared<PostedRecv>();
    r->buf = buf;
    r->bytes = bytes;
    r->source = peer;
    r->tag = tag;
    {
      std::lock_guard lock(group_->mu);
      auto& queue = group_->unexpected[{rank(), peer, tag}];
      if (!queue.empty()) {
        Deliver(queue.front().data(), static_cast<int64_t>(queue.front().size()), *r);
        queue.pop_front();
      } else {
        group_->posted[{rank(), peer, tag}].push_back(r);
      }
    }
    const uint64_t id = next_id_++;
    requests_[id] = std::move(r);
    return CommRequest{id};
  }

  Status DoWaitAll(std::span<CommRequest> requests) override {
    std::vector<std::shared_ptr<PostedRecv>> recvs;
    for (CommRequest& req : requests) {
      if (req.handle > kCompletedSend) {
        auto it = requests_.find(req.handle);
        if (it == requests_.end()) {
          return InvalidArgument("wait: request " + std::to_string(req.handle) +
                                 " is not pending on this rank");
        }
        recvs.push_back(std::move(it->second));
        requests_.erase(it);
      }
      req.handle = 0;
    }
    std::unique_lock lock(group_->mu);
    const bool done = WaitUntil(lock, [&] {
      for (const auto& r : recvs) {
        if (!r->done) return false;
      }
      return true;
    });
    if (!done) {
      if (size() == 1) {
        return FailedPrecondition(
            "wait: a receive on the single rank has no matching send (a lone rank can only "
            "receive what it sent to itself first)");
      }
      for (const auto& r : recvs) {
        if (!r->done) {
          return TimedOut("a receive from rank " + std::to_string(r->source) + " (tag " +
                          std::to_string(r->tag) + ")");
        }
      }
    }
    for (const auto& r : recvs) {
      if (!r->status.ok()) return r->status;
    }
    return OkStatus();
  }

 private:
  template <typename Pred>
  bool WaitUntil(std::unique_lock<std::mutex>& lock, Pred pred) {
    // A lone rank has nobody to wait for: what is not done now never will be.
    if (group_->size == 1) return pred();
    if (group_->timeout_seconds <= 0) {
      group_->cv.wait(lock, pred);
      return true;
    }
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(group_->timeout_seconds));
    return group_->cv.wait_until(lock, deadline, pred);
  }

  Status TimedOut(const std::string& what) const {
    return FailedPrecondition("rank " + std::to_string(rank()) + "/" +
                              std::to_string(size()) + ": " + what +
                              " did not complete within " +
                              std::to_string(group_->timeout_seconds) +
                              " s: a peer rank failed or hangs");
  }

  std::shared_ptr<Group> group_;
  std::string name_;
  std::unordered_map<uint64_t, std::shared_ptr<PostedRecv>> requests_;
  uint64_t next_id_ = kCompletedSend + 1;
  uint64_t splits_ = 0;  // Split calls so far (the same count on every rank)
  internal::RingScratch scratch_;
};

}  // namespace

std::unique_ptr<Communicator> MakeSingleRankCommunicator() {
  return std::make_unique<ThreadCommunicator>(std::make_shared<Group>(1, 0.0), 0, "single");
}

Status RunThreadRanks(int ranks, const std::function<Status(Communicator&)>& body,
                      const CommOptions& options) {
  if (ranks < 1) {
    return InvalidArgument("thread ranks: " + std::to_string(ranks) + " ranks; need >= 1");
  }
  if (options.algorithm != CollectiveAlgorithm::kRing) {
    return InvalidArgument(
        "thread ranks: only the ring collectives exist without MPI (algorithm=ring)");
  }
  auto group = std::make_shared<Group>(ranks, options.timeout_seconds);
  std::vector<Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r, "threads");
      results[static_cast<size_t>(r)] = body(comm);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }
  return OkStatus();
}

}  // namespace fp8moe
