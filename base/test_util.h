// Helpers shared by the test binaries of several layers. Test-only (includes
// gtest and Highway's test hooks).
#ifndef FP8MOE_BASE_TEST_UTIL_H_
#define FP8MOE_BASE_TEST_UTIL_H_

#include <cstdint>
#include <string>

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

// Runs fn once per Highway target that this CPU supports and the library was
// compiled for, with dispatch forced to that target, then restores normal
// dispatch.
template <class Fn>
void ForEachTarget(const Fn& fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    ASSERT_STREQ(SimdTargetName(), hwy::TargetName(target));
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace fp8moe::test

#endif  // FP8MOE_BASE_TEST_UTIL_H_
