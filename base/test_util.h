// Helpers shared by the test binaries of several layers. Test-only (includes
// gtest and Highway's test hooks).
#ifndef FP8MOE_BASE_TEST_UTIL_H_
#define FP8MOE_BASE_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/context.h"
#include "fp8moe/memory.h"
#include "fp8moe/numerics.h"
#include "hwy/targets.h"

namespace fp8moe::test {

// One Context per backend kind for a test binary (default threads), made
// on first use: ops under test on the cpu and on the reference backend.
inline Context& ContextOf(BackendKind kind) {
  static Context cpu{[] {
    ContextOptions o;
    o.backend = BackendKind::kCpu;
    return o;
  }()};
  static Context ref{[] {
    ContextOptions o;
    o.backend = BackendKind::kReference;
    return o;
  }()};
  return kind == BackendKind::kCpu ? cpu : ref;
}

// Restores, when it goes out of scope, the memory cap (memory.h) a test
// changed, with its source.
class CapGuard {
 public:
  CapGuard() : bytes_(MemoryCap()), source_(MemoryCapSource()) {}
  ~CapGuard() { SetMemoryCap(bytes_, source_); }
  CapGuard(const CapGuard&) = delete;
  CapGuard& operator=(const CapGuard&) = delete;

 private:
  uint64_t bytes_;
  std::string source_;
};

// A SIMD target the tests run: a Highway target, and on a CPU with
// AVX512-BF16 its AVX3 as plain AVX3 (the extensions off: a Skylake-X's
// kernels) and as AVX3_SPR (numerics.h), the latter with and without the
// bf16 dot-product kernels (the CPU's default choice and the other one), so
// that every kernel this machine can run is tested.
struct SimdTarget {
  int64_t hwy = 0;
  bool extensions = true;
  int bf16_dot = -1;  // internal::SetBf16DotProducts
  std::string name;   // SimdTargetName() under it
  std::string label;  // for traces
};

// Every target this CPU supports and the library was compiled for, best first.
inline std::vector<SimdTarget> SimdTargets() {
  std::vector<SimdTarget> out;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (t == HWY_AVX3 && CpuHasAvx512Bf16Dot()) {
      out.push_back({t, true, 1, "AVX3_SPR", "AVX3_SPR, bf16 dot products"});
      out.push_back({t, true, 0, "AVX3_SPR", "AVX3_SPR, f32 FMA"});
    }
    const std::string name = hwy::TargetName(t);
    const bool plain_avx3 = t == HWY_AVX3 && CpuHasAvx512Bf16Dot();
    out.push_back({t, !plain_avx3, -1, name, name});
  }
  return out;
}

// Forces dispatch to t (UseDefaultSimd undoes it).
inline void UseSimdTarget(const SimdTarget& t) {
  hwy::SetSupportedTargetsForTest(t.hwy);
  internal::SetAvx512ExtensionsEnabled(t.extensions);
  internal::SetBf16DotProducts(t.bf16_dot);
}
inline void UseDefaultSimd() {
  hwy::SetSupportedTargetsForTest(0);
  internal::SetAvx512ExtensionsEnabled(true);
  internal::SetBf16DotProducts(-1);
}

// Runs fn once per SimdTargets() entry with dispatch forced to it, then
// restores normal dispatch.
template <class Fn>
void ForEachTarget(const Fn& fn) {
  for (const SimdTarget& t : SimdTargets()) {
    UseSimdTarget(t);
    SCOPED_TRACE(t.label);
    ASSERT_EQ(std::string(SimdTargetName()), t.name);
    fn();
  }
  UseDefaultSimd();
}

}  // namespace fp8moe::test

#endif  // FP8MOE_BASE_TEST_UTIL_H_
