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

// The shapes, in the order the bench times them.
std::vector<Shape4> AllShapes() {
  return {
      {"train-fill wi", 8, 16384, 1024, 2048, true, false, false},
      {"train-fill wo", 8, 16384, 1024, 1024, false, false, false},
      {"fine-grained", 64, 16384, 1024, 512, false, true, false},
      {"decode", 8, 64, 2048, 4096, false, false, true},
      // Truly weight-bound: one row per expert (every weight element is used once).
      {"decode e64", 64, 64, 2048, 1024, false, false, true},
  };
}

// --shape: keeps the shape of exactly that name, else every shape whose name
// contains it ("decode" is one shape although "decode e64" contains it too).
// False, after printing the refusal with the shapes, when none matches.
bool KeepShapesNamed(const std::string& filter, std::vector<Shape4>* shapes) {
  bool exact = false;
  for (const auto& s : *shapes) exact = exact || s.name == filter;
  std::vector<Shape4> keep;
  for (const auto& s : *shapes) {
    if (exact ? s.name == filter : s.name.find(filter) != std::string::npos) keep.push_back(s);
  }
  if (keep.empty()) {
    std::string names;
    for (const auto& s : *shapes) names += (names.empty() ? "'" : ", '") + s.name + "'";
    std::fprintf(stderr, "error: --shape '%s' matches no shape of bench gmm; the shapes: %s\n",
                 filter.c_str(), names.c_str());
    return false;
  }
  *shapes = keep;
  return true;
}

// Rows per expert [E], summing to m.
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

// The seconds of one row of the run, and of each of its rounds (0 and none
// when the run has no such row).
double SecondsOf(const std::vector<Row>& rows, const std::string& shape, const std::string& pass,
                 const std::string& mode) {
  for (const Row& r : rows) {
    if (r.shape == shape && r.pass == pass && r.mode == mode) return r.seconds;
  }
  return 0.0;
}
std::vector<double> RoundsOf(const std::vector<Row>& rows, const std::string& shape,
                             const std::string& pass, const std::string& mode) {
  for (const Row& r : rows) {
    if (r.shape == shape && r.pass == pass && r.mode == mode) return r.rounds;
  }
  return {};
}

// What the timing of every shape shares: the options, the timed read, the
// sgemm ceiling and its child, and the rows so far.
struct GmmRun {
  explicit GmmRun(const BenchOptions& options) : opt(options) {}
  const BenchOptions& opt;
  std::unique_ptr<StreamingRead> stream;  // weight-bound shapes only
  std::vector<SgemmShape> sgemm_shapes;   // per shape: dense [valid rows, K] x [K, N]
  SgemmCeiling sgemm;
  std::unique_ptr<SgemmRounds> sgemm_rounds;  // null: the sgemm timed before stands
  std::string rounds_error;                   // why it is null
  std::vector<Row> rows;
};

// The modes of one pass are timed interleaved (SecondsInterleaved: every
// mode once per round, best of the rounds), so the ratios between them
// (native / bf16, native / fake_qat) do not carry a neighbour's load that
// fell on one mode's turn only; the shape's sgemm joins them when it runs in
// rounds (GmmRun::sgemm_rounds). Add queues a mode; Flush times the queue
// (its closures' captures must still be alive) and adds its rows to the run.
class PassRounds {
 public:
  PassRounds(GmmRun* run, const Shape4& s, size_t shape_index, double flops)
      : run_(run), s_(s), si_(shape_index), flops_(flops) {}

  void Add(const std::string& pass, const std::string& mode, double weight_bytes,
           std::function<void()> fn) {
    pending_.push_back({pass, mode, weight_bytes, std::move(fn)});
  }

  void Flush() {
    // The child's own times of its sgemm (without the request's round trip);
    // the first is the warm-up.
    std::vector<double> child_seconds;
    if (run_->sgemm_rounds != nullptr && !pending_.empty()) {
      SgemmRounds* sr = run_->sgemm_rounds.get();
      const size_t si = si_;
      auto sgemm = [sr, si, &child_seconds] { child_seconds.push_back(sr->Run(si)); };
      pending_.insert(pending_.begin(), Pending{pending_.front().pass, "openblas", 0, sgemm});
    }
    std::vector<std::function<void()>> fns;
    for (const Pending& p : pending_) fns.push_back(p.fn);
    std::vector<std::vector<double>> rounds = SecondsInterleaved(run_->opt.reps, fns);
    for (size_t i = 0; i < pending_.size(); ++i) {
      const Pending& p = pending_[i];
      if (p.mode == "openblas") rounds[i].assign(child_seconds.begin() + 1, child_seconds.end());
      const double t = *std::min_element(rounds[i].begin(), rounds[i].end());
      const bool read = p.pass == "read";
      Row r{s_.name, p.pass, p.mode, t, read ? 0.0 : flops_ / t / 1e9, 0};
      r.rounds = std::move(rounds[i]);
      if (!read) r.arith = ArithOfMode(p.mode);
      r.shape_index = si_;
      if (s_.weight_bound) r.gbs = p.weight_bytes / t / 1e9;
      run_->rows.push_back(r);
      if (!run_->opt.json) {
        std::fprintf(stderr, "  %-14s %-5s %-10s %8.2f ms %7.1f %s\n", s_.name.c_str(),
                     p.pass.c_str(), p.mode.c_str(), t * 1e3, read ? r.gbs : r.gflops,
                     read ? "GB/s" : "GFLOP/s");
      }
    }
    pending_.clear();
  }

 private:
  struct Pending {
    std::string pass, mode;
    double weight_bytes;
    std::function<void()> fn;
  };
  GmmRun* run_;
  const Shape4& s_;
  size_t si_;
  double flops_;
  std::vector<Pending> pending_;
};

// One shape's operands in every representation the modes take: lhs x
// [M, K] in f32 and bf16; rhs w [E, K, N] in f32, bf16, e4m3fn and int8
// codes with their per-channel scales [E, N]; outputs [M, N or N/2]; the
// group sizes [E].
struct GmmOperands {
  Tensor gs;
  Tensor x32, x16, w32, w16, wq, ws, w8, w8s, out, out32;
  ConstTensorView wsv, w8sv;  // views of ws and w8s, for the modes that take a scale pointer
};

GmmOperands MakeOperands(std::mt19937& rng, const Shape4& s, const std::vector<int32_t>& sizes) {
  GmmOperands o;
  o.gs = MustCreate(DType::kI32, {s.e});
  std::memcpy(o.gs.data(), sizes.data(), sizes.size() * 4);
  o.x32 = RandomF32(rng, {s.m, s.k}, 1.0f);
  o.x16 = ToBf16(o.x32);
  o.w32 = RandomF32(rng, {s.e, s.k, s.n}, 0.03f);
  o.w16 = ToBf16(o.w32);
  o.wq = MustCreate(DType::kE4M3FN, {s.e, s.k, s.n});
  o.ws = MustCreate(DType::kF32, {s.e, s.n});
  MustSucceed(QuantizeChannels(o.w32.data_as<float>(), s.e, s.k, s.n, QuantDType::kE4M3FN,
                               Calibration::AbsMax(), o.wq.data_as<uint8_t>(),
                               o.ws.data_as<float>()));
  o.w8 = MustCreate(DType::kI8, {s.e, s.k, s.n});
  o.w8s = MustCreate(DType::kF32, {s.e, s.n});
  MustSucceed(QuantizeChannels(o.w32.data_as<float>(), s.e, s.k, s.n, QuantDType::kInt8,
                               Calibration::AbsMax(), o.w8.data_as<uint8_t>(),
                               o.w8s.data_as<float>()));
  const int64_t oc = s.swiglu ? s.n / 2 : s.n;
  o.out = MustCreate(DType::kBF16, {s.m, oc});
  o.out32 = MustCreate(DType::kF32, {s.m, oc});
  o.wsv = o.ws.view();
  o.w8sv = o.w8s.view();
  return o;
}

// The forward of every mode, and for a weight-bound shape the streaming
// read (plain and prefetched) in the same rounds. Bytes: the weight once in
// its stored type + lhs + output.
void QueueForwardModes(const GmmRun& run, const Shape4& s, int64_t valid, GmmOperands& ops,
                       PassRounds* q) {
  const int64_t oc = s.swiglu ? s.n / 2 : s.n;
  const double act = static_cast<double>(valid) * s.k, outb = static_cast<double>(valid) * oc;
  const double wn = static_cast<double>(s.e) * s.k * s.n;
  const std::vector<int64_t>& tiles = run.opt.fwd_tiles;
  auto fwd = [&](GmmMode mode, const Tensor& lhs, const Tensor& rhs, const ConstTensorView* scale,
                 double bytes) {
    GmmOptions o;
    o.mode = mode;
    o.epilogue = s.swiglu ? GmmEpilogue::kSwiGlu : GmmEpilogue::kNone;
    if (tiles.size() == 3) {
      if (tiles[0] > 0) o.tiles.m = tiles[0];
      if (tiles[1] > 0) o.tiles.k = tiles[1];
      if (tiles[2] > 0) o.tiles.n = tiles[2];
    }
    const ConstTensorView l = lhs.view(), r = rhs.view();
    const TensorView ov = (mode == GmmMode::kF32 ? ops.out32 : ops.out).view();
    Tensor& gs = ops.gs;
    q->Add("fwd", std::string(GmmModeName(mode)), bytes, [&gs, o, l, r, scale, ov] {
      MustSucceed(Gmm(o, l, r, scale, gs.view(), ov));
    });
  };
  fwd(GmmMode::kF32, ops.x32, ops.w32, nullptr, 4 * (wn + act + outb));
  fwd(GmmMode::kBf16, ops.x16, ops.w16, nullptr, 2 * (wn + act + outb));
  fwd(GmmMode::kFakeQat, ops.x16, ops.wq, &ops.wsv, wn + 2 * (act + outb));
  fwd(GmmMode::kNativeFp8, ops.x16, ops.wq, &ops.wsv, wn + 2 * (act + outb));
  fwd(GmmMode::kInt8, ops.x16, ops.w8, &ops.w8sv, wn + 2 * (act + outb));
  if (s.weight_bound) {
    const StreamingRead* sr = run.stream.get();
    q->Add("read", "stream", sr->BytesPerRun(), [sr] { sr->Run(false); });
    q->Add("read", "stream+pf", sr->BytesPerRun(), [sr] { sr->Run(true); });
  }
}

// dLHS: dout [M, N] x w^T -> [M, K], then TGMM: x^T [K, M] x dout [M, N]
// -> [E, K, N]; each pass's modes in rounds of their own.
void TimeBackwardPasses(std::mt19937& rng, const Shape4& s, GmmOperands& ops, PassRounds* q) {
  Tensor d16 = ToBf16(RandomF32(rng, {s.m, s.n}, 1.0f));
  Tensor d32 = RandomF32(rng, {s.m, s.n}, 1.0f);
  Tensor dl = MustCreate(DType::kBF16, {s.m, s.k}), dl32 = MustCreate(DType::kF32, {s.m, s.k});
  Tensor& gs = ops.gs;
  const ConstTensorView& wsv = ops.wsv;
  GmmOptions o;
  o.mode = GmmMode::kF32;
  q->Add("dlhs", "f32", 0, [&, o] { MustSucceed(GmmDlhs(o, d32.view(), ops.w32.view(), nullptr, gs.view(), dl32.view())); });
  o.mode = GmmMode::kBf16;
  q->Add("dlhs", "bf16", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), ops.w16.view(), nullptr, gs.view(), dl.view())); });
  q->Add("dlhs", "native", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), ops.wq.view(), &wsv, gs.view(), dl.view())); });
  o.mode = GmmMode::kFakeQat;
  q->Add("dlhs", "fake_qat", 0, [&, o] { MustSucceed(GmmDlhs(o, d16.view(), ops.wq.view(), &wsv, gs.view(), dl.view())); });
  q->Flush();
  Tensor dw = MustCreate(DType::kF32, {s.e, s.k, s.n});
  Tensor xq = MustCreate(DType::kE4M3FN, {s.m, s.k});
  std::vector<float> xs(static_cast<size_t>(s.m));
  MustSucceed(QuantizeRows(ops.x32.data_as<float>(), s.m, s.k, s.m, 0, QuantDType::kE4M3FN,
                           Calibration::AbsMax(), xq.data_as<uint8_t>(), xs.data()));
  GmmOptions t;
  t.mode = GmmMode::kF32;
  q->Add("tgmm", "f32", 0, [&, t] { MustSucceed(Tgmm(t, {}, ops.x32.view(), d32.view(), gs.view(), dw.view())); });
  t.mode = GmmMode::kBf16;
  q->Add("tgmm", "bf16", 0, [&, t] { MustSucceed(Tgmm(t, {}, ops.x16.view(), d16.view(), gs.view(), dw.view())); });
  t.mode = GmmMode::kF32;
  TgmmQuant tq;
  tq.dout_dtype = QuantDType::kE5M2;
  q->Add("tgmm", "fp8_full", 0, [&, t, tq] { MustSucceed(Tgmm(t, tq, xq.view(), d32.view(), gs.view(), dw.view())); });
  tq.per_group = false;
  q->Add("tgmm", "fp8_inkern", 0, [&, t, tq] { MustSucceed(Tgmm(t, tq, xq.view(), d32.view(), gs.view(), dw.view())); });
  q->Flush();
}

// Every pass and mode of shape s (shapes[si]): rows added to the run.
void TimeShape(GmmRun* run, std::mt19937& rng, const Shape4& s, size_t si) {
  const std::vector<int32_t> sizes = GroupSizes(s);
  int64_t valid = 0;
  for (int32_t v : sizes) valid += v;
  const double flops = 2.0 * static_cast<double>(valid) * s.k * s.n;
  const SgemmCeiling& sgemm = run->sgemm;
  if (run->sgemm_rounds == nullptr && sgemm.seconds[si] > 0) {
    Row r{s.name, "sgemm", "openblas", sgemm.seconds[si], sgemm.Gflops(run->sgemm_shapes, si), 0};
    r.shape_index = si;
    run->rows.push_back(r);
  }
  GmmOperands ops = MakeOperands(rng, s, sizes);
  PassRounds q(run, s, si, flops);
  QueueForwardModes(*run, s, valid, ops, &q);
  q.Flush();
  if (run->opt.all_passes && !s.weight_bound) TimeBackwardPasses(rng, s, ops, &q);
}

// What the ratios say about the run as a whole: each shape's read ceiling,
// and how many rows passed their peak or their read ceiling (by over 2%).
struct RatioSummary {
  std::vector<double> shape_read;
  int above_peak = 0, above_read = 0;
};

// Every row's ratios to its ceilings, once the ceilings are measured the
// second time. "x sgemm": to sgemm from a right core, else (loudly) to the
// FMA peak.
RatioSummary ComputeRatios(const MachineCeilings& ceil, const SgemmCeiling& sgemm,
                           size_t shape_count, std::vector<Row>* rows_out) {
  std::vector<Row>& rows = *rows_out;
  const double memcpy_gbs = ceil.memcpy_gbs, read_gbs = ceil.read_gbs;
  const double fma_gflops = ceil.peaks.Get(PeakKind::kF32Fma).gops;
  RatioSummary sum;
  // A weight-bound shape's read ceiling: the faster of its own read rows,
  // and the run's ceiling where it has none.
  sum.shape_read.assign(shape_count, 0.0);
  std::vector<double>& shape_read = sum.shape_read;
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
      sum.above_read += r.read_ratio > 1.02 ? 1 : 0;
    }
    sum.above_peak += r.peak_ratio > 1.02 ? 1 : 0;
  }
  return sum;
}

// The rows as the table's rows, and as the JSON's "rows".
nlohmann::json RowsToTableAndJson(const std::vector<Row>& rows,
                                  const std::vector<double>& shape_read, bool sgemm_trusted,
                                  Table* t) {
  nlohmann::json js = nlohmann::json::array();
  for (const Row& r : rows) {
    const bool read = r.pass == "read";
    t->rows.push_back({r.shape, r.pass, r.mode, Fixed(r.seconds * 1e3, 2),
                       read ? "" : Fixed(r.gflops, 1), read ? "" : Fixed(r.ratio, 2),
                       read ? "" : Fixed(r.peak_ratio, 2), r.bound,
                       r.gbs > 0 ? Fixed(r.gbs, 1) : "", r.gbs > 0 ? Fixed(r.gbs_ratio, 2) : "",
                       r.gbs > 0 ? Fixed(r.read_ratio, 2) : ""});
    const nlohmann::json none;
    js.push_back({{"shape", r.shape}, {"pass", r.pass}, {"mode", r.mode}, {"seconds", r.seconds},
                  {"seconds_per_round", r.rounds},
                  {"gflops", read ? none : nlohmann::json(r.gflops)},
                  {"ratio_to_sgemm", sgemm_trusted && !read ? nlohmann::json(r.ratio) : none},
                  {"bound_peak", read ? none : nlohmann::json(r.bound)},
                  {"ratio_to_peak", read ? none : nlohmann::json(r.peak_ratio)},
                  {"ratio_to_fma_peak", read ? none : nlohmann::json(r.fma_ratio)},
                  {"gbs", r.gbs}, {"ratio_to_memcpy", r.gbs_ratio},
                  {"ratio_to_read", r.read_ratio},
                  {"read_ceiling_gbs", r.gbs > 0 ? nlohmann::json(shape_read[r.shape_index]) : none}});
  }
  return js;
}

// The notes on how the ceilings were measured and what they hold, with a
// warning for each kind of row that passed its ceiling.
void AddCeilingNotes(const GmmRun& run, const MachineCeilings& ceil, const RatioSummary& sum,
                     bool timed_read, Table* t) {
  t->notes.push_back(std::string("openblas rows: sgemm, dense [valid rows, K] x [K, N], the same "
                                 "FLOPs as the shape; ") +
                     (run.sgemm_rounds != nullptr
                          ? "timed in each pass's rounds with its modes (in a child process, by "
                            "its own clock), the 'x sgemm' of that pass's rows"
                          : "timed once before the shape's rows (" + run.rounds_error + ")") +
                     "; their 'x peak' is sgemm / f32 FMA peak (a good sgemm reaches 0.7-0.95)");
  t->notes.push_back("x peak: GFLOP/s over the measured peak of the arithmetic the kernel runs "
                     "(column 'peak'; bf16/fp8 modes use f32 FMA unless the kernels use vdpbf16ps)");
  for (const std::string& n : SgemmNotes(run.sgemm)) t->notes.push_back(n);
  for (const std::string& n : CeilingNotes(ceil)) t->notes.push_back(n);
  if (sum.above_peak > 0) {
    t->notes.push_back("WARNING: " + std::to_string(sum.above_peak) + " row(s) above their peak "
                       "('x peak' > 1.02): the peak loops were disturbed both times they ran; "
                       "the 'x peak' column is not to be trusted in this run, rerun it");
  }
  if (sum.above_read > 0) {
    t->notes.push_back("WARNING: " + std::to_string(sum.above_read) + " row(s) above their read "
                       "ceiling ('x read' > 1.02): the read rows were disturbed in every round "
                       "(more --reps give them more chances); 'x read' is not to be trusted in "
                       "this run");
  }
  t->notes.push_back("decode GB/s counts weight (stored type) + activations + output");
  if (timed_read) {
    t->notes.push_back("read rows: the streaming read of a " + SizeText(size_t{256} << 20) +
                       " buffer (plain; with a prefetch 4 KiB ahead), timed in the same rounds "
                       "as the shape's modes; 'x read' of the shape's rows is over the faster of "
                       "the two (the run's read ceiling above can differ: memory speed drifts)");
  }
}

// The two native-against-reference targets of each compute-bound shape
// (native_fp8 fwd / bf16 fwd, native dlhs / fake_qat dlhs), each pair timed
// interleaved: best against best, and the rounds' own ratios with their
// interval (PairedRatioInterval: can the rounds tell the two apart at all).
// Notes, and the JSON's "native_time_ratios".
nlohmann::json AddNativeRatioNotes(const std::vector<Shape4>& shapes,
                                   const std::vector<Row>& rows, Table* t) {
  nlohmann::json native_targets = nlohmann::json::array();
  for (const Shape4& s : shapes) {
    if (s.weight_bound) continue;
    const double nf = SecondsOf(rows, s.name, "fwd", "native_fp8");
    const double bf = SecondsOf(rows, s.name, "fwd", "bf16");
    const double nd = SecondsOf(rows, s.name, "dlhs", "native");
    const double fd = SecondsOf(rows, s.name, "dlhs", "fake_qat");
    if (nf <= 0 || bf <= 0) continue;
    const RatioInterval fwd = PairedRatioInterval(RoundsOf(rows, s.name, "fwd", "native_fp8"),
                                                  RoundsOf(rows, s.name, "fwd", "bf16"));
    std::string note = s.name + ": time native_fp8 fwd / bf16 fwd " + Fixed(nf / bf, 3) +
                       " best against best, " + DescribeInterval(fwd);
    nlohmann::json nt = {{"shape", s.name}, {"native_fwd_over_bf16_fwd", nf / bf},
                         {"native_fwd_over_bf16_fwd_interval", IntervalJson(fwd)}};
    if (nd > 0 && fd > 0) {
      const RatioInterval dl = PairedRatioInterval(RoundsOf(rows, s.name, "dlhs", "native"),
                                                   RoundsOf(rows, s.name, "dlhs", "fake_qat"));
      note += "; native dlhs / fake_qat dlhs " + Fixed(nd / fd, 3) + " best against best, " +
              DescribeInterval(dl);
      nt["native_dlhs_over_fake_qat_dlhs"] = nd / fd;
      nt["native_dlhs_over_fake_qat_dlhs_interval"] = IntervalJson(dl);
    }
    t->notes.push_back(note + " (below 1: native is faster)");
    native_targets.push_back(nt);
  }
  return native_targets;
}

// The decode question: how much faster is reading fp8 weights than bf16. For
// each weight-bound shape, native_fp8's speed-up and the floors of both: the
// fastest bf16-mode arithmetic this run saw (bf16 operands on the
// compute-bound shapes): native_fp8 runs the same kernel arithmetic
// (vdpbf16ps on AVX512-BF16, f32 FMAs elsewhere), so on a weight-bound shape
// it cannot beat FLOPs / that rate, while bf16 cannot beat its weight bytes /
// the read ceiling.
void AddDecodeNotes(const std::vector<Shape4>& shapes, const std::vector<Row>& rows,
                    const std::vector<double>& shape_read, Table* t) {
  double pair_gflops = 0;
  std::string pair_where;
  for (const Row& r : rows) {
    if (r.mode == "bf16" && r.gbs == 0 && r.gflops > pair_gflops) {
      pair_gflops = r.gflops;
      pair_where = r.shape + " " + r.pass;
    }
  }
  for (const Shape4& s : shapes) {
    const double nat = SecondsOf(rows, s.name, "fwd", "native_fp8");
    if (!s.weight_bound || nat <= 0) continue;
    t->notes.push_back(s.name + ": native_fp8 is " +
                       Fixed(SecondsOf(rows, s.name, "fwd", "bf16") / nat, 2) +
                       "x as fast as bf16, " +
                       Fixed(SecondsOf(rows, s.name, "fwd", "fake_qat") / nat, 2) +
                       "x as fake_qat");
    if (pair_gflops > 0) {
      const double flops = 2.0 * static_cast<double>(s.m) * s.k * s.n;
      const double native_floor = flops / (pair_gflops * 1e9);
      const size_t si = static_cast<size_t>(&s - shapes.data());
      const double bf16_floor =
          2.0 * static_cast<double>(s.e) * s.k * s.n / (shape_read[si] * 1e9);
      t->notes.push_back(s.name + " floors: native_fp8 >= " + Fixed(native_floor * 1e3, 2) +
                         " ms (FLOPs at the best bf16-mode rate, " + Fixed(pair_gflops, 0) +
                         " GFLOP/s, " + pair_where + "); bf16 >= " + Fixed(bf16_floor * 1e3, 2) +
                         " ms (bf16 weight at the read ceiling): a bandwidth-bound bf16 allows at "
                         "most " + Fixed(bf16_floor / native_floor, 2) + "x");
    }
  }
}

}  // namespace

int BenchGmm(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  std::vector<Shape4> shapes = AllShapes();
  if (!opt.shape.empty() && !KeepShapesNamed(opt.shape, &shapes)) return 2;
  std::mt19937 rng(7);
  GmmRun run(opt);
  // Measured here and again after the timed rows (RemeasureCeilings); the
  // ratios are computed after that.
  MachineCeilings ceil = MeasureMachineCeilings(opt.threads, opt.reps, size_t{256} << 20);
  // The streaming read, timed among each weight-bound shape's modes: the
  // memory's speed on these shared machines drifts by 1.5x within a run
  // (46 -> 72 GB/s between the start and the end of one), so a ceiling
  // measured apart from the rows it divides can flatter or wrong them.
  // Allocated after the ceilings' own buffers are freed, and freed before
  // they are measured again.
  for (const Shape4& s : shapes) {
    if (s.weight_bound && run.stream == nullptr) {
      run.stream = std::make_unique<StreamingRead>(size_t{256} << 20, opt.threads);
    }
  }
  // sgemm ceiling of each shape: a dense [valid rows, K] x [K, N], same FLOPs.
  for (const Shape4& s : shapes) run.sgemm_shapes.push_back({ValidRows(s), s.k, s.n});
  run.sgemm = MeasureSgemmCeiling(run.sgemm_shapes, opt.threads, opt.reps, opt.sgemm_core);
  // Each pass's rounds time the shape's sgemm too (row mode "openblas", the
  // pass of the rows it divides), in a child with the ceiling's core: the
  // speed of these shared machines drifts within a run (all modes of one
  // shape at 0.86-0.88x an sgemm timed a minute before them, 0.95x in a run
  // an hour earlier), and a ceiling timed in the same rounds drifts with its
  // rows. Without a trusted core, or should the child not start, the sgemm
  // timed before the rows stands (rows of pass "sgemm"), and a note says why.
  run.sgemm_rounds =
      SgemmRounds::Start(run.sgemm, run.sgemm_shapes, opt.threads, &run.rounds_error);
  for (size_t si = 0; si < shapes.size(); ++si) TimeShape(&run, rng, shapes[si], si);

  // The ceilings once more, the higher of each kept; then every ratio. The
  // timed read's buffer goes first, so that it and the remeasurement's own
  // read and memcpy buffers (~0.75 GiB together) are never held at once.
  const bool timed_read = run.stream != nullptr;
  run.stream.reset();
  RemeasureCeilings(&ceil);
  const RatioSummary sum = ComputeRatios(ceil, run.sgemm, shapes.size(), &run.rows);

  Table t;
  t.title = "fp8moe bench gmm: " + std::to_string(opt.threads) + " threads, SIMD " +
            SimdTargetName();
  t.columns = {"shape", "pass", "mode", "ms", "GFLOP/s",
               run.sgemm.trusted ? "x sgemm" : "x FMA peak!", "x peak", "peak", "GB/s",
               "x memcpy", "x read"};
  const nlohmann::json js = RowsToTableAndJson(run.rows, sum.shape_read, run.sgemm.trusted, &t);
  AddCeilingNotes(run, ceil, sum, timed_read, &t);
  const nlohmann::json native_targets = AddNativeRatioNotes(shapes, run.rows, &t);
  AddDecodeNotes(shapes, run.rows, sum.shape_read, &t);
  if (opt.json) {
    nlohmann::json j = {{"bench", "gmm"}, {"threads", opt.threads},
                        {"simd_target", SimdTargetName()}, {"memcpy_gbs", ceil.memcpy_gbs},
                        {"read_gbs", ceil.read_gbs}, {"ceilings", CeilingsJson(ceil)},
                        {"sgemm", SgemmJson(run.sgemm, run.sgemm_shapes)},
                        {"sgemm_in_rounds", run.sgemm_rounds != nullptr},
                        {"sgemm_not_in_rounds_because", run.rounds_error},
                        {"rows", js}, {"native_time_ratios", native_targets}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    t.Print();
  }
  return 0;
}

}  // namespace fp8moe::bench
