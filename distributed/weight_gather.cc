// The FSDP weight gathers (gather8 and bf16), the token all-gathers, and the
// bytes each sends.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fp8moe/dist.h"
#include "fp8moe/numerics.h"

namespace fp8moe {

struct DistScratch::Impl {
  std::vector<std::vector<uint32_t>> amax_bits;  // [threads][E * N]
};
DistScratch::DistScratch() : impl_(std::make_unique<Impl>()) {}
DistScratch::~DistScratch() = default;

namespace {

constexpr int64_t kChunk = 1024;  // elements quantized per stack buffer

Status CheckShape(const char* what, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  int64_t product = 1;
  for (const auto& [name, v] : dims) {
    if (v < 0) {
      return InvalidArgument(std::string(what) + ": " + name + " = " + std::to_string(v) +
                             " is negative");
    }
    if (v > 0 && product > std::numeric_limits<int64_t>::max() / v) {
      return InvalidArgument(std::string(what) + ": the shape overflows int64");
    }
    product *= v;
  }
  return OkStatus();
}

// The amax a max over |x| bits stands for (quant/'s rule: NaN bits are the
// largest, so one NaN makes the amax NaN).
float AmaxFromBits(uint32_t bits) {
  if (bits > 0x7F800000u) return std::numeric_limits<float>::quiet_NaN();
  return std::bit_cast<float>(bits);
}

Fp8Format Fp8FormatOfQuant(QuantDType dtype) {
  switch (dtype) {
    case QuantDType::kE4M3FNUZ: return Fp8Format::kE4M3FNUZ;
    case QuantDType::kE5M2: return Fp8Format::kE5M2;
    case QuantDType::kE5M2FNUZ: return Fp8Format::kE5M2FNUZ;
    default: return Fp8Format::kE4M3FN;  // e4m3fn (int8 does not use it)
  }
}

// x [len] / scales [len] -> codes, each as QuantizeValue: a true f32
// division, then the saturating cast.
void QuantizeWithScales(const float* x, const float* scales, int64_t len, QuantDType dtype,
                        uint8_t* codes) {
  float v[kChunk];
  const bool int8 = dtype == QuantDType::kInt8;
  const Fp8Format format = Fp8FormatOfQuant(dtype);
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int64_t m = std::min(kChunk, len - c0);
    for (int64_t j = 0; j < m; ++j) v[j] = x[c0 + j] / scales[c0 + j];
    if (int8) {
      for (int64_t j = 0; j < m; ++j) codes[c0 + j] = static_cast<uint8_t>(EncodeInt8(v[j]));
    } else {
      EncodeFp8Span(v, codes + c0, static_cast<size_t>(m), format, /*saturate=*/true);
    }
  }
}

// Calls fn(first, len, expert, column, thread) for each piece of
// [begin, end) of a row-major [E, K, N] tensor that lies within one row (one
// expert's k), rows spread over OpenMP threads when there is enough work.
// Every piece is computed on its own, so the result never depends on the
// thread count.
template <typename Fn>
void ForEachRowPiece(int64_t begin, int64_t end, int64_t k, int64_t n, Fn fn) {
  if (end <= begin) return;
  const int64_t row0 = begin / n, row1 = (end - 1) / n;
#pragma omp parallel for schedule(static) if (end - begin >= (int64_t{1} << 18))
  for (int64_t row = row0; row <= row1; ++row) {
    const int64_t first = std::max(begin, row * n);
    const int64_t last = std::min(end, (row + 1) * n);
    fn(first, last - first, row / k, first - row * n, omp_get_thread_num());
  }
}

}  // namespace

Status GatherFp8Weight(Communicator& comm, const float* shard, int64_t experts, int64_t k,
                       int64_t n, QuantDType dtype, const Calibration& calib,
                       uint8_t* codes, float* scales, DistScratch& scratch) {
  FP8MOE_RETURN_IF_ERROR(CheckShape("gather8", {{"experts", experts}, {"k", k}, {"n", n}}));
  const int64_t total = experts * k * n, channels = experts * n;
  const ShardRange mine = GetShardRange(total, comm.size(), comm.rank());
  if ((mine.size() > 0 && shard == nullptr) || (total > 0 && codes == nullptr) ||
      (channels > 0 && scales == nullptr)) {
    return InvalidArgument("gather8: a null buffer (shard, codes or scales)");
  }
  if (calib.kind == Calibration::Kind::kAbsMax) {
    // One table of |w| bits per thread (rows of one expert share channels),
    // merged with max: exact, so any thread count gives the same amax.
    auto& per_thread = scratch.impl().amax_bits;
    per_thread.resize(static_cast<size_t>(omp_get_max_threads()));
    for (auto& t : per_thread) t.assign(static_cast<size_t>(channels), 0u);
    ForEachRowPiece(mine.begin, mine.end, k, n,
                    [&](int64_t first, int64_t len, int64_t e, int64_t column, int thread) {
                      const float* x = shard + (first - mine.begin);
                      uint32_t* a = per_thread[static_cast<size_t>(thread)].data() + e * n + column;
                      for (int64_t j = 0; j < len; ++j) {
                        a[j] = std::max(a[j], std::bit_cast<uint32_t>(x[j]) & 0x7FFFFFFFu);
                      }
                    });
    std::vector<uint32_t>& amax = per_thread[0];
    for (size_t t = 1; t < per_thread.size(); ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        amax[static_cast<size_t>(c)] = std::max(amax[static_cast<size_t>(c)],
                                                per_thread[t][static_cast<size_t>(c)]);
      }
    }
    FP8MOE_RETURN_IF_ERROR(
        comm.AllReduce(amax.data(), amax.data(), channels, DType::kU32, ReduceOp::kMax));
    for (int64_t c = 0; c < channels; ++c) {
      scales[c] = ScaleFromAmax(AmaxFromBits(amax[static_cast<size_t>(c)]), dtype);
    }
  } else {
    std::fill(scales, scales + channels, ScaleFromAmax(calib.FixedAmax(), dtype));
  }
  ForEachRowPiece(mine.begin, mine.end, k, n,
                  [&](int64_t first, int64_t len, int64_t e, int64_t column, int) {
                    QuantizeWithScales(shard + (first - mine.begin), scales + e * n + column,
                                       len, dtype, codes + first);
                  });
  return comm.AllGatherShards(codes + mine.begin, codes, total, DType::kU8);
}

Status GatherBf16Weight(Communicator& comm, const float* shard, int64_t total,
                        uint16_t* out) {
  FP8MOE_RETURN_IF_ERROR(CheckShape("bf16 weight gather", {{"total", total}}));
  const ShardRange mine = GetShardRange(total, comm.size(), comm.rank());
  if ((mine.size() > 0 && shard == nullptr) || (total > 0 && out == nullptr)) {
    return InvalidArgument("bf16 weight gather: a null buffer (shard or out)");
  }
  F32ToBf16Span(shard, out + mine.begin, static_cast<size_t>(mine.size()));
  return comm.AllGatherShards(out + mine.begin, out, total, DType::kBF16);
}

Status GatherQuantizedTokens(Communicator& comm, const float* x, int64_t tokens, int64_t d,
                             QuantDType dtype, const Calibration& calib, uint8_t* codes,
                             float* scales) {
  FP8MOE_RETURN_IF_ERROR(CheckShape("token gather", {{"tokens", tokens}, {"d", d},
                                                     {"ranks", comm.size()}}));
  const int64_t row0 = comm.rank() * tokens;
  FP8MOE_RETURN_IF_ERROR(QuantizeRows(x, tokens, d, tokens, /*block_size=*/0, dtype, calib,
                                      codes + row0 * d, scales + row0));
  FP8MOE_RETURN_IF_ERROR(comm.AllGather(codes + row0 * d, codes, tokens * d, DType::kU8));
  return comm.AllGather(scales + row0, scales, tokens, DType::kF32);
}

Status GatherBf16Tokens(Communicator& comm, const float* x, int64_t tokens, int64_t d,
                        uint16_t* out) {
  FP8MOE_RETURN_IF_ERROR(CheckShape("token gather", {{"tokens", tokens}, {"d", d},
                                                     {"ranks", comm.size()}}));
  const int64_t first = comm.rank() * tokens * d;
  F32ToBf16Span(x, out + first, static_cast<size_t>(tokens * d));
  return comm.AllGather(out + first, out, tokens * d, DType::kBF16);
}

int64_t RingAllGatherBytes(int64_t total, int ranks, int rank, int64_t element_bytes) {
  if (ranks <= 1) return 0;
  const int64_t up = GetShardRange(total, ranks, (rank + 1) % ranks).size();
  const int64_t down = GetShardRange(total, ranks, (rank + ranks - 1) % ranks).size();
  return (total - (up + 1) / 2 - down / 2) * element_bytes;
}

int64_t RingReduceScatterBytes(int64_t total, int ranks, int rank, int64_t element_bytes) {
  if (ranks <= 1) return 0;
  return (total - GetShardRange(total, ranks, rank).size()) * element_bytes;
}

int64_t RingAllReduceBytes(int64_t count, int ranks, int rank, int64_t element_bytes) {
  return RingReduceScatterBytes(count, ranks, rank, element_bytes) +
         RingAllGatherBytes(count, ranks, rank, element_bytes);
}

GatherTraffic Fp8WeightGatherTraffic(int ranks, int rank, int64_t experts, int64_t k,
                                     int64_t n, bool absmax) {
  GatherTraffic t;
  t.payload = RingAllGatherBytes(experts * k * n, ranks, rank, 1);
  t.scales = absmax ? RingAllReduceBytes(experts * n, ranks, rank, 4) : 0;
  return t;
}

GatherTraffic Bf16WeightGatherTraffic(int ranks, int rank, int64_t total) {
  return {RingAllGatherBytes(total, ranks, rank, 2), 0};
}

GatherTraffic QuantizedTokenGatherTraffic(int ranks, int rank, int64_t tokens, int64_t d) {
  return {RingAllGatherBytes(tokens * d * ranks, ranks, rank, 1),
          RingAllGatherBytes(tokens * ranks, ranks, rank, 4)};
}

GatherTraffic Bf16TokenGatherTraffic(int ranks, int rank, int64_t tokens, int64_t d) {
  return {RingAllGatherBytes(tokens * d * ranks, ranks, rank, 2), 0};
}

}  // namespace fp8moe
