// Helpers shared by the test binaries of several layers. Test-only (includes
// gtest and Highway's test hooks).
#ifndef FP8MOE_BASE_TEST_UTIL_H_
#define FP8MOE_BASE_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/memory.h"
#include "fp8moe/numerics.h"
#include "hwy/targets.h"

namespace fp8moe::test {

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
// AVX512-BF16 its AVX3 twice, as plain AVX3 (the extensions off: a
// Skylake-X's kernels) and as AVX3_SPR (numerics.h).
struct SimdTarget {
  int64_t hwy = 0;
  bool extensions = true;
  std::string name;
};

// Every target this CPU supports and the library was compiled for, best first.
inline std::vector<SimdTarget> SimdTargets() {
  std::vector<SimdTarget> out;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (t == HWY_AVX3 && CpuHasAvx512Bf16Dot()) out.push_back({t, true, "AVX3_SPR"});
    out.push_back({t, t != HWY_AVX3, hwy::TargetName(t)});
  }
  return out;
}

// Forces dispatch to t (UseDefaultSimd undoes it).
inline void UseSimdTarget(const SimdTarget& t) {
  hwy::SetSupportedTargetsForTest(t.hwy);
  internal::SetAvx512ExtensionsEnabled(t.extensions);
}
inline void UseDefaultSimd() {
  hwy::SetSupportedTargetsForTest(0);
  internal::SetAvx512ExtensionsEnabled(true);
}

// Runs fn once per SimdTargets() entry with dispatch forced to it, then
// restores normal dispatch.
template <class Fn>
void ForEachTarget(const Fn& fn) {
  for (const SimdTarget& t : SimdTargets()) {
    UseSimdTarget(t);
    SCOPED_TRACE(t.name);
    ASSERT_EQ(std::string(SimdTargetName()), t.name);
    fn();
  }
  UseDefaultSimd();
}

}  // namespace fp8moe::test

#endif  // FP8MOE_BASE_TEST_UTIL_H_
