#include "distributed/reduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace fp8moe::internal {

bool IsSupportedReduction(DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kI64;
    case ReduceOp::kMax:
      return dtype == DType::kU32 || dtype == DType::kI64;
  }
  return false;
}

std::string SupportedReductions() { return "sum of f32, bf16, int64; max of uint32, int64"; }

namespace {

// The sign and payload of a NaN sum depend on which operand the compiler
// puts first (it may swap them: IEEE addition commutes for numbers) and on
// the CPU (inf - inf gives x86's negative default NaN). One canonical NaN
// keeps every reduction bit-deterministic.
inline float CanonicalNaN(float s) {
  return s != s ? std::bit_cast<float>(0x7FC00000u) : s;
}

}  // namespace

void Combine(DType dtype, ReduceOp op, const void* a, const void* b, void* out,
             int64_t n) {
  // Plain loops over restrict-free pointers: out may alias a or b, which is
  // fine elementwise. GCC vectorises each (no reassociation is involved).
  if (op == ReduceOp::kSum) {
    if (dtype == DType::kF32) {
      const float* x = static_cast<const float*>(a);
      const float* y = static_cast<const float*>(b);
      float* o = static_cast<float*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = CanonicalNaN(x[i] + y[i]);
    } else if (dtype == DType::kBF16) {
      const uint16_t* x = static_cast<const uint16_t*>(a);
      const uint16_t* y = static_cast<const uint16_t*>(b);
      uint16_t* o = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) {
        o[i] = RoundToBf16(CanonicalNaN(Bf16Value(x[i]) + Bf16Value(y[i])));
      }
    } else {  // i64, wrapping
      const uint64_t* x = static_cast<const uint64_t*>(a);
      const uint64_t* y = static_cast<const uint64_t*>(b);
      uint64_t* o = static_cast<uint64_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    }
    return;
  }
  if (dtype == DType::kU32) {
    const uint32_t* x = static_cast<const uint32_t*>(a);
    const uint32_t* y = static_cast<const uint32_t*>(b);
    uint32_t* o = static_cast<uint32_t*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = std::max(x[i], y[i]);
  } else {  // i64
    const int64_t* x = static_cast<const int64_t*>(a);
    const int64_t* y = static_cast<const int64_t*>(b);
    int64_t* o = static_cast<int64_t*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = std::max(x[i], y[i]);
  }
}

void RingOrderReference(DType dtype, ReduceOp op, const void* const* inputs,
                        const int64_t* counts, int ranks, int owner, void* out) {
  const size_t elem = DTypeSize(dtype);
  int64_t offset = 0;
  for (int r = 0; r < owner; ++r) offset += counts[r];
  const int64_t count = counts[owner];
  const int64_t first = (count + 1) / 2;
  auto at = [&](int r, int64_t i) {
    return static_cast<const uint8_t*>(inputs[r]) + (offset + i) * elem;
  };
  uint8_t* o = static_cast<uint8_t*>(out);
  for (int64_t i = 0; i < count; ++i) {
    // The first half starts at owner+1 and walks up, the second half starts
    // at owner-1 and walks down; both end with the owner.
    const int step = i < first ? 1 : ranks - 1;
    int r = (owner + step) % ranks;
    std::memcpy(o + i * elem, at(r, i), elem);
    for (int k = 1; k < ranks; ++k) {
      r = (r + step) % ranks;
      Combine(dtype, op, o + i * elem, at(r, i), o + i * elem, 1);
    }
  }
}

}  // namespace fp8moe::internal
