// The seed of every random test (docs/design.md §12): fresh each run, so the tests see
// new data every time, and replayable: FP8MOE_TEST_SEED=<n> makes every
// random test of every test binary draw from seed n. Use it as
//
//   TEST(Foo, Bar) {
//     FP8MOE_RANDOM_SEED(seed);   // declares `seed`, notes it on failure
//     std::mt19937 rng(seed);
//
// Every failure message inside the test then ends with
// "FP8MOE_TEST_SEED=<n> replays this test". Test-only (includes gtest).
#ifndef FP8MOE_BASE_TEST_SEED_H_
#define FP8MOE_BASE_TEST_SEED_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace fp8moe::test {

// FP8MOE_TEST_SEED when it is set (decimal), else a fresh random seed. A
// malformed value is a test setup error and aborts with a message.
inline uint64_t TestSeed() {
  if (const char* env = std::getenv("FP8MOE_TEST_SEED"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end == nullptr || *end != '\0') {
      std::fprintf(stderr, "FP8MOE_TEST_SEED='%s' is not a decimal number\n", env);
      std::abort();
    }
    return v;
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | rd();
}

inline std::string SeedNote(uint64_t seed) {
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return "FP8MOE_TEST_SEED=" + std::to_string(seed) + " replays this test";
}

}  // namespace fp8moe::test

// Declares `const uint64_t name` = the test's seed and adds the line that
// replays it to every failure reported in the enclosing scope.
#define FP8MOE_RANDOM_SEED(name)                         \
  const uint64_t name = ::fp8moe::test::TestSeed();      \
  SCOPED_TRACE(::fp8moe::test::SeedNote(name))

#endif  // FP8MOE_BASE_TEST_SEED_H_
