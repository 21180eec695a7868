// Grow-only scratch memory for kernels. Each thread keeps its buffers across
// calls (thread_local instances), so steady-state calls neither allocate nor
// take page faults on fresh memory.
#ifndef FP8MOE_KERNELS_CPU_SCRATCH_H_
#define FP8MOE_KERNELS_CPU_SCRATCH_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "fp8moe/memory.h"

namespace fp8moe::internal {

// A 64-byte aligned buffer that only ever grows.
class GrowBuffer {
 public:
  GrowBuffer() = default;
  GrowBuffer(const GrowBuffer&) = delete;
  GrowBuffer& operator=(const GrowBuffer&) = delete;
  ~GrowBuffer() {
    internal::TrackRelease(static_cast<int64_t>(size_));
    std::free(p_);
  }

  // Frees the memory (the next Get allocates again).
  void Release() {
    internal::TrackRelease(static_cast<int64_t>(size_));
    std::free(p_);
    p_ = nullptr;
    size_ = 0;
  }

  // At least `bytes` bytes; the contents are unspecified. nullptr only if the
  // system is out of memory.
  uint8_t* Get(size_t bytes) {
    if (bytes > size_) {
      internal::TrackRelease(static_cast<int64_t>(size_));
      std::free(p_);
      size_ = (bytes + 4095) / 4096 * 4096;
      p_ = static_cast<uint8_t*>(std::aligned_alloc(64, size_));
      if (p_ == nullptr) size_ = 0;
      internal::TrackAllocation(static_cast<int64_t>(size_));
    }
    return p_;
  }

 private:
  uint8_t* p_ = nullptr;
  size_t size_ = 0;
};

// The packing buffers of one worker thread (gemm_exec.cc).
struct ThreadScratch {
  GrowBuffer ap, bp, c;
};
ThreadScratch& WorkerScratch();  // the calling thread's

// Frees the scratch of the calling thread (gmm.cc's buffers) and of every
// OpenMP worker thread.
void ReleaseAllScratch();

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_SCRATCH_H_
