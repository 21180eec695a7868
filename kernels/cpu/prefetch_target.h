// Which weight chunk a direct (weight-bound) kernel call prefetches while it
// runs its own: target-independent, so the rule is tested on its own
// (kernels/gmm_test.cc). The walk over that chunk's lines is line_walk.h's.
#ifndef FP8MOE_KERNELS_CPU_PREFETCH_TARGET_H_
#define FP8MOE_KERNELS_CPU_PREFETCH_TARGET_H_

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/pack.h"

namespace fp8moe::internal {

// Where a chunk's look-ahead goes: the chunk of `item` (columns `runs`) that
// starts at reduction row r0 and holds `rows` rows.
struct PrefetchTarget {
  const WorkItem* item = nullptr;  // null: nothing to prefetch
  const ColumnRuns* runs = nullptr;
  int64_t r0 = 0, rows = 0;
};

// The target of chunk [r0, r0 + kc) of item `it`: its own next chunk, and
// on its last chunk the first chunk of `following` (the direct item this
// thread runs next, when the executor knows it; its columns, its chunk
// rows), so that an item no longer starts cold: measured on one-row items
// of 1-8 MiB of weight, each cold start cost ~25 us on a thread.
inline PrefetchTarget ChunkPrefetchTarget(const WorkItem& it, const ColumnRuns& runs, int64_t r0,
                                          int64_t kc, int64_t kc_step, const WorkItem* following,
                                          const ColumnRuns* following_runs,
                                          int64_t following_kc_step) {
  const int64_t red1 = it.red0 + it.red_len;
  if (r0 + kc < red1) return {&it, &runs, r0 + kc, std::min(kc_step, red1 - r0 - kc)};
  if (following == nullptr || following->red_len == 0) return {};
  return {following, following_runs, following->red0,
          std::min(following_kc_step, following->red_len)};
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_PREFETCH_TARGET_H_
