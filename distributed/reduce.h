// Elementwise combine of two contributions, the step every reduction of the
// collectives repeats (distributed/ring.cc, the thread and single-rank
// communicators, the MPI user op for bf16), and the plain-loop reference of
// the ring's documented summation order.
#ifndef FP8MOE_DISTRIBUTED_REDUCE_H_
#define FP8MOE_DISTRIBUTED_REDUCE_H_

#include <bit>
#include <cstdint>
#include <string>

#include "fp8moe/communicator.h"

namespace fp8moe::internal {

// True for the (dtype, op) pairs of ReduceOp's comment.
bool IsSupportedReduction(DType dtype, ReduceOp op);
// "sum of f32, bf16, i64; max of u32, i64".
std::string SupportedReductions();

// f32 -> bf16 bits, round to nearest even, NaN -> quiet NaN keeping the sign:
// the same bits as F32ToBf16 (numerics/), inline so loops vectorise.
inline uint16_t RoundToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16 & 0x8000u) | 0x7FC0u);
  }
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline float Bf16Value(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// out[i] = a[i] op b[i], i < n; out may be a or b. a is the partial result
// that arrived, b this rank's contribution. The pair must be supported.
// A NaN sum is the canonical quiet NaN (f32 0x7FC00000, bf16 0x7FC0).
void Combine(DType dtype, ReduceOp op, const void* a, const void* b, void* out,
             int64_t n);

// The ring's order, element by element, from every rank's contribution:
// inputs[r] is rank r's full buffer (blocks as `counts`), out gets block
// `owner` reduced as communicator.h states (first half from owner+1 upwards,
// second half from owner-1 downwards, the owner's own value last).
// counts [ranks] elements per block; out [counts[owner]].
void RingOrderReference(DType dtype, ReduceOp op, const void* const* inputs,
                        const int64_t* counts, int ranks, int owner, void* out);

}  // namespace fp8moe::internal

#endif  // FP8MOE_DISTRIBUTED_REDUCE_H_
