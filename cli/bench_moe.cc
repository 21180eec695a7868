// `fp8moe bench moe`: one MoE layer forward + backward per QAT mode at the
// issue's shape (T=4096, D=1024, F=1024, E=8, k=2): time, the native / fake
// QAT ratio, and the memory high-water mark of each step (all tensors and
// kernel scratch the library allocates, counted by fp8moe/memory.h), next to
// ceilings measured in the same run: OpenBLAS sgemm (from a core right for
// this CPU) on the step's largest GEMM shape, and the register-only peak of
// the arithmetic most of the step's FLOPs run on.
//
// FLOPs per step: forward 2 * T*k * (D*2F + F*D), backward twice that.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/bench.h"
#include "cli/bench_util.h"
#include "cli/sgemm_ceiling.h"
#include "fp8moe/gmm.h"
#include "fp8moe/memory.h"
#include "fp8moe/moe.h"
#include "fp8moe/numerics.h"

namespace fp8moe::bench {
namespace {

Tensor RandomF32(std::mt19937& rng, Shape s, float sd) {
  Tensor t = std::move(Tensor::Create(DType::kF32, std::move(s))).value();
  std::normal_distribution<float> nd(0.0f, sd);
  for (size_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = nd(rng);
  return t;
}

struct Mode {
  std::string name;
  std::vector<std::string> flags;
};

}  // namespace

int BenchMoe(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  const int64_t T = opt.tokens, D = 1024, F = 1024, E = 8, k = 2;
  std::mt19937 rng(11);
  Tensor x = RandomF32(rng, {T, D}, 1.0f), dy = RandomF32(rng, {T, D}, 1.0f);
  Tensor router = RandomF32(rng, {D, E}, 0.05f);
  Tensor wi = RandomF32(rng, {E, D, 2 * F}, 0.03f), wo = RandomF32(rng, {E, F, D}, 0.03f);
  const MoeWeights w{router.view(), wi.view(), wo.view()};
  const std::vector<Mode> modes = {
      {"bf16 (none)", {}},
      {"f32 (none)", {"dtype=float32"}},
      {"fake_qat", {"fp8_moe_fake_quant=true"}},
      {"native fwd", {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                      "fp8_moe_native_fwd=true"}},
      {"native fwd+dlhs", {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                           "fp8_moe_native_fwd=true", "fp8_moe_native_bwd_dlhs=true"}},
      {"fp8_full", {"quantization=fp8_full", "use_qwix_quantization=true"}},
      {"fp8_full inkernel", {"quantization=fp8_full", "use_qwix_quantization=true",
                             "moe_bwd_inkernel_quant=true"}},
      {"int8", {"quantization=int8"}},
      {"fp8 (hand-crafted)", {"quantization=fp8"}},
      {"nanoo_fp8", {"quantization=nanoo_fp8"}},
  };
  if (!opt.shape.empty() &&
      std::none_of(modes.begin(), modes.end(),
                   [&](const Mode& m) { return m.name.find(opt.shape) != std::string::npos; })) {
    std::string names;
    for (const Mode& m : modes) names += (names.empty() ? "'" : ", '") + m.name + "'";
    std::fprintf(stderr, "error: --shape '%s' matches no mode of bench moe (there it picks "
                 "modes by name); the modes: %s\n", opt.shape.c_str(), names.c_str());
    return 2;
  }
  const double flops = 3.0 * 2.0 * static_cast<double>(T * k) * (D * 2 * F + F * D);
  // Ceilings: the machine's peaks and bandwidths; sgemm of the step's
  // largest GEMM, [T*k, D] x [D, 2F], from a right core (else, loudly, the
  // f32 FMA peak stands in for it).
  const MachineCeilings ceil = MeasureMachineCeilings(opt.threads, opt.reps, size_t{256} << 20);
  const std::vector<SgemmShape> sgemm_shapes = {{T * k, D, 2 * F}};
  const SgemmCeiling sgemm =
      MeasureSgemmCeiling(sgemm_shapes, opt.threads, opt.reps, opt.sgemm_core);
  const double sgemm_gflops = sgemm.Gflops(sgemm_shapes, 0);
  const double fma_gflops = ceil.peaks.Get(PeakKind::kF32Fma).gops;
  const double gemm_ceiling = sgemm.trusted ? sgemm_gflops : fma_gflops;

  Table t;
  t.title = "fp8moe bench moe: T=" + std::to_string(T) + " D=1024 F=1024 E=8 k=2, " +
            std::to_string(opt.threads) + " threads, SIMD " + SimdTargetName();
  t.columns = {"mode",   "fwd ms", "bwd ms", "step ms", "GFLOP/s", sgemm.trusted ? "x sgemm" : "x FMA peak!",
               "x peak", "peak", "peak MiB"};
  nlohmann::json rows = nlohmann::json::array();
  double fake_ms = 0;
  std::vector<std::pair<std::string, double>> steps;
  for (const Mode& m : modes) {
    if (!opt.shape.empty() && m.name.find(opt.shape) == std::string::npos) continue;
    Config cfgfile = std::move(LoadConfig(MoeConfigSchema(), "", m.flags)).value();
    const MoeConfig cfg = std::move(MoeConfigFrom(cfgfile)).value();
    ReleaseGmmScratch();  // each mode's high-water starts from nothing cached
    ResetMemoryPeak();
    const int64_t base = GetMemoryStats().in_use;
    double best_f = 1e30, best_b = 1e30;
    int64_t peak = 0;
    for (int r = 0; r < opt.reps + 1; ++r) {
      const double t0 = NowSeconds();
      auto f = MoeForward(cfg, x.view(), w);
      const double t1 = NowSeconds();
      auto g = MoeBackward(cfg, x.view(), w, *f, dy.view());
      const double t2 = NowSeconds();
      if (!f.ok() || !g.ok()) {
        std::fprintf(stderr, "error: %s\n", (f.ok() ? g.status() : f.status()).ToString().c_str());
        return 1;
      }
      peak = std::max(peak, GetMemoryStats().peak - base);
      if (r == 0) continue;  // warm-up
      best_f = std::min(best_f, t1 - t0);
      best_b = std::min(best_b, t2 - t1);
    }
    const double step = best_f + best_b;
    if (m.name == "fake_qat") fake_ms = step * 1e3;
    steps.push_back({m.name, step * 1e3});
    const double gf = flops / step / 1e9;
    // Most of a step's FLOPs run in bf16/fp8 (pair) arithmetic, except in f32
    // mode (int8 quantizes only the forward, a third of the FLOPs).
    const Peak& bound = BoundingPeak(
        ceil.peaks, m.name.rfind("f32", 0) == 0 ? KernelArith::kF32 : KernelArith::kBf16Pairs);
    t.rows.push_back({m.name, Fixed(best_f * 1e3, 1), Fixed(best_b * 1e3, 1), Fixed(step * 1e3, 1),
                      Fixed(gf, 1), Fixed(gf / gemm_ceiling, 2), Fixed(gf / bound.gops, 2),
                      PeakName(bound.kind), Fixed(static_cast<double>(peak) / (1 << 20), 1)});
    rows.push_back({{"mode", m.name}, {"fwd_seconds", best_f}, {"bwd_seconds", best_b},
                    {"gflops", gf},
                    {"ratio_to_sgemm", sgemm.trusted ? nlohmann::json(gf / sgemm_gflops)
                                                     : nlohmann::json()},
                    {"bound_peak", PeakName(bound.kind)}, {"ratio_to_peak", gf / bound.gops},
                    {"ratio_to_fma_peak", gf / fma_gflops}, {"peak_bytes", peak}});
    if (!opt.json) std::fprintf(stderr, "  %-20s %8.1f ms\n", m.name.c_str(), step * 1e3);
  }
  for (const auto& [name, ms] : steps) {
    if (name.rfind("native", 0) == 0) {
      t.notes.push_back(name + " / fake_qat step time: " + Fixed(ms / fake_ms, 3) +
                        " (below 1: native is faster)");
    }
  }
  t.notes.push_back("sgemm: " + Fixed(sgemm_gflops, 1) + " GFLOP/s on [T*k, D] x [D, 2F] = " +
                    Fixed(sgemm_gflops / fma_gflops, 2) + " of the f32 FMA peak");
  for (const std::string& n : SgemmNotes(sgemm)) t.notes.push_back(n);
  for (const std::string& n : CeilingNotes(ceil)) t.notes.push_back(n);
  t.notes.push_back("peak MiB: high-water of everything fp8moe allocates during one step "
                    "(weights' codes or copies, buffers, scratch), kernel scratch freed before each mode");
  if (opt.json) {
    nlohmann::json j = {{"bench", "moe"}, {"threads", opt.threads}, {"tokens", T},
                        {"simd_target", SimdTargetName()},
                        {"sgemm_gflops", sgemm.trusted ? nlohmann::json(sgemm_gflops) : nlohmann::json()},
                        {"ceilings", CeilingsJson(ceil)}, {"sgemm", SgemmJson(sgemm, sgemm_shapes)},
                        {"rows", rows}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    t.Print();
  }
  return 0;
}

}  // namespace fp8moe::bench
