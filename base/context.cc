#include "fp8moe/context.h"

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>

#include "base/default_context.h"
#include "base/kernel_counters.h"
#include "base/scratch_arena.h"
#include "fp8moe/memory.h"

namespace fp8moe {

// ---- Rng: xoshiro256** (Blackman and Vigna), seeded through splitmix64 ----

namespace {
uint64_t SplitMix64(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

void Rng::Seed(uint64_t seed) {
  uint64_t x = seed;
  for (auto& w : s_) w = SplitMix64(&x);
}

uint64_t Rng::NextU64() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

double Rng::Uniform() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }

double Rng::Normal() {
  const double u1 = 1.0 - Uniform();  // (0, 1]: log is finite
  const double u2 = Uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

uint64_t Rng::Below(uint64_t n) {
  // Rejection keeps the draw exactly uniform.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t v;
  do {
    v = NextU64();
  } while (v >= limit);
  return v % n;
}

// ---- Names ----

std::string_view BackendName(BackendKind kind) {
  return kind == BackendKind::kCpu ? "cpu" : "reference";
}

Result<BackendKind> ParseBackend(std::string_view name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "reference") return BackendKind::kReference;
  return InvalidArgument("unknown backend '" + std::string(name) +
                         "'; expected cpu or reference");
}

// ---- Scratch ----

namespace internal {

void GrowBuffer::Release() {
  TrackRelease(static_cast<int64_t>(size_));
  std::free(p_);
  p_ = nullptr;
  size_ = 0;
}

uint8_t* GrowBuffer::Get(size_t bytes) {
  if (bytes > size_) {
    Release();
    const size_t want = (bytes + 4095) / 4096 * 4096;
    p_ = static_cast<uint8_t*>(std::aligned_alloc(64, want));
    if (p_ != nullptr) {
      size_ = want;
      TrackAllocation(static_cast<int64_t>(size_));
    }
  }
  return p_;
}

size_t ScratchArena::bytes() const {
  size_t total = 0;
  for (const auto& b : shared_) total += b.size();
  for (const auto& w : workers_) {
    for (const auto& b : w) total += b.size();
  }
  return total;
}

void ScratchArena::Release() {
  for (auto& b : shared_) b.Release();
  for (auto& w : workers_) {
    for (auto& b : w) b.Release();
  }
  objects_.clear();
}

}  // namespace internal

// ---- Context ----

struct Context::Impl {
  int threads = 0;  // 0: OpenMP's default at each call
  BackendKind backend = BackendKind::kCpu;
  Rng rng;
  MetricsSink* metrics = nullptr;
  internal::ScratchArena scratch;
  internal::KernelCounters counters;
};

Context::Context(const ContextOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->threads = options.threads > 0 ? options.threads : 0;
  impl_->backend = options.backend;
  impl_->rng.Seed(options.seed);
  impl_->metrics = options.metrics;
}

Context::~Context() = default;

int Context::threads() const {
  return impl_->threads > 0 ? impl_->threads : omp_get_max_threads();
}
BackendKind Context::backend() const { return impl_->backend; }
Rng& Context::rng() { return impl_->rng; }
MetricsSink* Context::metrics() const { return impl_->metrics; }
void Context::set_metrics(MetricsSink* sink) { impl_->metrics = sink; }
internal::ScratchArena& Context::scratch() { return impl_->scratch; }
void Context::ReleaseScratch() { impl_->scratch.Release(); }

internal::KernelCounters& Context::kernel_counters() { return impl_->counters; }
const internal::KernelCounters& Context::kernel_counters() const { return impl_->counters; }

Context& DefaultContext() {
  static Context* ctx = new Context();  // never destroyed: outlives every caller
  return *ctx;
}

namespace internal {
std::recursive_mutex& DefaultContextMutex() {
  static std::recursive_mutex* mu = new std::recursive_mutex();  // never destroyed
  return *mu;
}
}  // namespace internal

}  // namespace fp8moe
