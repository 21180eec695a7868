// Accounting of the memory fp8moe allocates for tensors and kernel scratch,
// so benchmarks can report a high-water mark per phase (e.g. that native FP8
// QAT holds no BF16 weight copy).
#ifndef FP8MOE_MEMORY_H_
#define FP8MOE_MEMORY_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "fp8moe/status.h"

namespace fp8moe {

struct MemoryStats {
  int64_t in_use = 0;  // bytes held now
  int64_t peak = 0;    // most bytes held since the last ResetMemoryPeak()
  // Allocations made since the process started (tensors and scratch growth;
  // a trainer step after warm-up should add none).
  int64_t allocations = 0;
};

MemoryStats GetMemoryStats();
// Starts a new high-water mark at the current use.
void ResetMemoryPeak();

// ---- The memory cap ----
// A request that would take the bytes fp8moe holds (GetMemoryStats().in_use)
// past the cap is refused up front, before anything is allocated, with a
// kResourceExhausted Status naming the request, the bytes it needs and the
// cap. Tensor::Create checks every tensor; callers that know the size of a
// whole request (an op's outputs, a trainer step) check it first with
// CheckMemoryRequest so the message names the tensor and the total.
//
// The cap is, in order of precedence: SetMemoryCap(); the environment
// variable FP8MOE_MEMORY_CAP (bytes, or with a K/M/G/T suffix, e.g. "8G" or
// "512MiB", read once at first use); else the machine's available memory
// (MemAvailable of /proc/meminfo at first use; the physical memory where that
// cannot be read).

// Sets the cap in bytes; 0 means no cap. `source` says where it came from and
// is quoted in refusals (e.g. "--memory-cap").
void SetMemoryCap(uint64_t bytes, std::string_view source = "SetMemoryCap");
// The cap in bytes (0 = none) and where it came from.
uint64_t MemoryCap();
std::string MemoryCapSource();

// OkStatus if `bytes` more fit under the cap; else kResourceExhausted:
// "<what> needs N bytes (...) but the memory cap is C bytes (source) and U
// bytes are in use; ...". `what` names the request, e.g. "output 'out' F32
// [1024, 1024]".
Status CheckMemoryRequest(std::string_view what, uint64_t bytes);

// "17179869184 bytes (16 GiB)".
std::string FormatBytes(uint64_t bytes);
// Parses a byte count: digits with an optional suffix K, M, G, T (powers of
// 1024; "KiB", "KB" and lower case accepted alike) or "B"; "0" means no cap
// where a cap is meant. Errors name the text.
Result<uint64_t> ParseByteSize(std::string_view text);

namespace internal {
// Called by every allocation the library makes (Tensor, scratch buffers).
void TrackAllocation(int64_t bytes);
void TrackRelease(int64_t bytes);
}  // namespace internal

}  // namespace fp8moe

#endif  // FP8MOE_MEMORY_H_
