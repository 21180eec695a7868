#include "bench/openblas_core.h"

#include <strings.h>

#include "fp8moe/numerics.h"

namespace fp8moe::bench {
namespace {

struct NamedCore {
  const char* name;
  IsaTier tier;
};

// The x86-64 core names of OpenBLAS 0.3.21 (corename[] in
// driver/others/dynamic.c) plus SapphireRapids of later releases, by the
// widest SIMD their sgemm kernels use. Bulldozer ... Excavator use 128-bit
// FMA3/FMA4 kernels, so they count as AVX even on Excavator (which has AVX2).
constexpr NamedCore kCores[] = {
    {"SapphireRapids", IsaTier::kAvx512}, {"Cooperlake", IsaTier::kAvx512},
    {"SkylakeX", IsaTier::kAvx512},       {"Haswell", IsaTier::kAvx2},
    {"Zen", IsaTier::kAvx2},              {"Sandybridge", IsaTier::kAvx},
    {"Bulldozer", IsaTier::kAvx},         {"Piledriver", IsaTier::kAvx},
    {"Steamroller", IsaTier::kAvx},       {"Excavator", IsaTier::kAvx},
    {"Katmai", IsaTier::kSse},            {"Coppermine", IsaTier::kSse},
    {"Northwood", IsaTier::kSse},         {"Prescott", IsaTier::kSse},
    {"Banias", IsaTier::kSse},            {"Atom", IsaTier::kSse},
    {"Core2", IsaTier::kSse},             {"Penryn", IsaTier::kSse},
    {"Dunnington", IsaTier::kSse},        {"Nehalem", IsaTier::kSse},
    {"Athlon", IsaTier::kSse},            {"Opteron", IsaTier::kSse},
    {"Opteron_SSE3", IsaTier::kSse},      {"Barcelona", IsaTier::kSse},
    {"Nano", IsaTier::kSse},              {"Bobcat", IsaTier::kSse},
};

// OPENBLAS_CORETYPE values that run the best sgemm kernel of a CPU of this
// tier, best first. Cooperlake goes first on AVX512-BF16 CPUs: 0.3.21 does
// not find the name and picks by features, which gives Cooperlake there;
// SkylakeX (the same sgemm kernel) is found by name.
std::vector<std::string> Candidates(const CpuIsa& isa) {
  switch (TierOf(isa)) {
    case IsaTier::kAvx512:
      if (isa.avx512bf16) return {"Cooperlake", "SkylakeX"};
      return {"SkylakeX"};
    case IsaTier::kAvx2:
      if (isa.amd) return {"Zen", "Haswell"};
      return {"Haswell"};
    case IsaTier::kAvx:
      return {"Sandybridge"};
    case IsaTier::kSse:
      return {};
  }
  return {};
}

}  // namespace

std::string_view IsaTierName(IsaTier tier) {
  switch (tier) {
    case IsaTier::kSse: return "sse";
    case IsaTier::kAvx: return "avx";
    case IsaTier::kAvx2: return "avx2";
    case IsaTier::kAvx512: return "avx512";
  }
  return "?";
}

CpuIsa DetectCpuIsa() {
  CpuIsa isa;
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's CPUID reading also checks XGETBV, so a feature the OS does not
  // save the registers of reads as absent.
  __builtin_cpu_init();
  isa.amd = __builtin_cpu_is("amd");
  isa.avx = __builtin_cpu_supports("avx");
  isa.avx2 = __builtin_cpu_supports("avx2");
  isa.fma = __builtin_cpu_supports("fma");
  isa.avx512f = __builtin_cpu_supports("avx512f");
  isa.avx512bw = __builtin_cpu_supports("avx512bw");
  isa.avx512dq = __builtin_cpu_supports("avx512dq");
  isa.avx512vl = __builtin_cpu_supports("avx512vl");
  isa.avx512bf16 = CpuHasAvx512Bf16Dot();
#endif
  return isa;
}

CpuIsa CapToSimdTarget(CpuIsa isa, std::string_view target) {
  const IsaTier before = TierOf(isa);
  if (target != "AVX3_SPR") isa.avx512bf16 = false;
  if (target != "AVX3_SPR" && target != "AVX3") {
    isa.avx512f = isa.avx512bw = isa.avx512dq = isa.avx512vl = false;
  }
  if (target != "AVX3_SPR" && target != "AVX3" && target != "AVX2") {
    isa.avx = isa.avx2 = isa.fma = false;
  }
  if (TierOf(isa) != before) isa.target = std::string(target);
  return isa;
}

IsaTier TierOf(const CpuIsa& isa) {
  if (isa.avx512f && isa.avx512bw && isa.avx512dq && isa.avx512vl) return IsaTier::kAvx512;
  if (isa.avx2 && isa.fma) return IsaTier::kAvx2;
  if (isa.avx) return IsaTier::kAvx;
  return IsaTier::kSse;
}

bool CoreTier(std::string_view corename, IsaTier* tier) {
  for (const NamedCore& c : kCores) {
    const std::string_view name(c.name);
    if (name.size() == corename.size() &&
        strncasecmp(name.data(), corename.data(), name.size()) == 0) {
      *tier = c.tier;
      return true;
    }
  }
  return false;
}

std::string KnownCoreNames() {
  std::string s;
  for (const NamedCore& c : kCores) s += (s.empty() ? "" : ", ") + std::string(c.name);
  return s;
}

CoreAdvice AdviseCore(std::string_view corename, const CpuIsa& isa) {
  const IsaTier cpu = TierOf(isa);
  const std::string core(corename);
  const std::string cpu_name =
      std::string(IsaTierName(cpu)) + (isa.target.empty() ? "" : " (--simd " + isa.target + ")");
  CoreAdvice a;
  IsaTier tier;
  if (!CoreTier(corename, &tier)) {
    a.fallback = true;
    a.why = "OpenBLAS core '" + core + "' is not one this bench knows, so it cannot vouch for it";
  } else if (tier < cpu) {
    a.fallback = true;
    a.why = "OpenBLAS core " + core + " runs " + std::string(IsaTierName(tier)) +
            " kernels, a fallback below this " + cpu_name + " CPU";
  } else if (tier > cpu) {
    // A forced core the CPU cannot run (sgemm would die of SIGILL).
    a.fallback = true;
    a.why = "OpenBLAS core " + core + " needs " + std::string(IsaTierName(tier)) +
            ", which this " + cpu_name + " CPU lacks";
  } else {
    a.why = "OpenBLAS core " + core + " runs " + std::string(IsaTierName(tier)) +
            " kernels on this " + cpu_name + " CPU";
    return a;
  }
  a.coretypes = Candidates(isa);
  return a;
}

}  // namespace fp8moe::bench
