// Accounting of the memory fp8moe allocates for tensors and kernel scratch,
// so benchmarks can report a high-water mark per phase (e.g. that native FP8
// QAT holds no BF16 weight copy).
#ifndef FP8MOE_MEMORY_H_
#define FP8MOE_MEMORY_H_

#include <cstdint>

namespace fp8moe {

struct MemoryStats {
  int64_t in_use = 0;  // bytes held now
  int64_t peak = 0;    // most bytes held since the last ResetMemoryPeak()
  // Allocations made since the process started (tensors and scratch growth;
  // a trainer step after warm-up should add none).
  int64_t allocations = 0;
};

MemoryStats GetMemoryStats();
// Starts a new high-water mark at the current use.
void ResetMemoryPeak();

namespace internal {
// Called by every allocation the library makes (Tensor, scratch buffers).
void TrackAllocation(int64_t bytes);
void TrackRelease(int64_t bytes);
}  // namespace internal

}  // namespace fp8moe

#endif  // FP8MOE_MEMORY_H_
