#include "fp8moe/memory.h"

#include <atomic>

namespace fp8moe {
namespace {
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
}  // namespace

MemoryStats GetMemoryStats() {
  return {g_in_use.load(), g_peak.load(), g_allocations.load()};
}

void ResetMemoryPeak() { g_peak.store(g_in_use.load()); }

namespace internal {

void TrackAllocation(int64_t bytes) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = g_in_use.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void TrackRelease(int64_t bytes) { g_in_use.fetch_sub(bytes); }

}  // namespace internal
}  // namespace fp8moe
