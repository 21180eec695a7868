// The backend seam (kernels/backend.h, docs/design.md §7.2) seen from a Context: which
// kernel path ran (so a path that silently stops being taken fails here,
// not only in a benchmark), a repeated call allocates nothing, the thread
// count of a Context never changes the bits, and scratch is released.
// Correctness over every backend is gmm_test.cc's harness.
#include <atomic>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "base/heap_count_test_util.h"
#include "base/scratch_arena.h"
#include "base/test_seed.h"
#include "base/test_util.h"
#include "fp8moe/context.h"
#include "fp8moe/gmm.h"
#include "fp8moe/memory.h"
#include "fp8moe/quant.h"
#include "hwy/targets.h"
#include "kernels/cpu/gemm_call.h"
#include "kernels/cpu/kernel_path.h"

namespace fp8moe {
namespace {

using internal::KernelPath;
using internal::ResetKernelCounts;

Tensor Make(DType d, Shape s) { return std::move(Tensor::Create(d, std::move(s))).value(); }

// Random normal f32 [shape], converted to dtype (bf16, or codes + a
// per-channel scale for fp8 / int8 weights [E, K, N]).
struct Operand {
  Tensor t, scale;
  const ConstTensorView* scale_view() {
    if (scale.num_elements() == 0) return nullptr;
    sv = scale.view();
    return &sv;
  }
  ConstTensorView sv;
};

Operand Random(std::mt19937& rng, DType dtype, Shape shape) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor f = Make(DType::kF32, shape);
  for (size_t i = 0; i < f.num_elements(); ++i) f.data_as<float>()[i] = nd(rng);
  Operand o;
  if (dtype == DType::kF32) {
    o.t = std::move(f);
  } else if (dtype == DType::kBF16) {
    o.t = Make(DType::kBF16, shape);
    F32ToBf16Span(f.data_as<float>(), o.t.data_as<uint16_t>(), f.num_elements());
  } else {
    o.t = Make(dtype, shape);
    o.scale = Make(DType::kF32, {shape[0], shape[2]});
    EXPECT_TRUE(QuantizeChannels(f.data_as<float>(), shape[0], shape[1], shape[2],
                                 *QuantDTypeOf(dtype), Calibration::AbsMax(),
                                 o.t.data_as<uint8_t>(), o.scale.data_as<float>())
                    .ok());
  }
  return o;
}

Tensor Groups(int64_t e, int64_t rows_each) {
  Tensor gs = Make(DType::kI32, {e});
  for (int64_t g = 0; g < e; ++g) gs.data_as<int32_t>()[g] = static_cast<int32_t>(rows_each);
  return gs;
}

// ---- Which kernel ran ------------------------------------------------------------

enum class Op { kFwd, kDlhs, kTgmm };

struct PathCase {
  std::string name;
  Op op;
  GmmMode mode;
  DType act, weight;  // lhs / dout, rhs (fwd, dlhs); lhs, dout (tgmm)
  int64_t e, rows_each, k, n;
};

// The CPU features the dispatched target may use.
struct Features {
  bool avx3 = false, bf16 = false, vnni = false, vbmi = false;
};

Features FeaturesOf(const test::SimdTarget& target) {
  Features f;
  f.avx3 = target.hwy == HWY_AVX3;
  const bool ext = f.avx3 && target.extensions;  // AVX3_SPR, not plain AVX3
  f.bf16 = ext && UseBf16DotProducts();  // the CPU has them and they are chosen
  f.vnni = ext && __builtin_cpu_supports("avx512vnni");
  f.vbmi = ext && __builtin_cpu_supports("avx512vbmi");
  return f;
}

// What docs/kernels.md promises for each case on a target with features f.
KernelPath ExpectedPath(const PathCase& c, const Features& f) {
  const bool decode = c.rows_each <= 8;
  const bool pairs = f.bf16 && c.mode != GmmMode::kF32 && c.mode != GmmMode::kInt8;
  if (c.mode == GmmMode::kInt8) {
    if (decode && f.vnni) return KernelPath::kDirectI8Vnni;
    return f.vnni ? KernelPath::kPackedI16Vnni : KernelPath::kPackedI16Pairs;
  }
  if (c.op != Op::kFwd || !decode) {
    return pairs ? KernelPath::kPackedBf16Pairs : KernelPath::kPackedF32;
  }
  if (!pairs) {
    return c.mode == GmmMode::kNativeFp8 ? KernelPath::kDirectRawFp8 : KernelPath::kDirectF32;
  }
  if (c.mode == GmmMode::kNativeFp8 && f.vbmi) return KernelPath::kDirectFp8Vbmi;
  return KernelPath::kDirectBf16Pairs;
}

std::vector<PathCase> PathCases() {
  std::vector<PathCase> v;
  for (int64_t rows : {1, 8, 200}) {  // decode (1 or 8 rows per expert), train-like
    const std::string shape = rows <= 8 ? "decode" + std::to_string(rows) : "big";
    v.push_back({shape + " fwd f32", Op::kFwd, GmmMode::kF32, DType::kF32, DType::kF32, 8, rows, 256, 256});
    v.push_back({shape + " fwd bf16", Op::kFwd, GmmMode::kBf16, DType::kBF16, DType::kBF16, 8, rows, 256, 256});
    v.push_back({shape + " fwd fake_qat", Op::kFwd, GmmMode::kFakeQat, DType::kBF16, DType::kE4M3FN, 8, rows, 256, 256});
    v.push_back({shape + " fwd native_fp8", Op::kFwd, GmmMode::kNativeFp8, DType::kBF16, DType::kE4M3FN, 8, rows, 256, 256});
    v.push_back({shape + " fwd int8", Op::kFwd, GmmMode::kInt8, DType::kBF16, DType::kI8, 8, rows, 256, 256});
    v.push_back({shape + " dlhs bf16 from codes", Op::kDlhs, GmmMode::kBf16, DType::kBF16, DType::kE4M3FN, 8, rows, 256, 256});
    v.push_back({shape + " dlhs f32", Op::kDlhs, GmmMode::kF32, DType::kF32, DType::kF32, 8, rows, 256, 256});
    v.push_back({shape + " tgmm bf16", Op::kTgmm, GmmMode::kBf16, DType::kBF16, DType::kBF16, 8, rows, 256, 256});
    v.push_back({shape + " tgmm f32", Op::kTgmm, GmmMode::kF32, DType::kF32, DType::kF32, 8, rows, 256, 256});
  }
  return v;
}

Status RunCase(Context& ctx, const PathCase& c, std::mt19937& rng) {
  const int64_t m = c.e * c.rows_each;
  Tensor gs = Groups(c.e, c.rows_each);
  GmmOptions o;
  o.mode = c.mode;
  if (c.op == Op::kTgmm) {
    Operand lhs = Random(rng, c.act, {m, c.k}), dout = Random(rng, c.weight, {m, c.n});
    Tensor drhs = Make(DType::kF32, {c.e, c.k, c.n});
    return Tgmm(ctx, o, {}, lhs.t.view(), dout.t.view(), gs.view(), drhs.view());
  }
  Operand w = Random(rng, c.weight, {c.e, c.k, c.n});
  if (c.op == Op::kFwd) {
    Operand lhs = Random(rng, c.act, {m, c.k});
    Tensor out = Make(DType::kF32, {m, c.n});
    return Gmm(ctx, o, lhs.t.view(), w.t.view(), w.scale_view(), gs.view(), out.view());
  }
  Operand dout = Random(rng, c.act, {m, c.n});
  Tensor out = Make(DType::kF32, {m, c.k});
  return GmmDlhs(ctx, o, dout.t.view(), w.t.view(), w.scale_view(), gs.view(), out.view());
}

// No kernel path this CPU can run goes untested: every AVX-512 extension the
// kernels use (AVX512-BF16 dot products, VNNI, VBMI) that the CPU has is in
// use on some target test::SimdTargets() gives, and so in every test that
// runs over them; so is every Highway target (AVX3, AVX2) the CPU supports,
// which the build must therefore have compiled. A CPU without a feature
// skips only the tests of that feature, with GTEST_SKIP and the reason, and
// those run as ctest tests of their own (kernels/CMakeLists.txt), so that
// the skip shows in ctest's summary.
TEST(KernelPath, EveryFeatureOfThisCpuIsOnATestedTarget) {
  const int64_t cpu = hwy::SupportedTargets();  // before any test forces one
  Features any;
  bool avx2 = false;
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    const Features f = FeaturesOf(target);
    any.avx3 |= f.avx3;
    any.bf16 |= f.bf16;
    any.vnni |= f.vnni;
    any.vbmi |= f.vbmi;
    avx2 |= target.hwy == HWY_AVX2;
  }
  test::UseDefaultSimd();
  const bool has_avx3 = (cpu & HWY_AVX3) != 0;
  EXPECT_EQ(any.avx3, has_avx3) << "the CPU has AVX3 (AVX-512), the tested targets do not";
  EXPECT_EQ(avx2, (cpu & HWY_AVX2) != 0) << "the CPU has AVX2, the tested targets do not";
  EXPECT_EQ(any.bf16, has_avx3 && CpuHasAvx512Bf16Dot())
      << "AVX512-BF16 dot products: the CPU and the tested targets disagree";
  EXPECT_EQ(any.vnni, has_avx3 && __builtin_cpu_supports("avx512vnni"))
      << "AVX512-VNNI: the CPU and the tested targets disagree";
  EXPECT_EQ(any.vbmi, has_avx3 && __builtin_cpu_supports("avx512vbmi"))
      << "AVX512-VBMI: the CPU and the tested targets disagree";
  std::printf("this CPU's kernel features, each tested: AVX2 %d, AVX3 %d, bf16 dot %d, "
              "VNNI %d, VBMI %d\n", avx2, any.avx3, any.bf16, any.vnni, any.vbmi);
}

// The counters of a Context by path: counted, reset, every path named, and
// the four entries that are not paths left out of a sum over the paths.
TEST(KernelPath, CountsNamesAndTheEntriesThatAreNotPaths) {
  Context ctx;
  EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedF32), 0);
  CountKernel(ctx, KernelPath::kPackedF32, 2);
  EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedF32), 2);
  EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedBf16Pairs), 0);
  ResetKernelCounts(ctx);
  EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedF32), 0);
  std::set<std::string_view> names;
  for (int i = 0; i < static_cast<int>(KernelPath::kCount); ++i) {
    names.insert(KernelPathName(static_cast<KernelPath>(i)));
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(KernelPath::kCount));
  int paths = 0;
  for (int i = 0; i < static_cast<int>(KernelPath::kCount); ++i) {
    paths += IsKernelPath(static_cast<KernelPath>(i)) ? 1 : 0;
  }
  EXPECT_EQ(paths, static_cast<int>(KernelPath::kCount) - 4);
  EXPECT_FALSE(IsKernelPath(KernelPath::kDirectNextItemPrefetch));
  EXPECT_FALSE(IsKernelPath(KernelPath::kPackedRowBlocks));
  EXPECT_FALSE(IsKernelPath(KernelPath::kInItemLhsQuant));
  EXPECT_FALSE(IsKernelPath(KernelPath::kInItemLhsValues));
  EXPECT_TRUE(IsKernelPath(KernelPath::kReference));
}

// Without the byte tables (AVX512-BF16 CPUs without VBMI), native fp8
// decode items take the u16 decode of the pair kernels. On a CPU without
// AVX512-BF16 it skips (GTEST_SKIP), as its own ctest test.
TEST(KernelPath, Fp8DecodeWithoutByteTablesTakesTheU16Decode) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  bool ran = false;
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    if (!FeaturesOf(target).bf16) continue;
    internal::SetFp8ByteTableDecode(false);
    for (int64_t rows : {1, 2, 4, 8, 12}) {
      SCOPED_TRACE(target.label + " rows " + std::to_string(rows));
      Context ctx;
      const PathCase c{"decode native_fp8", Op::kFwd, GmmMode::kNativeFp8, DType::kBF16,
                       DType::kE4M3FN, 8, rows, 256, 256};
      ASSERT_TRUE(RunCase(ctx, c, rng).ok());
      EXPECT_GT(KernelCount(ctx, KernelPath::kDirectBf16Pairs), 0);
      EXPECT_EQ(KernelCount(ctx, KernelPath::kDirectFp8Vbmi), 0);
    }
    internal::SetFp8ByteTableDecode(true);
    ran = true;
  }
  test::UseDefaultSimd();
  if (!ran) {
    ASSERT_FALSE(CpuHasAvx512Bf16Dot()) << "the CPU has AVX512-BF16 but no target used it";
    GTEST_SKIP() << "this CPU has no AVX512-BF16 (vdpbf16ps): the u16 decode of the pair "
                    "kernels is for CPUs that have it";
  }
}

// On every target this CPU runs, each representative case takes exactly the
// kernel path docs/kernels.md names for it (AVX2 here: the decode shape on
// MicroF32Direct, with native fp8 weights decoded raw; big shapes on the
// packed f32 kernel, int8 on the packed int16-pair kernel; AVX3 and
// AVX512-BF16 paths on CPUs that have them).
TEST(KernelPath, EachCaseTakesItsKernelOnEveryTarget) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    const Features f = FeaturesOf(target);
    for (const PathCase& c : PathCases()) {
      SCOPED_TRACE(target.label + " " + c.name);
      Context ctx;
      ASSERT_TRUE(RunCase(ctx, c, rng).ok());
      const KernelPath want = ExpectedPath(c, f);
      EXPECT_GT(KernelCount(ctx, want), 0) << "expected " << KernelPathName(want);
      for (size_t i = 0; i < static_cast<size_t>(KernelPath::kCount); ++i) {
        const auto path = static_cast<KernelPath>(i);
        if (path != want && IsKernelPath(path)) {
          EXPECT_EQ(KernelCount(ctx, path), 0) << KernelPathName(path) << " ran instead of "
                                              << KernelPathName(want);
        }
      }
    }
  }
  test::UseDefaultSimd();
}

// Weight-bound (direct) items of a forward with many items each prefetch the
// first chunk of the next item their thread runs, on every target and thread
// count (one thread included: it takes its next item ahead too), except
// near the end of the call. Packed items never take one ahead. (That the
// bits do not depend on it: Gmm.BitsDoNotDependOnThreadsOrTiles.)
TEST(KernelPath, DirectItemsPrefetchTheNextItem) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const GmmMode mode : {GmmMode::kBf16, GmmMode::kNativeFp8}) {
      const DType wd = mode == GmmMode::kBf16 ? DType::kBF16 : DType::kE4M3FN;
      for (const int threads : {1, 2, 3}) {
        SCOPED_TRACE(target.label + " " + std::string(GmmModeName(mode)) + " threads " +
                     std::to_string(threads));
        ContextOptions co;
        co.threads = threads;
        Context ctx(co);
        // 24 one-row items: all but the last `threads` or so take the next
        // item ahead and prefetch it.
        ASSERT_TRUE(RunCase(ctx, {"decode", Op::kFwd, mode, DType::kBF16, wd, 24, 1, 512, 256},
                            rng).ok());
        const int64_t ahead = KernelCount(ctx, KernelPath::kDirectNextItemPrefetch);
        EXPECT_GE(ahead, 24 - 2 * threads);
        EXPECT_LT(ahead, 24);
        // 24 items of 200 rows: packed.
        ResetKernelCounts(ctx);
        ASSERT_TRUE(RunCase(ctx, {"big", Op::kFwd, mode, DType::kBF16, wd, 24, 200, 64, 64},
                            rng).ok());
        EXPECT_EQ(KernelCount(ctx, KernelPath::kDirectNextItemPrefetch), 0);
      }
    }
  }
  test::UseDefaultSimd();
}

// Packed forward and dLHS items of more than 512 rows whose B, packed for
// the whole reduction, fits 4 MiB run in row-block order: by default whole
// groups of up to 2048 rows, cut into near-equal items until each thread has
// four, and of 512 columns where only those fit. TGMM, items of at most 512
// rows and a larger B keep the chunk order.
// (That both orders give the same bits: Gmm.RowBlockOrderGivesTheBitsOfChunkOrder.)
TEST(KernelPath, TallPackedItemsRunInRowBlockOrder) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const GmmMode mode : {GmmMode::kBf16, GmmMode::kNativeFp8, GmmMode::kF32}) {
      const DType act = mode == GmmMode::kF32 ? DType::kF32 : DType::kBF16;
      const DType wd = mode == GmmMode::kBf16  ? DType::kBF16
                       : mode == GmmMode::kF32 ? DType::kF32
                                               : DType::kE4M3FN;
      for (const int threads : {1, 2}) {
        SCOPED_TRACE(target.label + " " + std::string(GmmModeName(mode)) + " threads " +
                     std::to_string(threads));
        ContextOptions co;
        co.threads = threads;
        Context ctx(co);
        // Four groups of 1200 rows: one item each on one thread; on two
        // threads 2048 leaves fewer than 8 items, 1024 cuts each group into
        // 600 + 600.
        const int64_t items = threads == 1 ? 4 : 8;
        for (const Op op : {Op::kFwd, Op::kDlhs}) {
          ResetKernelCounts(ctx);
          const GmmMode m = op == Op::kDlhs && mode == GmmMode::kNativeFp8 ? GmmMode::kBf16 : mode;
          ASSERT_TRUE(RunCase(ctx, {"tall", op, m, act, wd, 4, 1200, 64, 96}, rng).ok());
          EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), items);
        }
        ResetKernelCounts(ctx);
        ASSERT_TRUE(RunCase(ctx, {"tall", Op::kTgmm, mode == GmmMode::kF32 ? mode : GmmMode::kBf16,
                                  act, act, 4, 1200, 64, 96}, rng).ok());
        EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
        // Groups of 300 rows: packed, in chunk order.
        ResetKernelCounts(ctx);
        ASSERT_TRUE(RunCase(ctx, {"short", Op::kFwd, mode, act, wd, 8, 300, 64, 96}, rng).ok());
        EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), 0);
      }
    }
    // dLHS over a 2048 x 1024 f32 weight (8 MiB of f32 panels at 1024
    // columns): items of 512 columns, whose 4 MiB fit, in row-block order
    // (one thread: 1100 rows as 550 + 550, times two column items).
    {
      ContextOptions co;
      co.threads = 1;
      Context ctx(co);
      Tensor gs = Groups(1, 1100);
      Tensor dout = Make(DType::kF32, {1100, 2048}), w = Make(DType::kF32, {1, 1024, 2048});
      std::fill_n(dout.data_as<float>(), dout.num_elements(), 1.0f);
      std::fill_n(w.data_as<float>(), w.num_elements(), 0.25f);
      Tensor dl = Make(DType::kF32, {1100, 1024});
      GmmOptions o;
      o.mode = GmmMode::kF32;
      ASSERT_TRUE(GmmDlhs(ctx, o, dout.view(), w.view(), nullptr, gs.view(), dl.view()).ok());
      EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), 4) << target.label;
      EXPECT_EQ(dl.data_as<float>()[1099 * 1024 + 1023], 512.0f);
    }
    // A forward over B of 1100 x 1024 f32 (5 MiB in f32 panels of 256
    // reduction steps): chunk order, even in an item of 600 rows, with
    // 1024-column tiles; by default items of 512 columns (2.75 MiB), in
    // row-block order.
    for (const bool set_n : {true, false}) {
      Context ctx;
      Tensor gs = Groups(1, 600);
      Tensor lhs = Make(DType::kF32, {600, 1100}), w = Make(DType::kF32, {1, 1100, 1024});
      std::fill_n(lhs.data_as<float>(), lhs.num_elements(), 1.0f);
      std::fill_n(w.data_as<float>(), w.num_elements(), 0.5f);
      Tensor out = Make(DType::kF32, {600, 1024});
      GmmOptions o;
      o.mode = GmmMode::kF32;
      o.tiles.m = 4096;
      if (set_n) o.tiles.n = 1024;
      ASSERT_TRUE(Gmm(ctx, o, lhs.view(), w.view(), nullptr, gs.view(), out.view()).ok());
      EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedRowBlocks), set_n ? 0 : 2) << target.label;
      EXPECT_EQ(out.data_as<float>()[599 * 1024 + 1023], 550.0f);
    }
  }
  test::UseDefaultSimd();
}

// Native fp8 and int8 forwards quantize the activation item by item where
// every item holds all the columns of its rows (the default tiles, up to
// 1024 output columns), in chunk and row-block order and on the direct path;
// with narrower column tiles a row would be quantized twice, so a pre-pass
// does it. (Same bits either way: Gmm.BitsDoNotDependOnThreadsOrTiles runs
// 5-column tiles against the default.) Packed native fp8 items write the
// codes' values, direct ones the codes (in_item_lhs_values).
TEST(KernelPath, ItemsQuantizeTheirOwnActivationRows) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const test::SimdTarget& target : test::SimdTargets()) {
    test::UseSimdTarget(target);
    for (const GmmMode mode : {GmmMode::kNativeFp8, GmmMode::kInt8}) {
      const DType wd = mode == GmmMode::kInt8 ? DType::kI8 : DType::kE4M3FN;
      // Direct items (2 rows), chunk order (300), row-block order (1200).
      for (const int64_t rows : {2, 300, 1200}) {
        SCOPED_TRACE(target.label + " " + std::string(GmmModeName(mode)) + " rows " +
                     std::to_string(rows));
        ContextOptions co;
        co.threads = 1;
        Context ctx(co);
        ASSERT_TRUE(RunCase(ctx, {"fwd", Op::kFwd, mode, DType::kBF16, wd, 4, rows, 64, 96},
                            rng).ok());
        EXPECT_EQ(KernelCount(ctx, KernelPath::kInItemLhsQuant), 4);
        // Packed native fp8 items pack the codes' values (bf16); direct items
        // and int8 keep the codes.
        int64_t direct = 0;
        for (KernelPath p : {KernelPath::kDirectF32, KernelPath::kDirectBf16Pairs,
                             KernelPath::kDirectFp8Vbmi, KernelPath::kDirectI8Vnni,
                             KernelPath::kDirectRawFp8}) {
          direct += KernelCount(ctx, p);
        }
        // (Native fp8's 2-row items are direct on every target; int8's only
        // with VNNI.)
        if (mode == GmmMode::kNativeFp8) {
          EXPECT_EQ(direct, rows == 2 ? 4 : 0);
        }
        EXPECT_EQ(KernelCount(ctx, KernelPath::kInItemLhsValues),
                  mode == GmmMode::kNativeFp8 ? 4 - direct : 0);
        // 32-column tiles: three items per row range, one pre-pass.
        ResetKernelCounts(ctx);
        const int64_t m = 4 * rows;
        Tensor gs = Groups(4, rows);
        Tensor lhs = Make(DType::kBF16, {m, 64}), out = Make(DType::kF32, {m, 96});
        std::fill_n(lhs.data_as<uint16_t>(), lhs.num_elements(), uint16_t{0x3f80});  // 1.0
        Tensor w = Make(wd, {4, 64, 96}), scale = Make(DType::kF32, {4, 96});
        std::fill_n(w.data_as<uint8_t>(), w.num_elements(), static_cast<uint8_t>(mode == GmmMode::kInt8 ? 2 : 0x38));
        std::fill_n(scale.data_as<float>(), scale.num_elements(), 0.5f);
        GmmOptions o;
        o.mode = mode;
        o.tiles.n = 32;
        const ConstTensorView sv = scale.view();
        ASSERT_TRUE(Gmm(ctx, o, lhs.view(), w.view(), &sv, gs.view(), out.view()).ok());
        EXPECT_EQ(KernelCount(ctx, KernelPath::kInItemLhsQuant), 0);
        EXPECT_EQ(KernelCount(ctx, KernelPath::kInItemLhsValues), 0);
        // Every output is 64 x 1 x (code value) x 0.5: int8 codes 2 at the
        // activation scale 1/127 (codes 127), fp8 0x38 = 1.0.
        const float want = mode == GmmMode::kInt8 ? 64.0f * 127 * 2 * 0.5f / 127 : 32.0f;
        EXPECT_NEAR(out.data_as<float>()[(m - 1) * 96 + 95], want, 1e-3f * want);
      }
    }
  }
  test::UseDefaultSimd();
}

// A context on the reference backend runs the plain loops (and counts them).
TEST(KernelPath, ReferenceBackendRunsTheReference) {
  std::mt19937 rng(1);
  ContextOptions opts;
  opts.backend = BackendKind::kReference;
  Context ctx(opts);
  const PathCase c{"small", Op::kFwd, GmmMode::kBf16, DType::kBF16, DType::kBF16, 2, 5, 16, 16};
  ASSERT_TRUE(RunCase(ctx, c, rng).ok());
  EXPECT_EQ(KernelCount(ctx, KernelPath::kReference), 1);
  EXPECT_EQ(KernelCount(ctx, KernelPath::kPackedF32) + KernelCount(ctx, KernelPath::kDirectF32), 0);
  ResetKernelCounts(ctx);
  EXPECT_EQ(KernelCount(ctx, KernelPath::kReference), 0);
}

// ---- Scratch: a repeated call allocates nothing ----------------------------------

// Every pre-pass and scratch buffer the CPU backend has, on one Context:
// SwiGLU with h (C tile, epilogue rows), fake QAT (the BF16 weight copy),
// native fp8 and int8 (activation codes), dLHS from codes with dSwiGLU, TGMM
// with the in-kernel gradient quantization per tile and per group (gradient
// codes, scales, row tiles). The views are made once, so that the test counts
// the calls' allocations only.
struct EveryScratchUser {
  static constexpr int64_t e = 4, rows = 40, k = 96, n = 80, m = e * rows;
  explicit EveryScratchUser(std::mt19937& rng)
      : lhs(Random(rng, DType::kBF16, {m, k})),
        lhs32(Random(rng, DType::kF32, {m, k})),
        wb(Random(rng, DType::kBF16, {e, k, n})),
        wq(Random(rng, DType::kE4M3FN, {e, k, n})),
        wi(Random(rng, DType::kI8, {e, k, n})),
        dout(Random(rng, DType::kBF16, {m, n})),
        dout32(Random(rng, DType::kF32, {m, n})),
        out(Make(DType::kBF16, {m, n / 2})),
        h(Make(DType::kF32, {m, n})),
        dl(Make(DType::kF32, {m, 2 * k})),
        hh(Make(DType::kF32, {m, 2 * k})),
        dw(Make(DType::kF32, {e, k, n})) {
    std::memset(hh.data(), 0, hh.num_bytes());
    lhs_v = lhs.t.view(), lhs32_v = lhs32.t.view();
    wb_v = wb.t.view(), wq_v = wq.t.view(), wi_v = wi.t.view();
    dout_v = dout.t.view(), dout32_v = dout32.t.view();
    out_v = out.view(), dl_v = dl.view(), dw_v = dw.view(), hv = h.view(), hhv = hh.view();
    wq_scale = wq.scale_view();
    wi_scale = wi.scale_view();
  }
  // Every call once with these group sizes.
  void Run(Context& ctx, const ConstTensorView& gs_v) {
    GmmOptions o;
    o.epilogue = GmmEpilogue::kSwiGlu;
    for (GmmMode mode : {GmmMode::kBf16, GmmMode::kFakeQat, GmmMode::kNativeFp8, GmmMode::kInt8}) {
      o.mode = mode;
      const ConstTensorView& w = mode == GmmMode::kBf16   ? wb_v
                                 : mode == GmmMode::kInt8 ? wi_v
                                                          : wq_v;
      const ConstTensorView* scale = mode == GmmMode::kBf16   ? nullptr
                                     : mode == GmmMode::kInt8 ? wi_scale
                                                              : wq_scale;
      ASSERT_TRUE(Gmm(ctx, o, lhs_v, w, scale, gs_v, out_v, &hv).ok());
    }
    GmmOptions od;
    od.mode = GmmMode::kBf16;
    od.epilogue = GmmEpilogue::kDSwiGlu;
    ASSERT_TRUE(GmmDlhs(ctx, od, dout_v, wq_v, wq_scale, gs_v, dl_v, &hhv).ok());
    GmmOptions ot;
    ot.mode = GmmMode::kF32;
    for (bool per_group : {false, true}) {
      TgmmQuant q;
      q.dout_dtype = QuantDType::kE5M2;
      q.per_group = per_group;
      ASSERT_TRUE(Tgmm(ctx, ot, q, lhs32_v, dout32_v, gs_v, dw_v).ok());
    }
  }
  Operand lhs, lhs32, wb, wq, wi, dout, dout32;
  Tensor out, h, dl, hh, dw;
  ConstTensorView lhs_v, lhs32_v, wb_v, wq_v, wi_v, dout_v, dout32_v, hhv;  // inputs
  TensorView out_v, dl_v, dw_v, hv;                                         // outputs
  const ConstTensorView* wq_scale = nullptr;
  const ConstTensorView* wi_scale = nullptr;
};

TEST(Scratch, RepeatedCallsAllocateNothing) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  EveryScratchUser u(rng);
  Tensor gs = Groups(u.e, u.rows);
  const ConstTensorView gs_v = gs.view();
  Context ctx;
  u.Run(ctx, gs_v);
  const MemoryStats before = GetMemoryStats();
  const int64_t heap_before = test::HeapAllocations();
  EXPECT_GT(ctx.scratch().bytes(), 0u);
  for (int rep = 0; rep < 3; ++rep) u.Run(ctx, gs_v);
  const int64_t heap_after = test::HeapAllocations();
  const MemoryStats after = GetMemoryStats();
  EXPECT_EQ(after.allocations, before.allocations) << "a repeated call allocated";
  // Nor any hidden std::vector (the TGMM gradient quantizer's tiles and amax
  // rows come from the arena too).
  EXPECT_EQ(heap_after, heap_before) << "a repeated call allocated on the heap";
  EXPECT_EQ(after.in_use, before.in_use);
  // Releasing the scratch gives its memory back; the next call takes it again.
  const size_t held = ctx.scratch().bytes();
  ctx.ReleaseScratch();
  EXPECT_EQ(ctx.scratch().bytes(), 0u);
  EXPECT_EQ(GetMemoryStats().in_use, after.in_use - static_cast<int64_t>(held));
  u.Run(ctx, gs_v);
  EXPECT_EQ(ctx.scratch().bytes(), held);
}

// A trainer calls with the same shapes and another routing each step: once
// one call with rows has run, no group sizes of the same shapes allocate
// (the buffers are sized by the shapes and tiles, never by the group sizes;
// sizing the C tile by the largest group made the trainer's second step
// allocate on AVX-512, where the tile is 12 rows).
TEST(Scratch, OtherGroupSizesOfTheSameShapesAllocateNothing) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  EveryScratchUser u(rng);
  const int64_t m = EveryScratchUser::m;
  Tensor gs = Groups(u.e, 0);
  int32_t* sizes = gs.data_as<int32_t>();
  const ConstTensorView gs_v = gs.view();
  Context ctx;
  sizes[0] = 1;  // the smallest call with rows: one row, three empty groups
  u.Run(ctx, gs_v);
  const std::vector<std::vector<int32_t>> routings = {
      {static_cast<int32_t>(m), 0, 0, 0}, {0, 0, 0, 0}, {13, 1, 0, 7},
      {40, 40, 40, 40}, {0, static_cast<int32_t>(m) - 1, 1, 0}};
  const int64_t before = GetMemoryStats().allocations;
  const int64_t heap_before = test::HeapAllocations();
  for (const auto& r : routings) {
    std::copy(r.begin(), r.end(), sizes);
    u.Run(ctx, gs_v);
  }
  std::uniform_int_distribution<int32_t> cut(0, static_cast<int32_t>(m));
  for (int rep = 0; rep < 8; ++rep) {
    int32_t a = cut(rng), b = cut(rng), c = cut(rng);  // random sizes, sum <= m
    if (a > b) std::swap(a, b);
    if (b > c) std::swap(b, c);
    if (a > b) std::swap(a, b);
    sizes[0] = a, sizes[1] = b - a, sizes[2] = c - b, sizes[3] = rep % 2 ? 0 : static_cast<int32_t>(m) - c;
    u.Run(ctx, gs_v);
  }
  EXPECT_EQ(GetMemoryStats().allocations, before) << "other group sizes allocated";
  EXPECT_EQ(test::HeapAllocations(), heap_before) << "other group sizes allocated on the heap";
}

// The calls without a Context run on DefaultContext(): the same promise.
TEST(Scratch, DefaultContextCallsAllocateNothingWhenRepeated) {
  std::mt19937 rng(3);
  Tensor gs = Groups(3, 20);
  Operand lhs = Random(rng, DType::kBF16, {60, 64}), w = Random(rng, DType::kE4M3FN, {3, 64, 48});
  Tensor out = Make(DType::kF32, {60, 48});
  GmmOptions o;
  o.mode = GmmMode::kNativeFp8;
  ASSERT_TRUE(Gmm(o, lhs.t.view(), w.t.view(), w.scale_view(), gs.view(), out.view()).ok());
  const int64_t before = GetMemoryStats().allocations;
  ASSERT_TRUE(Gmm(o, lhs.t.view(), w.t.view(), w.scale_view(), gs.view(), out.view()).ok());
  EXPECT_EQ(GetMemoryStats().allocations, before);
  ReleaseGmmScratch();
  EXPECT_EQ(DefaultContext().scratch().bytes(), 0u);
}

// ---- Threads of a Context ----------------------------------------------------------

TEST(ContextThreads, BitsDoNotDependOnTheContextsThreadCount) {
  FP8MOE_RANDOM_SEED(seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int64_t e = 5, rows = 70, k = 300, n = 96, m = e * rows;
  Tensor gs = Groups(e, rows);
  Operand lhs = Random(rng, DType::kBF16, {m, k}), w = Random(rng, DType::kE4M3FN, {e, k, n});
  Operand lhs32 = Random(rng, DType::kF32, {m, k}), dout = Random(rng, DType::kF32, {m, n});
  std::vector<Tensor> fwd, tg;
  for (int threads : {1, 2, 3}) {
    ContextOptions opts;
    opts.threads = threads;
    Context ctx(opts);
    EXPECT_EQ(ctx.threads(), threads);
    GmmOptions o;
    o.mode = GmmMode::kNativeFp8;
    o.epilogue = GmmEpilogue::kSwiGlu;
    fwd.push_back(Make(DType::kF32, {m, n / 2}));
    ASSERT_TRUE(Gmm(ctx, o, lhs.t.view(), w.t.view(), w.scale_view(), gs.view(), fwd.back().view()).ok());
    GmmOptions ot;
    ot.mode = GmmMode::kF32;
    tg.push_back(Make(DType::kF32, {e, k, n}));
    ASSERT_TRUE(Tgmm(ctx, ot, {}, lhs32.t.view(), dout.t.view(), gs.view(), tg.back().view()).ok());
  }
  for (size_t i = 1; i < fwd.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(fwd[0].data(), fwd[i].data(), fwd[0].num_bytes())) << i;
    EXPECT_EQ(0, std::memcmp(tg[0].data(), tg[i].data(), tg[0].num_bytes())) << i;
  }
}

}  // namespace
}  // namespace fp8moe
