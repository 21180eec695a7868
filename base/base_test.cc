#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>

#include "base/kernel_counters.h"
#include "base/number_text.h"
#include "base/scratch_arena.h"
#include "base/test_seed.h"
#include "fp8moe/context.h"
#include "fp8moe/dtype.h"
#include "fp8moe/memory.h"
#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  FP8MOE_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

// For 20000 values of random bits (the finite ones): `shortest(v)` reads
// back as v through `parse`, and v with one significant digit fewer does not.
template <class T, class Bits, class Shortest, class Parse>
void ExpectShortestOnRandomBits(uint64_t seed, Shortest shortest, Parse parse) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 20000; ++i) {
    T v;
    const Bits bits = static_cast<Bits>(rng());
    std::memcpy(&v, &bits, sizeof v);
    if (!std::isfinite(v)) continue;
    const std::string t = shortest(v);
    ASSERT_EQ(parse(t.c_str()), v) << t;
    char fewer[400];
    int digits = 0;  // significant digits in t: from its first non-zero digit
    for (char c : t.substr(0, t.find('e'))) digits += (c >= '1' && c <= '9') || (digits > 0 && c == '0');
    if (digits > 1) {
      std::snprintf(fewer, sizeof fewer, "%.*g", digits - 1, static_cast<double>(v));
      ASSERT_NE(parse(fewer), v) << t << " vs " << fewer;
    }
  }
}

TEST(FloatText, ShortestDecimalReadsBackAndIsShortest) {
  using internal::ShortestDecimal;
  EXPECT_EQ(ShortestDecimal(0.1), "0.1");
  EXPECT_EQ(ShortestDecimal(0.0005), "0.0005");
  EXPECT_EQ(ShortestDecimal(10000), "1e+04");
  EXPECT_EQ(ShortestDecimal(1234567), "1234567");
  EXPECT_EQ(ShortestDecimal(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(ShortestDecimal(-0.0), "-0");
  EXPECT_EQ(ShortestDecimal(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(ShortestDecimal(-std::numeric_limits<double>::infinity()), "-inf");
  EXPECT_EQ(ShortestDecimal(std::nan("")), "nan");
  EXPECT_EQ(ShortestDecimal(std::numeric_limits<double>::max()), "1.7976931348623157e+308");
  EXPECT_EQ(ShortestDecimal(std::numeric_limits<double>::denorm_min()), "5e-324");
  // Any double reads back exactly, and one digit fewer would not.
  FP8MOE_RANDOM_SEED(seed);
  ExpectShortestOnRandomBits<double, uint64_t>(
      seed, ShortestDecimal, [](const char* t) { return std::strtod(t, nullptr); });
}

TEST(NumberText, ShortestFloatDecimalReadsBackAsTheFloat) {
  using internal::ShortestFloatDecimal;
  EXPECT_EQ(ShortestFloatDecimal(0.1f), "0.1");
  EXPECT_EQ(ShortestFloatDecimal(-224.0f), "-224");
  EXPECT_EQ(ShortestFloatDecimal(0.0f), "0");
  EXPECT_EQ(ShortestFloatDecimal(-0.0f), "-0");
  EXPECT_EQ(ShortestFloatDecimal(std::numeric_limits<float>::max()), "3.4028235e+38");
  EXPECT_EQ(ShortestFloatDecimal(std::numeric_limits<float>::denorm_min()), "1e-45");
  EXPECT_EQ(ShortestFloatDecimal(std::numeric_limits<float>::infinity()), "inf");
  // Any float reads back exactly (strtof), and one digit fewer would not.
  FP8MOE_RANDOM_SEED(seed);
  ExpectShortestOnRandomBits<float, uint32_t>(
      seed, ShortestFloatDecimal, [](const char* t) { return std::strtof(t, nullptr); });
}

TEST(NumberText, Hex64IsSixteenLowerCaseDigits) {
  EXPECT_EQ(internal::Hex64(0), "0000000000000000");
  EXPECT_EQ(internal::Hex64(0xdeadbeef), "00000000deadbeef");
  EXPECT_EQ(internal::Hex64(~uint64_t{0}), "ffffffffffffffff");
  EXPECT_EQ(internal::Hex64(uint64_t{1} << 63), "8000000000000000");
}

TEST(Status, ValuesAndErrors) {
  EXPECT_TRUE(OkStatus().ok());
  EXPECT_EQ(InvalidArgument("bad").ToString(), "invalid argument: bad");
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_FALSE(Quarter(6).ok());
  EXPECT_EQ(Quarter(6).status().message(), "odd");
}

TEST(DType, NamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(DType::kU64); ++i) {
    const DType d = static_cast<DType>(i);
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_FALSE(ParseDType("f33").ok());
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_TRUE(IsFp8(DType::kE5M2FNUZ));
  EXPECT_FALSE(IsFp8(DType::kI8));
}

TEST(Tensor, AlignedAndChecked) {
  auto t = Tensor::Zeros(DType::kF32, {3, 5});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % 64, 0u);
  EXPECT_EQ(t->num_elements(), 15u);
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(t->data_as<float>()[i], 0.0f);
  EXPECT_TRUE(t->Reshape({15}).ok());
  EXPECT_FALSE(t->Reshape({16}).ok());
  EXPECT_FALSE(Tensor::Create(DType::kF32, {-1}).ok());
  EXPECT_FALSE(Tensor::Create(DType::kF32, {1LL << 40, 1LL << 40}).ok());
  auto huge = Tensor::Create(DType::kF32, {1LL << 61});
  EXPECT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
}

// Shape holds its dimensions inline and reads like the std::vector it
// replaced: size, [], iteration, comparison, push_back up to kMaxRank.
TEST(Shape, InlineDimensionsReadLikeAVector) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.size(), 3u);
  EXPECT_EQ(s[1], 3);
  EXPECT_EQ(s.back(), 4);
  int64_t product = 1;
  for (int64_t d : s) product *= d;
  EXPECT_EQ(product, 24);
  EXPECT_EQ(s, (Shape{2, 3, 4}));
  EXPECT_NE(s, (Shape{2, 3}));
  EXPECT_NE(s, (Shape{2, 3, 5}));
  Shape t = s;
  t.pop_back();
  EXPECT_EQ(t, (Shape{2, 3}));
  t.push_back(4);  // the popped dimension was cleared: equal again
  EXPECT_EQ(t, s);
  EXPECT_EQ(ShapeToString(s), "[2, 3, 4]");
  EXPECT_EQ(Shape(3, 7), (Shape{7, 7, 7}));
  EXPECT_TRUE(Shape().empty());
  Shape full;
  for (int i = 0; i < kMaxRank; ++i) full.push_back(1);
  EXPECT_EQ(full.size(), static_cast<size_t>(kMaxRank));
  EXPECT_DEATH(full.push_back(1), "at most");
  EXPECT_DEATH((void)s.at(3), "dimension 3 of the shape \\[2, 3, 4\\]");
}

// Views of const tensors are read-only: Tensor::view() of a const tensor is
// a ConstTensorView, whose as<T>() gives const T*, and a ConstTensorView never
// converts to the TensorView an output takes. A TensorView converts to a
// ConstTensorView of the same bytes, dtype and shape (a written buffer handed
// on as the next op's input).
static_assert(std::is_same_v<decltype(std::declval<const Tensor&>().view()), ConstTensorView>);
static_assert(std::is_same_v<decltype(std::declval<Tensor&>().view()), TensorView>);
static_assert(std::is_same_v<decltype(std::declval<const ConstTensorView&>().as<float>()),
                             const float*>);
static_assert(std::is_convertible_v<TensorView, ConstTensorView>);
static_assert(!std::is_convertible_v<ConstTensorView, TensorView>);
static_assert(!std::is_convertible_v<const ConstTensorView*, const TensorView*>);

TEST(TensorView, ConvertsToTheReadOnlyViewOfTheSameBytes) {
  Tensor t = Tensor::Zeros(DType::kBF16, {2, 3, 5}).value();
  const TensorView w = t.view();
  const ConstTensorView r = w;
  EXPECT_EQ(r.data, t.data());
  EXPECT_EQ(r.dtype, DType::kBF16);
  EXPECT_EQ(r.shape, (Shape{2, 3, 5}));
  EXPECT_EQ(r.num_bytes(), 60u);
  const Tensor& c = t;
  const ConstTensorView cv = c.view();
  EXPECT_EQ(cv.data, r.data);
  EXPECT_EQ(cv.dtype, r.dtype);
  EXPECT_EQ(cv.shape, r.shape);
  w.as<uint16_t>()[7] = 0x3F80;  // written through the output's view...
  EXPECT_EQ(cv.as<uint16_t>()[7], 0x3F80);  // ...read through the input's
}

TEST(Rng, DeterministicAndRestorable) {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) {
    const uint64_t v = a.NextU64();
    EXPECT_EQ(v, b.NextU64());
  }
  EXPECT_NE(a.NextU64(), c.NextU64());
  const Rng::State saved = a.state();
  const double u = a.Uniform(), n = a.Normal();
  Rng d;
  d.set_state(saved);
  EXPECT_EQ(d.Uniform(), u);
  EXPECT_EQ(d.Normal(), n);
}

TEST(Rng, RangesAndMoments) {
  Rng r(7);
  double sum = 0, sum2 = 0, usum = 0;
  const int n = 200000;
  int below_counts[5] = {};
  for (int i = 0; i < n; ++i) {
    const double u = r.Uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    usum += u;
    const double z = r.Normal();
    ASSERT_TRUE(std::isfinite(z));
    sum += z;
    sum2 += z * z;
    const uint64_t b = r.Below(5);
    ASSERT_LT(b, 5u);
    ++below_counts[b];
  }
  EXPECT_NEAR(usum / n, 0.5, 0.01);
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 1.0, 0.02);
  for (int c : below_counts) EXPECT_NEAR(c, n / 5, n / 50);
}

TEST(Context, OptionsCountersAndScratch) {
  struct Sink : MetricsSink {
    int calls = 0;
    void Record(std::string_view, double) override { ++calls; }
  } sink;
  ContextOptions o;
  o.threads = 3;
  o.backend = BackendKind::kReference;
  o.metrics = &sink;
  Context ctx(o);
  EXPECT_EQ(ctx.threads(), 3);
  EXPECT_EQ(ctx.backend(), BackendKind::kReference);
  EXPECT_EQ(ctx.metrics(), &sink);
  EXPECT_GE(DefaultContext().threads(), 1);
  EXPECT_EQ(DefaultContext().backend(), BackendKind::kCpu);
  // The kernels' counters (kernels/cpu/kernel_path.h names the slots).
  EXPECT_EQ(ctx.kernel_counters().Get(3), 0);
  ctx.kernel_counters().Add(3, 2);
  EXPECT_EQ(ctx.kernel_counters().Get(3), 2);
  EXPECT_EQ(ctx.kernel_counters().Get(4), 0);
  ctx.kernel_counters().Reset();
  EXPECT_EQ(ctx.kernel_counters().Get(3), 0);
  EXPECT_EQ(*ParseBackend(BackendName(BackendKind::kCpu)), BackendKind::kCpu);
  EXPECT_FALSE(ParseBackend("gpu").ok());

  // Scratch grows once, then is reused: no allocation on the second call.
  internal::ScratchArena& s = ctx.scratch();
  s.EnsureWorkers(2);
  uint8_t* p = s.Worker(1, internal::WorkerSlot::kPackA, 1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  const int64_t allocs = GetMemoryStats().allocations;
  EXPECT_EQ(s.Worker(1, internal::WorkerSlot::kPackA, 900), p);
  EXPECT_EQ(GetMemoryStats().allocations, allocs);
  EXPECT_GE(s.bytes(), 1000u);
  ctx.ReleaseScratch();
  EXPECT_EQ(s.bytes(), 0u);
}

}  // namespace
}  // namespace fp8moe
