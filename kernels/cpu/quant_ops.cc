// The cpu backend's quantization ops (kernels/cpu/cpu_ops.h): quant/'s
// quantizers and dequantizers (SIMD spans, OpenMP over rows or chunks, the
// same bits for any thread count), and the loops the MoE layer ran before
// the seam, moved unchanged: the per-expert weight copy of the int8 scheme,
// the recipe's scaling of its cotangents, the FP8 health counts.
#include <cmath>
#include <cstring>

#include "base/check.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "kernels/cpu/cpu_ops.h"

namespace fp8moe::internal {

// The arguments are the entry point's (kernels/ops.cc), checked as quant.h's
// functions check them: their Status is OK.
void CpuOps::QuantizeRows(Context& ctx, const QuantizeRowsArgs& a) {
  (void)ctx;
  [[maybe_unused]] const Status s =
      fp8moe::QuantizeRows(a.x, a.rows, a.cols, a.valid_rows, a.block_size, a.dtype, a.calib,
                           a.q, a.scales);
  FP8MOE_DCHECK(s.ok());
}

void CpuOps::DequantizeRows(Context& ctx, const DequantizeRowsArgs& a) {
  (void)ctx;
  fp8moe::DequantizeRows(a.q, a.rows, a.cols, a.block_size, a.scales, a.dtype, a.x);
}

void CpuOps::QuantizeChannels(Context& ctx, const QuantizeChannelsArgs& a) {
  (void)ctx;
  [[maybe_unused]] const Status s =
      fp8moe::QuantizeChannels(a.w, a.experts, a.k, a.n, a.dtype, a.calib, a.q, a.scales);
  FP8MOE_DCHECK(s.ok());
}

void CpuOps::DequantizeChannelsToBf16(Context& ctx, const DequantizeChannelsToBf16Args& a) {
  (void)ctx;
  const int64_t K = a.k, N = a.n;
#pragma omp parallel for schedule(static)
  for (int64_t ek = 0; ek < a.experts * K; ++ek) {
    const float* se = a.scales + (ek / K) * N;
    for (int64_t n = 0; n < N; ++n) {
      a.out[ek * N + n] = F32ToBf16(DequantizeValue(a.q[ek * N + n], se[n], a.dtype));
    }
  }
}

namespace {

// dst [n] f32 = x's row [n] (f32 or bf16 bits) widened.
void RowToF32(const ScaleToF32Args& a, int64_t row, float* dst) {
  const size_t n = static_cast<size_t>(a.cols);
  if (a.x_dtype == DType::kF32) {
    if (n > 0) std::memcpy(dst, static_cast<const float*>(a.x) + row * a.cols, n * sizeof(float));
  } else {
    Bf16ToF32Span(static_cast<const uint16_t*>(a.x) + row * a.cols, dst, n);
  }
}

}  // namespace

void CpuOps::ScaleToF32(Context& ctx, const ScaleToF32Args& a) {
  const int64_t n = a.cols;
  if (a.by == ScaleBy::kGroupColumn) {  // the recipe's dLHS operand: group by group
    int64_t row = 0;
    for (int64_t e = 0; e < a.groups; ++e) {
      const float* se = a.scale + e * n;
      const int64_t end = row + a.group_sizes[e];
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
      for (int64_t i = row; i < end; ++i) {
        float* dst = a.out + i * n;
        RowToF32(a, i, dst);
        for (int64_t j = 0; j < n; ++j) dst[j] *= se[j];
      }
      row = end;
    }
    return;
  }
  int64_t valid = 0;  // the recipe's dW operand: every valid row at once
  for (int64_t e = 0; e < a.groups; ++e) valid += a.group_sizes[e];
#pragma omp parallel for schedule(static) num_threads(ctx.threads())
  for (int64_t i = 0; i < valid; ++i) {
    float* dst = a.out + i * n;
    RowToF32(a, i, dst);
    for (int64_t j = 0; j < n; ++j) dst[j] *= a.scale[i];
  }
}

namespace {

// Per code: is it at the format's largest magnitude, is it zero.
struct CodeTable {
  bool saturated[256];
  bool zero[256];
};

const CodeTable& TableOf(QuantDType q) {
  static const auto* tables = [] {
    auto* t = new CodeTable[5];
    for (int d = 0; d < 5; ++d) {
      const auto qd = static_cast<QuantDType>(d);
      for (int c = 0; c < 256; ++c) {
        const float v = DequantizeValue(static_cast<uint8_t>(c), 1.0f, qd);
        t[d].saturated[c] = std::fabs(v) == QuantMax(qd);
        t[d].zero[c] = v == 0.0f;
      }
    }
    return t;
  }();
  return tables[static_cast<int>(q)];
}

}  // namespace

void CpuOps::Fp8HealthCount(Context& ctx, const Fp8HealthCountArgs& a) {
  (void)ctx;
  const CodeTable& t = TableOf(a.dtype);
  const uint8_t* q = a.q;
  const float* x = a.x;
  int64_t sat = 0, flushed = 0;
  // Integer counts: the same total for any thread count.
#pragma omp parallel for reduction(+ : sat, flushed) schedule(static)
  for (int64_t i = 0; i < a.n; ++i) {
    sat += t.saturated[q[i]];
    flushed += t.zero[q[i]] && x[i] != 0.0f;
  }
  *a.counts = {sat, flushed};
}

}  // namespace fp8moe::internal
