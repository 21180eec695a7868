// Helpers of the trainer's tests (train_test.cc, train_robustness_test.cc):
// tiny runs in this process's own directory.
#ifndef FP8MOE_TRAIN_TRAIN_TEST_UTIL_H_
#define FP8MOE_TRAIN_TRAIN_TEST_UTIL_H_

#include <omp.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/train.h"

namespace fp8moe {
namespace fs = std::filesystem;

// This process's own directory: engineers and CI jobs run train_test at the
// same time on one machine, and a shared directory let one process resume
// another's run.
inline const std::string& TestDir() {
  static const std::string* dir = [] {
    auto* d = new std::string(::testing::TempDir() + "fp8moe_train_test." +
                              std::to_string(::getpid()));
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(TestDir(), ec);
    });
    return d;
  }();
  return *dir;
}

// A tiny run in a fresh directory.
inline std::vector<std::string> Tiny(const std::string& name) {
  const std::string& dir = TestDir();
  return {"base_output_directory=" + dir, "run_name=" + name, "base_emb_dim=16",
          "base_num_decoder_layers=2", "base_num_query_heads=2", "head_dim=8",
          "base_moe_mlp_dim=16", "max_target_length=16", "per_device_batch_size=4",
          "vocab_size=40", "synthetic_alphabet_size=8", "steps=12", "checkpoint_period=4",
          "eval_interval=6", "eval_steps=2", "log_period=3"};
}

inline Result<TrainSummary> RunTiny(std::vector<std::string> flags, const TrainOptions& o = {},
                         bool fresh = false) {
  // One thread: these shapes are far too small to gain from two, and on a
  // busy machine OpenMP's barriers make a second thread slow. (The bits do
  // not depend on the thread count: model_test checks that.)
  omp_set_num_threads(1);
  auto cfg = LoadTrainConfig("", flags);
  if (!cfg.ok()) return cfg.status();
  if (fresh) {
    std::error_code ec;
    fs::remove_all(fs::path(cfg->base_output_directory) / cfg->run_name, ec);
  }
  TrainOptions q = o;
  q.quiet = true;
  return Train(*cfg, q);
}

inline std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace fp8moe

#endif  // FP8MOE_TRAIN_TRAIN_TEST_UTIL_H_
