// The epilogues of gemm_exec.cc, per target: what happens to an item's
// finished f32 (or int32) tile C [rows x cols] before it reaches the output:
// the activation and weight scales (native fp8, int8), SwiGLU (with the
// pre-activation kept), dSwiGLU, and the bf16 rounding of a BF16 output.

#if defined(FP8MOE_KERNELS_CPU_EPILOGUE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FP8MOE_KERNELS_CPU_EPILOGUE_INL_H_
#undef FP8MOE_KERNELS_CPU_EPILOGUE_INL_H_
#else
#define FP8MOE_KERNELS_CPU_EPILOGUE_INL_H_
#endif

#include <cstring>

#include "fp8moe/numerics.h"
#include "hwy/highway.h"
#include "kernels/cpu/activation-inl.h"
#include "kernels/cpu/gemm_call.h"
#include "numerics/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {

// Floats of epilogue scratch an item of `cols` output columns needs.
inline int64_t EpilogueFloats(int64_t cols) { return 4 * cols; }

// Stores n f32 values to an F32 or BF16 row.
inline void StoreRow(const float* v, int64_t n, void* out, DType dtype) {
  if (dtype == DType::kF32) {
    std::memcpy(out, v, static_cast<size_t>(n) * sizeof(float));
  } else {
    F32ToBf16SpanT(v, static_cast<uint16_t*>(out), static_cast<size_t>(n));
  }
}

inline void LoadRow(const void* in, DType dtype, int64_t n, float* v) {
  if (dtype == DType::kF32) {
    std::memcpy(v, in, static_cast<size_t>(n) * sizeof(float));
  } else {
    Bf16ToF32SpanT<false>(static_cast<const uint16_t*>(in), v, static_cast<size_t>(n));
  }
}

inline void* RowPtr(void* base, DType dtype, int64_t row, int64_t ld, int64_t col) {
  return static_cast<uint8_t*>(base) + (row * ld + col) * static_cast<int64_t>(DTypeSize(dtype));
}
inline const void* RowPtr(const void* base, DType dtype, int64_t row, int64_t ld, int64_t col) {
  return static_cast<const uint8_t*>(base) +
         (row * ld + col) * static_cast<int64_t>(DTypeSize(dtype));
}

// TGMM with one gradient scale per (group, column): applied once to the
// item's finished sums, C [rows x cols] at c (ldc).
inline void ApplyGroupColScale(const internal::GemmCall& call, const internal::WorkItem& it,
                               float* c, int64_t ldc) {
  const float* s = call.b_col_scale + call.b_row_tile[it.red0] * call.b_col_scale_ld + it.col0;
  for (int64_t i = 0; i < it.rows; ++i) {
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < it.cols; ++j) ci[j] *= s[j];
  }
}

// Writes an item's finished tile C [rows x width] (f32 or int32; SwiGLU's
// up half starts run_stride columns after the gate half). scratch holds
// EpilogueFloats(it.cols) floats.
inline void RunEpilogue(const internal::GemmCall& call, const internal::WorkItem& it,
                        const void* cbuf, int64_t ldc, int64_t run_stride, bool c_is_int,
                        float* scratch) {
  using internal::Epilogue;
  const Epilogue& e = call.epi;
  const int64_t w = it.cols;
  float* v0 = scratch;  // run 0 (or the only run)
  float* v1 = v0 + w;   // run 1 (SwiGLU up)
  float* t0 = v1 + w;
  float* t1 = t0 + w;
  const float* col_scale =
      e.col_scale ? e.col_scale + it.group * e.col_scale_group_stride : nullptr;
  const int runs = e.kind == Epilogue::Kind::kSwiGlu ? 2 : 1;
  for (int64_t i = 0; i < it.rows; ++i) {
    const int64_t row = it.row0 + i;
    for (int run = 0; run < runs; ++run) {
      float* v = run == 0 ? v0 : v1;
      const int64_t off = i * ldc + run * run_stride;
      if (c_is_int) {
        const int32_t* c = static_cast<const int32_t*>(cbuf) + off;
        for (int64_t j = 0; j < w; ++j) v[j] = static_cast<float>(c[j]);
      } else {
        std::memcpy(v, static_cast<const float*>(cbuf) + off, static_cast<size_t>(w) * sizeof(float));
      }
      if (e.row_scale != nullptr || col_scale != nullptr) {
        const float rs = e.row_scale != nullptr ? e.row_scale[row] : 1.0f;
        const float* cs = col_scale + (run == 0 ? it.col0 : e.half + it.col0);
        for (int64_t j = 0; j < w; ++j) v[j] = v[j] * rs * cs[j];
      }
    }
    switch (e.kind) {
      case Epilogue::Kind::kStore:
      case Epilogue::Kind::kAccumulateF32:
        StoreRow(v0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        break;
      case Epilogue::Kind::kSwiGlu:
        if (e.h_out != nullptr) {
          StoreRow(v0, w, RowPtr(e.h_out, e.h_dtype, row, e.h_ld, it.col0), e.h_dtype);
          StoreRow(v1, w, RowPtr(e.h_out, e.h_dtype, row, e.h_ld, e.half + it.col0), e.h_dtype);
        }
        SiluMulRow(v0, v1, w, t0);
        StoreRow(t0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        break;
      case Epilogue::Kind::kDSwiGlu:
        LoadRow(RowPtr(e.h, e.h_dtype, row, e.h_ld, it.col0), e.h_dtype, w, t0);
        LoadRow(RowPtr(e.h, e.h_dtype, row, e.h_ld, e.half + it.col0), e.h_dtype, w, t1);
        DSiluRow(v0, t0, t1, w, v0, v1);  // in place: v0 is read before written
        StoreRow(v0, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, it.col0), e.out_dtype);
        StoreRow(v1, w, RowPtr(e.out, e.out_dtype, row, e.out_ld, e.half + it.col0), e.out_dtype);
        break;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
