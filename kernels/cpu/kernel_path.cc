#include "kernels/cpu/kernel_path.h"

#include <cstddef>

namespace fp8moe::internal {

std::string_view KernelPathName(KernelPath path) {
  static constexpr std::string_view kNames[] = {
      "packed_f32",  "packed_bf16_pairs", "packed_i16_pairs", "packed_i16_vnni",
      "direct_f32",  "direct_bf16_pairs", "direct_fp8_vbmi",  "direct_i8_vnni", "direct_raw_fp8",
      "reference",   "direct_next_item_prefetch", "packed_row_blocks",
      "in_item_lhs_quant", "in_item_lhs_values"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(KernelPath::kCount));
  return kNames[static_cast<size_t>(path)];
}

bool IsKernelPath(KernelPath path) {
  return path != KernelPath::kDirectNextItemPrefetch && path != KernelPath::kPackedRowBlocks &&
         path != KernelPath::kInItemLhsQuant && path != KernelPath::kInItemLhsValues &&
         path != KernelPath::kCount;
}

}  // namespace fp8moe::internal
