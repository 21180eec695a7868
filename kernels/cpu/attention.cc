// Causal softmax attention, the cpu backend's (kernels/ops.h:
// AttentionForward, AttentionBackward), vectorized per Highway target. The
// reference backend's (ReferenceOps) is the same formula in double;
// kernels/backend_ops_test.cc compares the two. model/layers_test.cc holds
// this to the model's float64 twin (model/reference/layers_reference.h) on
// every SIMD target and checks the backward by finite differences.
//
// qkv [B*S, (H + Hkv) hd + Hkv vd]: row s of batch b holds the H query
// heads, then the Hkv key heads (hd wide) and the Hkv value heads (vd wide:
// hd, or MLA's v_head_dim) (grouped-query attention); query
// head h reads kv head h / (H / Hkv). The forward runs one (batch, query
// head) on one thread, the backward one (batch, kv head) with its query
// heads in order (their dK and dV sum into the same columns), so the bits
// do not depend on the thread count. They do not depend on the SIMD target
// either, among the targets with FMA (AVX2 and wider): every sum runs in one
// fixed order per output element, with FMA (vectors run over independent
// outputs, never across a sum), the softmax denominator is a scalar sum in
// double, and exp is Highway's lane-wise Exp (the same polynomial on every
// target). The SSE4 and scalar fallbacks round products separately.
// Non-finite inputs: a NaN in q, k or v, or a score that overflows to +inf,
// makes the rows it reaches NaN (as the scalar std::exp loops did); the
// trainer then skips the step.
//
// Why vectors: at the default model's size (S 64, hd 16) the scalar loops
// were a quarter of a training step (perf, 2 threads).
//   scores  s_ij = scale * q_i . k_j, lanes over keys j: k is transposed once
//           per head into kt [hd][Sp] (Sp: S rounded up to whole vectors,
//           zero-padded), so each lane sums over t in order;
//   output  o_i[t] = sum_j p_ij v_j[t], lanes over t, j in order;
//   backward ds_ij = do_i . v_j (lanes over j, v transposed like k), then
//           dv_j, dq_i, dk_j (lanes over t), each summed in i or j order.
// A width hd that is not a multiple of the vector runs its last columns with
// scalar std::fma: one rounding, like the vector FMA, so the same bits.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/exp_shifted-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

namespace {

// The transposed head columns [hd][sp] of rows [0, seq) at src (row stride
// width), zero in columns [seq, sp).
void Transpose(const float* src, int64_t width, int64_t seq, int64_t hd, int64_t sp,
               float* dst) {
  for (int64_t t = 0; t < hd; ++t) {
    float* d = dst + t * sp;
    for (int64_t j = 0; j < seq; ++j) d[j] = src[j * width + t];
    std::fill(d + seq, d + sp, 0.0f);
  }
}

// out[j] = sum over t in order of x[t] * mt[t*sp + j] (FMA), for j in
// [0, n) rounded up to whole vectors (mt is padded to sp).
void DotColumns(const float* x, const float* mt, int64_t hd, int64_t sp, int64_t n, float* out) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t j0 = 0; j0 < n; j0 += N) {
    auto acc = hn::Zero(d);
    for (int64_t t = 0; t < hd; ++t) {
      acc = hn::MulAdd(hn::Set(d, x[t]), hn::LoadU(d, mt + t * sp + j0), acc);
    }
    hn::StoreU(acc, d, out + j0);
  }
}

// The sizes every (batch, head) of a call shares.
struct Geometry {
  int64_t N;      // lanes
  int64_t width;  // qkv row: (heads + kv_heads) * hd + kv_heads * vd
  int64_t hw;     // the query heads' columns: heads * hd
  int64_t kvw;    // the key heads' columns: kv_heads * hd (the value heads follow them)
  int64_t ow;     // an output row: heads * vd
  int64_t group;  // query heads per kv head: heads / kv_heads
  int64_t sp;     // seq rounded up to whole vectors (the transposed rows)
  int64_t tv;     // columns t < hd below tv run as whole vectors, the rest scalar
  int64_t tvv;    // the same for the value columns t < vd
  float scale;    // 1 / sqrt(hd)
};
Geometry GeometryOf(int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd, int64_t vd) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  return {N,
          (heads + kv_heads) * hd + kv_heads * vd,
          heads * hd,
          kv_heads * hd,
          heads * vd,
          kv_heads > 0 ? heads / kv_heads : 0,
          (seq + N - 1) / N * N,
          hd / N * N,
          vd / N * N,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
}

// This thread's buffers of a call: a transposed head [hd][sp] and a row
// [sp], kept across calls (no allocation per step once grown).
struct ThreadRows {
  float* transposed;
  float* row;
};
ThreadRows ThreadRowsFor(std::vector<float>& transposed, std::vector<float>& row, int64_t hd,
                         int64_t sp) {
  if (transposed.size() < static_cast<size_t>(hd * sp)) transposed.resize(static_cast<size_t>(hd * sp));
  if (row.size() < static_cast<size_t>(sp)) row.resize(static_cast<size_t>(sp));
  return {transposed.data(), row.data()};
}

}  // namespace

// One (batch, head) of the forward: probs [S, S] and out rows of head h.
// Called from the OpenMP region, not written inside it: clang 14 outlines a
// parallel region into a function without the target's attributes, and
// Highway code inlined there fails to compile (Exp on AVX2: "Do not know how
// to split the result of this operator") or runs as SSE.
HWY_NOINLINE void HeadForward(const float* qkv, int64_t bh, int64_t seq, int64_t heads,
                              int64_t hd, int64_t vd, const Geometry& g, float* kt, float* row,
                              float* probs, float* out) {
  const hn::ScalableTag<float> d;
  const int64_t N = g.N, width = g.width, hw = g.hw, sp = g.sp, tvv = g.tvv;
  const int64_t b = bh / heads, h = bh % heads, kv = h / g.group;
  const float* base = qkv + b * seq * width;
  const float* vbase = base + hw + g.kvw + kv * vd;
  Transpose(base + hw + kv * hd, width, seq, hd, sp, kt);
  for (int64_t i = 0; i < seq; ++i) {
    const int64_t n = i + 1;  // keys 0..i
    DotColumns(base + i * width + h * hd, kt, hd, sp, n, row);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      row[j] *= g.scale;
      mx = std::max(mx, row[j]);
    }
    ExpShifted(row, n, mx, row);  // NaN kept (exp_shifted-inl.h)
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += row[j];
    const float inv = static_cast<float>(1.0 / sum);
    float* p = probs + (bh * seq + i) * seq;
    for (int64_t j = 0; j < n; ++j) p[j] = row[j] * inv;
    std::fill(p + n, p + seq, 0.0f);
    float* o = out + (b * seq + i) * g.ow + h * vd;
    for (int64_t t0 = 0; t0 < tvv; t0 += N) {
      auto acc = hn::Zero(d);
      for (int64_t j = 0; j < n; ++j) {
        acc = hn::MulAdd(hn::Set(d, p[j]), hn::LoadU(d, vbase + j * width + t0), acc);
      }
      hn::StoreU(acc, d, o + t0);
    }
    for (int64_t t = tvv; t < vd; ++t) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j) acc = std::fma(p[j], vbase[j * width + t], acc);
      o[t] = acc;
    }
  }
}

// One (batch, query head) of the backward: writes its q columns of dqkv
// and adds to the k and v columns of its kv head (zeroed by the caller).
// (Outside the OpenMP region: see HeadForward.)
HWY_NOINLINE void HeadBackward(const float* qkv, const float* probs, const float* dout,
                               int64_t bh, int64_t seq, int64_t heads, int64_t hd, int64_t vd,
                               const Geometry& g, float* vt, float* ds, float* dqkv) {
  const hn::ScalableTag<float> d;
  const int64_t N = g.N, width = g.width, sp = g.sp, tv = g.tv, tvv = g.tvv;
  const int64_t b = bh / heads, h = bh % heads, kv = h / g.group;
  const float* base = qkv + b * seq * width;
  float* dbase = dqkv + b * seq * width;
  const int64_t kcol = g.hw + kv * hd, vcol = g.hw + g.kvw + kv * vd;
  const float* kbase = base + kcol;
  const float* vbase = base + vcol;
  for (int64_t j = 0; j < seq; ++j) {
    float* r = dbase + j * width + h * hd;
    std::fill(r, r + hd, 0.0f);
  }
  Transpose(vbase, width, seq, vd, sp, vt);
  for (int64_t i = 0; i < seq; ++i) {
    const int64_t n = i + 1;
    const float* p = probs + (bh * seq + i) * seq;
    const float* go = dout + (b * seq + i) * g.ow + h * vd;
    const float* q = base + i * width + h * hd;
    DotColumns(go, vt, vd, sp, n, ds);  // dP_ij = do_i . v_j
    double pd = 0;
    for (int64_t j = 0; j < n; ++j) pd += static_cast<double>(p[j]) * ds[j];
    // dS_ij = P_ij (dP_ij - sum_j P_ij dP_ij) * scale, in place.
    for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - static_cast<float>(pd)) * g.scale;
    float* dq = dbase + i * width + h * hd;
    // dv_j += P_ij do_i over the vd value columns; dk_j += dS_ij q_i and
    // dq_i = sum_j dS_ij k_j over the hd key columns. Each element's sum
    // runs over j in order, whichever loop it is in.
    for (int64_t t0 = 0; t0 < tvv; t0 += N) {
      const auto gov = hn::LoadU(d, go + t0);
      for (int64_t j = 0; j < n; ++j) {
        float* dv = dbase + j * width + vcol + t0;
        hn::StoreU(hn::MulAdd(hn::Set(d, p[j]), gov, hn::LoadU(d, dv)), d, dv);
      }
    }
    for (int64_t t = tvv; t < vd; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        float* dv = dbase + j * width + vcol;
        dv[t] = std::fma(p[j], go[t], dv[t]);
      }
    }
    for (int64_t t0 = 0; t0 < tv; t0 += N) {
      const auto qv = hn::LoadU(d, q + t0);
      auto dqv = hn::LoadU(d, dq + t0);
      for (int64_t j = 0; j < n; ++j) {
        float* dk = dbase + j * width + kcol + t0;
        const auto s = hn::Set(d, ds[j]);
        hn::StoreU(hn::MulAdd(s, qv, hn::LoadU(d, dk)), d, dk);
        dqv = hn::MulAdd(s, hn::LoadU(d, kbase + j * width + t0), dqv);
      }
      hn::StoreU(dqv, d, dq + t0);
    }
    for (int64_t t = tv; t < hd; ++t) {
      float dqt = dq[t];
      for (int64_t j = 0; j < n; ++j) {
        float* dk = dbase + j * width + kcol;
        dk[t] = std::fma(ds[j], q[t], dk[t]);
        dqt = std::fma(ds[j], kbase[j * width + t], dqt);
      }
      dq[t] = dqt;
    }
  }
}

void AttentionForwardT(const float* qkv, int64_t batch, int64_t seq, int64_t heads,
                       int64_t kv_heads, int64_t hd, int64_t vd, int threads, float* probs,
                       float* out) {
  const Geometry g = GeometryOf(seq, heads, kv_heads, hd, vd);
#pragma omp parallel num_threads(threads)
  {
    static thread_local std::vector<float> kt_buf, row_buf;  // keys transposed, scores
    const ThreadRows bufs = ThreadRowsFor(kt_buf, row_buf, hd, g.sp);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < batch * heads; ++bh) {
      HeadForward(qkv, bh, seq, heads, hd, vd, g, bufs.transposed, bufs.row, probs, out);
    }
  }
}

void AttentionBackwardT(const float* qkv, const float* probs, const float* dout, int64_t batch,
                        int64_t seq, int64_t heads, int64_t kv_heads, int64_t hd, int64_t vd,
                        int threads, float* dqkv) {
  const Geometry g = GeometryOf(seq, heads, kv_heads, hd, vd);
#pragma omp parallel num_threads(threads)
  {
    static thread_local std::vector<float> vt_buf, ds_buf;  // values transposed, a row of dS
    const ThreadRows bufs = ThreadRowsFor(vt_buf, ds_buf, vd, g.sp);
    // One (batch, kv head) per iteration: its dK and dV start at zero and
    // take its query heads' sums in head order.
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < batch * kv_heads; ++bk) {
      const int64_t b = bk / kv_heads, kv = bk % kv_heads;
      float* dbase = dqkv + b * seq * g.width;
      for (int64_t j = 0; j < seq; ++j) {
        float* dk = dbase + j * g.width + g.hw + kv * hd;
        float* dv = dbase + j * g.width + g.hw + g.kvw + kv * vd;
        std::fill(dk, dk + hd, 0.0f);
        std::fill(dv, dv + vd, 0.0f);
      }
      for (int64_t h = kv * g.group; h < (kv + 1) * g.group; ++h) {
        HeadBackward(qkv, probs, dout, b * heads + h, seq, heads, hd, vd, g, bufs.transposed,
                     bufs.row, dqkv);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::internal {

HWY_EXPORT(AttentionForwardT);
HWY_EXPORT(AttentionBackwardT);

void CpuOps::AttentionForward(Context& ctx, const AttentionForwardArgs& a) {
  HWY_DYNAMIC_DISPATCH(AttentionForwardT)(a.qkv, a.batch, a.seq, a.heads, a.kv_heads, a.hd, a.vd,
                                          ctx.threads(), a.probs, a.out);
}

void CpuOps::AttentionBackward(Context& ctx, const AttentionBackwardArgs& a) {
  HWY_DYNAMIC_DISPATCH(AttentionBackwardT)(a.qkv, a.probs, a.dout, a.batch, a.seq, a.heads,
                                           a.kv_heads, a.hd, a.vd, ctx.threads(), a.dqkv);
}

}  // namespace fp8moe::internal
#endif  // HWY_ONCE
