// Event counters a Context keeps for its kernels (DESIGN 9): the CPU
// backend counts the path each work item took (kernels/cpu/kernel_path.h
// names the slots), so tests can prove a path is taken. Internal; slots are
// plain indices here so that base/ knows nothing of the kernels.
#ifndef FP8MOE_BASE_KERNEL_COUNTERS_H_
#define FP8MOE_BASE_KERNEL_COUNTERS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace fp8moe::internal {

class KernelCounters {
 public:
  static constexpr size_t kSlots = 32;
  // Thread-safe; relaxed: a count is read after the call that made it.
  void Add(size_t slot, int64_t n) { counts_[slot].fetch_add(n, std::memory_order_relaxed); }
  int64_t Get(size_t slot) const { return counts_[slot].load(std::memory_order_relaxed); }
  void Reset() {
    for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  }

 private:
  std::atomic<int64_t> counts_[kSlots] = {};
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_KERNEL_COUNTERS_H_
