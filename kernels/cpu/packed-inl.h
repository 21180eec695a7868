// The packed path of gemm_exec.cc, per target: one register tile of C
// (+)= a packed A panel x a packed B panel (pack.h layouts), on the
// microkernel of the panel kind (microkernels-inl.h).

#if defined(FP8MOE_KERNELS_CPU_PACKED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_PACKED_INL_H_
#undef FP8MOE_KERNELS_CPU_PACKED_INL_H_
#else
#define FP8MOE_KERNELS_CPU_PACKED_INL_H_
#endif

#include <cstdint>

#include "fp8moe/context.h"
#include "hwy/highway.h"
#include "kernels/cpu/kernel_path.h"
#include "kernels/cpu/microkernels-inl.h"
#include "kernels/cpu/pack.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

// The kernel path of a packed item (the KernelPath counters).
inline internal::KernelPath PackedPath(internal::PanelKind kind) {
  switch (kind) {
    case internal::PanelKind::kF32: return internal::KernelPath::kPackedF32;
    case internal::PanelKind::kBf16Pairs: return internal::KernelPath::kPackedBf16Pairs;
    case internal::PanelKind::kI16Pairs: break;
  }
#if HWY_TARGET == HWY_AVX3
  if (CpuHasAvx512Vnni()) return internal::KernelPath::kPackedI16Vnni;
#endif
  return internal::KernelPath::kPackedI16Pairs;
}

// C tile [MR x NR] at c (ldc) (+)= A panel x B panel over kc reduction steps.
inline void RunPackedTile(internal::PanelKind kind, int64_t kc, const void* ap, const void* bp,
                          void* c, int64_t ldc, bool load_c, const float* row_scale,
                          const float* col_scale) {
  const size_t ukc = static_cast<size_t>(kc), uldc = static_cast<size_t>(ldc);
  switch (kind) {
    case internal::PanelKind::kF32:
      MicroF32<kMR, kNV>(ukc, static_cast<const float*>(ap), static_cast<const float*>(bp),
                         static_cast<float*>(c), uldc, load_c, row_scale, col_scale);
      return;
    case internal::PanelKind::kI16Pairs:
#if HWY_TARGET == HWY_AVX3
      if (CpuHasAvx512Vnni()) {
        MicroI16Vnni<kMR>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                          static_cast<const uint32_t*>(bp), static_cast<int32_t*>(c), uldc,
                          load_c);
        return;
      }
#endif
      MicroI16<kMR, kNV>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                         static_cast<const uint32_t*>(bp), static_cast<int32_t*>(c), uldc,
                         load_c);
      return;
    case internal::PanelKind::kBf16Pairs:
#if HWY_TARGET == HWY_AVX3
      MicroBf16Pairs<kMR>((ukc + 1) / 2, static_cast<const uint32_t*>(ap),
                          static_cast<const uint32_t*>(bp), static_cast<float*>(c), uldc, load_c,
                          row_scale, col_scale);
#endif
      return;  // chosen only on AVX512-BF16 CPUs (ChooseKind)
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
