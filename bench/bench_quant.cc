// `fp8moe bench quant`: throughput of every conversion and quantization next
// to the memcpy bandwidth measured in the same run with the same threads (and
// the machine's other ceilings, printed for reference).
//
// Model: all of these are streaming element-wise passes, so the ceiling is
// memory bandwidth. GB/s counts the bytes a pass must read plus write once
// (f32 -> e4m3fn: 4 + 1 per element), the same way memcpy's GB/s counts its
// read plus its write. Quantizers with absmax read x twice (amax, then
// encode); their GB/s still counts x once, so they cannot reach memcpy.
#include <omp.h>

#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_quant.h"
#include "bench/bench_util.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "fp8moe/tensor.h"

namespace fp8moe::bench {
namespace {

struct Case {
  std::string name;
  double bytes_per_elem;  // read + written once
  std::function<void()> run;
};

}  // namespace

int BenchQuant(const BenchOptions& opt) {
  const int64_t cols = 1024;
  // At least 8 rows: the per-channel case quantizes [8, rows / 8, cols].
  const int64_t n = std::max<int64_t>(8 * cols, opt.elements / cols * cols);
  const int64_t rows = n / cols;
  omp_set_num_threads(opt.threads);

  Tensor x = MustCreate(DType::kF32, {n});
  Tensor y = MustCreate(DType::kF32, {n});
  Tensor c8 = MustCreate(DType::kU8, {n});
  Tensor c8b = MustCreate(DType::kU8, {n});
  Tensor h16 = MustCreate(DType::kU16, {n});
  // Scales: rows x 8 blocks of 128 (row+block128), or 8 x cols (per channel).
  Tensor scales = MustCreate(DType::kF32, {std::max(rows * 8, 8 * cols)});
  float* xs = x.data_as<float>();
  {
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    for (int64_t i = 0; i < n; ++i) xs[i] = nd(rng);
  }
  EncodeFp8Span(xs, c8.data_as<uint8_t>(), static_cast<size_t>(n), Fp8Format::kE4M3FN, true);
  F32ToBf16Span(xs, h16.data_as<uint16_t>(), static_cast<size_t>(n));

  const size_t un = static_cast<size_t>(n);
  uint8_t* codes = c8.data_as<uint8_t>();
  uint8_t* out8 = c8b.data_as<uint8_t>();
  float* ys = y.data_as<float>();
  float* ss = scales.data_as<float>();
  const Calibration absmax = Calibration::AbsMax();
  const std::vector<Case> cases = {
      {"cast f32->e4m3fn saturating", 5, [&] { EncodeFp8Span(xs, out8, un, Fp8Format::kE4M3FN, true); }},
      {"cast f32->e4m3fn", 5, [&] { EncodeFp8Span(xs, out8, un, Fp8Format::kE4M3FN, false); }},
      {"cast f32->e5m2 saturating", 5, [&] { EncodeFp8Span(xs, out8, un, Fp8Format::kE5M2, true); }},
      {"cast f32->e4m3fnuz saturating", 5, [&] { EncodeFp8Span(xs, out8, un, Fp8Format::kE4M3FNUZ, true); }},
      {"decode e4m3fn->f32", 5, [&] { DecodeFp8Span(codes, ys, un, Fp8Format::kE4M3FN); }},
      {"decode e5m2->f32", 5, [&] { DecodeFp8Span(codes, ys, un, Fp8Format::kE5M2); }},
      {"decode e4m3fnuz->f32", 5, [&] { DecodeFp8Span(codes, ys, un, Fp8Format::kE4M3FNUZ); }},
      {"decode e4m3fn->bf16", 3, [&] { DecodeFp8ToBf16Span(codes, h16.data_as<uint16_t>(), un, Fp8Format::kE4M3FN); }},
      {"cast f32->bf16", 6, [&] { F32ToBf16Span(xs, h16.data_as<uint16_t>(), un); }},
      {"decode bf16->f32", 6, [&] { Bf16ToF32Span(h16.data_as<uint16_t>(), ys, un); }},
      {"quantize tensor e4m3fn absmax", 5, [&] { (void)QuantizeTensor(xs, n, QuantDType::kE4M3FN, absmax, out8, ss); }},
      {"quantize row e4m3fn (K=1024)", 5, [&] { (void)QuantizeRows(xs, rows, cols, rows, 0, QuantDType::kE4M3FN, absmax, out8, ss); }},
      {"quantize row+block128 e4m3fn", 5, [&] { (void)QuantizeRows(xs, rows, cols, rows, 128, QuantDType::kE4M3FN, absmax, out8, ss); }},
      {"quantize row int8", 5, [&] { (void)QuantizeRows(xs, rows, cols, rows, 0, QuantDType::kInt8, absmax, out8, ss); }},
      {"quantize channel e4m3fn [8,K,1024]", 5, [&] { (void)QuantizeChannels(xs, 8, rows / 8, cols, QuantDType::kE4M3FN, absmax, out8, ss); }},
      {"dequantize row e4m3fn", 5, [&] { DequantizeRows(codes, rows, cols, 0, ss, QuantDType::kE4M3FN, ys); }},
  };

  // The bandwidths over a buffer the size of x, so they see the same caches
  // as the ops; measured before and after the ops, the higher kept.
  MachineCeilings ceil =
      MeasureMachineCeilings(opt.threads, opt.reps, static_cast<size_t>(n) * 4);
  std::vector<double> seconds;
  for (const Case& c : cases) seconds.push_back(BestSeconds(opt.reps, c.run));
  RemeasureCeilings(&ceil);
  const double memcpy_gbs = ceil.memcpy_gbs;
  Table t;
  t.title = "fp8moe bench quant: " + std::to_string(n) + " elements, " +
            std::to_string(opt.threads) + " threads, SIMD " + SimdTargetName();
  t.columns = {"op", "bytes/elem", "ms", "GB/s", "x memcpy"};
  nlohmann::json rows_json = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const double s = seconds[i];
    const double gbs = c.bytes_per_elem * static_cast<double>(n) / s / 1e9;
    t.rows.push_back({c.name, Fixed(c.bytes_per_elem, 0), Fixed(s * 1e3, 2),
                      Fixed(gbs, 2), Fixed(gbs / memcpy_gbs, 2)});
    rows_json.push_back({{"op", c.name}, {"bytes_per_elem", c.bytes_per_elem},
                         {"seconds", s}, {"gbs", gbs}, {"ratio_to_memcpy", gbs / memcpy_gbs}});
  }
  t.notes.push_back("memcpy ceiling (same run, " + std::to_string(opt.threads) +
                    " threads, " + SizeText(static_cast<size_t>(n) * 4) + "): " +
                    Fixed(memcpy_gbs, 2) + " GB/s (read + write)");
  for (const std::string& note : CeilingNotes(ceil)) t.notes.push_back(note);
  if (opt.json) {
    nlohmann::json j = {{"bench", "quant"}, {"elements", n}, {"threads", opt.threads},
                        {"simd_target", SimdTargetName()}, {"memcpy_gbs", memcpy_gbs},
                        {"ceilings", CeilingsJson(ceil)}, {"rows", rows_json}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    t.Print();
  }
  return 0;
}

}  // namespace fp8moe::bench
