// Grow-only scratch memory for kernels. Each thread keeps its buffers across
// calls (thread_local instances), so steady-state calls neither allocate nor
// take page faults on fresh memory.
#ifndef FP8MOE_KERNELS_CPU_SCRATCH_H_
#define FP8MOE_KERNELS_CPU_SCRATCH_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace fp8moe::internal {

// A 64-byte aligned buffer that only ever grows.
class GrowBuffer {
 public:
  GrowBuffer() = default;
  GrowBuffer(const GrowBuffer&) = delete;
  GrowBuffer& operator=(const GrowBuffer&) = delete;
  ~GrowBuffer() { std::free(p_); }

  // At least `bytes` bytes; the contents are unspecified. nullptr only if the
  // system is out of memory.
  uint8_t* Get(size_t bytes) {
    if (bytes > size_) {
      std::free(p_);
      size_ = (bytes + 4095) / 4096 * 4096;
      p_ = static_cast<uint8_t*>(std::aligned_alloc(64, size_));
      if (p_ == nullptr) size_ = 0;
    }
    return p_;
  }

 private:
  uint8_t* p_ = nullptr;
  size_t size_ = 0;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_SCRATCH_H_
