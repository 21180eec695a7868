// `fp8moe bench moe`: one MoE layer forward + backward per QAT mode at the
// issue's shape (T=4096, D=1024, F=1024, E=8, k=2), as the trainer runs it
// (prepared weights and workspace kept from step to step, modes interleaved
// round by round): time, the native / fake QAT ratio, and the memory
// high-water mark of each mode's first step (all tensors and
// kernel scratch the library allocates, counted by fp8moe/memory.h), next to
// ceilings measured in the same run: OpenBLAS sgemm (from a core right for
// this CPU) on the step's largest GEMM shape, and the register-only peak of
// the arithmetic most of the step's FLOPs run on.
//
// FLOPs per step: forward 2 * T*k * (D*2F + F*D), backward twice that.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_moe.h"
#include "bench/bench_util.h"
#include "bench/sgemm_ceiling.h"
#include "fp8moe/memory.h"
#include "fp8moe/moe.h"
#include "fp8moe/numerics.h"

namespace fp8moe::bench {
namespace {

struct Mode {
  std::string name;
  std::vector<std::string> flags;
};

// The QAT modes, by the flags of `fp8moe train` that make each.
std::vector<Mode> AllModes() {
  return {
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
}

// --shape picks modes: a list "a,b" by their exact names (fake_qat and
// native fwd+dlhs alone), else every mode whose name contains it. The picked
// modes in their order; false, after printing the refusal with the modes,
// when a listed name is no mode or nothing matches.
bool PickModes(const std::string& filter, const std::vector<Mode>& modes,
               std::vector<const Mode*>* picked) {
  std::vector<std::string> exact;
  if (filter.find(',') != std::string::npos) {
    for (size_t from = 0;;) {
      const size_t comma = filter.find(',', from);
      exact.push_back(filter.substr(from, comma - from));
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
  }
  auto selected = [&](const Mode& m) {
    if (!exact.empty()) return std::find(exact.begin(), exact.end(), m.name) != exact.end();
    return filter.empty() || m.name.find(filter) != std::string::npos;
  };
  std::string names;
  for (const Mode& m : modes) names += (names.empty() ? "'" : ", '") + m.name + "'";
  for (const std::string& e : exact) {
    if (std::none_of(modes.begin(), modes.end(), [&](const Mode& m) { return m.name == e; })) {
      std::fprintf(stderr, "error: --shape '%s': '%s' is no mode of bench moe (a list picks "
                   "modes by their exact names); the modes: %s\n", filter.c_str(), e.c_str(),
                   names.c_str());
      return false;
    }
  }
  if (std::none_of(modes.begin(), modes.end(), selected)) {
    std::fprintf(stderr, "error: --shape '%s' matches no mode of bench moe (there it picks "
                 "modes by name); the modes: %s\n", filter.c_str(), names.c_str());
    return false;
  }
  for (const Mode& m : modes) {
    if (selected(m)) picked->push_back(&m);
  }
  return true;
}

// The layer's input x [T, D], output gradient dy [T, D] and weights: router
// [D, E], wi [E, D, 2F], wo [E, F, D]; the same for every mode.
struct MoeOperands {
  Tensor x, dy, router, wi, wo;
  MoeWeights w;
};

MoeOperands MakeOperands(int64_t T, int64_t D, int64_t F, int64_t E) {
  std::mt19937 rng(11);
  MoeOperands o;
  o.x = RandomF32(rng, {T, D}, 1.0f);
  o.dy = RandomF32(rng, {T, D}, 1.0f);
  o.router = RandomF32(rng, {D, E}, 0.05f);
  o.wi = RandomF32(rng, {E, D, 2 * F}, 0.03f);
  o.wo = RandomF32(rng, {E, F, D}, 0.03f);
  o.w = MoeWeights{o.router.view(), o.wi.view(), o.wo.view()};
  return o;
}

// A mode this run times, with what a training loop keeps from step to step
// (model/model.cc): its own context (kernel scratch), prepared weights,
// workspace, output and gradient buffers. A step is what the trainer runs
// per layer: PrepareMoeWeights (the masters change every step) + MoeForward
// as "fwd", MoeBackward as "bwd"; after the warm-up step none of them
// allocates (moe_workspace_test), so the times hold no page faults of fresh
// buffers, which were ~8% of the step with the one-call API's fresh
// workspace per call.
struct ModeRun {
  const Mode* mode = nullptr;
  MoeConfig cfg;
  std::unique_ptr<Context> ctx;
  PreparedMoeWeights prepared;
  MoeWorkspace workspace;
  Tensor y, dx, drouter, dwi, dwo;
  double best_f = 1e30, best_b = 1e30;
  std::vector<double> steps;  // seconds of each timed round
  std::vector<double> fwds, bwds;  // its fwd and bwd parts
  int64_t peak = 0;
};

std::vector<ModeRun> MakeRuns(const std::vector<const Mode*>& modes, int threads) {
  std::vector<ModeRun> runs;
  for (const Mode* m : modes) {
    Config cfgfile = std::move(LoadConfig(MoeConfigSchema(), "", m->flags)).value();
    ModeRun& r = runs.emplace_back();
    r.mode = m;
    r.cfg = std::move(MoeConfigFrom(cfgfile)).value();
    ContextOptions co;
    co.threads = threads;
    r.ctx = std::make_unique<Context>(co);
  }
  return runs;
}

// One step of run r: its fwd and bwd seconds; false (after printing why) on
// an error.
bool Step(const MoeOperands& in, ModeRun& r, double* fwd_s, double* bwd_s) {
  const double t0 = NowSeconds();
  Status st = PrepareMoeWeights(*r.ctx, r.cfg, in.w.wi, in.w.wo, &r.prepared);
  MoeStepInfo info;
  if (st.ok()) {
    st = MoeForward(*r.ctx, r.cfg, in.x.view(), in.w, r.prepared, &r.workspace, r.y.view(), &info);
  }
  const double t1 = NowSeconds();
  if (st.ok()) {
    const MoeGradientViews g{r.dx.view(), r.drouter.view(), r.dwi.view(), r.dwo.view()};
    st = MoeBackward(*r.ctx, r.cfg, in.x.view(), in.w, r.prepared, &r.workspace, in.dy.view(), g);
  }
  const double t2 = NowSeconds();
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s: %s\n", r.mode->name.c_str(), st.ToString().c_str());
    return false;
  }
  *fwd_s = t1 - t0;
  *bwd_s = t2 - t1;
  return true;
}

// Warm-up round, one mode at a time: the memory high-water of a first step
// (its buffers, codes or copies, and kernel scratch, from nothing) into each
// run's `peak`. Every mode keeps its buffers for the whole run (T=4096: ~0.4
// GiB each). Before each mode's first step, an estimate: if the bytes held
// plus the largest first step so far pass 3/4 of the memory cap
// (fp8moe/memory.h: by default the memory available at start; with no cap,
// the physical memory), the run is refused with what to do, rather than
// midway by the cap or the kernel's OOM killer. (The first mode has no
// estimate; the cap still refuses what does not fit.) The exit code: 0, 1
// (a step failed) or 2 (refused).
int WarmUpEachMode(const MoeOperands& in, std::vector<ModeRun>* runs) {
  const bool capped = MemoryCap() > 0;
  const double limit = capped ? static_cast<double>(MemoryCap())
                              : static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  const std::string limit_name = capped ? "the memory cap (" + MemoryCapSource() + ")" : "the memory";
  int64_t most = 0;
  for (ModeRun& r : *runs) {
    const int64_t held = GetMemoryStats().in_use;
    if (static_cast<double>(held + most) > 0.75 * limit) {
      std::fprintf(stderr, "error: bench moe keeps every mode's buffers for the whole run: %.1f GiB "
                   "are held and the next mode needs about %.1f GiB more, over 3/4 of %s, "
                   "%.1f GiB; pick fewer modes with --shape or use fewer --tokens\n",
                   held / 1073741824.0, most / 1073741824.0, limit_name.c_str(),
                   limit / 1073741824.0);
      return 2;
    }
    ResetMemoryPeak();
    const int64_t base = GetMemoryStats().in_use;
    r.y = MustCreate(DType::kF32, in.x.shape());
    r.dx = MustCreate(DType::kF32, in.x.shape());
    r.drouter = MustCreate(DType::kF32, in.router.shape());
    r.dwi = MustCreate(DType::kF32, in.wi.shape());
    r.dwo = MustCreate(DType::kF32, in.wo.shape());
    double f = 0, b = 0;
    if (!Step(in, r, &f, &b)) return 1;
    r.peak = GetMemoryStats().peak - base;
    most = std::max(most, r.peak);
  }
  return 0;
}

// Timed rounds: every mode once per round, so that a neighbour's load,
// which drifts over seconds on shared machines, falls on all modes alike
// rather than on whichever ran during it; best of the rounds per mode. Each
// round starts one mode later, so no mode always follows the same one. The
// sgemm ceiling's child, if any, runs once before each round's modes; its
// best seconds go to *sgemm_seconds (left as they are without a child).
// False (after printing why) when a step fails.
bool TimeRounds(const BenchOptions& opt, const MoeOperands& in, SgemmRounds* sgemm_rounds,
                std::vector<ModeRun>* runs_out, double* sgemm_seconds) {
  std::vector<ModeRun>& runs = *runs_out;
  if (sgemm_rounds != nullptr) sgemm_rounds->Run(0);  // its warm-up, as the modes had theirs
  for (int round = 0; round < opt.reps; ++round) {
    if (sgemm_rounds != nullptr) *sgemm_seconds = std::min(*sgemm_seconds, sgemm_rounds->Run(0));
    for (size_t q = 0; q < runs.size(); ++q) {
      ModeRun& r = runs[(q + static_cast<size_t>(round)) % runs.size()];
      double f = 0, b = 0;
      if (!Step(in, r, &f, &b)) return false;
      r.best_f = std::min(r.best_f, f);
      r.best_b = std::min(r.best_b, b);
      r.steps.push_back(f + b);
      r.fwds.push_back(f);
      r.bwds.push_back(b);
    }
    if (!opt.json) std::fprintf(stderr, "  round %d of %d\n", round + 1, opt.reps);
  }
  return true;
}

// A native mode's step against fake_qat's: best against best, and the
// rounds' own ratios (each round's two steps ran seconds apart under the
// same load): their median with a distribution-free interval, which says
// whether the rounds can tell the two modes apart at all; and the same for
// the step's two parts. Into the mode's JSON row and a note.
void AddRatioToFakeQat(const ModeRun& r, const ModeRun& fake, nlohmann::json* row, Table* t) {
  const RatioInterval step = PairedRatioInterval(r.steps, fake.steps);
  const RatioInterval fwd = PairedRatioInterval(r.fwds, fake.fwds);
  const RatioInterval bwd = PairedRatioInterval(r.bwds, fake.bwds);
  const double best = (r.best_f + r.best_b) / (fake.best_f + fake.best_b);
  (*row)["step_ratio_to_fake_qat"] = best;
  (*row)["step_ratio_to_fake_qat_median_round"] = step.median;
  (*row)["step_ratio_to_fake_qat_interval"] = IntervalJson(step);
  (*row)["fwd_ratio_to_fake_qat_interval"] = IntervalJson(fwd);
  (*row)["bwd_ratio_to_fake_qat_interval"] = IntervalJson(bwd);
  t->notes.push_back(r.mode->name + " / fake_qat step time: " + Fixed(best, 3) +
                     " best against best; " + DescribeInterval(step) +
                     " (below 1: native is faster); fwd " + Fixed(fwd.median, 3) + " (" +
                     Fixed(fwd.low, 3) + "-" + Fixed(fwd.high, 3) + "), bwd " +
                     Fixed(bwd.median, 3) + " (" + Fixed(bwd.low, 3) + "-" + Fixed(bwd.high, 3) +
                     ")");
}

// Each mode's row of the table and of the JSON's "rows", its GFLOP/s over
// `gemm_ceiling` (sgemm when trusted, else the f32 FMA peak) and over the
// peak that bounds it.
nlohmann::json ModeRowsToTableAndJson(const std::vector<ModeRun>& runs, double flops,
                                      const MachineCeilings& ceil, bool sgemm_trusted,
                                      double sgemm_gflops, double gemm_ceiling, bool json,
                                      Table* t) {
  const double fma_gflops = ceil.peaks.Get(PeakKind::kF32Fma).gops;
  nlohmann::json rows = nlohmann::json::array();
  const ModeRun* fake = nullptr;
  for (const ModeRun& r : runs) {
    if (r.mode->name == "fake_qat") fake = &r;
  }
  for (const ModeRun& r : runs) {
    const Mode& m = *r.mode;
    const double best_f = r.best_f, best_b = r.best_b, step_s = best_f + best_b;
    const double gf = flops / step_s / 1e9;
    // Most of a step's FLOPs run in bf16/fp8 (pair) arithmetic, except in f32
    // mode (int8 quantizes only the forward, a third of the FLOPs).
    const Peak& bound = BoundingPeak(
        ceil.peaks, m.name.rfind("f32", 0) == 0 ? KernelArith::kF32 : KernelArith::kBf16Pairs);
    t->rows.push_back({m.name, Fixed(best_f * 1e3, 1), Fixed(best_b * 1e3, 1),
                       Fixed(step_s * 1e3, 1), Fixed(gf, 1), Fixed(gf / gemm_ceiling, 2),
                       Fixed(gf / bound.gops, 2), PeakName(bound.kind),
                       Fixed(static_cast<double>(r.peak) / (1 << 20), 1)});
    nlohmann::json row = {{"mode", m.name}, {"fwd_seconds", best_f}, {"bwd_seconds", best_b},
                          {"step_seconds_per_round", r.steps},
                          {"fwd_seconds_per_round", r.fwds}, {"bwd_seconds_per_round", r.bwds},
                          {"gflops", gf},
                          {"ratio_to_sgemm", sgemm_trusted ? nlohmann::json(gf / sgemm_gflops)
                                                           : nlohmann::json()},
                          {"bound_peak", PeakName(bound.kind)}, {"ratio_to_peak", gf / bound.gops},
                          {"ratio_to_fma_peak", gf / fma_gflops}, {"peak_bytes", r.peak}};
    if (fake != nullptr && m.name.rfind("native", 0) == 0) AddRatioToFakeQat(r, *fake, &row, t);
    rows.push_back(row);
    if (!json) std::fprintf(stderr, "  %-20s %8.1f ms\n", m.name.c_str(), step_s * 1e3);
  }
  return rows;
}

}  // namespace

int BenchMoe(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  const int64_t T = opt.tokens, D = 1024, F = 1024, E = 8, k = 2;
  const MoeOperands in = MakeOperands(T, D, F, E);
  const std::vector<Mode> modes = AllModes();
  std::vector<const Mode*> picked;
  if (!PickModes(opt.shape, modes, &picked)) return 2;
  const double flops = 3.0 * 2.0 * static_cast<double>(T * k) * (D * 2 * F + F * D);
  // Ceilings: the machine's peaks and bandwidths; sgemm of the step's
  // largest GEMM, [T*k, D] x [D, 2F], from a right core (else, loudly, the
  // f32 FMA peak stands in for it).
  // Measured again after the timed rounds (RemeasureCeilings, the higher of
  // each kept); the ratios are computed after that.
  MachineCeilings ceil = MeasureMachineCeilings(opt.threads, opt.reps, size_t{256} << 20);
  const std::vector<SgemmShape> sgemm_shapes = {{T * k, D, 2 * F}};
  const SgemmCeiling sgemm =
      MeasureSgemmCeiling(sgemm_shapes, opt.threads, opt.reps, opt.sgemm_core);
  // The same sgemm timed again once per timed round, before the round's
  // modes, in a child with the ceiling's core (SgemmRounds, as bench gmm
  // does): the ceiling then drifts with the steps it divides. The best of
  // those is the ceiling; without them (no trusted core, or the child did
  // not start) the one timed before the rounds stands.
  std::string rounds_error;
  std::unique_ptr<SgemmRounds> sgemm_rounds =
      SgemmRounds::Start(sgemm, sgemm_shapes, opt.threads, &rounds_error);
  double sgemm_gflops = sgemm.Gflops(sgemm_shapes, 0);

  std::vector<ModeRun> runs = MakeRuns(picked, opt.threads);
  if (const int rc = WarmUpEachMode(in, &runs); rc != 0) return rc;
  double sgemm_round_seconds = 1e30;
  if (!TimeRounds(opt, in, sgemm_rounds.get(), &runs, &sgemm_round_seconds)) return 1;

  sgemm_rounds.reset();
  if (sgemm_round_seconds < 1e30) sgemm_gflops = sgemm_shapes[0].Flops() / sgemm_round_seconds / 1e9;
  RemeasureCeilings(&ceil);
  const double fma_gflops = ceil.peaks.Get(PeakKind::kF32Fma).gops;
  const double gemm_ceiling = sgemm.trusted ? sgemm_gflops : fma_gflops;

  Table t;
  t.title = "fp8moe bench moe: T=" + std::to_string(T) + " D=1024 F=1024 E=8 k=2, " +
            std::to_string(opt.threads) + " threads, SIMD " + SimdTargetName();
  t.columns = {"mode",   "fwd ms", "bwd ms", "step ms", "GFLOP/s", sgemm.trusted ? "x sgemm" : "x FMA peak!",
               "x peak", "peak", "peak MiB"};
  const nlohmann::json rows = ModeRowsToTableAndJson(runs, flops, ceil, sgemm.trusted,
                                                     sgemm_gflops, gemm_ceiling, opt.json, &t);
  t.notes.push_back("sgemm: " + Fixed(sgemm_gflops, 1) + " GFLOP/s on [T*k, D] x [D, 2F] = " +
                    Fixed(sgemm_gflops / fma_gflops, 2) + " of the f32 FMA peak; " +
                    (rounds_error.empty() ? "best of it timed once per round before the "
                                            "round's modes (in a child process, by its own clock)"
                                          : "timed before the rounds (" + rounds_error + ")"));
  for (const std::string& n : SgemmNotes(sgemm)) t.notes.push_back(n);
  for (const std::string& n : CeilingNotes(ceil)) t.notes.push_back(n);
  t.notes.push_back("step: PrepareMoeWeights + MoeForward (together 'fwd', as before) + "
                    "MoeBackward ('bwd') on buffers kept from step to step, as the trainer runs "
                    "a layer; modes interleaved, one step each per round (each round starting "
                    "one mode later), best of " + std::to_string(opt.reps) +
                    " rounds after a warm-up");
  t.notes.push_back("peak MiB: high-water of everything fp8moe allocates during a first step "
                    "(weights' codes or copies, buffers, gradients, kernel scratch), from nothing");
  if (opt.json) {
    nlohmann::json j = {{"bench", "moe"}, {"threads", opt.threads}, {"tokens", T},
                        {"simd_target", SimdTargetName()},
                        {"sgemm_gflops", sgemm.trusted ? nlohmann::json(sgemm_gflops) : nlohmann::json()},
                        {"sgemm_in_rounds", rounds_error.empty()},
                        {"sgemm_not_in_rounds_because", rounds_error},
                        {"ceilings", CeilingsJson(ceil)}, {"sgemm", SgemmJson(sgemm, sgemm_shapes)},
                        {"rows", rows}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    t.Print();
  }
  return 0;
}

}  // namespace fp8moe::bench
