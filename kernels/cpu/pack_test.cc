// The packers (pack.h) against plain loops written from the panel layouts:
// every source kind (f32, bf16, fp8 with and without a per-channel scale,
// rounded to bf16, int8), every panel kind, plain and transposed, odd
// extents and reduction blocks, two column runs, a group other than 0, on
// every SIMD target; padding is zero, and nothing is written past the
// panels.
#include "kernels/cpu/pack.h"

#include <bit>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/numerics.h"
#include "hwy/targets.h"

namespace fp8moe::internal {
namespace {

// A source of `rows` x `cols` per group, 2 groups, with random contents.
struct TestSource {
  Source src;
  std::vector<uint8_t> bytes;
  std::vector<float> scale;  // [2, cols]
  int64_t rows, cols;
};

TestSource MakeSource(std::mt19937& rng, SrcKind kind, Fp8Format fmt, bool scaled, bool round,
                      int64_t rows, int64_t cols) {
  TestSource t;
  t.rows = rows;
  t.cols = cols;
  t.src.kind = kind;
  t.src.fp8 = fmt;
  const size_t es = kind == SrcKind::kF32 ? 4 : kind == SrcKind::kBf16 ? 2 : 1;
  t.bytes.resize(static_cast<size_t>(2 * rows * cols) * es);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (size_t i = 0; i < t.bytes.size() / es; ++i) {
    const float v = nd(rng);
    if (kind == SrcKind::kF32) {
      std::memcpy(t.bytes.data() + 4 * i, &v, 4);
    } else if (kind == SrcKind::kBf16) {
      const uint16_t b = F32ToBf16(v);
      std::memcpy(t.bytes.data() + 2 * i, &b, 2);
    } else {
      t.bytes[i] = static_cast<uint8_t>(rng());  // any code, NaN codes included
      if (kind == SrcKind::kI8 && t.bytes[i] == 0x80) t.bytes[i] = 0x81;  // int8 codes are +-127
    }
  }
  t.src.data = t.bytes.data();
  t.src.ld = cols;
  t.src.group_stride = rows * cols;
  if (scaled) {
    t.scale.resize(static_cast<size_t>(2 * cols));
    for (float& s : t.scale) s = std::ldexp(1.0f + static_cast<float>(rng() % 100) / 100, -3);
    t.src.col_scale = t.scale.data();
    t.src.col_scale_group_stride = cols;
  }
  t.src.round_bf16 = round;
  return t;
}

// The value of source element (row, col) of group g, as the kernels see it.
float ValueOf(const TestSource& t, int32_t g, int64_t row, int64_t col) {
  const size_t at = static_cast<size_t>((g * t.rows + row) * t.cols + col);
  switch (t.src.kind) {
    case SrcKind::kF32: {
      float v;
      std::memcpy(&v, t.bytes.data() + 4 * at, 4);
      return v;
    }
    case SrcKind::kBf16: {
      uint16_t b;
      std::memcpy(&b, t.bytes.data() + 2 * at, 2);
      return Bf16ToF32(b);
    }
    case SrcKind::kI8:
      return static_cast<float>(static_cast<int8_t>(t.bytes[at]));
    case SrcKind::kFp8:
      break;
  }
  float v = DecodeFp8(t.bytes[at], t.src.fp8);
  if (t.src.col_scale != nullptr) v *= t.scale[static_cast<size_t>(g * t.cols + col)];
  if (t.src.round_bf16) v = Bf16ToF32(F32ToBf16(v));
  return v;
}

// The 16-bit lane a pair panel holds for a value (bf16 bits, or int16).
uint16_t HalfOf(const TestSource& t, float v) {
  if (t.src.kind == SrcKind::kI8) return static_cast<uint16_t>(static_cast<int16_t>(v));
  return F32ToBf16(v);
}

bool SameF32(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (a != a && b != b);
}

struct Kinds {
  SrcKind kind;
  Fp8Format fmt;
  bool scaled, round;
  PanelKind panel;
  std::string name;
};

std::vector<Kinds> AllKinds() {
  std::vector<Kinds> v;
  const Fp8Format e4 = Fp8Format::kE4M3FN, e5 = Fp8Format::kE5M2;
  for (PanelKind p : {PanelKind::kF32, PanelKind::kBf16Pairs}) {
    const std::string pn = p == PanelKind::kF32 ? " f32 panels" : " bf16 pairs";
    v.push_back({SrcKind::kBf16, e4, false, false, p, "bf16" + pn});
    v.push_back({SrcKind::kFp8, e4, false, false, p, "e4m3fn" + pn});
    v.push_back({SrcKind::kFp8, e5, false, false, p, "e5m2" + pn});
    v.push_back({SrcKind::kFp8, Fp8Format::kE4M3FNUZ, true, true, p, "e4m3fnuz scaled rounded" + pn});
    v.push_back({SrcKind::kFp8, e5, true, true, p, "e5m2 scaled rounded" + pn});
  }
  v.push_back({SrcKind::kF32, e4, false, false, PanelKind::kF32, "f32"});
  v.push_back({SrcKind::kFp8, e4, true, false, PanelKind::kF32, "e4m3fn scaled"});
  v.push_back({SrcKind::kI8, e4, false, false, PanelKind::kF32, "int8 f32 panels"});
  v.push_back({SrcKind::kI8, e4, false, false, PanelKind::kI16Pairs, "int8 i16 pairs"});
  return v;
}

constexpr uint8_t kCanary = 0xA5;

TEST(Pack, PanelsMatchPlainLoopsOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const Kinds& k : AllKinds()) {
      for (bool transposed : {false, true}) {
        // (MR, NR, kc): the register tiles of AVX2, AVX3, the direct kernels,
        // SSE4 and scalar (NR is a power of two: B transposes 8 columns at a
        // time), with odd and even reduction blocks.
        for (const auto& [mr, nr, kc] :
             {std::tuple<int64_t, int64_t, int64_t>{6, 16, 37}, {12, 32, 5}, {12, 32, 18},
              {8, 16, 64}, {6, 8, 256}, {4, 2, 1}, {4, 2, 10}}) {
          SCOPED_TRACE(target.label + " " + k.name +
                       (transposed ? " transposed" : "") + " mr " + std::to_string(mr) + " nr " + std::to_string(nr) +
                       " kc " + std::to_string(kc));
          // Per group; room for every reduction block read below.
          const int64_t rows = 61 + kc, cols = 83 + kc;
          const TestSource t = MakeSource(rng, k.kind, k.fmt, k.scaled, k.round, rows, cols);
          const int32_t g = 1;
          const Operand op{&t.src, g, transposed};
          const int64_t step = k.panel == PanelKind::kF32 ? kc : (kc + 1) / 2;
          std::vector<uint8_t> scratch(PackScratch::Bytes(128 + kc + 1, kc));
          PackScratch s;
          s.Carve(scratch.data(), 128 + kc + 1, kc);
          // A: the GEMM's (i, r) = source (i0 + i, r0 + r), or transposed; once
          // inside the source and once ending at its last byte (group 1 is the
          // last: an over-read, e.g. of a bf16 row read in place, leaves the
          // buffer, which ASan reports).
          const int64_t n_rows = transposed ? 29 : 23;
          for (const bool at_end : {false, true}) {
            SCOPED_TRACE(at_end ? "A at the end of the source" : "A inside the source");
            const int64_t i0 = !at_end ? 3 : transposed ? cols - n_rows : rows - n_rows;
            const int64_t r0 = !at_end ? (transposed ? 7 : 11) : transposed ? rows - kc : cols - kc;
            const size_t bytes = PanelBytes(k.panel, n_rows, mr, kc);
            std::vector<uint8_t> ap(bytes + 64, kCanary);
            PackA(op, k.panel, i0, n_rows, r0, kc, mr, ap.data(), s);
            for (size_t b = bytes; b < ap.size(); ++b) ASSERT_EQ(ap[b], kCanary) << "A overrun";
            const int64_t panels = (n_rows + mr - 1) / mr;
            for (int64_t i = 0; i < panels * mr; ++i) {
              for (int64_t r = 0; r < step * (k.panel == PanelKind::kF32 ? 1 : 2); ++r) {
                const bool in = i < n_rows && r < kc;
                const float v = !in ? 0.0f
                                : transposed ? ValueOf(t, g, r0 + r, i0 + i)
                                             : ValueOf(t, g, i0 + i, r0 + r);
                const int64_t p = i / mr, ii = i % mr;
                if (k.panel == PanelKind::kF32) {
                  float got;
                  std::memcpy(&got, ap.data() + ((p * step + r) * mr + ii) * 4, 4);
                  ASSERT_TRUE(SameF32(got, v)) << "A(" << i << ", " << r << ") " << got << " vs " << v;
                } else {
                  uint32_t pair;
                  std::memcpy(&pair, ap.data() + ((p * step + r / 2) * mr + ii) * 4, 4);
                  const uint16_t got = static_cast<uint16_t>(r % 2 ? pair >> 16 : pair & 0xFFFF);
                  ASSERT_EQ(got, in ? HalfOf(t, v) : 0) << "A(" << i << ", " << r << ")";
                }
              }
            }
          }
          // B: (r, j) = source (r0 + r, c0 + j) for the columns of two runs,
          // or transposed (dLHS).
          {
            ColumnRuns runs;
            runs.runs = 2;
            runs.count = transposed ? 19 : 21;
            runs.start[0] = 2;
            runs.start[1] = transposed ? 31 : 50;
            const int64_t r0 = transposed ? 13 : 4;
            const int64_t per_run = (runs.count + nr - 1) / nr;
            const size_t bytes = 2 * PanelBytes(k.panel, runs.count, nr, kc);
            std::vector<uint8_t> bp(bytes + 64, kCanary);
            const int64_t panels = PackB(op, k.panel, r0, kc, runs, nr, bp.data(), s);
            ASSERT_EQ(panels, 2 * per_run);
            for (size_t b = bytes; b < bp.size(); ++b) ASSERT_EQ(bp[b], kCanary) << "B overrun";
            for (int run = 0; run < 2; ++run) {
              for (int64_t j = 0; j < per_run * nr; ++j) {
                for (int64_t r = 0; r < step * (k.panel == PanelKind::kF32 ? 1 : 2); ++r) {
                  const bool in = j < runs.count && r < kc;
                  const int64_t c = runs.start[run] + j;
                  const float v = !in ? 0.0f
                                  : transposed ? ValueOf(t, g, c, r0 + r)
                                               : ValueOf(t, g, r0 + r, c);
                  const int64_t q = run * per_run + j / nr, jj = j % nr;
                  if (k.panel == PanelKind::kF32) {
                    float got;
                    std::memcpy(&got, bp.data() + ((q * step + r) * nr + jj) * 4, 4);
                    ASSERT_TRUE(SameF32(got, v)) << "B(" << r << ", " << j << ") run " << run;
                  } else {
                    uint32_t pair;
                    std::memcpy(&pair, bp.data() + ((q * step + r / 2) * nr + jj) * 4, 4);
                    const uint16_t got = static_cast<uint16_t>(r % 2 ? pair >> 16 : pair & 0xFFFF);
                    ASSERT_EQ(got, in ? HalfOf(t, v) : 0) << "B(" << r << ", " << j << ") run " << run;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  test::UseDefaultSimd();
}

}  // namespace
}  // namespace fp8moe::internal
