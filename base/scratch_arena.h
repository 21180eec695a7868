// Grow-only scratch memory for kernels, owned by a Context (docs/design.md §7.1, §9): a few
// buffers shared by the calling thread and one set per worker thread. Kept
// from call to call, so a steady-state call neither allocates nor takes page
// faults on fresh memory.
#ifndef FP8MOE_BASE_SCRATCH_ARENA_H_
#define FP8MOE_BASE_SCRATCH_ARENA_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fp8moe::internal {

// A 64-byte aligned buffer that only ever grows.
class GrowBuffer {
 public:
  GrowBuffer() = default;
  GrowBuffer(const GrowBuffer&) = delete;
  GrowBuffer& operator=(const GrowBuffer&) = delete;
  GrowBuffer(GrowBuffer&& o) noexcept : p_(o.p_), size_(o.size_) {
    o.p_ = nullptr;
    o.size_ = 0;
  }
  ~GrowBuffer() { Release(); }

  // Frees the memory (the next Get allocates again).
  void Release();
  // At least `bytes` bytes; the contents are unspecified. nullptr only if the
  // system is out of memory.
  uint8_t* Get(size_t bytes);
  size_t size() const { return size_; }

 private:
  uint8_t* p_ = nullptr;
  size_t size_ = 0;
};

// Buffers used by the calling thread of a kernel call.
enum class SharedSlot : uint8_t {
  kLhsCodes,    // the activation's codes (native fp8, int8)
  kLhsScales,   // and their scales
  kWeightCopy,  // the fake-QAT BF16 weight copy
  kGradCodes,   // TGMM: the quantized gradient
  kGradScales,  // and its scales
  kRowTile,     // TGMM: the scale tile of every row
  kGradTiles,   // TGMM: the gradient's (group, tile) row ranges
  kGradAmax,    // TGMM: per-thread channel amax of the gradient's quantizer
  kGradInv,     // TGMM: per-thread reciprocal scales (xla_reciprocal arithmetic)
  kCount
};

// Buffers of each worker thread.
enum class WorkerSlot : uint8_t {
  kPackA,     // packed A panels
  kPackB,     // packed B panels
  kTileC,     // the C tile finished by an epilogue
  kPackRows,  // the rows a packer converts before it lays them into panels
  kEpilogue,  // the rows an epilogue works on
  kLhsCodes,  // an item's activation codes (LhsQuantPlan)
  kCount
};

class ScratchArena {
 public:
  uint8_t* Shared(SharedSlot slot, size_t bytes) {
    return shared_[static_cast<size_t>(slot)].Get(bytes);
  }
  // Makes room for `threads` workers; call before a parallel region.
  void EnsureWorkers(int threads) {
    if (workers_.size() < static_cast<size_t>(threads)) workers_.resize(static_cast<size_t>(threads));
  }
  // Worker `thread`'s buffer; thread < the EnsureWorkers count. Different
  // threads may call this at the same time.
  uint8_t* Worker(int thread, WorkerSlot slot, size_t bytes) {
    return workers_[static_cast<size_t>(thread)][static_cast<size_t>(slot)].Get(bytes);
  }
  // Workers made room for so far.
  int workers() const { return static_cast<int>(workers_.size()); }

  // A T kept from call to call, default-constructed on first use: state with
  // containers of its own (a planned call whose vectors keep their capacity),
  // so that a steady-state call allocates nothing. One object per type; the
  // calling thread only.
  template <class T>
  T& Object() {
    for (const auto& o : objects_) {
      if (o.key == &kTypeKey<T>) return *static_cast<T*>(o.ptr.get());
    }
    objects_.push_back({&kTypeKey<T>, ObjectPtr(new T(), [](void* p) { delete static_cast<T*>(p); })});
    return *static_cast<T*>(objects_.back().ptr.get());
  }

  // Bytes held by all buffers (not counting Object()s).
  size_t bytes() const;
  // Frees every buffer and object.
  void Release();

 private:
  template <class T>
  static constexpr char kTypeKey = 0;  // its address names T
  using ObjectPtr = std::unique_ptr<void, void (*)(void*)>;
  struct KeyedObject {
    const char* key;
    ObjectPtr ptr;
  };
  std::array<GrowBuffer, static_cast<size_t>(SharedSlot::kCount)> shared_;
  std::vector<std::array<GrowBuffer, static_cast<size_t>(WorkerSlot::kCount)>> workers_;
  std::vector<KeyedObject> objects_;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_SCRATCH_ARENA_H_
