// The datasets: the synthetic corpus is deterministic, resumable, and its
// exact entropy floor agrees with the empirical loss of the true model; text
// files split and resume; bad inputs are clear errors.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/data.h"

namespace fp8moe {
namespace {

DataConfig Synthetic() {
  DataConfig c;
  c.seq_len = 16;
  c.batch = 8;
  c.vocab_size = 40;
  c.num_sources = 3;
  c.alphabet_size = 6;
  c.branching = 3;
  c.seed = 11;
  return c;
}

TEST(Data, SyntheticIsDeterministicAndResumable) {
  auto a = OpenDataset(Synthetic());
  auto b = OpenDataset(Synthetic());
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int32_t> in1(128), t1(128), in2(128), t2(128);
  (*a)->NextTrainBatch(in1.data(), t1.data());
  const auto pos = (*a)->Position();
  (*a)->NextTrainBatch(in1.data(), t1.data());
  ASSERT_TRUE((*b)->SetPosition(pos).ok());
  (*b)->NextTrainBatch(in2.data(), t2.data());
  EXPECT_EQ(in1, in2);
  EXPECT_EQ(t1, t2);
  // Targets are the inputs shifted by one; the first input is a marker.
  for (int b = 0; b < 8; ++b) {
    EXPECT_LT(in1[b * 16], 3);
    for (int t = 1; t < 16; ++t) EXPECT_EQ(in1[b * 16 + t], t1[b * 16 + t - 1]);
    for (int t = 0; t < 16; ++t) EXPECT_GE(t1[b * 16 + t], 3);
  }
  // Eval batches do not move the training stream and repeat exactly.
  (*a)->EvalBatch(2, in1.data(), t1.data());
  (*b)->EvalBatch(2, in2.data(), t2.data());
  EXPECT_EQ(in1, in2);
}

// The floor is the expected loss of the Bayes-optimal predictor: estimate it
// from samples with the true conditional probabilities (read off the empirical
// counts of a long sample of the same corpus) and compare.
TEST(Data, SyntheticFloorMatchesTheEmpiricalConditionalEntropy) {
  DataConfig c = Synthetic();
  c.batch = 256;
  auto d = OpenDataset(c);
  ASSERT_TRUE(d.ok());
  const double floor = *(*d)->EntropyFloor();
  // Counts of (source, position-class, previous, next): position 0 is the
  // first symbol given the marker; later ones depend on the previous symbol.
  const int M = 3, A = 6, S = 16;
  std::vector<double> first(M * A, 0), trans(M * A * A, 0);
  std::vector<int32_t> in(256 * S), tgt(256 * S);
  std::vector<std::vector<int32_t>> seqs;
  for (int batch = 0; batch < 200; ++batch) {
    (*d)->NextTrainBatch(in.data(), tgt.data());
    for (int b = 0; b < 256; ++b) {
      const int s = in[b * S];
      first[s * A + tgt[b * S] - M] += 1;
      for (int t = 1; t < S; ++t) trans[(s * A + tgt[b * S + t - 1] - M) * A + tgt[b * S + t] - M] += 1;
    }
  }
  // Plug-in conditional entropy from the counts.
  double h = 0, n = 0;
  for (int s = 0; s < M; ++s) {
    double tot = 0;
    for (int j = 0; j < A; ++j) tot += first[s * A + j];
    for (int j = 0; j < A; ++j) {
      const double p = first[s * A + j] / tot;
      if (p > 0) h -= first[s * A + j] * std::log(p);
    }
    n += tot;
    for (int i = 0; i < A; ++i) {
      double rt = 0;
      for (int j = 0; j < A; ++j) rt += trans[(s * A + i) * A + j];
      for (int j = 0; j < A; ++j) {
        const double cnt = trans[(s * A + i) * A + j];
        if (cnt > 0) h -= cnt * std::log(cnt / rt);
      }
      n += rt;
    }
  }
  h /= n;
  // 819,200 targets: the plug-in estimate is within ~1e-3 of the truth.
  EXPECT_NEAR(h, floor, 5e-3) << "floor " << floor << " empirical " << h;
  EXPECT_GT(floor, 0.3);
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(Data, TextSplitsResumesAndRefusesShortFiles) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  DataConfig c;
  c.type = "text";
  c.path = WriteFile("fp8moe_data_text.txt", text);
  c.seq_len = 32;
  c.batch = 4;
  auto d = OpenDataset(c);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE((*d)->EntropyFloor().has_value());
  std::vector<int32_t> in(128), tgt(128), in2(128), tgt2(128);
  const auto pos = (*d)->Position();
  (*d)->NextTrainBatch(in.data(), tgt.data());
  ASSERT_TRUE((*d)->SetPosition(pos).ok());
  (*d)->NextTrainBatch(in2.data(), tgt2.data());
  EXPECT_EQ(in, in2);
  for (int t = 0; t < 31; ++t) EXPECT_EQ(in[t + 1], tgt[t]);
  for (int v : in) EXPECT_EQ(v, static_cast<unsigned char>(v));

  c.path = WriteFile("fp8moe_data_short.txt", "too short");
  auto s = OpenDataset(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("shorter than one sequence"), std::string::npos)
      << s.status().message();
  c.path = ::testing::TempDir() + "no/such/file.txt";
  s = OpenDataset(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("cannot read dataset_path"), std::string::npos);
  c.path = WriteFile("fp8moe_data_text.txt", text);
  c.vocab_size = 100;
  s = OpenDataset(c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("vocab_size=256"), std::string::npos);
  DataConfig syn = Synthetic();
  syn.vocab_size = 5;
  s = OpenDataset(syn);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("raise vocab_size"), std::string::npos);
}

}  // namespace
}  // namespace fp8moe
