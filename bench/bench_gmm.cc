// `fp8moe bench gmm`: GFLOP/s of every GMM pass and mode on the shapes of
// the issue, each next to ceilings measured in the same run: OpenBLAS sgemm
// (from a core right for this CPU) on a dense GEMM of the same FLOPs, and the
// register-only peak of the arithmetic the kernel runs on; GB/s next to the
// streaming read and memcpy bandwidths for the weight-bound decode shape.
//
// FLOPs: 2 * valid_rows * K * N per pass (SwiGLU counts both halves).
// Bytes (decode): the weight once in its stored type + lhs + output.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_gmm.h"
#include "bench/bench_util.h"
#include "bench/sgemm_ceiling.h"
#include "fp8moe/gmm.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"

namespace fp8moe::bench {
namespace {

struct Shape4 {
  std::string name;
  int64_t e, m, k, n;
  bool swiglu;
  bool uneven;
  bool weight_bound;  // report GB/s
};

std::vector<int32_t> GroupSizes(const Shape4& s) {
  std::vector<int32_t> g(static_cast<size_t>(s.e), static_cast<int32_t>(s.m / s.e));
  if (s.uneven) {  // a fixed uneven pattern with empty groups, summing to m
    int64_t left = s.m;
    for (int64_t i = 0; i < s.e; ++i) {
      int64_t v = (i % 8 == 3 || i % 8 == 6) ? 0 : (s.m / s.e) * (1 + (i % 5)) / 2;
      if (i == s.e - 1) v = left;
      v = std::min(v, left);
      g[static_cast<size_t>(i)] = static_cast<int32_t>(v);
      left -= v;
    }
  }
  return g;
}

struct Row {
  std::string shape, pass, mode;
  double seconds, gflops, ratio, gbs = 0, gbs_ratio = 0, read_ratio = 0;
  std::vector<double> rounds = {};  // seconds of each round (seconds: the best)
  KernelArith arith = KernelArith::kF32;
  size_t shape_index = 0;      // into the run's shapes (its sgemm ceiling)
  // Filled once the ceilings are measured the second time, after every row:
  std::string bound = {};      // the peak that bounds this row's arithmetic
  double peak_ratio = 0;       // gflops / that peak
  double fma_ratio = 0;        // gflops / the f32 FMA peak
};

int64_t ValidRows(const Shape4& s) {
  int64_t valid = 0;
  for (int32_t v : GroupSizes(s)) valid += v;
  return valid;
}

}  // namespace

int BenchGmm(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  std::vector<Shape4> shapes = {
      {"train-fill wi", 8, 16384, 1024, 2048, true, false, false},
      {"train-fill wo", 8, 16384, 1024, 1024, false, false, false},
      {"fine-grained", 64, 16384, 1024, 512, false, true, false},
      {"decode", 8, 64, 2048, 4096, false, false, true},
      // Truly weight-bound: one row per expert (every weight element is used once).
      {"decode e64", 64, 64, 2048, 1024, false, false, true},
  };
  if (!opt.shape.empty()) {
    // The shape of exactly that name, else every shape whose name contains it
    // ("decode" is one shape although "decode e64" contains it too).
    bool exact = false;
    for (const auto& s : shapes) exact = exact || s.name == opt.shape;
    std::vector<Shape4> keep;
    for (const auto& s : shapes) {
      if (exact ? s.name == opt.shape : s.name.find(opt.shape) != std::string::npos) {
        keep.push_back(s);
      }
    }
    if (keep.empty()) {
      std::string names;
      for (const auto& s : shapes) names += (names.empty() ? "'" : ", '") + s.name + "'";
      std::fprintf(stderr, "error: --shape '%s' matches no shape of bench gmm; the shapes: %s\n",
                   opt.shape.c_str(), names.c_str());
      return 2;
    }
    shapes = keep;
  }
  std::mt19937 rng(7);
  std::vector<Row> rows;
  // Measured here and again after the timed rows (RemeasureCeilings); the
  // ratios are computed after that.
  MachineCeilings ceil = MeasureMachineCeilings(opt.threads, opt.reps, size_t{256} << 20);
  // The streaming read, timed among each weight-bound shape's modes: the
  // memory's speed on these shared machines drifts by 1.5x within a run
  // (46 -> 72 GB/s between the start and the end of one), so a ceiling
  // measured apart from the rows it divides can flatter or wrong them.
  // Allocated after the ceilings' own buffers are freed, and freed before
  // they are measured again.
  std::unique_ptr<StreamingRead> stream;
  for (const Shape4& s : shapes) {
    if (s.weight_bound && stream == nullptr) {
      stream = std::make_unique<StreamingRead>(size_t{256} << 20, opt.threads);
    }
  }
  // sgemm ceiling of each shape: a dense [valid rows, K] x [K, N], same FLOPs.
  std::vector<SgemmShape> sgemm_shapes;
  for (const Shape4& s : shapes) sgemm_shapes.push_back({ValidRows(s), s.k, s.n});
  const SgemmCeiling sgemm =
      MeasureSgemmCeiling(sgemm_shapes, opt.threads, opt.reps, opt.sgemm_core);
  // Each pass's rounds time the shape's sgemm too (row mode "openblas", the
  // pass of the rows it divides), in a child with the ceiling's core: the
  // speed of these shared machines drifts within a run (all modes of one
  // shape at 0.86-0.88x an sgemm timed a minute before them, 0.95x in a run
  // an hour earlier), and a ceiling timed in the same rounds drifts with its
  // rows. Without a trusted core, or should the child not start, the sgemm
  // timed before the rows stands (rows of pass "sgemm"), and a note says why.
  std::string rounds_error;
  std::unique_ptr<SgemmRounds> sgemm_rounds =
      SgemmRounds::Start(sgemm, sgemm_shapes, opt.threads, &rounds_error);
  const bool sgemm_in_rounds = sgemm_rounds != nullptr;
  for (const Shape4& s : shapes) {
    const std::vector<int32_t> sizes = GroupSizes(s);
    int64_t valid = 0;
    for (int32_t v : sizes) valid += v;
    Tensor gs = MustCreate(DType::kI32, {s.e});
    std::memcpy(gs.data(), sizes.data(), sizes.size() * 4);
    const double flops = 2.0 * static_cast<double>(valid) * s.k * s.n;
    const size_t si = static_cast<size_t>(&s - shapes.data());
    if (!sgemm_in_rounds && sgemm.seconds[si] > 0) {
      Row r{s.name, "sgemm", "openblas", sgemm.seconds[si], sgemm.Gflops(sgemm_shapes, si), 0};
      r.shape_index = si;
      rows.push_back(r);
    }

    // Operands in every representation.
    Tensor x32 = RandomF32(rng, {s.m, s.k}, 1.0f);
    Tensor x16 = ToBf16(x32);
    Tensor w32 = RandomF32(rng, {s.e, s.k, s.n}, 0.03f);
    Tensor w16 = ToBf16(w32);
    Tensor wq = MustCreate(DType::kE4M3FN, {s.e, s.k, s.n}), ws = MustCreate(DType::kF32, {s.e, s.n});
    MustSucceed(QuantizeChannels(w32.data_as<float>(), s.e, s.k, s.n, QuantDType::kE4M3FN,
                           Calibration::AbsMax(), wq.data_as<uint8_t>(), ws.data_as<float>()));
    Tensor w8 = MustCreate(DType::kI8, {s.e, s.k, s.n}), w8s = MustCreate(DType::kF32, {s.e, s.n});
    MustSucceed(QuantizeChannels(w32.data_as<float>(), s.e, s.k, s.n, QuantDType::kInt8,
                           Calibration::AbsMax(), w8.data_as<uint8_t>(), w8s.data_as<float>()));
    const int64_t oc = s.swiglu ? s.n / 2 : s.n;
    Tensor out = MustCreate(DType::kBF16, {s.m, oc});
    Tensor out32 = MustCreate(DType::kF32, {s.m, oc});
    TensorView wsv = ws.view(), w8sv = w8s.view();

    // The modes of one pass are timed interleaved (BestSecondsInterleaved:
    // every mode once per round, best of the rounds), so the ratios between
    // them (native / bf16, native / fake_qat) do not carry a neighbour's load
    // that fell on one mode's turn only; the shape's sgemm joins them when it
    // runs here. `add` queues a mode; `flush` times the queue (the closures
    // must still be alive) and adds its rows.
    struct Pending {
      std::string pass, mode;
      double weight_bytes;
      std::function<void()> fn;
    };
    std::vector<Pending> pending;
    auto add = [&](const std::string& pass, const std::string& mode, double weight_bytes,
                   std::function<void()> fn) {
      pending.push_back({pass, mode, weight_bytes, std::move(fn)});
    };
    auto flush = [&] {
      // The child's own times of its sgemm (without the request's round
      // trip); the first is the warm-up.
      std::vector<double> child_seconds;
      if (sgemm_rounds != nullptr && !pending.empty()) {
        SgemmRounds* sr = sgemm_rounds.get();
        auto run = [sr, si, &child_seconds] { child_seconds.push_back(sr->Run(si)); };
        pending.insert(pending.begin(), Pending{pending.front().pass, "openblas", 0, run});
      }
      std::vector<std::function<void()>> fns;
      for (const Pending& p : pending) fns.push_back(p.fn);
      std::vector<std::vector<double>> rounds = SecondsInterleaved(opt.reps, fns);
      for (size_t i = 0; i < pending.size(); ++i) {
        const Pending& p = pending[i];
        if (p.mode == "openblas") rounds[i].assign(child_seconds.begin() + 1, child_seconds.end());
        const double t = *std::min_element(rounds[i].begin(), rounds[i].end());
        const bool read = p.pass == "read";
        Row r{s.name, p.pass, p.mode, t, read ? 0.0 : flops / t / 1e9, 0};
        r.rounds = std::move(rounds[i]);
        if (!read) r.arith = ArithOfMode(p.mode);
        r.shape_index = si;
        if (s.weight_bound) r.gbs = p.weight_bytes / t / 1e9;
        rows.push_back(r);
        if (!opt.json) {
          std::fprintf(stderr, "  %-14s %-5s %-10s %8.2f ms %7.1f %s\n", s.name.c_str(),
                       p.pass.c_str(), p.mode.c_str(), t * 1e3, read ? r.gbs : r.gflops,
                       read ? "GB/s" : "GFLOP/s");
        }
      }
      pending.clear();
    };
    const double act = static_cast<double>(valid) * s.k, outb = static_cast<double>(valid) * oc;
    const double wn = static_cast<double>(s.e) * s.k * s.n;
    auto fwd = [&](GmmMode mode, Tensor& lhs, Tensor& rhs, TensorView* scale, double bytes) {
      GmmOptions o;
      o.mode = mode;
      o.epilogue = s.swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
      if (opt.fwd_tiles.size() == 3) {
        if (opt.fwd_tiles[0] > 0) o.tiles.m = opt.fwd_tiles[0];
        if (opt.fwd_tiles[1] > 0) o.tiles.k = opt.fwd_tiles[1];
        if (opt.fwd_tiles[2] > 0) o.tiles.n = opt.fwd_tiles[2];
      }
      const TensorView l = lhs.view(), r = rhs.view();
      const TensorView ov = (mode == GmmMode::kF32 ? out32 : out).view();
      add("fwd", std::string(GmmModeName(mode)), bytes, [&gs, o, l, r, scale, ov] {
        MustSucceed(Gmm(o, l, r, scale, gs.view(), ov));
      });
    };
    fwd(GmmMode::kF32, x32, w32, nullptr, 4 * (wn + act + outb));
    fwd(GmmMode::kBf16, x16, w16, nullptr, 2 * (wn + act + outb));
    fwd(GmmMode::kFakeQat, x16, wq, &wsv, wn + 2 * (act + outb));
    fwd(GmmMode::kNativeFp8, x16, wq, &wsv, wn + 2 * (act + outb));
    fwd(GmmMode::kInt8, x16, w8, &w8sv, wn + 2 * (act + outb));
    if (s.weight_bound) {
      const StreamingRead* sr = stream.get();
      add("read", "stream", sr->BytesPerRun(), [sr] { sr->Run(false); });
      add("read", "stream+pf", sr->BytesPerRun(), [sr] { sr->Run(true); });
    }
    flush();

    if (opt.all_passes && !s.weight_bound) {
      // dLHS: dout [M, N] x w^T -> [M, K].
      Tensor d16 = ToBf16(RandomF32(rng, {s.m, s.n}, 1.0f));
      Tensor d32 = RandomF32(rng, {s.m, s.n}, 1.0f);
      Tensor dl = MustCreate(DType::kBF16, {s.m, s.k}), dl32 = MustCreate(DType::kF32, {s.m, s.k});
      GmmOptions o;
      o.mode = GmmMode::kF32;
      add("dlhs", "f32", 0, [&, o] { MustSucceed(GmmDlhs(o, d32.view(), w32.view(), nullptr, gs.view(), dl32.view())); });
      o.mode = GmmMode::kBf16;
      add("dlhs", "bf16", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), w16.view(), nullptr, gs.view(), dl.view())); });
      add("dlhs", "native", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), wq.view(), &wsv, gs.view(), dl.view())); });
      o.mode = GmmMode::kFakeQat;
      add("dlhs", "fake_qat", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), wq.view(), &wsv, gs.view(), dl.view())); });
      flush();
      // TGMM: x^T [K, M] x dout [M, N] -> [E, K, N].
      Tensor dw = MustCreate(DType::kF32, {s.e, s.k, s.n});
      Tensor xq = MustCreate(DType::kE4M3FN, {s.m, s.k});
      std::vector<float> xs(static_cast<size_t>(s.m));
      MustSucceed(QuantizeRows(x32.data_as<float>(), s.m, s.k, s.m, 0, QuantDType::kE4M3FN,
                         Calibration::AbsMax(), xq.data_as<uint8_t>(), xs.data()));
      GmmOptions t;
      t.mode = GmmMode::kF32;
      add("tgmm", "f32", 0, [&, t] { MustSucceed(Tgmm(t, {}, x32.view(), d32.view(), gs.view(), dw.view())); });
      t.mode = GmmMode::kBf16;
      add("tgmm", "bf16", 0, [&, t] { MustSucceed(Tgmm(t, {}, x16.view(), d16.view(), gs.view(), dw.view())); });
      t.mode = GmmMode::kF32;
      TgmmQuant q;
      q.dout_dtype = QuantDType::kE5M2;
      add("tgmm", "fp8_full", 0, [&, t, q] { MustSucceed(Tgmm(t, q, xq.view(), d32.view(), gs.view(), dw.view())); });
      q.per_group = false;
      add("tgmm", "fp8_inkern", 0, [&, t, q] { MustSucceed(Tgmm(t, q, xq.view(), d32.view(), gs.view(), dw.view())); });
      flush();
    }
  }

  // The ceilings once more, the higher of each kept; then every ratio. "x
  // sgemm": to sgemm from a right core, else (loudly) to the FMA peak. The
  // timed read's buffer goes first, so that it and the remeasurement's own
  // read and memcpy buffers (~0.75 GiB together) are never held at once.
  const bool timed_read = stream != nullptr;
  stream.reset();
  RemeasureCeilings(&ceil);
  const double memcpy_gbs = ceil.memcpy_gbs, read_gbs = ceil.read_gbs;
  const double fma_gflops = ceil.peaks.Get(PeakKind::kF32Fma).gops;
  // A weight-bound shape's read ceiling: the faster of its own read rows,
  // and the run's ceiling where it has none.
  std::vector<double> shape_read(shapes.size(), 0.0);
  // The sgemm a row is compared with: the shape's sgemm timed in the row's
  // own rounds, else the one timed before the rows (pass "sgemm").
  auto sgemm_gflops_of = [&](const Row& r) {
    double before = 0;
    for (const Row& q : rows) {
      if (q.mode != "openblas" || q.shape_index != r.shape_index) continue;
      if (q.pass == r.pass) return q.gflops;
      if (q.pass == "sgemm") before = q.gflops;
    }
    return before;
  };
  for (const Row& r : rows) {
    if (r.pass == "read") shape_read[r.shape_index] = std::max(shape_read[r.shape_index], r.gbs);
  }
  for (double& g : shape_read) g = g > 0 ? g : read_gbs;
  int above_peak = 0, above_read = 0;
  for (Row& r : rows) {
    if (r.pass == "read") {
      r.gbs_ratio = r.gbs / memcpy_gbs;
      r.read_ratio = r.gbs / shape_read[r.shape_index];
      continue;
    }
    const Peak& bound = BoundingPeak(ceil.peaks, r.arith);
    r.ratio = r.gflops / (sgemm.trusted ? sgemm_gflops_of(r) : fma_gflops);
    r.bound = PeakName(bound.kind);
    r.peak_ratio = r.gflops / bound.gops;
    r.fma_ratio = r.gflops / fma_gflops;
    if (r.gbs > 0) {
      r.gbs_ratio = r.gbs / memcpy_gbs;
      r.read_ratio = r.gbs / shape_read[r.shape_index];
      above_read += r.read_ratio > 1.02 ? 1 : 0;
    }
    above_peak += r.peak_ratio > 1.02 ? 1 : 0;
  }

  Table t;
  t.title = "fp8moe bench gmm: " + std::to_string(opt.threads) + " threads, SIMD " +
            SimdTargetName();
  t.columns = {"shape", "pass", "mode", "ms", "GFLOP/s", sgemm.trusted ? "x sgemm" : "x FMA peak!",
               "x peak", "peak", "GB/s", "x memcpy", "x read"};
  nlohmann::json js = nlohmann::json::array();
  for (const Row& r : rows) {
    const bool read = r.pass == "read";
    t.rows.push_back({r.shape, r.pass, r.mode, Fixed(r.seconds * 1e3, 2),
                      read ? "" : Fixed(r.gflops, 1), read ? "" : Fixed(r.ratio, 2),
                      read ? "" : Fixed(r.peak_ratio, 2), r.bound,
                      r.gbs > 0 ? Fixed(r.gbs, 1) : "", r.gbs > 0 ? Fixed(r.gbs_ratio, 2) : "",
                      r.gbs > 0 ? Fixed(r.read_ratio, 2) : ""});
    const nlohmann::json none;
    js.push_back({{"shape", r.shape}, {"pass", r.pass}, {"mode", r.mode}, {"seconds", r.seconds},
                  {"seconds_per_round", r.rounds},
                  {"gflops", read ? none : nlohmann::json(r.gflops)},
                  {"ratio_to_sgemm", sgemm.trusted && !read ? nlohmann::json(r.ratio) : none},
                  {"bound_peak", read ? none : nlohmann::json(r.bound)},
                  {"ratio_to_peak", read ? none : nlohmann::json(r.peak_ratio)},
                  {"ratio_to_fma_peak", read ? none : nlohmann::json(r.fma_ratio)},
                  {"gbs", r.gbs}, {"ratio_to_memcpy", r.gbs_ratio},
                  {"ratio_to_read", r.read_ratio},
                  {"read_ceiling_gbs", r.gbs > 0 ? nlohmann::json(shape_read[r.shape_index]) : none}});
  }
  t.notes.push_back(std::string("openblas rows: sgemm, dense [valid rows, K] x [K, N], the same "
                                "FLOPs as the shape; ") +
                    (sgemm_in_rounds ? "timed in each pass's rounds with its modes (in a child "
                                       "process, by its own clock), the 'x sgemm' of that pass's "
                                       "rows"
                                     : "timed once before the shape's rows (" + rounds_error + ")") +
                    "; their 'x peak' is sgemm / f32 FMA peak (a good sgemm reaches 0.7-0.95)");
  t.notes.push_back("x peak: GFLOP/s over the measured peak of the arithmetic the kernel runs "
                    "(column 'peak'; bf16/fp8 modes use f32 FMA unless the kernels use vdpbf16ps)");
  for (const std::string& n : SgemmNotes(sgemm)) t.notes.push_back(n);
  for (const std::string& n : CeilingNotes(ceil)) t.notes.push_back(n);
  if (above_peak > 0) {
    t.notes.push_back("WARNING: " + std::to_string(above_peak) + " row(s) above their peak "
                      "('x peak' > 1.02): the peak loops were disturbed both times they ran; "
                      "the 'x peak' column is not to be trusted in this run, rerun it");
  }
  if (above_read > 0) {
    t.notes.push_back("WARNING: " + std::to_string(above_read) + " row(s) above their read "
                      "ceiling ('x read' > 1.02): the read rows were disturbed in every round "
                      "(more --reps give them more chances); 'x read' is not to be trusted in "
                      "this run");
  }
  t.notes.push_back("decode GB/s counts weight (stored type) + activations + output");
  if (timed_read) {
    t.notes.push_back("read rows: the streaming read of a " + SizeText(size_t{256} << 20) +
                      " buffer (plain; with a prefetch 4 KiB ahead), timed in the same rounds "
                      "as the shape's modes; 'x read' of the shape's rows is over the faster of "
                      "the two (the run's read ceiling above can differ: memory speed drifts)");
  }
  // The decode question: how much faster is reading fp8 weights than bf16.
  // The time of one row (0 when the run has no such row).
  auto seconds_of = [&](const std::string& shape, const std::string& pass, const std::string& mode) {
    for (const Row& r : rows) {
      if (r.shape == shape && r.pass == pass && r.mode == mode) return r.seconds;
    }
    return 0.0;
  };
  auto rounds_of = [&](const std::string& shape, const std::string& pass, const std::string& mode) {
    for (const Row& r : rows) {
      if (r.shape == shape && r.pass == pass && r.mode == mode) return r.rounds;
    }
    return std::vector<double>{};
  };
  // The fastest bf16-mode arithmetic this run saw (bf16 operands on the
  // compute-bound shapes): native_fp8 runs the same kernel arithmetic (vdpbf16ps
  // on AVX512-BF16, f32 FMAs elsewhere), so on a
  // weight-bound shape it cannot beat FLOPs / that rate, while bf16 cannot
  // beat its weight bytes / the read ceiling.
  double pair_gflops = 0;
  std::string pair_where;
  for (const Row& r : rows) {
    if (r.mode == "bf16" && r.gbs == 0 && r.gflops > pair_gflops) {
      pair_gflops = r.gflops;
      pair_where = r.shape + " " + r.pass;
    }
  }
  // The two native-against-reference targets, each pair timed interleaved.
  nlohmann::json native_targets = nlohmann::json::array();
  for (const Shape4& s : shapes) {
    if (s.weight_bound) continue;
    const double nf = seconds_of(s.name, "fwd", "native_fp8"), bf = seconds_of(s.name, "fwd", "bf16");
    const double nd = seconds_of(s.name, "dlhs", "native"), fd = seconds_of(s.name, "dlhs", "fake_qat");
    if (nf <= 0 || bf <= 0) continue;
    // Best against best, and the rounds' own ratios with their interval
    // (PairedRatioInterval: can the rounds tell the two apart at all).
    const RatioInterval fwd = PairedRatioInterval(rounds_of(s.name, "fwd", "native_fp8"),
                                                  rounds_of(s.name, "fwd", "bf16"));
    std::string note = s.name + ": time native_fp8 fwd / bf16 fwd " + Fixed(nf / bf, 3) +
                       " best against best, " + DescribeInterval(fwd);
    nlohmann::json nt = {{"shape", s.name}, {"native_fwd_over_bf16_fwd", nf / bf},
                         {"native_fwd_over_bf16_fwd_interval", IntervalJson(fwd)}};
    if (nd > 0 && fd > 0) {
      const RatioInterval dl = PairedRatioInterval(rounds_of(s.name, "dlhs", "native"),
                                                   rounds_of(s.name, "dlhs", "fake_qat"));
      note += "; native dlhs / fake_qat dlhs " + Fixed(nd / fd, 3) + " best against best, " +
              DescribeInterval(dl);
      nt["native_dlhs_over_fake_qat_dlhs"] = nd / fd;
      nt["native_dlhs_over_fake_qat_dlhs_interval"] = IntervalJson(dl);
    }
    t.notes.push_back(note + " (below 1: native is faster)");
    native_targets.push_back(nt);
  }
  for (const Shape4& s : shapes) {
    const double nat = seconds_of(s.name, "fwd", "native_fp8");
    if (!s.weight_bound || nat <= 0) continue;
    t.notes.push_back(s.name + ": native_fp8 is " + Fixed(seconds_of(s.name, "fwd", "bf16") / nat, 2) +
                      "x as fast as bf16, " + Fixed(seconds_of(s.name, "fwd", "fake_qat") / nat, 2) +
                      "x as fake_qat");
    if (pair_gflops > 0) {
      const double flops = 2.0 * static_cast<double>(s.m) * s.k * s.n;
      const double native_floor = flops / (pair_gflops * 1e9);
      const size_t si = static_cast<size_t>(&s - shapes.data());
      const double bf16_floor =
          2.0 * static_cast<double>(s.e) * s.k * s.n / (shape_read[si] * 1e9);
      t.notes.push_back(s.name + " floors: native_fp8 >= " + Fixed(native_floor * 1e3, 2) +
                        " ms (FLOPs at the best bf16-mode rate, " + Fixed(pair_gflops, 0) +
                        " GFLOP/s, " + pair_where + "); bf16 >= " + Fixed(bf16_floor * 1e3, 2) +
                        " ms (bf16 weight at the read ceiling): a bandwidth-bound bf16 allows at "
                        "most " + Fixed(bf16_floor / native_floor, 2) + "x");
    }
  }
  if (opt.json) {
    nlohmann::json j = {{"bench", "gmm"}, {"threads", opt.threads},
                        {"simd_target", SimdTargetName()}, {"memcpy_gbs", memcpy_gbs}, {"read_gbs", read_gbs},
                        {"ceilings", CeilingsJson(ceil)}, {"sgemm", SgemmJson(sgemm, sgemm_shapes)},
                        {"sgemm_in_rounds", sgemm_in_rounds},
                        {"sgemm_not_in_rounds_because", rounds_error},
                        {"rows", js}, {"native_time_ratios", native_targets}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    t.Print();
  }
  return 0;
}

}  // namespace fp8moe::bench
