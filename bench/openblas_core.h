// Which OpenBLAS core is good enough to be the sgemm ceiling of a benchmark.
//
// How the core is chosen (Debian 12's libopenblas0-pthread / -openmp /
// -serial 0.3.21, all built with DYNAMIC_ARCH: one library holding the
// kernels of many cores, Prescott ... SkylakeX and Cooperlake):
//  - a constructor that runs when the library is loaded picks one core for the
//    whole process: OPENBLAS_CORETYPE from the environment if it names a core
//    it knows (case-insensitive), else a table of CPUID family/model numbers
//    (driver/others/dynamic.c, get_coretype). A CPU model the table does not
//    know can end on a generic core: an AVX-512 Xeon ran "Prescott" (SSE3),
//    at an eighth of the machine's FMA peak.
//  - 0.3.21 matches OPENBLAS_CORETYPE against the first 24 names only, so
//    "Cooperlake" is "not found"; it then picks by CPU features alone
//    (AVX512-BF16 -> Cooperlake, AVX-512 -> SkylakeX, AVX2 -> Haswell, AVX
//    -> Sandybridge). A forced name is not checked against the CPU: forcing
//    SkylakeX on an AVX2-only CPU loads and then dies of SIGILL in sgemm.
//  - The core cannot change after loading, so a benchmark that finds a core
//    below the CPU's ISA measures sgemm again in a child process started with
//    OPENBLAS_CORETYPE set to one of AdviseCore()'s coretypes
//    (bench/sgemm_ceiling.h). sgemm on Cooperlake is SkylakeX's kernel; on
//    Zen it is Haswell's kernel with other blocking.
#ifndef FP8MOE_BENCH_OPENBLAS_CORE_H_
#define FP8MOE_BENCH_OPENBLAS_CORE_H_

#include <string>
#include <string_view>
#include <vector>

namespace fp8moe::bench {

// The widest SIMD class of a CPU or of an OpenBLAS core's kernels.
enum class IsaTier { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };
std::string_view IsaTierName(IsaTier tier);  // "sse", "avx", "avx2", "avx512"

// The CPU features that decide which OpenBLAS cores can run here.
struct CpuIsa {
  bool amd = false;  // AMD or Hygon (Zen cores)
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512bf16 = false;
  // Non-empty when a SIMD target below the CPU capped these (CapToSimdTarget).
  std::string target;
};
CpuIsa DetectCpuIsa();  // this CPU, as the OS lets programs use it
// isa as fp8moe's SIMD target (SimdTargetName) sees it: a target below the
// CPU caps its class, so `--simd AVX2` on an AVX-512 CPU is compared with
// OpenBLAS's AVX2 kernels, not with twice its own peak.
CpuIsa CapToSimdTarget(CpuIsa isa, std::string_view target);
// avx512 needs F, BW, DQ and VL (what OpenBLAS's SkylakeX kernels use);
// avx2 needs AVX2 and FMA.
IsaTier TierOf(const CpuIsa& isa);

// The SIMD class of an OpenBLAS core name as openblas_get_corename() spells
// it (case-insensitive); false for a name this table does not know.
bool CoreTier(std::string_view corename, IsaTier* tier);
std::string KnownCoreNames();  // "SapphireRapids, Cooperlake, ..." for messages

struct CoreAdvice {
  bool fallback = false;  // the core is below the CPU (or unknown): not a ceiling
  // OPENBLAS_CORETYPE values to try in a child, best first (empty when the
  // core is fine or nothing better exists); each runs on this CPU.
  std::vector<std::string> coretypes;
  std::string why;  // one line for the benchmark's output
};
CoreAdvice AdviseCore(std::string_view corename, const CpuIsa& isa);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_OPENBLAS_CORE_H_
