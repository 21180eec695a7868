// Run-time dispatch of the packers (pack.h, pack-inl.h) for the tests; the
// executor (gemm_exec.cc) calls the per-target packers of its own target.
#include "kernels/cpu/pack.h"

#include <algorithm>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/pack.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/pack-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

void PackAEntry(const internal::Operand& a, internal::PanelKind kind, int64_t i0, int64_t rows,
                int64_t r0, int64_t kc, int64_t mr, void* ap, internal::PackScratch* s) {
  PackAT(a, kind, i0, rows, r0, kc, mr, ap, *s);
}

int64_t PackBEntry(const internal::Operand& b, internal::PanelKind kind, int64_t r0, int64_t kc,
                   const internal::ColumnRuns& cols, int64_t nr, void* bp,
                   internal::PackScratch* s) {
  return PackBT(b, kind, r0, kc, cols, nr, bp, *s);
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(PackAEntry);
HWY_EXPORT(PackBEntry);

void PackScratch::Carve(uint8_t* p, int64_t w, int64_t k) {
  width = w;
  kc = k;
  float* f = reinterpret_cast<float*>(p);
  f32 = f;
  tmp = f + w;
  zero = f + 2 * w;
  rows = f + 3 * w;
  uint16_t* h = reinterpret_cast<uint16_t*>(rows + kTransposeRows * (k + 1));
  lo = h;
  hi = h + w;
  std::fill(zero, zero + w, 0.0f);
}

void PackA(const Operand& a, PanelKind kind, int64_t i0, int64_t rows, int64_t r0, int64_t kc,
           int64_t mr, void* ap, PackScratch& s) {
  HWY_DYNAMIC_DISPATCH(PackAEntry)(a, kind, i0, rows, r0, kc, mr, ap, &s);
}

int64_t PackB(const Operand& b, PanelKind kind, int64_t r0, int64_t kc, const ColumnRuns& cols,
              int64_t nr, void* bp, PackScratch& s) {
  return HWY_DYNAMIC_DISPATCH(PackBEntry)(b, kind, r0, kc, cols, nr, bp, &s);
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
