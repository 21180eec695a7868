// Counts every operator new of a test binary that links
// base/heap_count_test_util.cc, so a test can show that a call makes no heap
// allocation at all: the library's own accounting (GetMemoryStats) sees its
// tensors and scratch, not a std::vector. Test-only; one binary links the
// replacement once.
#ifndef FP8MOE_BASE_HEAP_COUNT_TEST_UTIL_H_
#define FP8MOE_BASE_HEAP_COUNT_TEST_UTIL_H_

#include <cstdint>

namespace fp8moe::test {

// operator new calls of this process so far (all threads).
int64_t HeapAllocations();

}  // namespace fp8moe::test

#endif  // FP8MOE_BASE_HEAP_COUNT_TEST_UTIL_H_
