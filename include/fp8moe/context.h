// The explicit state a library call runs in (docs/design.md §7.1): how many threads,
// which backend, the kernels' scratch memory, a random number generator
// and a metrics sink. Passed down by reference instead of thread-local or
// global state, so that
//  - a trainer owns one Context for the whole run and, after the first step,
//    every kernel finds its scratch already allocated (no allocation per
//    step);
//  - a test can run the same call over every backend (the fast CPU kernels
//    and the plain-loop reference twins) the way ggml's test-backend-ops
//    does, and read which kernel paths ran (internal counters);
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

// Which implementation the ops of a context run on (the GMMs and the model
// step's other ops, docs/design.md §7.2).
enum class BackendKind : uint8_t {
  kCpu,        // the fast implementations (kernels/cpu)
  kReference,  // the plain-loop twins (kernels/reference)
};
std::string_view BackendName(BackendKind kind);  // "cpu", "reference"
Result<BackendKind> ParseBackend(std::string_view name);

struct ContextOptions {
  // Worker threads; 0: OpenMP's default at the time of each call
  // (omp_set_num_threads, OMP_NUM_THREADS or the cores).
  int threads = 0;
  BackendKind backend = BackendKind::kCpu;
  uint64_t seed = 0;                // seeds rng()
  MetricsSink* metrics = nullptr;   // not owned; may be null
};

namespace internal {
class ScratchArena;    // base/scratch_arena.h: the kernels' grow-only buffers
class KernelCounters;  // base/kernel_counters.h: which kernel paths ran
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

  // What the kernels count (internal: kernels/cpu/kernel_path.h names the
  // paths and reads them), kept from call to call.
  internal::KernelCounters& kernel_counters();
  const internal::KernelCounters& kernel_counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The process-wide context behind the overloads that take none: OpenMP's
// default thread count, the cpu backend, seed 0, no metrics sink.
Context& DefaultContext();

}  // namespace fp8moe

#endif  // FP8MOE_CONTEXT_H_
