// The trainer against hostile input (docs/robustness.md): model shapes whose
// products overflow or whose run does not fit the memory cap (refused before
// anything is allocated or created), and checkpoints that are truncated,
// bit-flipped, edited, of other shapes or dtypes, missing tensors, past the
// run's steps, or directories: each is refused with the file named, and the
// file is left exactly as it was.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_util.h"
#include "fp8moe/memory.h"
#include "fp8moe/safetensors.h"
#include "fp8moe/train.h"
#include "train/checkpoint.h"
#include "train/train_test_util.h"

namespace fp8moe {
namespace {

using test::CapGuard;

TEST(TrainRobustness, SizesWhoseProductsOverflowAreRefused) {
  // per_device_batch_size x max_target_length wrapped past 2^64 to a small
  // number and the run segfaulted; each size is now bounded by int32 first.
  for (const std::vector<std::string>& extra :
       std::vector<std::vector<std::string>>{
           {"per_device_batch_size=4611686018427387904", "max_target_length=4"},
           {"base_num_decoder_layers=1000000000000"},
           {"base_num_query_heads=2147483647", "head_dim=2147483646"},
           {"base_moe_mlp_dim=2000000000"},
           {"vocab_size=4294967296"}}) {
    std::vector<std::string> f = Tiny("overflow");
    f.insert(f.end(), extra.begin(), extra.end());
    auto s = RunTiny(f, {}, true);
    ASSERT_FALSE(s.ok()) << extra[0];
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status().ToString();
    const std::string flag = extra[0].substr(0, extra[0].find('='));
    EXPECT_NE(s.status().message().find(flag.substr(0, 8)), std::string::npos)
        << s.status().message();
    EXPECT_FALSE(fs::exists(TestDir() + "/overflow"));
  }
}

TEST(TrainRobustness, ARunOverTheMemoryCapIsRefusedBeforeAllocating) {
  CapGuard guard;
  // 1 MiB: the tiny model's run needs more (its plan is about 2 MiB).
  SetMemoryCap(1 << 20, "test");
  ResetMemoryPeak();
  const int64_t before = GetMemoryStats().in_use;
  auto s = RunTiny(Tiny("capped"), {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
  EXPECT_NE(s.status().message().find("this training run"), std::string::npos);
  EXPECT_NE(s.status().message().find("memory cap is 1048576 bytes"), std::string::npos)
      << s.status().message();
  EXPECT_EQ(GetMemoryStats().peak, before);  // nothing was allocated
  EXPECT_FALSE(fs::exists(TestDir() + "/capped"));

  // A huge model under the machine's own cap: refused with the total.
  SetMemoryCap(uint64_t{16} << 30, "test");
  std::vector<std::string> f = Tiny("huge");
  f.insert(f.end(), {"base_emb_dim=100000", "num_experts=1000", "base_moe_mlp_dim=100000"});
  s = RunTiny(f, {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
  EXPECT_NE(s.status().message().find("expert weights for the GMMs"), std::string::npos)
      << s.status().message();
  EXPECT_EQ(GetMemoryStats().peak, before);
}

TEST(TrainRobustness, ThePlanCoversWhatARunAllocates) {
  // The plan is an upper bound of the library's peak in every QAT mode, so a
  // run the plan admits does not fail mid-way, and not a wild one.
  const std::vector<std::string> off = {"fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=",
                                        "fp8_moe_native_fwd=false",
                                        "fp8_moe_native_bwd_dlhs=false"};
  std::vector<std::vector<std::string>> variants = {
      {}, {"fp8_moe_native_bwd_dlhs=false"}, off, off, off, off,
      {"base_emb_dim=32", "base_moe_mlp_dim=64", "num_experts=8", "per_device_batch_size=8"},
      {"routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.001"}};
  variants[3].push_back("dtype=float32");
  variants[4].insert(variants[4].end(), {"quantization=fp8_full", "use_qwix_quantization=true",
                                         "moe_bwd_inkernel_quant=true"});
  variants[5].push_back("ragged_buffer_factor=2");
  variants.push_back({"attention_type=mla", "q_lora_rank=12", "kv_lora_rank=10",
                      "qk_nope_head_dim=8", "qk_rope_head_dim=6", "v_head_dim=5"});
  // Activation-heavy shapes (512 tokens a step, 1024 routed rows), where
  // what every layer's MoE workspace keeps between steps
  // dominates: the backward's buffers, fp8_full's recipe operands, the FP8
  // health buffers (an fp8_full run peaked at 1.16x a plan that counted one
  // layer's backward and no recipe operands).
  const std::vector<std::string> wide = {"base_emb_dim=64",  "head_dim=32",
                                         "base_moe_mlp_dim=128", "num_experts=4",
                                         "vocab_size=64",   "max_target_length=64",
                                         "per_device_batch_size=8"};
  for (int w = 0; w < 3; ++w) {
    std::vector<std::string> v = w == 0 ? std::vector<std::string>{} : off;
    if (w == 1) v.insert(v.end(), {"quantization=fp8_full", "use_qwix_quantization=true"});
    if (w == 2) v.push_back("dtype=float32");
    v.insert(v.end(), wide.begin(), wide.end());
    variants.push_back(v);
  }
  for (size_t i = 0; i < variants.size(); ++i) {
    std::vector<std::string> f = Tiny("plan");
    f.insert(f.end(), variants[i].begin(), variants[i].end());
    f.push_back("steps=4");
    auto raw = LoadConfig(TrainConfigSchema(), "", f);
    ASSERT_TRUE(raw.ok()) << raw.status().ToString();
    auto cfg = TrainConfigFrom(*raw);
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    auto s = RunTiny(f, {}, true);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const TrainMemoryPlan plan = PlanTrainMemory(*cfg);
    std::printf("plan variant %zu: peak %lld bytes, plan %llu bytes (%.2fx)\n", i,
                static_cast<long long>(s->peak_bytes),
                static_cast<unsigned long long>(plan.total_bytes),
                static_cast<double>(plan.total_bytes) / static_cast<double>(s->peak_bytes));
    EXPECT_GE(plan.total_bytes, static_cast<uint64_t>(s->peak_bytes)) << i;
    EXPECT_LE(plan.total_bytes, 8 * static_cast<uint64_t>(s->peak_bytes)) << i;
  }
}

// A tiny run stopped after its first checkpoint (step 4), and that file.
std::string CheckpointOfAStoppedRun(const std::string& name) {
  TrainOptions stop;
  stop.stop_after_steps = 4;
  EXPECT_TRUE(RunTiny(Tiny(name), stop, true).ok());
  return TestDir() + "/" + name + "/checkpoints/step_00000004.safetensors";
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Resuming from `path` after `corrupt` changed it must fail with `code`, name
// the file and say `what` (a phrase of the message for that very fault, found
// outside the file's path, which alone holds "step" and the run's name), and
// leave the file's bytes as they were.
void ExpectRefused(const std::string& name, const std::function<void(const std::string&)>& corrupt,
                   StatusCode code, const std::string& what,
                   std::vector<std::string> extra_flags = {}) {
  ASSERT_FALSE(what.empty()) << name << ": name the message the fault must give";
  const std::string path = CheckpointOfAStoppedRun(name);
  corrupt(path);
  const std::string before = fs::is_regular_file(path) ? Bytes(path) : "";
  std::vector<std::string> f = Tiny(name);
  f.insert(f.end(), extra_flags.begin(), extra_flags.end());
  auto s = RunTiny(f);
  ASSERT_FALSE(s.ok()) << name;
  EXPECT_EQ(s.status().code(), code) << s.status().ToString();
  const std::string message = s.status().message();
  EXPECT_NE(message.find(path), std::string::npos) << message;
  std::string rest = message;  // the message without the path
  for (size_t at; (at = rest.find(path)) != std::string::npos;) rest.erase(at, path.size());
  EXPECT_NE(rest.find(what), std::string::npos) << "want '" << what << "' in: " << message;
  if (fs::is_regular_file(path)) {
    EXPECT_EQ(Bytes(path), before) << "the checkpoint changed";
  }
  // Nothing newer was written beside it.
  EXPECT_FALSE(fs::exists(TestDir() + "/" + name + "/checkpoints/step_00000008.safetensors"));
}

TEST(TrainRobustness, TruncatedCheckpointsAreRefused) {
  // The safetensors reader names what the bytes left cannot hold.
  const std::vector<std::pair<double, std::string>> cases = {
      {0.0, "safetensors file is 0 bytes, shorter than its 8-byte header length"},
      {0.001, "runs past the end of the file"},  // the header length
      {0.5, "lie outside the byte buffer of"},
      {0.999, "lie outside the byte buffer of"}};
  for (const auto& [keep, what] : cases) {
    SCOPED_TRACE(keep);
    ExpectRefused("truncated", [&](const std::string& p) {
      const std::string b = Bytes(p);
      WriteBytes(p, b.substr(0, static_cast<size_t>(keep * static_cast<double>(b.size()))));
    }, StatusCode::kDataLoss, what);
  }
}

TEST(TrainRobustness, FlippedBitsAreCaughtByTheChecksum) {
  // Bits in the tensor bytes (which the safetensors reader cannot judge) and
  // in the metadata's values (the step counter).
  for (double at : {0.3, 0.6, 0.99}) {
    ExpectRefused("flipped", [&](const std::string& p) {
      std::string b = Bytes(p);
      b[static_cast<size_t>(at * static_cast<double>(b.size()))] ^= 0x10;
      WriteBytes(p, b);
    }, StatusCode::kDataLoss, "is corrupt: its contents have checksum");
  }
  ExpectRefused("flipped_step", [&](const std::string& p) {
    std::string b = Bytes(p);
    const size_t at = b.find("\"step\":\"4\"");
    ASSERT_NE(at, std::string::npos);
    b[at + 8] = '5';
    WriteBytes(p, b);
  }, StatusCode::kDataLoss, "is corrupt: its contents have checksum");
}

// Rewrites the checkpoint through `edit` with a valid checksum, so the
// checks behind the checksum are reached.
void Rewrite(const std::string& path, const std::function<void(SafetensorsFile*)>& edit) {
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  edit(&*f);
  f->metadata["checksum"] = internal::CheckpointChecksum(*f);
  ASSERT_TRUE(WriteSafetensors(path, *f).ok());
}

TEST(TrainRobustness, CheckpointsOfTheWrongContentsAreRefused) {
  ExpectRefused("wrong_shape", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) {
      for (auto& [name, t] : f->tensors) {
        if (name == "params/embed") t = *Tensor::Create(DType::kF32, {40, 8});
      }
    });
  }, StatusCode::kDataLoss, "holds tensor params/embed as f32 [40, 8] but this run needs f32 [40, 16]");
  ExpectRefused("wrong_dtype", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) {
      for (auto& [name, t] : f->tensors) {
        if (name == "adam_v/final_norm") t = *Tensor::Create(DType::kBF16, {16});
      }
    });
  }, StatusCode::kDataLoss,
      "holds tensor adam_v/final_norm as bf16 [16] but this run needs f32 [16]");
  ExpectRefused("missing", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) {
      std::erase_if(f->tensors, [](const auto& e) { return e.first == "adam_m/layers.1.wi"; });
    });
  }, StatusCode::kDataLoss, "lacks tensor adam_m/layers.1.wi");
  ExpectRefused("extra", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) {
      (void)f->Add("params/layers.2.wi", *Tensor::Create(DType::kF32, {1}));
    });
  }, StatusCode::kDataLoss, "holds 52 tensors but this model has 51");
  ExpectRefused("nan", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) {
      f->Find("params/lm_head")->data_as<float>()[3] = std::nanf("");
    });
  }, StatusCode::kDataLoss, "holds 1 NaN or Inf values in params/lm_head");
  // A step that is a number but not the file's, and steps that are no
  // number at all.
  for (const char* step : {"0", "5"}) {
    ExpectRefused("bad_step", [&](const std::string& p) {
      Rewrite(p, [&](SafetensorsFile* f) { f->metadata["step"] = step; });
    }, StatusCode::kDataLoss,
        "records step " + std::string(step) + ", which does not match its file name");
  }
  for (const char* step : {"-1", "+4", "99999999999999999999", "4,4", ""}) {
    ExpectRefused("bad_step", [&](const std::string& p) {
      Rewrite(p, [&](SafetensorsFile* f) { f->metadata["step"] = step; });
    }, StatusCode::kDataLoss,
        "has a malformed 'step' in its metadata: '" + std::string(step) + "'");
  }
  ExpectRefused("rng", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) { f->metadata["rng_state"] = "0,0,0,0"; });
  }, StatusCode::kDataLoss, "has a malformed rng_state (four numbers, not all zero)");
  ExpectRefused("position", [](const std::string& p) {
    Rewrite(p, [](SafetensorsFile* f) { f->metadata["data_position"] = "1,2"; });
  }, StatusCode::kDataLoss,
      "has a data_position this dataset cannot use: a synthetic data position is one number");
  ExpectRefused("no_checksum", [](const std::string& p) {
    auto f = ReadSafetensors(p);
    ASSERT_TRUE(f.ok());
    f->metadata.erase("checksum");
    ASSERT_TRUE(WriteSafetensors(p, *f).ok());
  }, StatusCode::kDataLoss, "has no checksum in its metadata");
  ExpectRefused("not_ours", [](const std::string& p) {
    SafetensorsFile f;
    ASSERT_TRUE(f.Add("x", *Tensor::Create(DType::kF32, {2})).ok());
    ASSERT_TRUE(WriteSafetensors(p, f).ok());
  }, StatusCode::kDataLoss, "is not an fp8moe checkpoint (no fp8moe_checkpoint metadata)");
}

// A save streams the tensors in name order (the checksum's order), one at a
// time; the file is exactly what WriteSafetensors writes for the same
// contents, and a checkpoint in any tensor order (those of earlier versions
// were in parameter order) resumes to the same bits.
TEST(TrainRobustness, ACheckpointInAnyTensorOrderResumesToTheSameBits) {
  const std::string path = CheckpointOfAStoppedRun("order_a");
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors.size(), 3 * 17u);  // params, adam_m, adam_v of 2 layers
  for (size_t i = 1; i < f->tensors.size(); ++i) {
    EXPECT_LT(f->tensors[i - 1].first, f->tensors[i].first);
  }
  EXPECT_EQ(internal::CheckpointChecksum(*f), f->metadata["checksum"]);
  auto bytes = SerializeSafetensors(*f);
  ASSERT_TRUE(bytes.ok());
  EXPECT_TRUE(std::string(bytes->begin(), bytes->end()) == Bytes(path));

  const std::string b = TestDir() + "/order_b";
  std::error_code ec;
  fs::remove_all(b, ec);
  fs::copy(TestDir() + "/order_a", b, fs::copy_options::recursive);
  std::reverse(f->tensors.begin(), f->tensors.end());
  ASSERT_TRUE(WriteSafetensors(b + "/checkpoints/step_00000004.safetensors", *f).ok());
  auto ra = RunTiny(Tiny("order_a"));
  auto rb = RunTiny(Tiny("order_b"));
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status().ToString() << rb.status().ToString();
  EXPECT_EQ(ra->resumed_from, 4);
  EXPECT_EQ(rb->resumed_from, 4);
  EXPECT_EQ(ra->final_loss, rb->final_loss);
  EXPECT_EQ(*ra->final_eval_loss, *rb->final_eval_loss);
  // The next checkpoints hold the same bits (their metadata differ by the
  // run name).
  const std::string last = "/checkpoints/step_00000012.safetensors";
  auto la = ReadSafetensors(TestDir() + "/order_a" + last);
  auto lb = ReadSafetensors(b + last);
  ASSERT_TRUE(la.ok() && lb.ok());
  ASSERT_EQ(la->tensors.size(), lb->tensors.size());
  for (size_t i = 0; i < la->tensors.size(); ++i) {
    const Tensor& x = la->tensors[i].second;
    const Tensor& y = lb->tensors[i].second;
    EXPECT_EQ(la->tensors[i].first, lb->tensors[i].first);
    ASSERT_EQ(x.num_bytes(), y.num_bytes());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.num_bytes()), 0) << la->tensors[i].first;
  }
}

TEST(TrainRobustness, ACheckpointPastTheRunsStepsIsRefused) {
  ExpectRefused("future", [](const std::string&) {}, StatusCode::kFailedPrecondition,
                "past this run's steps=3", {"steps=3"});
}

TEST(TrainRobustness, ACheckpointThatIsADirectoryIsRefused) {
  ExpectRefused("dir", [](const std::string& p) {
    fs::remove(p);
    fs::create_directory(p);
  }, StatusCode::kInvalidArgument, "' is not a regular file");
}

TEST(TrainRobustness, NamesThatAreNotCheckpointsAreIgnored) {
  // A name with more digits than int64 holds made std::stoll throw.
  const std::string path = CheckpointOfAStoppedRun("names");
  const std::string dir = fs::path(path).parent_path().string();
  WriteBytes(dir + "/step_99999999999999999999999999.safetensors", "x");
  WriteBytes(dir + "/step_-5.safetensors", "x");
  auto s = RunTiny(Tiny("names"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->resumed_from, 4);
}

TEST(TrainRobustness, DatasetPathsThatAreNotFilesAreRefused) {
  std::vector<std::string> f = Tiny("data");
  f.insert(f.end(), {"dataset_type=text", "vocab_size=256", "dataset_path=" + TestDir()});
  fs::create_directories(TestDir());
  auto s = RunTiny(f, {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("is not a regular file (a directory)"), std::string::npos)
      << s.status().message();
  f.back() = "dataset_path=/dev/zero";
  s = RunTiny(f, {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("not a regular file"), std::string::npos);
  EXPECT_FALSE(fs::exists(TestDir() + "/data"));
}

TEST(TrainRobustness, SyntheticDataThatWouldNotFinishIsRefused) {
  std::vector<std::string> f = Tiny("synthetic");
  f.push_back("synthetic_branching=1000000000000");
  auto s = RunTiny(f, {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("synthetic_branching=1000000000000"), std::string::npos);
  // 4 sources x 8192 positions x 2048^2 = 2^37 steps: refused before the
  // tables are built (no cap, so the memory plan lets it through).
  CapGuard guard;
  SetMemoryCap(0, "test");
  f = Tiny("synthetic");
  f.insert(f.end(), {"vocab_size=2100", "synthetic_alphabet_size=2048", "max_target_length=8192",
                     "per_device_batch_size=1"});
  s = RunTiny(f, {}, true);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("2^34"), std::string::npos) << s.status().message();
}

}  // namespace
}  // namespace fp8moe
