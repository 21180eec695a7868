// The datasets: the synthetic corpus is deterministic, resumable, and its
// exact entropy floor agrees with the empirical loss of the true model; text
// files split and resume; token files are checked whole, split by documents,
// packed into windows and resume; bad inputs are clear errors.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/data.h"
#include "fp8moe/memory.h"

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

// A token file as docs/train.md lays it out: header, offsets, ids (each
// document gets its EOS appended here, as the encoder does).
std::string TokenFile(uint64_t vocab, uint64_t eos, const std::vector<std::vector<uint32_t>>& docs) {
  const uint32_t id_bytes = vocab <= 65536 ? 2 : 4;
  std::vector<uint64_t> offsets{0};
  std::vector<uint32_t> ids;
  for (const auto& d : docs) {
    ids.insert(ids.end(), d.begin(), d.end());
    ids.push_back(static_cast<uint32_t>(eos));
    offsets.push_back(ids.size());
  }
  std::string f("FP8MTOKS", 8);
  auto put = [&](const void* p, size_t n) { f.append(static_cast<const char*>(p), n); };
  const uint32_t version = 1;
  const uint64_t nd = docs.size(), nt = ids.size();
  put(&version, 4);
  put(&id_bytes, 4);
  put(&vocab, 8);
  put(&eos, 8);
  put(&nd, 8);
  put(&nt, 8);
  for (uint64_t o : offsets) put(&o, 8);
  for (uint32_t id : ids) {
    if (id_bytes == 2) {
      const auto v = static_cast<uint16_t>(id);
      put(&v, 2);
    } else {
      put(&id, 4);
    }
  }
  return f;
}

// Documents d of `n` ids each: ids 10 d + 1.. (below the vocab of 64), EOS 0.
std::vector<std::vector<uint32_t>> Docs(int count, int n) {
  std::vector<std::vector<uint32_t>> docs(static_cast<size_t>(count));
  for (int d = 0; d < count; ++d) {
    for (int i = 0; i < n; ++i) docs[static_cast<size_t>(d)].push_back(static_cast<uint32_t>((10 * d + 1 + i) % 63 + 1));
  }
  return docs;
}

DataConfig Tokens(const std::string& name, const std::string& bytes) {
  DataConfig c;
  c.type = "tokens";
  c.path = WriteFile(name, bytes);
  c.seq_len = 4;
  c.batch = 2;
  c.vocab_size = 64;
  c.seed = 5;
  return c;
}

// 10 documents of 3 ids (+ EOS): 40 tokens. eval_split_fraction 0.25 keeps
// ceil(2.5) = 3 documents (12 tokens) for eval and 7 (28 tokens) for
// training: (28 - 1) / 4 = 6 train windows, (12 - 1) / 4 = 2 eval windows.
TEST(Data, TokensPackDocumentsIntoWindowsSplitByDocumentsAndResume) {
  const auto docs = Docs(10, 3);
  std::vector<int32_t> stream;
  for (const auto& d : docs) {
    stream.insert(stream.end(), d.begin(), d.end());
    stream.push_back(0);
  }
  DataConfig c = Tokens("fp8moe_tokens_good.bin", TokenFile(64, 0, docs));
  c.eval_fraction = 0.25;
  auto d = OpenDataset(c);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_NE((*d)->Describe().find("10 documents, 40 tokens, vocab 64, EOS 0; 7 documents for "
                                  "training: 6 windows, eval 2"),
            std::string::npos)
      << (*d)->Describe();
  // Each epoch (3 batches of 2) draws the 6 train windows once each; window w
  // is stream[4w .. 4w + 4], inputs the first 4, targets the last 4.
  std::vector<int32_t> in(8), tgt(8);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<int> seen;
    std::vector<int> order;
    for (int batch = 0; batch < 3; ++batch) {
      (*d)->NextTrainBatch(in.data(), tgt.data());
      for (int b = 0; b < 2; ++b) {
        int w = -1;
        for (int k = 0; k < 6; ++k) {
          if (std::equal(in.begin() + 4 * b, in.begin() + 4 * b + 4, stream.begin() + 4 * k)) w = k;
        }
        ASSERT_GE(w, 0) << "a train window that is not one of the 6";
        for (int t = 0; t < 4; ++t) EXPECT_EQ(tgt[4 * b + t], stream[4 * w + t + 1]);
        seen.insert(w);
      }
    }
    EXPECT_EQ(seen.size(), 6u) << "epoch " << epoch;
  }
  // Eval batch i holds eval windows (2i, 2i + 1) mod 2 of the eval stream
  // (tokens 28..39), the same every time.
  (*d)->EvalBatch(3, in.data(), tgt.data());
  EXPECT_EQ(in, std::vector<int32_t>(stream.begin() + 28, stream.begin() + 36));
  EXPECT_EQ(tgt[3], stream[32]);
  EXPECT_EQ(tgt[7], stream[36]);
  // Resume: a fresh dataset at a saved position draws the same bits as the
  // uninterrupted one, across an epoch boundary.
  auto a = OpenDataset(c);
  auto b = OpenDataset(c);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int32_t> ia(8), ta(8), ib(8), tb(8);
  for (int i = 0; i < 5; ++i) (*a)->NextTrainBatch(ia.data(), ta.data());
  const auto pos = (*a)->Position();
  ASSERT_EQ(pos, std::vector<uint64_t>{10});
  ASSERT_TRUE((*b)->SetPosition(pos).ok());
  for (int i = 0; i < 4; ++i) {
    (*a)->NextTrainBatch(ia.data(), ta.data());
    (*b)->NextTrainBatch(ib.data(), tb.data());
    EXPECT_EQ(ia, ib);
    EXPECT_EQ(ta, tb);
  }
  EXPECT_FALSE((*b)->SetPosition({1, 2}).ok());
  // Another data_shuffle_seed draws another order of the same windows.
  DataConfig other = c;
  other.seed = 6;
  auto e = OpenDataset(other);
  ASSERT_TRUE(e.ok());
  auto f = OpenDataset(c);
  std::vector<int32_t> all_c, all_e;
  for (int i = 0; i < 3; ++i) {
    (*f)->NextTrainBatch(in.data(), tgt.data());
    all_c.insert(all_c.end(), in.begin(), in.end());
    (*e)->NextTrainBatch(in.data(), tgt.data());
    all_e.insert(all_e.end(), in.begin(), in.end());
  }
  EXPECT_NE(all_c, all_e);
}

TEST(Data, TokensWithAVocabAbove65536StoreUint32Ids) {
  std::vector<std::vector<uint32_t>> docs = {{70000, 1, 2, 3, 69999}, {5, 6, 7, 8, 9}};
  DataConfig c = Tokens("fp8moe_tokens_u32.bin", TokenFile(70001, 70000, docs));
  c.vocab_size = 70001;
  c.eval_fraction = 0.5;
  auto d = OpenDataset(c);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::vector<int32_t> in(8), tgt(8);
  (*d)->NextTrainBatch(in.data(), tgt.data());
  EXPECT_EQ(in[0], 70000);
  EXPECT_EQ(tgt[3], 69999);
  (*d)->EvalBatch(0, in.data(), tgt.data());
  EXPECT_EQ(std::vector<int32_t>(in.begin(), in.begin() + 4), (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(tgt[3], 9);
}

// Every damaged file is refused with its numbers, before any batch.
TEST(Data, TokensRefuseEveryDamagedFile) {
  const std::string good = TokenFile(64, 0, Docs(10, 3));
  auto with = [&](size_t at, const void* p, size_t n) {
    std::string f = good;
    std::memcpy(f.data() + at, p, n);
    return f;
  };
  const uint32_t v2 = 2, four = 4;
  const uint64_t big_vocab = 100, eos_out = 64, docs11 = 11, off3 = 3, huge = UINT64_MAX;
  const uint16_t id_out = 64, not_eos = 5;
  const size_t ids_at = 48 + 8 * 11;
  struct Case {
    std::string name, bytes, needle;
  } cases[] = {
      {"empty", "", "0 bytes, fewer than the 48-byte header"},
      {"header cut", good.substr(0, 47), "47 bytes, fewer than the 48-byte header"},
      {"magic", with(0, "FP8MTOKZ", 8), "not a token file"},
      {"text", std::string(200, 'a'), "not a token file"},
      {"version", with(8, &v2, 4), "token file version 2; this fp8moe reads version 1"},
      {"width", with(12, &four, 4), "stores ids in 4 bytes, but its vocab_size 64 takes 2"},
      {"vocab", with(16, &big_vocab, 8), "a vocabulary of 100 ids but the model's vocab_size=64"},
      {"eos", with(24, &eos_out, 8), "EOS id 64 outside its vocabulary of 64"},
      {"truncated", good.substr(0, good.size() - 1),
       "has 215 bytes but its header (10 documents, 40 ids of 2 bytes) makes it 216 bytes; the "
       "file is truncated"},
      {"trailing", good + "x", "has 217 bytes but its header"},
      {"documents", with(32, &docs11, 8), "(11 documents, 40 ids of 2 bytes) makes it 224 bytes"},
      {"huge", with(40, &huge, 8), "makes it more than 2^64 bytes; the file is truncated"},
      {"offset", with(48 + 8 * 2, &off3, 8), "document 1 spans ids 4..3 of 40"},
      {"no eos", with(ids_at + 2 * 3, &not_eos, 2), "document 0 ends with id 5, not EOS 0"},
      {"id", with(ids_at + 2 * 1, &id_out, 2), "id 1 is 64, outside its vocabulary of 64"},
  };
  for (const Case& k : cases) {
    auto d = OpenDataset(Tokens("fp8moe_tokens_bad.bin", k.bytes));
    ASSERT_FALSE(d.ok()) << k.name;
    EXPECT_NE(d.status().message().find(k.needle), std::string::npos)
        << k.name << ": " << d.status().message();
    EXPECT_NE(d.status().message().find("fp8moe_tokens_bad.bin"), std::string::npos) << k.name;
  }
  // Splits too small for one window each, and a missing path.
  DataConfig c = Tokens("fp8moe_tokens_small.bin", good);
  c.seq_len = 12;
  c.eval_fraction = 0.25;  // eval: 3 documents, 12 tokens < 13
  auto d = OpenDataset(c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("7 for training (28 tokens) and 3 for eval (12 tokens)"),
            std::string::npos)
      << d.status().message();
  c = Tokens("fp8moe_tokens_one.bin", TokenFile(64, 0, Docs(1, 40)));
  d = OpenDataset(c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("each split needs one document"), std::string::npos);
  c.path.clear();
  d = OpenDataset(c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("dataset_type=tokens needs dataset_path"), std::string::npos);
  c.path = ::testing::TempDir() + "no/such/tokens.bin";
  d = OpenDataset(c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("cannot read dataset_path"), std::string::npos);
}

// A token file past the memory cap is refused from its size before it is
// read: a 400 MB sparse file whose header is consistent with that size.
TEST(Data, TokensPastTheMemoryCapAreRefusedBeforeTheRead) {
  const uint64_t n = 200'000'000;
  std::string head = TokenFile(64, 0, {});
  const uint64_t one = 1;
  std::memcpy(head.data() + 32, &one, 8);  // D = 1 (its offsets are never read)
  std::memcpy(head.data() + 40, &n, 8);
  DataConfig c = Tokens("fp8moe_tokens_big.bin", head + std::string(8, '\0'));
  std::filesystem::resize_file(c.path, 48 + 16 + 2 * n);
  const uint64_t cap = MemoryCap();
  const std::string source = MemoryCapSource();
  SetMemoryCap(100 << 20, "test");
  auto d = OpenDataset(c);
  SetMemoryCap(cap, source);
  std::filesystem::remove(c.path);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kResourceExhausted) << d.status().ToString();
  EXPECT_NE(d.status().message().find("fp8moe_tokens_big.bin' and its window order needs"),
            std::string::npos)
      << d.status().message();
}

}  // namespace
}  // namespace fp8moe
