// Register-only peak loops (machine_peaks.h), compiled once per Highway
// target; the timing, the core clock and the per-thread arithmetic are in the
// HWY_ONCE part at the end.
//
// Each loop keeps `kChains` accumulators in registers and updates every one
// once per step with the instruction under test, whose other operands are
// loop-invariant registers. A chain's next step waits for its previous one
// (latency L cycles); P pipes need L x P chains in flight. FMA: L = 4 and
// P = 2 on Zen 3 and Skylake (8 chains); SSE4 has no FMA, and its mul + add
// chain is 6 cycles long on Zen 3's 2 mul + 2 add pipes (12 chains). 12
// chains fit the 16 registers of AVX2/SSE4; AVX-512 has 32 and gets 16.
#include "bench/machine_peaks.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/machine_peaks.cc"
#include "fp8moe/numerics.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace fp8moe {
namespace bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The chains are named variables c0, c1, ... (FP8MOE_EACH_CHAIN(X) expands
// X(j) for each): GCC keeps arrays of vectors partly on the stack, which would put
// loads and stores into the loop.
#undef FP8MOE_PEAK_AVX3
#undef FP8MOE_EACH_CHAIN
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define FP8MOE_PEAK_AVX3 1
constexpr int kChains = 16;
#define FP8MOE_EACH_CHAIN(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#else
constexpr int kChains = 12;
#define FP8MOE_EACH_CHAIN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#endif

// An empty asm statement that takes and gives back a chain in a vector
// register: without it GCC moves some integer chains through the stack on
// every step, which would put memory traffic into the loop. Emits nothing.
#undef FP8MOE_IN_REG
#if defined(FP8MOE_PEAK_AVX3)
#define FP8MOE_IN_REG(x) __asm__("" : "+v"(x))
#elif HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3
#define FP8MOE_IN_REG(x) __asm__("" : "+x"(x))
#else
#define FP8MOE_IN_REG(x) (void)(x)
#endif

template <class T>
HWY_INLINE uint64_t Bits(T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(v));
  return bits;
}

// c <- c * m + a. With m = 0.999 and a = 1 every chain tends to 1000 from
// any start, so values stay normal (no subnormal or overflow slow paths) for
// any number of steps.
HWY_NOINLINE uint64_t F32FmaLoop(int64_t iters) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const V m = hn::Set(d, 0.999f), a = hn::Set(d, 1.0f);
#define FP8MOE_INIT(j) V c##j = hn::Set(d, static_cast<float>(j));
#define FP8MOE_STEP(j) \
  c##j = hn::MulAdd(c##j, m, a); \
  FP8MOE_IN_REG(c##j.raw);
#define FP8MOE_SUM(j) s = hn::Add(s, c##j);
  FP8MOE_EACH_CHAIN(FP8MOE_INIT)
  for (int64_t i = 0; i < iters; ++i) {
    FP8MOE_EACH_CHAIN(FP8MOE_STEP)
  }
  V s = hn::Zero(d);
  FP8MOE_EACH_CHAIN(FP8MOE_SUM)
#undef FP8MOE_INIT
#undef FP8MOE_STEP
#undef FP8MOE_SUM
  return Bits(hn::GetLane(hn::SumOfLanes(d, s)));
}

// int16 pairs into int32 as the int8 kernel without VNNI runs them
// (ReorderWidenMulAccumulate: vpmaddwd + vpaddd on x86). The chain's own
// accumulator is the multiplicand, so the multiply cannot be hoisted out of
// the loop; integer wrap-around is harmless.
HWY_NOINLINE uint64_t Int16PairsLoop(int64_t iters) {
#if HWY_TARGET == HWY_SCALAR
  // One-lane vectors cannot hold a pair: plain integer code, like the kernel.
  uint32_t c[kChains];
  for (int j = 0; j < kChains; ++j) c[j] = static_cast<uint32_t>(j + 1);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) {
      const int32_t lo = static_cast<int16_t>(c[j] & 0xFFFF), hi = static_cast<int16_t>(c[j] >> 16);
      c[j] += static_cast<uint32_t>(lo * 3 + hi * 3);
    }
  }
  uint64_t s = 0;
  for (uint32_t v : c) s += v;
  return s;
#else
  const hn::ScalableTag<int32_t> d32;
  const hn::Repartition<int16_t, decltype(d32)> d16;
  using V = hn::Vec<decltype(d32)>;
  const auto b = hn::Set(d16, int16_t{3});
  // x86 keeps the whole sum in the first accumulator and never touches the
  // second, so one `odd` serves every chain.
  V odd = hn::Zero(d32);
#define FP8MOE_INIT(j) V c##j = hn::Set(d32, j + 1);
#define FP8MOE_STEP(j)                                                           \
  c##j = hn::ReorderWidenMulAccumulate(d32, hn::BitCast(d16, c##j), b, c##j, odd); \
  FP8MOE_IN_REG(c##j.raw);
#define FP8MOE_SUM(j) s = hn::Add(s, c##j);
  FP8MOE_EACH_CHAIN(FP8MOE_INIT)
  for (int64_t i = 0; i < iters; ++i) {
    FP8MOE_EACH_CHAIN(FP8MOE_STEP)
  }
  V s = odd;
  FP8MOE_EACH_CHAIN(FP8MOE_SUM)
#undef FP8MOE_INIT
#undef FP8MOE_STEP
#undef FP8MOE_SUM
  // The lanes summed as unsigned: SumOfLanes on int32 is a signed sum (on
  // AVX-512 _mm512_reduce_add_epi32, plain int additions), and these
  // wrapped-around accumulators overflow it (UBSan caught it in `bench gmm`).
  const hn::RebindToUnsigned<decltype(d32)> du32;
  alignas(64) uint32_t lanes[hn::MaxLanes(du32)];
  hn::Store(hn::BitCast(du32, s), du32, lanes);
  uint64_t total = 0;
  for (size_t i = 0; i < hn::Lanes(du32); ++i) total += lanes[i];
  return total;
#endif
}

// Raw-intrinsics loops: c = FP8MOE_OP(c, a, b) over every chain, then the
// sum of all chains' 32-bit lanes (FP8MOE_INIT_OF, FP8MOE_OP, FP8MOE_ADD are
// defined around each use). Defined once: the file is included per target.
#ifndef FP8MOE_RAW_LOOP
#define FP8MOE_RAW_LOOP(VEC, LANES)                                    \
  VEC s;                                                               \
  {                                                                    \
    FP8MOE_EACH_CHAIN(FP8MOE_RAW_INIT)                                    \
    for (int64_t i = 0; i < iters; ++i) {                              \
      FP8MOE_EACH_CHAIN(FP8MOE_RAW_STEP)                                  \
    }                                                                  \
    s = c0;                                                            \
    FP8MOE_EACH_CHAIN(FP8MOE_RAW_SUM)                                     \
  }                                                                    \
  alignas(64) uint32_t lanes[LANES];                                   \
  std::memcpy(lanes, &s, sizeof(lanes));                               \
  uint64_t total = 0;                                                  \
  for (uint32_t v : lanes) total += v;                                 \
  return total;
#define FP8MOE_RAW_INIT(j) auto c##j = FP8MOE_INIT_OF(j);
#define FP8MOE_RAW_STEP(j) \
  c##j = FP8MOE_OP(c##j, a, b); \
  FP8MOE_IN_REG(c##j);
#define FP8MOE_RAW_SUM(j) s = FP8MOE_ADD(s, c##j);
#endif  // FP8MOE_RAW_LOOP

#if defined(FP8MOE_PEAK_AVX3)
#define FP8MOE_PEAK_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define FP8MOE_PEAK_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// c <- c + a0 b0 + a1 b1 per f32 lane, a = 2^-10 and b = 1 in bf16: c grows
// by 2^-9 a step, far from overflow for any run this bench makes.
FP8MOE_PEAK_BF16 HWY_NOINLINE uint64_t Bf16DotLoop(int64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3A80);
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3F80);
#define FP8MOE_INIT_OF(j) _mm512_set1_ps(static_cast<float>(j))
#define FP8MOE_OP _mm512_dpbf16_ps
#define FP8MOE_ADD _mm512_add_ps
  FP8MOE_RAW_LOOP(__m512, 16)
#undef FP8MOE_INIT_OF
#undef FP8MOE_OP
#undef FP8MOE_ADD
}

FP8MOE_PEAK_VNNI512 HWY_NOINLINE uint64_t Int16VnniLoop(int64_t iters) {
  const __m512i a = _mm512_set1_epi16(1), b = _mm512_set1_epi16(3);
#define FP8MOE_INIT_OF(j) _mm512_set1_epi32(j)
#define FP8MOE_OP _mm512_dpwssd_epi32
#define FP8MOE_ADD _mm512_add_epi32
  FP8MOE_RAW_LOOP(__m512i, 16)
#undef FP8MOE_INIT_OF
#undef FP8MOE_OP
#undef FP8MOE_ADD
}

FP8MOE_PEAK_VNNI512 HWY_NOINLINE uint64_t Int8VnniLoop(int64_t iters) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(3);
#define FP8MOE_INIT_OF(j) _mm512_set1_epi32(j)
#define FP8MOE_OP _mm512_dpbusd_epi32
#define FP8MOE_ADD _mm512_add_epi32
  FP8MOE_RAW_LOOP(__m512i, 16)
#undef FP8MOE_INIT_OF
#undef FP8MOE_OP
#undef FP8MOE_ADD
}
#endif  // FP8MOE_PEAK_AVX3

#if HWY_TARGET == HWY_AVX2
// AVX-VNNI (the VEX-encoded 256-bit vpdpwssd / vpdpbusd of Alder Lake,
// Sapphire Rapids, Zen 5). The kernels do not use it yet.
#define FP8MOE_PEAK_AVXVNNI __attribute__((target("avx2,avxvnni")))

FP8MOE_PEAK_AVXVNNI HWY_NOINLINE uint64_t Int16VnniLoop(int64_t iters) {
  const __m256i a = _mm256_set1_epi16(1), b = _mm256_set1_epi16(3);
#define FP8MOE_INIT_OF(j) _mm256_set1_epi32(j)
#define FP8MOE_OP _mm256_dpwssd_avx_epi32
#define FP8MOE_ADD _mm256_add_epi32
  FP8MOE_RAW_LOOP(__m256i, 8)
#undef FP8MOE_INIT_OF
#undef FP8MOE_OP
#undef FP8MOE_ADD
}

FP8MOE_PEAK_AVXVNNI HWY_NOINLINE uint64_t Int8VnniLoop(int64_t iters) {
  const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(3);
#define FP8MOE_INIT_OF(j) _mm256_set1_epi32(j)
#define FP8MOE_OP _mm256_dpbusd_avx_epi32
#define FP8MOE_ADD _mm256_add_epi32
  FP8MOE_RAW_LOOP(__m256i, 8)
#undef FP8MOE_INIT_OF
#undef FP8MOE_OP
#undef FP8MOE_ADD
}
#endif  // HWY_AVX2

// The instruction names of this target, for the output.
#undef FP8MOE_VREG
#if defined(FP8MOE_PEAK_AVX3)
#define FP8MOE_VREG "zmm"
#elif HWY_TARGET == HWY_AVX2
#define FP8MOE_VREG "ymm"
#else
#define FP8MOE_VREG "xmm"
#endif

// The kernels take their raw AVX-512 paths (vdpbf16ps, vpdpwssd) on the
// AVX3_SPR target only: Highway's AVX3 with the extensions enabled
// (kernels/cpu/gemm_exec.cc, numerics.h).
bool KernelsRawAvx512() { return HWY_TARGET == HWY_AVX3 && Avx512ExtensionsEnabled(); }

const char* PeakTargetName() {
  return HWY_TARGET == HWY_AVX3 ? SimdTargetName() : hwy::TargetName(HWY_TARGET);
}

PeakLoop GetPeakLoop(int kind) {
  const hn::ScalableTag<float> df;
  const int lanes = static_cast<int>(hn::Lanes(df));
  PeakLoop p;
  p.lanes = lanes;
  p.chains = kChains;
  switch (static_cast<PeakKind>(kind)) {
    case PeakKind::kF32Fma:
      p.available = p.kernels_use = true;
      p.ops_per_instr = 2.0 * lanes;
      p.run = &F32FmaLoop;
#if HWY_TARGET == HWY_AVX2 || defined(FP8MOE_PEAK_AVX3)
      p.instr = "vfmadd ps " FP8MOE_VREG;
#elif HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3
      p.instr = "mulps + addps xmm (no FMA on this target)";
#elif HWY_TARGET == HWY_SCALAR
      p.instr = "scalar mul + add (no SIMD on this target)";
#else
      p.instr = "mul + add on emulated vectors (no SIMD on this target)";
#endif
      return p;
    case PeakKind::kInt16Pairs:
      p.available = true;
      p.ops_per_instr = 4.0 * lanes;  // 2 int16 products + 2 adds per 32-bit lane
      p.run = &Int16PairsLoop;
#if HWY_TARGET == HWY_AVX2 || defined(FP8MOE_PEAK_AVX3)
      p.instr = "vpmaddwd + vpaddd " FP8MOE_VREG;
#elif HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3
      p.instr = "pmaddwd + paddd xmm";
#elif HWY_TARGET == HWY_SCALAR
      p.instr = "scalar int16 pair multiply-add";
#else
      p.instr = "int16 pair multiply-add on emulated vectors";
#endif
      // The int8 kernel's instructions wherever it does not use vpdpwssd.
      p.kernels_use = true;
#if defined(FP8MOE_PEAK_AVX3)
      p.kernels_use = !(KernelsRawAvx512() && __builtin_cpu_supports("avx512vnni"));
#endif
      return p;
    case PeakKind::kBf16Dot:
#if defined(FP8MOE_PEAK_AVX3)
      p.available = CpuHasAvx512Bf16Dot();
      p.kernels_use = KernelsRawAvx512() && UseBf16DotProducts();
      p.ops_per_instr = 4.0 * lanes;  // 2 bf16 products + 2 adds per f32 lane
      p.run = &Bf16DotLoop;
      p.instr = "vdpbf16ps zmm";
#endif
      return p;
    case PeakKind::kInt16Vnni:
#if defined(FP8MOE_PEAK_AVX3)
      p.available = __builtin_cpu_supports("avx512vnni");
      p.kernels_use = KernelsRawAvx512() && p.available;
      p.ops_per_instr = 4.0 * lanes;
      p.run = &Int16VnniLoop;
      p.instr = "vpdpwssd zmm";
#elif HWY_TARGET == HWY_AVX2
      p.available = __builtin_cpu_supports("avxvnni");
      p.ops_per_instr = 4.0 * lanes;
      p.run = &Int16VnniLoop;
      p.instr = "{vex} vpdpwssd ymm (AVX-VNNI)";
#endif
      return p;
    case PeakKind::kInt8Vnni:
#if defined(FP8MOE_PEAK_AVX3)
      p.available = __builtin_cpu_supports("avx512vnni");
      p.ops_per_instr = 8.0 * lanes;  // 4 u8 x s8 products + 4 adds per lane
      p.run = &Int8VnniLoop;
      p.instr = "vpdpbusd zmm";
#elif HWY_TARGET == HWY_AVX2
      p.available = __builtin_cpu_supports("avxvnni");
      p.ops_per_instr = 8.0 * lanes;
      p.run = &Int8VnniLoop;
      p.instr = "{vex} vpdpbusd ymm (AVX-VNNI)";
#endif
      return p;
    case PeakKind::kCount:
      break;
  }
  return p;
}

}  // namespace HWY_NAMESPACE
}  // namespace bench
}  // namespace fp8moe
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace fp8moe::bench {

HWY_EXPORT(GetPeakLoop);
HWY_EXPORT(PeakTargetName);

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The best of many runs of `threads` threads running fn(iters) at once.
struct Timing {
  int64_t iters = 0;
  // Runs per second of the whole team: the sum over threads of 1 / (the
  // thread's own CPU seconds), at most as many threads as CPUs counted. CPU
  // time leaves out the time other processes took from a thread, so a busy
  // machine does not pull this rate down unless it shares a core's pipes.
  double runs_per_s = 0;
  // The same from the parallel region's wall time (threads x 1 / wall): a
  // lower bound that falls when the machine is busy.
  double runs_per_s_wall = 0;
  double per_thread_runs_per_s = 0;  // the mean over threads, from CPU time
};

// One run: per-thread CPU rates summed, and the region's wall seconds.
void RunTogether(uint64_t (*fn)(int64_t), int64_t iters, int threads, double* cpu_rate,
                 double* per_thread_rate, double* wall) {
  double inv_cpu[1024] = {};
  uint64_t results[1024] = {};
  int team = 1;
  const double t0 = Now();
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num() & 1023;
    if (id == 0) team = omp_get_num_threads();
    const double c0 = ThreadCpuSeconds();
    results[id] = fn(iters);
    const double c = ThreadCpuSeconds() - c0;
    inv_cpu[id] = c > 0 ? 1.0 / c : 0.0;
  }
  *wall = Now() - t0;
  double sum = 0;
  for (int i = 0; i < std::min(team, 1024); ++i) sum += inv_cpu[i];
  // More threads than CPUs time-share them: count at most one thread per CPU.
  const int cpus = std::max(1, omp_get_num_procs());
  *cpu_rate = team > cpus ? sum * cpus / team : sum;
  *per_thread_rate = sum / team;
  volatile uint64_t sink = 0;
  for (uint64_t r : results) sink = sink + r;
}

// kRuns runs of about target_s / kRuns each. Short runs, many of them: on a
// shared machine the best run is one in which no thread was disturbed, and
// short runs have a better chance of that. Iterations are calibrated on the
// calling thread alone (grown until a run takes >= 1 ms, far above the
// clocks' resolution).
Timing BestOf(uint64_t (*fn)(int64_t), int threads, double target_s) {
  constexpr int kRuns = 40;
  volatile uint64_t sink = fn(1);
  int64_t iters = 1 << 8;
  double t = 0;
  for (;;) {
    const double t0 = Now();
    sink = sink + fn(iters);
    t = Now() - t0;
    if (t >= 1e-3 || iters >= (int64_t{1} << 40)) break;
    iters *= 2;
  }
  Timing best;
  best.iters =
      std::max(iters, static_cast<int64_t>(static_cast<double>(iters) * (target_s / kRuns) / t));
  double cpu_rate = 0, per_thread = 0, wall = 0;
  RunTogether(fn, 1, threads, &cpu_rate, &per_thread, &wall);  // starts OpenMP's threads
  double best_wall = 1e30;
  for (int r = 0; r < kRuns; ++r) {
    RunTogether(fn, best.iters, threads, &cpu_rate, &per_thread, &wall);
    best.runs_per_s = std::max(best.runs_per_s, cpu_rate);
    best.per_thread_runs_per_s = std::max(best.per_thread_runs_per_s, per_thread);
    best_wall = std::min(best_wall, wall);
  }
  best.runs_per_s_wall = threads / best_wall;
  return best;
}

#if defined(__x86_64__)
// 32 dependent integer adds per step: one per core cycle on every x86 core
// (a register operand, so no rename-time elimination of immediate adds); the
// loop counter runs on the other ALUs in parallel.
uint64_t AddChain(int64_t iters) {
  uint64_t x = 0, one = 1;
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile(".rept 32\n\taddq %1, %0\n\t.endr" : "+r"(x) : "r"(one));
  }
  return x;
}
#endif

}  // namespace

const char* PeakName(PeakKind kind) {
  switch (kind) {
    case PeakKind::kF32Fma: return "f32_fma";
    case PeakKind::kBf16Dot: return "bf16_dot";
    case PeakKind::kInt16Pairs: return "int16_pairs";
    case PeakKind::kInt16Vnni: return "int16_vnni";
    case PeakKind::kInt8Vnni: return "int8_vnni";
    case PeakKind::kCount: break;
  }
  return "?";
}

double MachinePeaks::TwoPipeF32Estimate() const {
  return 2.0 * Get(PeakKind::kF32Fma).loop.ops_per_instr * core_ghz * threads;
}

MachinePeaks MeasurePeaks(int threads) {
  MachinePeaks m;
  m.threads = threads;
  m.simd_target = HWY_DYNAMIC_DISPATCH(PeakTargetName)();
  constexpr double kTargetSeconds = 0.15;
#if defined(__x86_64__)
  {
    const uint64_t tsc0 = __rdtsc();
    const double t0 = Now();
    const Timing t = BestOf(&AddChain, threads, kTargetSeconds);
    const double wall = Now() - t0;
    const uint64_t tsc1 = __rdtsc();
    // 32 adds (cycles) per iteration.
    m.core_ghz = 32.0 * static_cast<double>(t.iters) * t.per_thread_runs_per_s / 1e9;
    m.tsc_ghz = static_cast<double>(tsc1 - tsc0) / wall / 1e9;
  }
#endif
  for (int k = 0; k < static_cast<int>(PeakKind::kCount); ++k) {
    Peak p;
    p.kind = static_cast<PeakKind>(k);
    p.loop = HWY_DYNAMIC_DISPATCH(GetPeakLoop)(k);
    p.what = std::to_string(p.loop.chains) + " independent accumulators in registers, " +
             p.loop.instr + " on " + std::to_string(p.loop.lanes) +
             " 32-bit lanes, no memory traffic; " + std::to_string(threads) +
             " threads at once";
    if (p.loop.available && p.loop.run != nullptr) {
      const Timing t = BestOf(p.loop.run, threads, kTargetSeconds);
      const double ops_per_run =
          static_cast<double>(t.iters) * p.loop.chains * p.loop.ops_per_instr;
      p.gops = ops_per_run * t.runs_per_s / 1e9;
      p.gops_wall = ops_per_run * t.runs_per_s_wall / 1e9;
      if (m.core_ghz > 0) p.ops_per_cycle = p.gops / (m.core_ghz * threads);
    }
    m.peaks.push_back(p);
  }
  return m;
}

}  // namespace fp8moe::bench
#endif  // HWY_ONCE
