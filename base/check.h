// FP8MOE_DCHECK(cond): an assertion on an internal invariant (a tile fits
// its buffer, an index is in range) that a correct program never breaks. On
// in Debug builds and in the sanitizer builds (FP8MOE_DEBUG_CHECKS, set by
// FP8MOE_SANITIZE), where it prints the condition and aborts; compiled out
// of Release builds, so hot loops pay nothing. Bad input is never checked
// this way: that is a Status.
#ifndef FP8MOE_BASE_CHECK_H_
#define FP8MOE_BASE_CHECK_H_

#include <cstdio>
#include <cstdlib>

#if defined(FP8MOE_DEBUG_CHECKS) || !defined(NDEBUG)
#define FP8MOE_DCHECK_IS_ON 1
#define FP8MOE_DCHECK(cond)                                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: FP8MOE_DCHECK failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                         \
      std::abort();                                                                \
    }                                                                              \
  } while (0)
#else
#define FP8MOE_DCHECK_IS_ON 0
#define FP8MOE_DCHECK(cond) \
  do {                      \
  } while (0)
#endif

#endif  // FP8MOE_BASE_CHECK_H_
