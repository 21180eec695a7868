// The machine's own arithmetic peaks, measured in the calling process with
// register-only loops: independent accumulator chains (enough to cover the
// instruction's latency times its throughput), no loads or stores inside the
// timed loop, every thread of the benchmark running the same loop at once,
// the best of many short runs.
// Compiled per SIMD target (Highway), so `--simd AVX2` on an AVX-512 machine
// measures the AVX2 peak; instructions Highway 1.0.3 lacks (vdpbf16ps,
// vpdpbusd, vpdpwssd) are raw intrinsics of that target with the CPU checked
// at run time, like the kernels that use them.
#ifndef FP8MOE_BENCH_MACHINE_PEAKS_H_
#define FP8MOE_BENCH_MACHINE_PEAKS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe::bench {

// What the register-only loops measure.
enum class PeakKind : int {
  kF32Fma = 0,   // f32 multiply-add (FMA; mul + add where the target has none)
  kBf16Dot,      // vdpbf16ps: bf16 pairs into f32 (AVX512-BF16)
  kInt16Pairs,   // int16 pairs into int32 without VNNI (vpmaddwd + vpaddd)
  kInt16Vnni,    // vpdpwssd (AVX512-VNNI, or AVX-VNNI on the AVX2 target)
  kInt8Vnni,     // vpdpbusd: u8 x s8 quads into int32 (same CPU features)
  kCount
};
const char* PeakName(PeakKind kind);  // "f32_fma", "bf16_dot", ...

// One loop of the current SIMD target (filled per target).
struct PeakLoop {
  bool available = false;     // this target and this CPU have the instruction
  bool kernels_use = false;   // fp8moe's GMM kernels use it on this target and CPU
  int lanes = 0;              // 32-bit result lanes per vector
  int chains = 0;             // independent accumulators
  double ops_per_instr = 0;   // flops (int ops) per vector instruction: a MAC is 2
  const char* instr = "";     // the instruction(s) one chain step issues
  // Runs `iters` steps of every chain; returns a value that depends on every
  // accumulator, so that the compiler keeps them all.
  uint64_t (*run)(int64_t iters) = nullptr;
};

struct Peak {
  PeakKind kind = PeakKind::kF32Fma;
  PeakLoop loop;
  // GFLOP/s (GOP/s for integers) of all threads together, each thread's rate
  // from its own CPU time (time other processes take does not count); 0 if
  // unavailable.
  double gops = 0;
  double gops_wall = 0;       // the same from wall time: lower on a busy machine
  double ops_per_cycle = 0;   // per thread per core cycle (0 if the clock is unknown)
  std::string what;           // what the loop does, in words
};

struct MachinePeaks {
  int threads = 0;
  std::string simd_target;
  double core_ghz = 0;  // from a chain of dependent integer adds (1 per cycle); 0 if unknown
  double tsc_ghz = 0;   // rdtsc ticks per second (the nominal clock); 0 if none
  std::vector<Peak> peaks;  // one per PeakKind, in order

  const Peak& Get(PeakKind kind) const { return peaks[static_cast<int>(kind)]; }
  // f32 flop/s if every thread issued two f32_fma instructions (FMAs of the
  // target's width; mul + add pairs where it has no FMA) per cycle at
  // core_ghz: two FMA pipes (Zen 3: 2 x 256-bit, 32 flop/cycle; Haswell and
  // later; Skylake-SP Gold/Platinum at 512 bits), or two mul + two add pipes.
  // The spec-sheet number to hold the measured f32_fma peak against.
  double TwoPipeF32Estimate() const;
};

// Measures every peak this target and CPU have with `threads` threads (about
// 0.2 s each) and the core clock.
MachinePeaks MeasurePeaks(int threads);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_MACHINE_PEAKS_H_
