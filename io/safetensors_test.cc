#include "fp8moe/safetensors.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include "base/test_seed.h"
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <thread>

#include "fp8moe/memory.h"

namespace fp8moe {
namespace {

constexpr DType kAllDTypes[] = {
    DType::kF32,    DType::kF64,      DType::kF16,  DType::kBF16,
    DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2, DType::kE5M2FNUZ,
    DType::kBool,   DType::kI8,       DType::kU8,   DType::kI16,
    DType::kU16,    DType::kI32,      DType::kU32,  DType::kI64,
    DType::kU64,
};

// Fresh random bytes each run; the seed is reported on failure.
class SafetensorsTest : public ::testing::Test {
 protected:
  SafetensorsTest() : seed_(test::TestSeed()), rng_(static_cast<uint32_t>(seed_)) {
    char tmpl[] = "/tmp/fp8moe_safetensors_XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  ~SafetensorsTest() override {
    std::string cmd = "rm -rf '" + dir_ + "'";
    (void)std::system(cmd.c_str());
  }
  void SetUp() override { ASSERT_FALSE(dir_.empty()); }

  Tensor RandomTensor(DType dtype, Shape shape) {
    Tensor t = Tensor::Create(dtype, std::move(shape)).value();
    auto* p = t.data_as<uint8_t>();
    for (size_t i = 0; i < t.num_bytes(); ++i) {
      p[i] = dtype == DType::kBool ? rng_() & 1 : rng_() & 0xFF;
    }
    return t;
  }

  std::vector<std::string> DirEntries() {
    std::vector<std::string> names;
    DIR* d = opendir(dir_.c_str());
    while (dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) {
        names.push_back(e->d_name);
      }
    }
    closedir(d);
    return names;
  }

  uint64_t seed_;
  std::mt19937 rng_;
  std::string dir_;
};

#define SEED_TRACE() SCOPED_TRACE(test::SeedNote(seed_))

std::vector<uint8_t> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteBytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()),
            static_cast<std::streamsize>(b.size()));
}

// A file from a header text and a byte buffer, optionally space-padded.
std::vector<uint8_t> MakeFile(std::string header,
                              const std::vector<uint8_t>& buffer = {},
                              bool pad = false) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t n = header.size();
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + buffer.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), buffer.begin(), buffer.end());
  return out;
}

Result<SafetensorsFile> Parse(const std::vector<uint8_t>& b) {
  return ParseSafetensors(b.data(), b.size());
}

// Expects `bytes` to fail with `code` and a message holding every `words`.
void ExpectError(const std::vector<uint8_t>& bytes, StatusCode code,
                 std::initializer_list<std::string> words) {
  auto r = Parse(bytes);
  ASSERT_FALSE(r.ok()) << "parsed a malformed file";
  const Status s = r.status();
  EXPECT_EQ(s.code(), code) << s.ToString();
  for (const std::string& w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos)
        << "message lacks \"" << w << "\": " << s.message();
  }
}

void ExpectSameFile(const SafetensorsFile& a, const SafetensorsFile& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [an, at] = a.tensors[i];
    const auto& [bn, bt] = b.tensors[i];
    SCOPED_TRACE("tensor " + an);
    EXPECT_EQ(an, bn);
    EXPECT_EQ(at.dtype(), bt.dtype());
    EXPECT_EQ(at.shape(), bt.shape());
    ASSERT_EQ(at.num_bytes(), bt.num_bytes());
    EXPECT_EQ(std::memcmp(at.data(), bt.data(), at.num_bytes()), 0);
  }
  EXPECT_EQ(a.metadata, b.metadata);
}

TEST_F(SafetensorsTest, RoundTripsEveryDTypeAndShape) {
  SEED_TRACE();
  SafetensorsFile f;
  const Shape shapes[] = {{}, {0}, {7}, {2, 3, 4}, {3, 0, 2}, {1, 1, 5}};
  for (DType d : kAllDTypes) {
    for (size_t s = 0; s < std::size(shapes); ++s) {
      const std::string name =
          std::string(DTypeName(d)) + "/" + std::to_string(s);
      ASSERT_TRUE(f.Add(name, RandomTensor(d, shapes[s])).ok());
    }
  }
  f.metadata = {
      {"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}, {"", ""}};
  const std::string path = dir_ + "/all.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, f).ok());
  auto read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameFile(f, *read);

  // The in-memory pair agrees with the file pair, byte for byte.
  auto bytes = SerializeSafetensors(f);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, ReadBytes(path));
  auto parsed = Parse(*bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ExpectSameFile(f, *parsed);
}

TEST_F(SafetensorsTest, RoundTripsEmptyFileAndKeepsOrderOfEmptyTensors) {
  SafetensorsFile empty;
  auto bytes = SerializeSafetensors(empty);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, MakeFile("{}      "));
  auto parsed = Parse(*bytes);
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->tensors.empty() && parsed->metadata.empty());

  // Several zero-size tensors share an offset; the order must survive.
  SafetensorsFile f;
  for (const char* name : {"z", "b", "m", "a"}) {
    ASSERT_TRUE(f.Add(name, RandomTensor(DType::kF32, {0, 4})).ok());
  }
  ASSERT_TRUE(f.Add("data", RandomTensor(DType::kI16, {3})).ok());
  ASSERT_TRUE(f.Add("y", RandomTensor(DType::kU8, {0})).ok());
  auto again = Parse(SerializeSafetensors(f).value());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectSameFile(f, *again);
}

TEST_F(SafetensorsTest, FnuzIsStoredAsU8WithFormatMetadata) {
  SEED_TRACE();
  SafetensorsFile f;
  ASSERT_TRUE(f.Add("w", RandomTensor(DType::kE4M3FNUZ, {2, 2})).ok());
  ASSERT_TRUE(f.Add("g", RandomTensor(DType::kE5M2FNUZ, {3})).ok());
  std::vector<uint8_t> bytes = SerializeSafetensors(f).value();
  const std::string text(bytes.begin() + 8, bytes.end());
  EXPECT_NE(text.find("\"__metadata__\":{\"g.format\":\"e5m2fnuz\","
                      "\"w.format\":\"e4m3fnuz\"}"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\"w\":{\"dtype\":\"U8\""), std::string::npos) << text;
  auto back = Parse(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->Find("w")->dtype(), DType::kE4M3FNUZ);
  EXPECT_EQ(back->Find("g")->dtype(), DType::kE5M2FNUZ);
  EXPECT_TRUE(back->metadata.empty());  // the format entries are consumed
}

// Bytes as the official Python library writes them (save_file with
// metadata={"format": "pt"}): compact JSON, __metadata__ first, fields in
// dtype/shape/data_offsets order, space padding to a multiple of 8.
TEST_F(SafetensorsTest, ParsesAndReproducesOfficialLayout) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[16,24]},)"
      R"("c":{"dtype":"F8_E4M3","shape":[3],"data_offsets":[24,27]},)"
      R"("d":{"dtype":"BOOL","shape":[2],"data_offsets":[27,29]}})";
  std::vector<uint8_t> buffer(29);
  const float f32[4] = {1.0f, -2.5f, 0.0f, 448.0f};
  const int64_t i64 = -1234567890123;
  const uint8_t bytes1[5] = {0x38, 0x7E, 0x80, 1, 0};  // F8_E4M3 x3, BOOL x2
  std::memcpy(&buffer[0], f32, 16);
  std::memcpy(&buffer[16], &i64, 8);
  std::memcpy(&buffer[24], bytes1, 5);
  const std::vector<uint8_t> bytes = MakeFile(header, buffer, /*pad=*/true);
  ASSERT_EQ((bytes.size() - buffer.size()) % 8, 0u);

  auto f = Parse(bytes);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors.size(), 4u);
  EXPECT_EQ(f->metadata,
            (std::map<std::string, std::string>{{"format", "pt"}}));
  const Tensor* a = f->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype(), DType::kF32);
  EXPECT_EQ(a->shape(), (Shape{2, 2}));
  EXPECT_EQ(a->data_as<float>()[1], -2.5f);
  EXPECT_EQ(a->data_as<float>()[3], 448.0f);
  EXPECT_EQ(f->Find("b")->rank(), 0);
  EXPECT_EQ(f->Find("b")->data_as<int64_t>()[0], i64);
  EXPECT_EQ(f->Find("c")->dtype(), DType::kE4M3FN);
  EXPECT_EQ(f->Find("c")->data_as<uint8_t>()[1], 0x7E);
  EXPECT_EQ(f->Find("d")->dtype(), DType::kBool);
  EXPECT_EQ(f->Find("e"), nullptr);

  // Our writer produces the identical bytes for the same tensors.
  auto out = SerializeSafetensors(*f);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, bytes);
}

TEST_F(SafetensorsTest, ReadsTensorsInBufferOrderWhateverTheKeyOrder) {
  const std::string header =
      R"({"late":{"data_offsets":[4,6],"shape":[1],"dtype":"U16"},)"
      R"("early":{"shape":[2],"dtype":"U16","data_offsets":[0,4]}})";
  auto f = Parse(MakeFile(header, {1, 2, 3, 4, 5, 6}));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->tensors[0].first, "early");
  EXPECT_EQ(f->tensors[1].first, "late");
  EXPECT_EQ(f->Find("late")->data_as<uint16_t>()[0], 0x0605);
}

TEST_F(SafetensorsTest, WritingIsDeterministic) {
  SEED_TRACE();
  SafetensorsFile f;
  f.metadata = {{"k2", "v"}, {"k1", "w"}};
  ASSERT_TRUE(f.Add("x", RandomTensor(DType::kBF16, {4, 4})).ok());
  ASSERT_TRUE(f.Add("y", RandomTensor(DType::kE4M3FNUZ, {5})).ok());
  ASSERT_TRUE(WriteSafetensors(dir_ + "/1", f).ok());
  ASSERT_TRUE(WriteSafetensors(dir_ + "/2", f).ok());
  EXPECT_EQ(ReadBytes(dir_ + "/1"), ReadBytes(dir_ + "/2"));
}

TEST_F(SafetensorsTest, AddRefusesDuplicateNames) {
  SafetensorsFile f;
  ASSERT_TRUE(f.Add("a", RandomTensor(DType::kF32, {1})).ok());
  Status s = f.Add("a", RandomTensor(DType::kF32, {1}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("\"a\""), std::string::npos);
  EXPECT_EQ(f.tensors.size(), 1u);
}

// ---- malformed input: one test per defect ----

TEST(SafetensorsParse, ShorterThanEightBytes) {
  for (size_t n = 0; n < 8; ++n) {
    ExpectError(std::vector<uint8_t>(n, 0), StatusCode::kDataLoss,
                {"8-byte header length"});
  }
  auto r = ParseSafetensors(nullptr, 0);
  EXPECT_FALSE(r.ok());
}

TEST(SafetensorsParse, HeaderLengthPastEnd) {
  std::vector<uint8_t> b = MakeFile("{}");
  b[0] = 3;  // claims 3 bytes, only 2 follow
  ExpectError(b, StatusCode::kDataLoss, {"header length 3", "past the end"});
  b[7] = 0xFF;  // ~2^63: must not overflow any size arithmetic
  ExpectError(b, StatusCode::kDataLoss, {"past the end"});
}

TEST(SafetensorsParse, HeaderOverLimit) {
  // A real, mostly untouched mapping: only the prefix is ever read.
  const size_t size = kSafetensorsMaxHeaderBytes + 4096;
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  const uint64_t n = kSafetensorsMaxHeaderBytes + 1;
  std::memcpy(m, &n, 8);
  auto r = ParseSafetensors(static_cast<const uint8_t*>(m), size);
  munmap(m, size);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("limit"), std::string::npos);
}

TEST(SafetensorsParse, HeaderNotJson) {
  ExpectError(MakeFile("{\"a\": "), StatusCode::kDataLoss, {"not valid JSON"});
  ExpectError(MakeFile(""), StatusCode::kDataLoss, {"not valid JSON"});
  ExpectError(MakeFile("{\"a\xff\": 1}"), StatusCode::kDataLoss,
              {"not valid JSON"});  // invalid UTF-8
  // nlohmann would stop at the NUL and ignore the rest.
  ExpectError(MakeFile(std::string("{}\0\"x\":1}", 10)), StatusCode::kDataLoss,
              {"not valid JSON", "NUL byte at header offset 2"});
}

TEST(SafetensorsParse, HeaderNotObject) {
  ExpectError(MakeFile("[1, 2]"), StatusCode::kDataLoss, {"not a JSON object"});
  ExpectError(MakeFile("\"x\""), StatusCode::kDataLoss, {"not a JSON object"});
}

TEST(SafetensorsParse, DeeplyNestedHeaderDoesNotCrash) {
  const std::string deep =
      "{\"a\":" + std::string(200000, '[') + std::string(200000, ']') + "}";
  ExpectError(MakeFile(deep), StatusCode::kDataLoss,
              {"\"a\"", "not a JSON object"});
}

TEST(SafetensorsParse, EntryNotObject) {
  ExpectError(MakeFile(R"({"w": [1]})"), StatusCode::kDataLoss,
              {"\"w\"", "not a JSON object"});
}

TEST(SafetensorsParse, MissingOrMistypedFields) {
  struct Case {
    const char* header;
    const char* word;
  } cases[] = {
      {R"({"w":{"shape":[],"data_offsets":[0,0]}})", "missing field \"dtype\""},
      {R"({"w":{"dtype":4,"shape":[],"data_offsets":[0,0]}})",
       "\"dtype\" is not a string"},
      {R"({"w":{"dtype":"U8","data_offsets":[0,0]}})",
       "missing field \"shape\""},
      {R"({"w":{"dtype":"U8","shape":3,"data_offsets":[0,0]}})",
       "\"shape\" is not an array"},
      {R"({"w":{"dtype":"U8","shape":[0]}})", "missing field \"data_offsets\""},
      {R"({"w":{"dtype":"U8","shape":[0],"data_offsets":{}}})",
       "\"data_offsets\" is not an array"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.header);
    ExpectError(MakeFile(c.header), StatusCode::kDataLoss, {"\"w\"", c.word});
  }
}

TEST(SafetensorsParse, UnknownDType) {
  ExpectError(
      MakeFile(R"({"w":{"dtype":"F8_E8M0","shape":[],"data_offsets":[0,1]}})",
               {0}),
      StatusCode::kInvalidArgument,
      {"\"w\"", "\"F8_E8M0\"", "F32", "BF16", "F8_E4M3", "BOOL"});
}

// A Shape holds kMaxRank dimensions: a tensor of more is refused by name
// (kMaxRank of them still parses).
TEST(SafetensorsParse, MoreDimensionsThanAShapeHolds) {
  std::string dims = "1";
  for (int i = 1; i < kMaxRank; ++i) dims += ",1";
  ASSERT_TRUE(Parse(MakeFile(R"({"w":{"dtype":"U8","shape":[)" + dims +
                             R"(],"data_offsets":[0,1]}})", {7}))
                  .ok());
  ExpectError(MakeFile(R"({"w":{"dtype":"U8","shape":[)" + dims +
                           R"(,1],"data_offsets":[0,1]}})", {7}),
              StatusCode::kInvalidArgument,
              {"\"w\"", std::to_string(kMaxRank + 1) + " dimensions", "at most"});
}

TEST(SafetensorsParse, NegativeDimension) {
  ExpectError(
      MakeFile(R"({"w":{"dtype":"U8","shape":[2,-3],"data_offsets":[0,0]}})"),
      StatusCode::kDataLoss, {"\"w\"", "shape dimension 1", "negative (-3)"});
}

TEST(SafetensorsParse, NonIntegerDimension) {
  for (const char* dim :
       {"2.5", "2.0", "\"2\"", "null", "1e30", "18446744073709551616"}) {
    SCOPED_TRACE(dim);
    ExpectError(MakeFile(std::string(R"({"w":{"dtype":"U8","shape":[)") + dim +
                             R"(],"data_offsets":[0,2]}})",
                         {0, 0}),
                StatusCode::kDataLoss, {"\"w\"", "shape dimension 0"});
  }
  ExpectError(
      MakeFile(
          R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]}})"),
      StatusCode::kDataLoss, {"\"w\"", "too large"});
}

TEST(SafetensorsParse, ShapeProductOverflow) {
  ExpectError(
      MakeFile(
          R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
      StatusCode::kResourceExhausted, {"\"w\"", "too large"});
  // Fits in size_t as elements, but not as bytes.
  ExpectError(
      MakeFile(
          R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})"),
      StatusCode::kResourceExhausted, {"\"w\""});
  // A zero dimension makes the tensor empty, but the other dimensions must
  // still multiply in range (tensor.h), so no stride computed from them can
  // overflow: [0, 2^40] is fine, [0, 2^63 - 1] of F64 and [2^40, 2^40, 0] are not.
  auto ok = Parse(MakeFile(
      R"({"w":{"dtype":"F64","shape":[0,1099511627776],"data_offsets":[0,0]}})"));
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  ExpectError(
      MakeFile(R"({"w":{"dtype":"F64","shape":[0,9223372036854775807],"data_offsets":[0,0]}})"),
      StatusCode::kResourceExhausted, {"\"w\"", "nonzero dimensions"});
  ExpectError(
      MakeFile(
          R"({"w":{"dtype":"U8","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}})"),
      StatusCode::kResourceExhausted, {"\"w\"", "nonzero dimensions"});
}

TEST(SafetensorsParse, DataOffsetsNotTwoIntegers) {
  for (const char* offs :
       {"[0]", "[0,1,1]", "[]", "[0,\"1\"]", "[0.0,1]", "[-1,0]", "[0,1.5]"}) {
    SCOPED_TRACE(offs);
    ExpectError(
        MakeFile(
            std::string(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":)") +
                offs + "}}",
            {7}),
        StatusCode::kDataLoss, {"\"w\"", "data_offsets"});
  }
}

TEST(SafetensorsParse, DataOffsetsBeginAfterEnd) {
  ExpectError(
      MakeFile(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})",
               {1, 2}),
      StatusCode::kDataLoss, {"\"w\"", "begin 2 is past end 1"});
}

TEST(SafetensorsParse, DataOffsetsOutsideBuffer) {
  ExpectError(
      MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
               {1, 2, 3}),
      StatusCode::kDataLoss, {"\"w\"", "[0, 4)", "3 bytes"});
  ExpectError(
      MakeFile(
          R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})"),
      StatusCode::kDataLoss, {"\"w\"", "outside the byte buffer"});
}

TEST(SafetensorsParse, SizeDisagreesWithShape) {
  ExpectError(
      MakeFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
               {1, 2, 3, 4}),
      StatusCode::kDataLoss, {"\"w\"", "span 4 bytes", "needs 8"});
}

TEST(SafetensorsParse, OverlappingTensors) {
  ExpectError(
      MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
               std::vector<uint8_t>(6)),
      StatusCode::kDataLoss, {"\"b\"", "overlaps", "\"a\""});
  // Two names for the same bytes.
  ExpectError(
      MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
               std::vector<uint8_t>(4)),
      StatusCode::kDataLoss, {"overlaps"});
}

TEST(SafetensorsParse, HoleBetweenTensors) {
  ExpectError(
      MakeFile(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
               R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
               std::vector<uint8_t>(6)),
      StatusCode::kDataLoss, {"[2, 4)", "\"b\"", "hole"});
  ExpectError(
      MakeFile(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
               std::vector<uint8_t>(3)),
      StatusCode::kDataLoss, {"[0, 1)", "\"b\""});
}

TEST(SafetensorsParse, TrailingBytes) {
  ExpectError(
      MakeFile(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
               std::vector<uint8_t>(5)),
      StatusCode::kDataLoss, {"last 3 bytes", "offset 2"});
  ExpectError(MakeFile("{}", {0}), StatusCode::kDataLoss, {"last 1 bytes"});
}

TEST(SafetensorsParse, DuplicateKeysAreRefused) {
  // JSON leaves duplicate keys undefined (nlohmann keeps the last, other
  // readers the first), so a repeated tensor name, metadata key or entry
  // field is refused instead of silently picking one.
  ExpectError(MakeFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("a":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})",
                       {1, 2}),
              StatusCode::kDataLoss, {"\"a\"", "appears twice", "tensor name"});
  ExpectError(MakeFile(R"({"__metadata__":{"k":"1","k":"2"}})"), StatusCode::kDataLoss,
              {"\"k\"", "appears twice"});
  ExpectError(MakeFile(R"({"__metadata__":{},"__metadata__":{}})"), StatusCode::kDataLoss,
              {"__metadata__", "appears twice"});
  ExpectError(MakeFile(R"({"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})",
                       {1}),
              StatusCode::kDataLoss, {"\"dtype\"", "appears twice"});
  // The same name in different objects is fine.
  auto ok = Parse(MakeFile(R"({"__metadata__":{"a":"x"},"a":{"dtype":"U8","shape":[1],)"
                           R"("data_offsets":[0,1]}})",
                           {1}));
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(SafetensorsParse, ByteOrderMarkIsRefused) {
  // nlohmann would skip it; the official reader requires '{' first.
  ExpectError(MakeFile("\xEF\xBB\xBF{}"), StatusCode::kDataLoss, {"byte order mark"});
  ExpectError(MakeFile("\xEF\xBB\xBF"), StatusCode::kDataLoss, {"byte order mark"});
  // Leading JSON whitespace stays accepted, as before.
  EXPECT_TRUE(Parse(MakeFile(" {}")).ok());
}

TEST(SafetensorsParse, FileOverTheMemoryCapIsRefusedBeforeAllocating) {
  const uint64_t cap = MemoryCap();
  const std::string source = MemoryCapSource();
  SetMemoryCap(16, "the test");
  const int64_t allocations = GetMemoryStats().allocations;
  auto r = Parse(MakeFile(R"({"small":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("big":{"dtype":"F32","shape":[8],"data_offsets":[4,36]}})",
                          std::vector<uint8_t>(36)));
  SetMemoryCap(cap, source);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  for (const char* needle : {"\"big\"", "36 bytes", "memory cap is 16 bytes", "the test"}) {
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(GetMemoryStats().allocations, allocations);
}

TEST(SafetensorsParse, MetadataNotAnObjectOfStrings) {
  ExpectError(MakeFile(R"({"__metadata__":["a"]})"), StatusCode::kDataLoss,
              {"__metadata__", "not an object"});
  ExpectError(MakeFile(R"({"__metadata__":{"epoch":3}})"),
              StatusCode::kDataLoss, {"\"epoch\"", "not a string"});
}

TEST(SafetensorsParse, BadFormatEntries) {
  const std::string w =
      R"("w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  ExpectError(
      MakeFile(R"({"__metadata__":{"w.format":"e4m3"},)" + w + "}", {0}),
      StatusCode::kInvalidArgument, {"\"w.format\"", "\"e4m3\"", "e4m3fnuz"});
  ExpectError(
      MakeFile(R"({"__metadata__":{"v.format":"e4m3fnuz"},)" + w + "}", {0}),
      StatusCode::kDataLoss, {"\"v.format\"", "no tensor \"v\""});
  ExpectError(
      MakeFile(R"({"__metadata__":{"w.format":"e5m2fnuz"},)"
               R"("w":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})",
               {0}),
      StatusCode::kDataLoss, {"\"w\"", "I8", "U8"});
}

TEST(SafetensorsParse, BoolBytesMustBeZeroOrOne) {
  ExpectError(
      MakeFile(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
               {1, 0, 2}),
      StatusCode::kDataLoss, {"\"m\"", "element 2", "byte value 2"});
}

TEST_F(SafetensorsTest, EveryTruncationFails) {
  SEED_TRACE();
  SafetensorsFile f;
  f.metadata["k"] = "v";
  ASSERT_TRUE(f.Add("a", RandomTensor(DType::kF32, {3, 2})).ok());
  ASSERT_TRUE(f.Add("b", RandomTensor(DType::kE5M2FNUZ, {5})).ok());
  ASSERT_TRUE(f.Add("c", RandomTensor(DType::kBool, {})).ok());
  const std::vector<uint8_t> bytes = SerializeSafetensors(f).value();
  ASSERT_TRUE(Parse(bytes).ok());
  for (size_t n = 0; n < bytes.size(); ++n) {
    // A fresh allocation of exactly n bytes lets ASan catch any overread.
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    auto r = Parse(cut);
    EXPECT_FALSE(r.ok()) << "parsed a file cut to " << n << " bytes";
  }
}

// ---- files ----

TEST_F(SafetensorsTest, ReadErrorsNameThePath) {
  const std::string missing = dir_ + "/missing.safetensors";
  auto r = ReadSafetensors(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(missing), std::string::npos);
  EXPECT_NE(r.status().message().find(std::strerror(ENOENT)),
            std::string::npos);

  EXPECT_FALSE(ReadSafetensors(dir_).ok());  // a directory

  const std::string zero = dir_ + "/zero_header.safetensors";
  WriteBytes(zero, MakeFile(""));
  r = ReadSafetensors(zero);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("not valid JSON"), std::string::npos);

  SafetensorsFile f;
  ASSERT_TRUE(f.Add("a", RandomTensor(DType::kI32, {4})).ok());
  std::vector<uint8_t> bytes = SerializeSafetensors(f).value();
  bytes.pop_back();
  const std::string cut = dir_ + "/cut.safetensors";
  WriteBytes(cut, bytes);
  r = ReadSafetensors(cut);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find(cut), std::string::npos);
  EXPECT_NE(r.status().message().find("\"a\""), std::string::npos);
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFailsCleanly) {
  SafetensorsFile f;
  ASSERT_TRUE(f.Add("a", RandomTensor(DType::kF32, {2})).ok());
  const std::string path = dir_ + "/no/such/dir/out.safetensors";
  Status s = WriteSafetensors(path, f);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::strerror(ENOENT)), std::string::npos);
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(SafetensorsTest, FailedRenameLeavesTargetAndNoTempFile) {
  // The target is a directory: everything succeeds up to the rename.
  const std::string target = dir_ + "/target";
  ASSERT_EQ(mkdir(target.c_str(), 0755), 0);
  SafetensorsFile f;
  ASSERT_TRUE(f.Add("a", RandomTensor(DType::kF32, {2})).ok());
  Status s = WriteSafetensors(target, f);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(target), std::string::npos);
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"target"});
  struct stat st;
  ASSERT_EQ(stat(target.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
}

TEST_F(SafetensorsTest, FailedWriteLeavesExistingTargetUntouched) {
  SEED_TRACE();
  const std::string path = dir_ + "/model.safetensors";
  SafetensorsFile small;
  ASSERT_TRUE(small.Add("a", RandomTensor(DType::kF32, {8})).ok());
  ASSERT_TRUE(WriteSafetensors(path, small).ok());
  const std::vector<uint8_t> before = ReadBytes(path);

  // A file-size limit makes write() fail half way (EFBIG), even for root.
  SafetensorsFile big;
  ASSERT_TRUE(big.Add("b", RandomTensor(DType::kF32, {64, 1024})).ok());
  struct rlimit old_limit;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 64 * 1024;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  Status s = WriteSafetensors(path, big);
  setrlimit(RLIMIT_FSIZE, &old_limit);
  signal(SIGXFSZ, old_handler);

  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::strerror(EFBIG)), std::string::npos)
      << s.message();
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsTest, WriteRefusesInvalidContentsBeforeTouchingDisk) {
  const std::string path = dir_ + "/out.safetensors";
  auto expect_refused = [&](const SafetensorsFile& f, const std::string& word) {
    Status s = WriteSafetensors(path, f);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(word), std::string::npos) << s.message();
    EXPECT_FALSE(SerializeSafetensors(f).ok());
    EXPECT_TRUE(DirEntries().empty());
  };
  SafetensorsFile dup;
  dup.tensors.emplace_back("a", RandomTensor(DType::kU8, {1}));
  dup.tensors.emplace_back("a", RandomTensor(DType::kU8, {1}));
  expect_refused(dup, "duplicate tensor name \"a\"");

  SafetensorsFile reserved_name;
  reserved_name.tensors.emplace_back("__metadata__",
                                     RandomTensor(DType::kU8, {1}));
  expect_refused(reserved_name, "__metadata__");

  SafetensorsFile reserved_key;
  reserved_key.metadata["a.format"] = "e4m3fnuz";
  expect_refused(reserved_key, "\"a.format\"");

  SafetensorsFile no_data;
  no_data.tensors.emplace_back("empty", Tensor());
  expect_refused(no_data, "\"empty\"");

  SafetensorsFile bad_utf8;
  bad_utf8.tensors.emplace_back("bad\xff", RandomTensor(DType::kU8, {1}));
  expect_refused(bad_utf8, "UTF-8");
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

TEST_F(SafetensorsTest, ConcurrentWritersLeaveOneCompleteFile) {
  // Two writers of the same path, many rounds: each writes its own temp file
  // (unique per process and call) and renames it over the target, so the
  // target is always one of the two complete files and no temp file stays.
  const std::string path = dir_ + "/out.safetensors";
  SafetensorsFile a, b;
  ASSERT_TRUE(a.Add("a", RandomTensor(DType::kF32, {256, 1024})).ok());
  ASSERT_TRUE(b.Add("b", RandomTensor(DType::kBF16, {512, 1000})).ok());
  const std::vector<uint8_t> want_a = *SerializeSafetensors(a), want_b = *SerializeSafetensors(b);
  for (int round = 0; round < 8; ++round) {
    Status sa, sb;
    std::thread ta([&] { sa = WriteSafetensors(path, a); });
    std::thread tb([&] { sb = WriteSafetensors(path, b); });
    ta.join();
    tb.join();
    ASSERT_TRUE(sa.ok()) << sa.ToString();
    ASSERT_TRUE(sb.ok()) << sb.ToString();
    const std::vector<uint8_t> got = ReadBytes(path);
    EXPECT_TRUE(got == want_a || got == want_b) << "round " << round;
    EXPECT_EQ(DirEntries(), std::vector<std::string>{"out.safetensors"});
  }
}

TEST_F(SafetensorsTest, SignalDuringWriteRemovesTheTempFile) {
  // A child process writes a large file over and over with the handlers of
  // RemoveTempFilesOnSignals; as soon as a temp file shows up the parent
  // sends SIGTERM. The child must die of SIGTERM and leave no temp file, and
  // the target is either absent or a complete earlier write.
  const std::string path = dir_ + "/big.safetensors";
  SafetensorsFile f;
  Tensor w = Tensor::Create(DType::kU32, {4, 1024, 1024}).value();  // 16 MiB
  for (size_t i = 0; i < w.num_elements(); ++i) w.data_as<uint32_t>()[i] = static_cast<uint32_t>(i * 2654435761u);
  ASSERT_TRUE(f.Add("w", std::move(w)).ok());
  const std::vector<uint8_t> want = *SerializeSafetensors(f);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    RemoveTempFilesOnSignals();
    for (;;) {
      if (!WriteSafetensors(path, f).ok()) _exit(3);
    }
  }
  bool seen = false;
  for (int i = 0; i < 200000 && !seen; ++i) {  // up to ~20 s
    for (const std::string& e : DirEntries()) seen = seen || e.find(".tmp.") != std::string::npos;
    if (!seen) usleep(100);
  }
  kill(child, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(seen) << "never saw the temp file";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  for (const std::string& e : DirEntries()) {
    EXPECT_EQ(e, "big.safetensors") << "left behind: " << e;
  }
  if (access(path.c_str(), F_OK) == 0) {
    EXPECT_TRUE(ReadBytes(path) == want);
  }
}

// ---- Streaming: SafetensorsWriter and SafetensorsReader ----

TEST_F(SafetensorsTest, StreamedWriteInAnyPiecesEqualsWriteSafetensors) {
  SEED_TRACE();
  SafetensorsFile f;  // every dtype, a few shapes
  const Shape shapes[] = {{}, {0}, {7}, {2, 3, 5}};
  for (DType d : kAllDTypes) {
    for (size_t i = 0; i < std::size(shapes); ++i) {
      ASSERT_TRUE(f.Add(std::string(DTypeName(d)) + "/" + std::to_string(i), RandomTensor(d, shapes[i])).ok());
    }
  }
  f.metadata = {{"checksum", "0123456789abcdef"}, {"step", "7"}};
  std::vector<SafetensorsEntry> layout;
  std::vector<uint8_t> data;
  for (const auto& [name, t] : f.tensors) {
    layout.push_back({name, t.dtype(), t.shape()});
    EXPECT_EQ(layout.back().num_bytes(), t.num_bytes());
    const auto* p = t.data_as<uint8_t>();
    data.insert(data.end(), p, p + t.num_bytes());
  }
  // Written under a placeholder of the checksum's width, in random pieces
  // that cross the tensors' boundaries.
  const std::string path = dir_ + "/streamed.safetensors";
  std::map<std::string, std::string> placeholder = f.metadata;
  placeholder["checksum"] = "0000000000000000";
  auto w = SafetensorsWriter::Create(path, layout, placeholder);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (size_t at = 0; at < data.size();) {
    const size_t n = std::min<size_t>(data.size() - at, rng_() % 23);
    ASSERT_TRUE((*w)->Write(data.data() + at, n).ok());
    at += n;
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "visible before Finish";
  ASSERT_TRUE((*w)->Finish(f.metadata).ok());
  EXPECT_EQ(ReadBytes(path), *SerializeSafetensors(f));
  for (const std::string& e : DirEntries()) EXPECT_EQ(e, "streamed.safetensors");
  EXPECT_EQ((*w)->Write(data.data(), 0).code(), StatusCode::kFailedPrecondition);

  // The reader lists the layout in file order and reads each tensor alone.
  auto r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->metadata(), f.metadata);
  ASSERT_EQ((*r)->entries().size(), layout.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    const SafetensorsEntry& e = (*r)->entries()[i];
    EXPECT_EQ(e.name, layout[i].name);
    EXPECT_EQ(e.dtype, layout[i].dtype);
    EXPECT_EQ(e.shape, layout[i].shape);
    EXPECT_EQ((*r)->Find(e.name), &e);
  }
  for (size_t i = layout.size(); i-- > 0;) {  // any order
    const Tensor& want = f.tensors[i].second;
    std::vector<uint8_t> got(want.num_bytes() + 8, 0xA5);  // a poisoned tail
    ASSERT_TRUE((*r)->Read(layout[i].name, got.data()).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0) << layout[i].name;
    for (size_t j = want.num_bytes(); j < got.size(); ++j) ASSERT_EQ(got[j], 0xA5);
  }
  EXPECT_EQ((*r)->Find("nope"), nullptr);
  const Status missing = (*r)->Read("nope", data.data());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find(path), std::string::npos) << missing.message();
}

TEST_F(SafetensorsTest, StreamedWriteMisuseLeavesTargetAndNoTempFile) {
  SEED_TRACE();
  const std::string path = dir_ + "/t.safetensors";
  SafetensorsFile old;
  ASSERT_TRUE(old.Add("old", RandomTensor(DType::kF32, {3})).ok());
  ASSERT_TRUE(WriteSafetensors(path, old).ok());
  const std::vector<uint8_t> before = ReadBytes(path);
  const std::vector<SafetensorsEntry> layout = {{"a", DType::kF32, {2, 3}}, {"b", DType::kU8, {5}}};
  const std::vector<uint8_t> bytes(29, 1);
  auto expect_untouched = [&](const char* what) {
    EXPECT_EQ(ReadBytes(path), before) << what;
    for (const std::string& e : DirEntries()) EXPECT_EQ(e, "t.safetensors") << what;
  };
  {  // more bytes than the tensors hold
    auto w = SafetensorsWriter::Create(path, layout, {{"k", "v"}});
    ASSERT_TRUE(w.ok());
    const Status s = (*w)->Write(bytes.data(), 30);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("29 bytes"), std::string::npos) << s.message();
    expect_untouched("too many bytes");
    EXPECT_EQ((*w)->Finish({{"k", "v"}}).code(), StatusCode::kFailedPrecondition);
  }
  {  // Finish before the last byte
    auto w = SafetensorsWriter::Create(path, layout, {{"k", "v"}});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(bytes.data(), 28).ok());
    const Status s = (*w)->Finish({{"k", "v"}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("28 of its 29"), std::string::npos) << s.message();
    expect_untouched("short");
  }
  {  // final metadata of another width
    auto w = SafetensorsWriter::Create(path, layout, {{"k", "v"}});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(bytes.data(), 29).ok());
    const Status s = (*w)->Finish({{"k", "longer value"}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("length"), std::string::npos) << s.message();
    expect_untouched("header length");
  }
  {  // destroyed unfinished
    auto w = SafetensorsWriter::Create(path, layout, {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(bytes.data(), 10).ok());
    bool temp = false;
    for (const std::string& e : DirEntries()) temp = temp || e.find(".tmp.") != std::string::npos;
    EXPECT_TRUE(temp);
  }
  expect_untouched("abandoned");
  // A bad layout is refused before the disk is touched.
  for (const auto& bad : std::vector<std::vector<SafetensorsEntry>>{
           {{"a", DType::kF32, {2}}, {"a", DType::kF32, {2}}},
           {{"__metadata__", DType::kF32, {2}}},
           {{"a", DType::kF32, {-1}}},
           {{"a", DType::kF32, {int64_t{1} << 40, int64_t{1} << 40}}}}) {
    auto w = SafetensorsWriter::Create(path, bad, {});
    EXPECT_FALSE(w.ok()) << bad[0].name;
    expect_untouched("bad layout");
  }
  EXPECT_FALSE(SafetensorsWriter::Create(path, layout, {{"x.format", "e4m3fnuz"}}).ok());
  expect_untouched("reserved key");
}

TEST_F(SafetensorsTest, StreamedReadChecksBoolBytesAndNamesThePath) {
  SafetensorsFile f;
  ASSERT_TRUE(f.Add("ok", RandomTensor(DType::kU8, {4})).ok());
  Tensor b = Tensor::Create(DType::kBool, {3}).value();
  b.data_as<uint8_t>()[0] = 1;
  b.data_as<uint8_t>()[1] = 2;  // not a bool
  b.data_as<uint8_t>()[2] = 0;
  ASSERT_TRUE(f.Add("flag", std::move(b)).ok());
  const std::string path = dir_ + "/b.safetensors";
  std::vector<uint8_t> bytes = *SerializeSafetensors(f);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  auto r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  uint8_t buf[4];
  EXPECT_TRUE((*r)->Read("ok", buf).ok());
  const Status s = (*r)->Read("flag", buf);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("byte value 2"), std::string::npos) << s.message();
  // Open refuses what ReadSafetensors refuses, with the same message.
  bytes.resize(bytes.size() - 1);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  auto bad = SafetensorsReader::Open(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().ToString(), ReadSafetensors(path).status().ToString());
}

}  // namespace
}  // namespace fp8moe
