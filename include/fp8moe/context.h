// The explicit state a library call runs in (docs/design.md §7.1): how many threads,
// which GMM backend, the kernels' scratch memory, a random number generator
// and a metrics sink. Passed down by reference instead of thread-local or
// global state, so that
//  - a trainer owns one Context for the whole run and, after the first step,
//    every kernel finds its scratch already allocated (no allocation per
//    step);
//  - a test can run the same call over every backend (the fast CPU kernels
//    and the plain-loop reference twins) the way ggml's test-backend-ops
//    does, and read which kernel paths ran;
//  - a later GPU backend adds a BackendKind and a stream here, and nothing
//    above the kernels changes.
// A Context is used by one calling thread at a time (it may start OpenMP
// teams of threads() workers itself).
#ifndef FP8MOE_CONTEXT_H_
#define FP8MOE_CONTEXT_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string_view>

#include "fp8moe/status.h"

namespace fp8moe {

// Receives named scalar metrics (e.g. "moe/dropless_reruns") from the
// library. Called only from the thread that called into the library.
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  virtual void Record(std::string_view name, double value) = 0;
};

// A deterministic pseudo-random generator (xoshiro256**, seeded through
// splitmix64). Its whole state is four words, so a checkpoint can save it and
// a resumed run draws the same numbers as an uninterrupted one.
class Rng {
 public:
  using State = std::array<uint64_t, 4>;
  explicit Rng(uint64_t seed = 0) { Seed(seed); }
  void Seed(uint64_t seed);
  uint64_t NextU64();
  // Uniform in [0, 1) with 53 random bits.
  double Uniform();
  // Standard normal (Box-Muller in double; two draws per call, no cache, so
  // the state alone determines the sequence).
  double Normal();
  // Uniform integer in [0, n); n > 0.
  uint64_t Below(uint64_t n);
  const State& state() const { return s_; }
  void set_state(const State& s) { s_ = s; }

 private:
  State s_{};
};

// Which implementation the grouped matmuls of a context run on.
enum class BackendKind : uint8_t {
  kCpu,        // the fast SIMD kernels (kernels/cpu)
  kReference,  // the plain-loop twins (kernels/reference)
};
std::string_view BackendName(BackendKind kind);  // "cpu", "reference"
Result<BackendKind> ParseBackend(std::string_view name);

// The kernel paths a call can take; each work item a kernel runs counts once
// on its path, so tests can prove that a path is (still) taken. Four
// entries are not paths (kDirectNextItemPrefetch, kPackedRowBlocks,
// kInItemLhsQuant, kInItemLhsValues: counted besides the item's path): a sum over the paths
// skips them (IsKernelPath).
enum class KernelPath : uint8_t {
  kPackedF32,         // packed panels, f32 FMA microkernel
  kPackedBf16Pairs,   // packed panels, AVX512-BF16 vdpbf16ps
  kPackedI16Pairs,    // packed panels, int16 pairs (vpmaddwd)
  kPackedI16Vnni,     // packed panels, AVX512-VNNI vpdpwssd
  kDirectF32,         // weight rows read in place, f32 FMA
  kDirectBf16Pairs,   // weight rows read in place, vdpbf16ps
  kDirectFp8Vbmi,     // fp8 weight rows, byte-table decode (VBMI) + vdpbf16ps
  kDirectI8Vnni,      // int8 weight rows, VNNI
  kDirectRawFp8,      // fp8 weight rows decoded raw (native fp8), f32 FMA
  kReference,         // a reference twin ran the whole call
  // Not a path: a direct item whose last chunk prefetched the first chunk of
  // the next item its thread ran (counted besides the item's own path).
  kDirectNextItemPrefetch,
  // Not a path: a packed item that ran in row-block order, B packed once for
  // its whole reduction (counted besides the item's path).
  kPackedRowBlocks,
  // Not a path: an item that quantized its own activation rows (native fp8,
  // int8) instead of a pre-pass over all rows.
  kInItemLhsQuant,
  // Not a path: of those, a packed native fp8 item that wrote the values of
  // its codes (bf16) and packed them, with no decode of codes.
  kInItemLhsValues,
  kCount
};
std::string_view KernelPathName(KernelPath path);
// False for the entries that count something besides an item's path.
bool IsKernelPath(KernelPath path);

struct ContextOptions {
  // Worker threads; 0: OpenMP's default at the time of each call
  // (omp_set_num_threads, OMP_NUM_THREADS or the cores).
  int threads = 0;
  BackendKind backend = BackendKind::kCpu;
  uint64_t seed = 0;                // seeds rng()
  MetricsSink* metrics = nullptr;   // not owned; may be null
};

namespace internal {
class ScratchArena;  // base/scratch_arena.h: the kernels' grow-only buffers
}  // namespace internal

class Context {
 public:
  explicit Context(const ContextOptions& options = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int threads() const;
  BackendKind backend() const;
  Rng& rng();
  MetricsSink* metrics() const;
  void set_metrics(MetricsSink* sink);

  // The kernels' scratch memory, kept from call to call.
  internal::ScratchArena& scratch();
  // Frees the scratch memory (the next call allocates it again).
  void ReleaseScratch();

  // Work items run on `path` (or, for kDirectNextItemPrefetch, items that
  // prefetched their successor; for kPackedRowBlocks, packed items run in
  // row-block order; for kInItemLhsQuant, items that quantized their rows;
  // for kInItemLhsValues, those that packed the codes' values)
  // since the last ResetKernelCounts (thread-safe).
  int64_t KernelCount(KernelPath path) const;
  void CountKernel(KernelPath path, int64_t n = 1);
  void ResetKernelCounts();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The process-wide context behind the overloads that take none: OpenMP's
// default thread count, the cpu backend, seed 0, no metrics sink.
Context& DefaultContext();

}  // namespace fp8moe

#endif  // FP8MOE_CONTEXT_H_
