#include "bench/bench_util.h"

#include "fp8moe/numerics.h"
#include "fp8moe/tensor.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace fp8moe::bench {

Tensor MustCreate(DType dtype, Shape shape) {
  auto t = Tensor::Create(dtype, std::move(shape));
  MustSucceed(t.status());
  return std::move(t).value();
}

void MustSucceed(const Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

Tensor RandomF32(std::mt19937& rng, Shape shape, float sd) {
  Tensor t = MustCreate(DType::kF32, std::move(shape));
  std::normal_distribution<float> nd(0.0f, sd);
  for (size_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = nd(rng);
  return t;
}

Tensor ToBf16(const Tensor& f) {
  Tensor t = MustCreate(DType::kBF16, f.shape());
  F32ToBf16Span(f.data_as<float>(), t.data_as<uint16_t>(), f.num_elements());
  return t;
}

double NowSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double BestSeconds(int reps, const std::function<void()>& fn) {
  return BestSecondsInterleaved(reps, {fn})[0];
}

std::vector<double> BestSecondsInterleaved(int reps, const std::vector<std::function<void()>>& fns) {
  const std::vector<std::vector<double>> rounds = SecondsInterleaved(reps, fns);
  std::vector<double> best(fns.size(), 1e30);
  for (size_t i = 0; i < fns.size(); ++i) {
    for (double t : rounds[i]) best[i] = std::min(best[i], t);
  }
  return best;
}

std::vector<std::vector<double>> SecondsInterleaved(int reps,
                                                    const std::vector<std::function<void()>>& fns) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> seconds(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const double t0 = NowSeconds();
      fns[i]();
      seconds[i].push_back(NowSeconds() - t0);
    }
  }
  return seconds;
}

RatioInterval PairedRatioInterval(const std::vector<double>& a, const std::vector<double>& b) {
  RatioInterval out;
  const size_t n = std::min(a.size(), b.size());
  if (n == 0) return out;
  std::vector<double> ratios(n);
  for (size_t i = 0; i < n; ++i) ratios[i] = a[i] / b[i];
  std::sort(ratios.begin(), ratios.end());
  out.rounds = static_cast<int>(n);
  out.median = n % 2 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]);
  // P(X <= j) for X ~ Binomial(n, 1/2), summed in doubles: exact enough for
  // the thousand rounds --reps allows (the terms are tiny, not lost).
  std::vector<double> cdf(n + 1);
  double term = std::pow(0.5, static_cast<double>(n)), sum = 0;
  for (size_t j = 0; j <= n; ++j) {
    sum += term;
    cdf[j] = sum;
    term = term * static_cast<double>(n - j) / static_cast<double>(j + 1);
  }
  // [x_(k), x_(n+1-k)] (1-based) misses the median when at least n+1-k
  // ratios lie on one side of it: coverage 1 - 2 P(X <= k-1).
  size_t k = 1;
  while (k + 1 <= (n + 1) / 2 && 1.0 - 2.0 * cdf[k] >= 0.95) ++k;
  out.low = ratios[k - 1];
  out.high = ratios[n - k];
  out.coverage = n == 1 ? 0.0 : 1.0 - 2.0 * cdf[k - 1];
  out.verdict = out.high < 1.0 ? "faster" : out.low > 1.0 ? "slower" : "parity";
  return out;
}

std::string DescribeInterval(const RatioInterval& r) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%.3f median of %d rounds' ratios, %.1f%% interval %.3f-%.3f: %s",
                r.median, r.rounds, std::floor(r.coverage * 1000) / 10, r.low, r.high,
                r.verdict.c_str());
  return buf;
}

nlohmann::json IntervalJson(const RatioInterval& r) {
  return {{"rounds", r.rounds}, {"median", r.median}, {"low", r.low}, {"high", r.high},
          {"coverage", r.coverage}, {"verdict", r.verdict}};
}

namespace {

// Passes over a buffer per timed run: small buffers are gone over until a
// run moves >= 64 MiB, so that starting the threads does not dominate.
size_t PassesFor(size_t bytes) {
  return std::max<size_t>(1, (size_t{64} << 20) / std::max<size_t>(bytes, 1));
}

}  // namespace

double MemcpyGBs(size_t bytes, int threads, int reps) {
  // Buffers from the same allocator as the kernels' tensors (2 MiB aligned,
  // huge pages), so the ceiling and the kernels see the same memory system.
  Tensor src_t = MustCreate(DType::kU8, {static_cast<int64_t>(bytes)});
  Tensor dst_t = MustCreate(DType::kU8, {static_cast<int64_t>(bytes)});
  char* src = src_t.data_as<char>();
  char* dst = dst_t.data_as<char>();
  std::memset(src, 1, bytes);
  std::memset(dst, 2, bytes);
  const size_t passes = PassesFor(bytes);
  const double t = BestSeconds(std::max(reps, 3), [&] {
#pragma omp parallel num_threads(threads)
    {
      const int nt = omp_get_num_threads(), id = omp_get_thread_num();
      const size_t per = (bytes / nt) & ~size_t{63};
      const size_t b = per * id, e = id == nt - 1 ? bytes : b + per;
      for (size_t p = 0; p < passes; ++p) {
        std::memcpy(dst + b, src + b, e - b);
        asm volatile("" ::: "memory");  // every pass is a real copy
      }
    }
  });
  return 2.0 * static_cast<double>(bytes * passes) / t / 1e9;
}

namespace {

// One pass of the streaming-read loop over words [b, e): four independent
// sums (no add chain); with kAhead > 0 the loop also prefetches kAhead words
// ahead, one line per 8 words (the direct GMM kernels prefetch, so a ceiling
// without it could be beaten, and was: bf16 decode at 1.05-1.15x of it).
template <size_t kAhead>
uint64_t ReadPass(const uint64_t* src, size_t b, size_t e) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t i = b;
  for (; i + 8 <= e; i += 8) {
    if constexpr (kAhead > 0) __builtin_prefetch(src + i + kAhead, 0, 0);
    a0 += src[i] + src[i + 4];
    a1 += src[i + 1] + src[i + 5];
    a2 += src[i + 2] + src[i + 6];
    a3 += src[i + 3] + src[i + 7];
  }
  for (; i < e; ++i) a0 += src[i];
  return a0 + a1 + a2 + a3;
}

}  // namespace

StreamingRead::StreamingRead(size_t bytes, int threads)
    : buffer_(MustCreate(DType::kU8, {static_cast<int64_t>(bytes)})),
      bytes_(bytes),
      threads_(threads),
      passes_(PassesFor(bytes)) {
  std::memset(buffer_.data(), 1, bytes);
}

void StreamingRead::Run(bool prefetch) const {
  const uint64_t* src = buffer_.data_as<uint64_t>();
  const size_t words = bytes_ / 8;
  uint64_t total = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : total)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const size_t per = (words / static_cast<size_t>(nt)) & ~size_t{7};
    const size_t b = per * static_cast<size_t>(id);
    const size_t e = id == nt - 1 ? words : b + per;
    for (size_t p = 0; p < passes_; ++p) {
      asm volatile("" ::: "memory");  // every pass reads the buffer again
      total += prefetch ? ReadPass<512>(src, b, e) : ReadPass<0>(src, b, e);
    }
  }
  static volatile uint64_t sink = 0;
  sink = sink + total;
}

double ReadGBs(size_t bytes, int threads, int reps) {
  const StreamingRead read(bytes, threads);
  // The best of the plain loop and the prefetching one (alternated runs).
  double best = 0;
  for (bool prefetch : {false, true, false, true}) {
    const double t = BestSeconds(std::max(reps, 3), [&] { read.Run(prefetch); });
    best = std::max(best, read.BytesPerRun() / t / 1e9);
  }
  return best;
}

MachineCeilings MeasureMachineCeilings(int threads, int reps, size_t bytes) {
  MachineCeilings c;
  c.peaks = MeasurePeaks(threads);
  c.bytes = bytes;
  c.reps = reps;
  c.read_gbs = ReadGBs(bytes, threads, reps);
  c.memcpy_gbs = MemcpyGBs(bytes, threads, reps);
  c.measurements = 1;
  return c;
}

void MergeCeilings(MachineCeilings* kept, const MachineCeilings& again) {
  // Whether `now` beats `was`; a move of more than 10% either way is noted.
  auto higher = [&](const std::string& name, const char* unit, double was, double now) {
    const double lo = std::min(was, now), hi = std::max(was, now);
    if (lo > 0 && hi > 1.1 * lo) {
      kept->moved.push_back(name + " " + Fixed(was, 1) + " then " + Fixed(now, 1) + " " + unit);
    }
    return now > was;
  };
  MachinePeaks& m = kept->peaks;
  bool f32_again = false;  // the f32 FMA peak kept is the second measurement's
  for (size_t k = 0; k < m.peaks.size() && k < again.peaks.peaks.size(); ++k) {
    Peak& p = m.peaks[k];
    const Peak& q = again.peaks.peaks[k];
    const bool flt = p.kind == PeakKind::kF32Fma || p.kind == PeakKind::kBf16Dot;
    if (higher(PeakName(p.kind), flt ? "GFLOP/s" : "GOP/s", p.gops, q.gops)) {
      p = q;
      f32_again = f32_again || p.kind == PeakKind::kF32Fma;
    }
  }
  // The clock of the measurement whose f32 FMA peak was kept (the table
  // holds that peak against 2 pipes x this clock), and every peak's ops per
  // cycle over it.
  if (f32_again) {
    m.core_ghz = again.peaks.core_ghz;
    m.tsc_ghz = again.peaks.tsc_ghz;
  }
  for (Peak& p : m.peaks) {
    p.ops_per_cycle = p.gops > 0 && m.core_ghz > 0 ? p.gops / (m.core_ghz * m.threads) : 0.0;
  }
  if (higher("streaming read", "GB/s", kept->read_gbs, again.read_gbs)) kept->read_gbs = again.read_gbs;
  if (higher("memcpy", "GB/s", kept->memcpy_gbs, again.memcpy_gbs)) {
    kept->memcpy_gbs = again.memcpy_gbs;
  }
  kept->measurements += again.measurements;
}

void RemeasureCeilings(MachineCeilings* c) {
  MergeCeilings(c, MeasureMachineCeilings(c->peaks.threads, c->reps, c->bytes));
}

std::vector<std::string> CeilingNotes(const MachineCeilings& c) {
  const MachinePeaks& m = c.peaks;
  std::vector<std::string> notes;
  notes.push_back("machine peaks (same run, " + std::to_string(m.threads) + " threads, SIMD " +
                  m.simd_target + "): register-only loops, each thread updating " +
                  std::to_string(m.Get(PeakKind::kF32Fma).loop.chains) +
                  " independent vector accumulators with one instruction, no loads or stores; "
                  "each thread's rate from its own CPU time, best of 40 runs" +
                  (c.measurements > 1 ? std::string("; these peaks and the bandwidths measured at "
                                                     "the start and again at the end of the run, "
                                                     "the higher of each kept")
                                       : std::string()));
  if (!c.moved.empty()) {
    std::string line = "  ceilings that moved by more than 10% between the two (the machine was "
                       "busy during the lower): ";
    for (size_t i = 0; i < c.moved.size(); ++i) line += (i ? "; " : "") + c.moved[i];
    notes.push_back(line);
  }
  for (const Peak& p : m.peaks) {
    std::string line = "  " + std::string(PeakName(p.kind)) + ": ";
    if (p.gops <= 0) {
      line += "none on this target/CPU";
    } else {
      const bool flt = p.kind == PeakKind::kF32Fma || p.kind == PeakKind::kBf16Dot;
      line += Fixed(p.gops, 1) + (flt ? " GFLOP/s" : " GOP/s") + " (" + p.loop.instr;
      if (p.ops_per_cycle > 0) {
        line += "; " + Fixed(p.ops_per_cycle, 1) + (flt ? " flop" : " op") + "/cycle/thread = " +
                Fixed(p.ops_per_cycle / p.loop.ops_per_instr, 2) + " instructions/cycle";
      }
      line += std::string(p.loop.kernels_use ? "; the GMM kernels use it" : "") + ")";
      if (p.gops_wall < 0.9 * p.gops) {
        line += " [busy machine: " + Fixed(p.gops_wall, 1) + " by wall time]";
      }
    }
    notes.push_back(line);
  }
  if (m.core_ghz > 0) {
    const Peak& f = m.Get(PeakKind::kF32Fma);
    notes.push_back("  core clock " + Fixed(m.core_ghz, 2) +
                    " GHz under this load (a chain of dependent integer adds, 1 per cycle; TSC " +
                    Fixed(m.tsc_ghz, 2) + " GHz); two pipes of " + f.loop.instr +
                    " would give 2 x " + Fixed(f.loop.ops_per_instr, 0) + " flop x " +
                    Fixed(m.core_ghz, 2) + " GHz x " +
                    std::to_string(m.threads) + " threads = " + Fixed(m.TwoPipeF32Estimate(), 1) +
                    " GFLOP/s; measured " + Fixed(f.gops / m.TwoPipeF32Estimate(), 2) + " of that");
  }
  notes.push_back("bandwidth (same run, " + SizeText(c.bytes) +
                  " buffers): streaming read " + Fixed(c.read_gbs, 1) + " GB/s, memcpy " +
                  Fixed(c.memcpy_gbs, 1) + " GB/s (read + written)");
  return notes;
}

nlohmann::json CeilingsJson(const MachineCeilings& c) {
  const MachinePeaks& m = c.peaks;
  nlohmann::json peaks = nlohmann::json::object();
  for (const Peak& p : m.peaks) {
    peaks[PeakName(p.kind)] = {
        {"available", p.gops > 0},        {"kernels_use", p.loop.kernels_use},
        {"gops", p.gops},                 {"gops_wall", p.gops_wall},
        {"ops_per_cycle", p.ops_per_cycle},
        {"instructions_per_cycle", p.loop.ops_per_instr > 0 ? p.ops_per_cycle / p.loop.ops_per_instr : 0.0},
        {"lanes", p.loop.lanes},          {"chains", p.loop.chains},
        {"ops_per_instruction", p.loop.ops_per_instr}, {"instruction", p.loop.instr},
        {"what", p.what}};
  }
  return {{"threads", m.threads},
          {"simd_target", m.simd_target},
          {"core_ghz", m.core_ghz},
          {"tsc_ghz", m.tsc_ghz},
          {"f32_fma_two_pipe_estimate_gflops", m.TwoPipeF32Estimate()},
          {"peaks", peaks},
          {"read_gbs", c.read_gbs},
          {"memcpy_gbs", c.memcpy_gbs},
          {"measurements", c.measurements},
          {"moved", c.moved},
          {"bandwidth_bytes", c.bytes}};
}

KernelArith ArithOfMode(const std::string& mode) {
  if (mode == "f32" || mode == "openblas") return KernelArith::kF32;
  if (mode == "int8") return KernelArith::kInt16Pairs;
  return KernelArith::kBf16Pairs;
}

const Peak& BoundingPeak(const MachinePeaks& peaks, KernelArith arith) {
  auto used = [&](PeakKind k) {
    const Peak& p = peaks.Get(k);
    return p.gops > 0 && p.loop.kernels_use;
  };
  switch (arith) {
    case KernelArith::kF32:
      break;
    case KernelArith::kBf16Pairs:
      if (used(PeakKind::kBf16Dot)) return peaks.Get(PeakKind::kBf16Dot);
      break;  // bf16 and fp8 operands are widened to f32 and use FMA
    case KernelArith::kInt16Pairs:
      if (used(PeakKind::kInt16Vnni)) return peaks.Get(PeakKind::kInt16Vnni);
      return peaks.Get(PeakKind::kInt16Pairs);
  }
  return peaks.Get(PeakKind::kF32Fma);
}

void Table::Print() const {
  std::vector<size_t> w(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) w[c] = columns[c].size();
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
  }
  std::printf("\n%s\n", title.c_str());
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < columns.size(); ++c) {
      const std::string& s = c < cells.size() ? cells[c] : "";
      if (c == 0) {
        std::printf("%-*s", static_cast<int>(w[c]), s.c_str());
      } else {
        std::printf("  %*s", static_cast<int>(w[c]), s.c_str());
      }
    }
    std::printf("\n");
  };
  line(columns);
  size_t total = 0;
  for (size_t x : w) total += x + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const auto& r : rows) line(r);
  for (const auto& n : notes) std::printf("%s\n", n.c_str());
}

std::string Fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

std::string SizeText(size_t bytes) {
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) {
    return std::to_string(bytes >> 20) + " MiB";
  }
  if (bytes >= 1024) return Fixed(static_cast<double>(bytes) / 1024, bytes % 1024 ? 1 : 0) + " KiB";
  return std::to_string(bytes) + " B";
}

}  // namespace fp8moe::bench
