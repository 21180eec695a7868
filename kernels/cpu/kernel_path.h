// The kernel paths a GMM call can take, counted per Context so that tests
// prove a path is (still) taken (docs/kernels.md). Internal: the public
// Context (fp8moe/context.h) holds the counters without naming the paths.
#ifndef FP8MOE_KERNELS_CPU_KERNEL_PATH_H_
#define FP8MOE_KERNELS_CPU_KERNEL_PATH_H_

#include <cstdint>
#include <string_view>

#include "base/kernel_counters.h"
#include "fp8moe/context.h"

namespace fp8moe::internal {

// Each work item a kernel runs counts once on its path. Four entries are not
// paths (kDirectNextItemPrefetch, kPackedRowBlocks, kInItemLhsQuant,
// kInItemLhsValues: counted besides the item's path): a sum over the paths
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
static_assert(static_cast<size_t>(KernelPath::kCount) <= KernelCounters::kSlots);

std::string_view KernelPathName(KernelPath path);
// False for the entries that count something besides an item's path.
bool IsKernelPath(KernelPath path);

// Work items run on `path` (or, for kDirectNextItemPrefetch, items that
// prefetched their successor; for kPackedRowBlocks, packed items run in
// row-block order; for kInItemLhsQuant, items that quantized their rows;
// for kInItemLhsValues, those that packed the codes' values) since the last
// ResetKernelCounts (thread-safe).
inline int64_t KernelCount(const Context& ctx, KernelPath path) {
  return ctx.kernel_counters().Get(static_cast<size_t>(path));
}
inline void CountKernel(Context& ctx, KernelPath path, int64_t n = 1) {
  ctx.kernel_counters().Add(static_cast<size_t>(path), n);
}
inline void ResetKernelCounts(Context& ctx) { ctx.kernel_counters().Reset(); }

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_KERNEL_PATH_H_
