// Distributed building blocks the trainer calls (docs/design.md §4, §6): the FSDP
// weight gather with FP8 codes ("gather8"), the quantized token all-gather of
// the ring of experts, the bytes each moves, and the check that every rank
// runs the same configuration on a matching layout. All run on any
// Communicator; on one rank they equal the single-process computation bit for
// bit (and so on N ranks: tested against it).
#ifndef FP8MOE_DIST_H_
#define FP8MOE_DIST_H_

#include <cstdint>
#include <memory>
#include <string_view>

#include "fp8moe/communicator.h"
#include "fp8moe/quant.h"
#include "fp8moe/status.h"

namespace fp8moe {

// Reusable memory of the helpers below. Keep one per trainer: after the first
// step they allocate nothing.
class DistScratch {
 public:
  DistScratch();
  ~DistScratch();
  DistScratch(const DistScratch&) = delete;
  DistScratch& operator=(const DistScratch&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// ---- FSDP weight gather ----
// An expert weight w [E, K, N] (f32 master, row-major) is sharded flat over
// the ranks: rank r holds elements GetShardRange(E * K * N, size, r). The
// per-channel scale spans the whole K (docs/design.md §3.2), which a shard does not:
// each rank takes the amax of its elements per (expert, channel), the ranks
// all-reduce them with max (exact, order-free), every rank derives the same
// scales, quantizes its own shard, and the codes are all-gathered (1 byte per
// weight). Result on every rank: codes [E, K, N] and scales [E, N], the bits
// QuantizeChannels gives on the whole tensor. A fixed calibration needs no
// amax and skips the all-reduce.
// shard [GetShardRange(E*K*N, size, rank).size()] f32.
Status GatherFp8Weight(Communicator& comm, const float* shard, int64_t experts, int64_t k,
                       int64_t n, QuantDType dtype, const Calibration& calib,
                       uint8_t* codes, float* scales, DistScratch& scratch);

// Unquantized modes: the shard rounded to bf16 (to nearest even) and
// all-gathered. shard as above for `total` elements -> out [total] bf16 bits.
Status GatherBf16Weight(Communicator& comm, const float* shard, int64_t total,
                        uint16_t* out);

// ---- Ring-of-experts token all-gather ----
// Every rank holds x [tokens, d] f32 (the same `tokens` on each). With
// moe_quantize_token_all_gather each row (token) is quantized over its full d
// with an f32 scale, exactly as QuantizeRows does, and codes and scales are
// all-gathered: codes [size * tokens, d], scales [size * tokens], rank r's
// tokens at rows [r * tokens, (r + 1) * tokens).
Status GatherQuantizedTokens(Communicator& comm, const float* x, int64_t tokens, int64_t d,
                             QuantDType dtype, const Calibration& calib, uint8_t* codes,
                             float* scales);
// The unquantized path: x rounded to bf16 and all-gathered; out [size * tokens, d].
Status GatherBf16Tokens(Communicator& comm, const float* x, int64_t tokens, int64_t d,
                        uint16_t* out);

// ---- Bytes one rank sends (what bytes_sent() counts under the ring) ----
// Ring all-gather of `total` elements sharded by GetShardRange: rank r sends
// every half-block except the two whose trip ends at it, i.e.
// total - first_half(block r + 1) - second_half(block r - 1) elements.
int64_t RingAllGatherBytes(int64_t total, int ranks, int rank, int64_t element_bytes);
// Ring reduce-scatter of `total` elements: total - shard(rank) elements.
int64_t RingReduceScatterBytes(int64_t total, int ranks, int rank, int64_t element_bytes);
// Ring all-reduce of `count` elements: the two above.
int64_t RingAllReduceBytes(int64_t count, int ranks, int rank, int64_t element_bytes);

struct GatherTraffic {
  int64_t payload = 0;  // codes or bf16 / f32 values
  int64_t scales = 0;   // the amax all-reduce (weights) or the token scales
  int64_t total() const { return payload + scales; }
};
// GatherFp8Weight: codes 1 byte per weight, exactly half the bf16 gather's
// bytes; scales: the u32 amax all-reduce of E * N channels (0 when fixed).
GatherTraffic Fp8WeightGatherTraffic(int ranks, int rank, int64_t experts, int64_t k,
                                     int64_t n, bool absmax);
GatherTraffic Bf16WeightGatherTraffic(int ranks, int rank, int64_t total);
// GatherQuantizedTokens: d bytes of codes plus 4 bytes of scale per token,
// against 2 * d bytes per token in bf16.
GatherTraffic QuantizedTokenGatherTraffic(int ranks, int rank, int64_t tokens, int64_t d);
GatherTraffic Bf16TokenGatherTraffic(int ranks, int rank, int64_t tokens, int64_t d);

// ---- Configuration consistency ----

// FNV-1a 64 of a configuration's canonical text (Config::ToYaml()).
uint64_t ConfigFingerprint(std::string_view canonical_text);

// Where a rank sits in the device mesh: MaxText's axis order, the expert axis
// innermost, so rank = fsdp_index * expert + expert_index and an expert ring
// is `expert` consecutive ranks.
struct ParallelLayout {
  int fsdp = 1;
  int expert = 1;
  int fsdp_index = 0;
  int expert_index = 0;
};

// What a rank whose own flags did not parse passes as its canonical text,
// followed by its error: it still takes part, so the others do not hang.
inline constexpr std::string_view kInvalidConfigText = "invalid configuration: ";

// Every rank calls this before any work with the canonical text of its
// configuration and MaxText's ici_fsdp_parallelism / ici_expert_parallelism
// (either may be -1: "the ranks that are left", as in MaxText). Fails on every
// rank when the configurations differ: the message names the ranks of each
// fingerprint and the first flag that differs, each rank adding its own
// value (a rank with kInvalidConfigText shows its error, the others name it).
// Fails with the same message on every rank when fsdp * expert != size.
Result<ParallelLayout> CheckDistributedConfig(Communicator& comm,
                                              std::string_view canonical_text,
                                              int64_t ici_fsdp_parallelism,
                                              int64_t ici_expert_parallelism);

}  // namespace fp8moe

#endif  // FP8MOE_DIST_H_
