// The datasets of include/fp8moe/data.h.
#include "fp8moe/data.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <string>

#include "fp8moe/context.h"
#include "fp8moe/memory.h"

namespace fp8moe {
namespace {

// The most multiply-adds the synthetic corpus's loss floor may take (about
// ten seconds); past it a config is refused instead of seeming to hang.
constexpr int64_t kMaxSyntheticSize = (int64_t{1} << 31) - 1;
constexpr unsigned __int128 kMaxSyntheticWork = static_cast<unsigned __int128>(1) << 34;

// A seed for sequence `index` of `stream` (0 train, 1 eval): every sequence
// has its own generator, so any one can be drawn without the ones before.
uint64_t SequenceSeed(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (stream + 1) * 0xD1B54A32D192ED03ull;
  x ^= index + 0x632BE59BD9B4E019ull + (x << 6) + (x >> 2);
  return x;
}

// Draws from a cumulative distribution cdf [n] (cdf[n-1] == 1).
int64_t Sample(Rng& rng, const double* cdf, int64_t n) {
  const double u = rng.Uniform();
  for (int64_t i = 0; i < n - 1; ++i) {
    if (u < cdf[i]) return i;
  }
  return n - 1;
}

double Entropy(const double* p, int64_t n) {
  double h = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] > 0) h -= p[i] * std::log(p[i]);
  }
  return h;
}

class SyntheticDataset : public Dataset {
 public:
  explicit SyntheticDataset(const DataConfig& c) : c_(c) {
    const int64_t M = c.num_sources, A = c.alphabet_size;
    Rng rng(c.seed ^ 0x5EEDDA7Aull);
    init_.assign(static_cast<size_t>(M * A), 0.0);
    trans_.assign(static_cast<size_t>(M * A * A), 0.0);
    for (int64_t s = 0; s < M; ++s) {
      double* q = &init_[static_cast<size_t>(s * A)];
      double total = 0;
      for (int64_t i = 0; i < A; ++i) total += q[i] = 0.5 + rng.Uniform();
      for (int64_t i = 0; i < A; ++i) q[i] /= total;
      for (int64_t i = 0; i < A; ++i) {
        double* row = &trans_[static_cast<size_t>((s * A + i) * A)];
        // The successor i+1+s keeps every chain irreducible; the others are
        // random, with log-normal weights.
        row[(i + 1 + s) % A] = std::exp(rng.Normal());
        for (int64_t b = 1; b < c.branching; ++b) {
          row[static_cast<int64_t>(rng.Below(static_cast<uint64_t>(A)))] += std::exp(rng.Normal());
        }
        double t = 0;
        for (int64_t j = 0; j < A; ++j) t += row[j];
        for (int64_t j = 0; j < A; ++j) row[j] /= t;
      }
    }
    // Exact expected loss over the S targets of a sequence: target 1 given
    // the marker has entropy H(q_s); target t >= 2 given the previous symbol
    // has sum_i pi_{t-1}(i) H(P_s[i]), pi_1 = q_s, pi_t = pi_{t-1} P_s.
    double floor = 0;
    std::vector<double> pi(static_cast<size_t>(A)), next(static_cast<size_t>(A)),
        row_h(static_cast<size_t>(A));
    for (int64_t s = 0; s < M; ++s) {
      for (int64_t i = 0; i < A; ++i) {
        row_h[static_cast<size_t>(i)] = Entropy(&trans_[static_cast<size_t>((s * A + i) * A)], A);
      }
      std::copy(&init_[static_cast<size_t>(s * A)], &init_[static_cast<size_t>(s * A)] + A, pi.begin());
      double h = Entropy(pi.data(), A);
      for (int64_t t = 2; t <= c.seq_len; ++t) {
        std::fill(next.begin(), next.end(), 0.0);
        for (int64_t i = 0; i < A; ++i) {
          h += pi[static_cast<size_t>(i)] * row_h[static_cast<size_t>(i)];
          for (int64_t j = 0; j < A; ++j) {
            next[static_cast<size_t>(j)] += pi[static_cast<size_t>(i)] * trans_[static_cast<size_t>((s * A + i) * A + j)];
          }
        }
        pi.swap(next);
      }
      floor += h / static_cast<double>(c.seq_len);
    }
    floor_ = floor / static_cast<double>(M);
    // Cumulative tables for sampling.
    for (int64_t r = 0; r < M * A; ++r) {
      double acc = 0;
      for (int64_t j = 0; j < A; ++j) acc = trans_[static_cast<size_t>(r * A + j)] += acc;
      trans_[static_cast<size_t>(r * A + A - 1)] = 1.0;
    }
    for (int64_t s = 0; s < M; ++s) {
      double acc = 0;
      for (int64_t j = 0; j < A; ++j) acc = init_[static_cast<size_t>(s * A + j)] += acc;
      init_[static_cast<size_t>(s * A + A - 1)] = 1.0;
    }
  }

  void NextTrainBatch(int32_t* inputs, int32_t* targets) override {
    for (int64_t b = 0; b < c_.batch; ++b) Sequence(0, next_++, inputs + b * c_.seq_len, targets + b * c_.seq_len);
  }
  void EvalBatch(int64_t index, int32_t* inputs, int32_t* targets) override {
    for (int64_t b = 0; b < c_.batch; ++b) {
      Sequence(1, static_cast<uint64_t>(index * c_.batch + b), inputs + b * c_.seq_len,
               targets + b * c_.seq_len);
    }
  }
  std::optional<double> EntropyFloor() const override { return floor_; }
  std::vector<uint64_t> Position() const override { return {next_}; }
  Status SetPosition(const std::vector<uint64_t>& p) override {
    if (p.size() != 1) return InvalidArgument("a synthetic data position is one number");
    next_ = p[0];
    return OkStatus();
  }
  std::string Describe() const override {
    return "synthetic: " + std::to_string(c_.num_sources) + " Markov sources x " +
           std::to_string(c_.alphabet_size) + " symbols (branching " +
           std::to_string(c_.branching) + "), seed " + std::to_string(c_.seed);
  }

 private:
  // tokens x_0..x_S of sequence `index`; inputs = x_0..x_{S-1}, targets = x_1..x_S.
  void Sequence(uint64_t stream, uint64_t index, int32_t* in, int32_t* tgt) {
    Rng rng(SequenceSeed(c_.seed, stream, index));
    const int64_t M = c_.num_sources, A = c_.alphabet_size;
    const int64_t s = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(M)));
    int64_t prev = Sample(rng, &init_[static_cast<size_t>(s * A)], A);
    in[0] = static_cast<int32_t>(s);
    for (int64_t t = 0; t < c_.seq_len; ++t) {
      tgt[t] = static_cast<int32_t>(M + prev);
      if (t + 1 < c_.seq_len) in[t + 1] = tgt[t];
      prev = Sample(rng, &trans_[static_cast<size_t>((s * A + prev) * A)], A);
    }
  }

  DataConfig c_;
  std::vector<double> init_;   // [M, A] cumulative after construction
  std::vector<double> trans_;  // [M, A, A] cumulative rows after construction
  double floor_ = 0;
  uint64_t next_ = 0;
};

class TextDataset : public Dataset {
 public:
  TextDataset(const DataConfig& c, std::string bytes, int64_t train_bytes)
      : c_(c), bytes_(std::move(bytes)), train_(train_bytes), rng_(c.seed ^ 0x7E47ull) {}

  void NextTrainBatch(int32_t* inputs, int32_t* targets) override {
    for (int64_t b = 0; b < c_.batch; ++b) {
      const int64_t off = static_cast<int64_t>(rng_.Below(static_cast<uint64_t>(train_ - c_.seq_len)));
      Window(off, inputs + b * c_.seq_len, targets + b * c_.seq_len);
    }
  }
  void EvalBatch(int64_t index, int32_t* inputs, int32_t* targets) override {
    const int64_t n_eval = static_cast<int64_t>(bytes_.size()) - train_;
    const int64_t starts = n_eval - c_.seq_len;  // >= 1, checked at open
    for (int64_t b = 0; b < c_.batch; ++b) {
      const int64_t j = index * c_.batch + b;
      Window(train_ + (j * (c_.seq_len + 1)) % starts, inputs + b * c_.seq_len,
             targets + b * c_.seq_len);
    }
  }
  std::optional<double> EntropyFloor() const override { return std::nullopt; }
  std::vector<uint64_t> Position() const override {
    const Rng::State& s = rng_.state();
    return {s[0], s[1], s[2], s[3]};
  }
  Status SetPosition(const std::vector<uint64_t>& p) override {
    if (p.size() != 4 || (p[0] | p[1] | p[2] | p[3]) == 0) {
      return InvalidArgument("a text data position is four numbers, not all zero");
    }
    rng_.set_state({p[0], p[1], p[2], p[3]});
    return OkStatus();
  }
  std::string Describe() const override {
    return "text: " + c_.path + " (" + std::to_string(bytes_.size()) + " bytes, " +
           std::to_string(train_) + " for training)";
  }

 private:
  void Window(int64_t off, int32_t* in, int32_t* tgt) const {
    const auto* u = reinterpret_cast<const unsigned char*>(bytes_.data());
    for (int64_t t = 0; t < c_.seq_len; ++t) {
      in[t] = u[off + t];
      tgt[t] = u[off + t + 1];
    }
  }

  DataConfig c_;
  std::string bytes_;
  int64_t train_;
  Rng rng_;
};

}  // namespace

const FlagTable<DataConfig>& DataConfigFlags() {
  static const FlagTable<DataConfig>* const table = [] {
    auto* t = new FlagTable<DataConfig>;
    t->String("dataset_type", &DataConfig::type,
              "synthetic: a seeded mixture of Markov sources with an exact loss floor; text: "
              "the bytes of dataset_path.",
              {"synthetic", "text"});
    t->String("dataset_path", &DataConfig::path, "The text file of dataset_type=text.");
    t->Int("data_shuffle_seed", &DataConfig::seed,
           "Seed of the synthetic corpus and of the order of text windows.", {.min = 0});
    t->Int("synthetic_num_sources", &DataConfig::num_sources,
           "Synthetic: Markov sources in the mixture; each sequence starts with its source's "
           "marker token.");
    t->Int("synthetic_alphabet_size", &DataConfig::alphabet_size,
           "Synthetic: symbols shared by the sources (tokens after the markers).");
    t->Int("synthetic_branching", &DataConfig::branching,
           "Synthetic: random successors drawn for each symbol of each source.");
    t->Float("eval_split_fraction", &DataConfig::eval_fraction,
             "Text: the last fraction of the file kept for evaluation.",
             {.min = 0,
              .max = 1,
              .min_open = true,
              .max_open = true,
              .show_value = true,
              .note = ": the share of the data held out for eval"});
    return t;
  }();
  return *table;
}

Result<std::unique_ptr<Dataset>> OpenDataset(const DataConfig& c) {
  if (c.seq_len < 1 || c.batch < 1) {
    return InvalidArgument("max_target_length and per_device_batch_size must be positive");
  }
  if (c.type == "synthetic") {
    if (c.num_sources < 1 || c.alphabet_size < 2 || c.branching < 1) {
      return InvalidArgument("synthetic data needs synthetic_num_sources >= 1, "
                             "synthetic_alphabet_size >= 2 and synthetic_branching >= 1");
    }
    // Compared one at a time first: the sum of two huge values would overflow.
    if (c.num_sources > c.vocab_size || c.alphabet_size > c.vocab_size ||
        c.num_sources + c.alphabet_size > c.vocab_size) {
      return InvalidArgument(
          "synthetic data uses " + std::to_string(c.num_sources + c.alphabet_size) +
          " tokens (synthetic_num_sources + synthetic_alphabet_size) but vocab_size=" +
          std::to_string(c.vocab_size) + "; raise vocab_size or lower the two");
    }
    if (c.branching > c.alphabet_size) {
      return InvalidArgument("synthetic_branching=" + std::to_string(c.branching) +
                             " exceeds synthetic_alphabet_size=" +
                             std::to_string(c.alphabet_size) +
                             " (a symbol has at most that many successors); lower it");
    }
    if (c.num_sources > kMaxSyntheticSize || c.alphabet_size > kMaxSyntheticSize ||
        c.seq_len > kMaxSyntheticSize) {
      return InvalidArgument("synthetic_num_sources, synthetic_alphabet_size and "
                             "max_target_length must be below 2^31");
    }
    // The exact loss floor walks every source's chain over the sequence:
    // M x S x A^2 multiply-adds (each factor is below 2^31 here).
    const unsigned __int128 work = static_cast<unsigned __int128>(c.num_sources) *
                                   static_cast<unsigned __int128>(c.seq_len) *
                                   static_cast<unsigned __int128>(c.alphabet_size) *
                                   static_cast<unsigned __int128>(c.alphabet_size);
    if (work > kMaxSyntheticWork) {
      return InvalidArgument(
          "synthetic data of synthetic_num_sources x max_target_length x "
          "synthetic_alphabet_size^2 = " + std::to_string(c.num_sources) + " x " +
          std::to_string(c.seq_len) + " x " + std::to_string(c.alphabet_size) +
          "^2 is more than 2^34 steps to set up; lower synthetic_alphabet_size or "
          "synthetic_num_sources");
    }
    FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest(
        "the synthetic corpus's tables (synthetic_num_sources x synthetic_alphabet_size^2 "
        "doubles)",
        static_cast<uint64_t>(8 * (c.num_sources * c.alphabet_size * c.alphabet_size +
                                   c.num_sources * c.alphabet_size + 3 * c.alphabet_size))));
    return std::unique_ptr<Dataset>(new SyntheticDataset(c));
  }
  if (c.type != "text") {
    return InvalidArgument("dataset_type='" + c.type + "' is not supported; set "
                           "dataset_type=synthetic or dataset_type=text");
  }
  if (c.path.empty()) {
    return InvalidArgument("dataset_type=text needs dataset_path=FILE (any UTF-8 text file)");
  }
  if (c.vocab_size < 256) {
    return InvalidArgument("dataset_type=text reads bytes (tokens 0..255) but vocab_size=" +
                           std::to_string(c.vocab_size) + "; set vocab_size=256");
  }
  if (!(c.eval_fraction > 0 && c.eval_fraction < 1)) {
    char frac[32];
    std::snprintf(frac, sizeof frac, "%g", c.eval_fraction);
    return InvalidArgument(std::string("eval_split_fraction=") + frac +
                           " must be between 0 and 1 (exclusive): the share of the text held "
                           "out for eval");
  }
  // A regular file only: a directory, a FIFO or a device (/dev/zero never
  // ends) is refused before reading, and the file's size is checked against
  // the memory cap before it is read into memory.
  std::error_code ec;
  const auto status = std::filesystem::status(c.path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return NotFound("cannot read dataset_path '" + c.path + "': " +
                    (ec ? ec.message() : std::string("no such file")) +
                    "; give a readable text file");
  }
  if (!std::filesystem::is_regular_file(status)) {
    return InvalidArgument("dataset_path '" + c.path + "' is not a regular file (" +
                           (std::filesystem::is_directory(status) ? "a directory" : "a device, "
                            "FIFO or socket") + "); give a text file");
  }
  const uint64_t size = std::filesystem::file_size(c.path, ec);
  if (ec) return NotFound("cannot read dataset_path '" + c.path + "': " + ec.message());
  FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest("dataset_path '" + c.path + "'", size));
  std::FILE* f = std::fopen(c.path.c_str(), "rb");
  if (f == nullptr) {
    return NotFound("cannot read dataset_path '" + c.path + "': " + std::strerror(errno) +
                    "; give a readable text file");
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  const size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return NotFound("cannot read dataset_path '" + c.path + "': read error");
  bytes.resize(got);  // a file that shrank while being read
  const int64_t n = static_cast<int64_t>(bytes.size());
  const int64_t train = n - static_cast<int64_t>(std::ceil(static_cast<double>(n) * c.eval_fraction));
  // Each split needs one window of S+1 bytes and room for a second start.
  const int64_t need = c.seq_len + 2;
  if (train < need || n - train < need) {
    // The smallest size whose two splits both hold `need` bytes (the split
    // rounds, so the closed form can be off by a few bytes either way).
    auto fits = [&](int64_t m) {
      const int64_t tr = m - static_cast<int64_t>(std::ceil(static_cast<double>(m) * c.eval_fraction));
      return tr >= need && m - tr >= need;
    };
    int64_t least = std::max<int64_t>(
        2 * need, static_cast<int64_t>(need / std::min(c.eval_fraction, 1 - c.eval_fraction)) - 4);
    while (!fits(least)) ++least;
    while (least > 2 * need && fits(least - 1)) --least;
    char frac[32];
    std::snprintf(frac, sizeof frac, "%g", c.eval_fraction);
    return InvalidArgument(
        "dataset_path '" + c.path + "' has " + std::to_string(n) +
        " bytes, shorter than one sequence per split: with max_target_length=" +
        std::to_string(c.seq_len) + " and eval_split_fraction=" + frac + " it needs at least " +
        std::to_string(least) + " bytes; use a longer file or a smaller max_target_length");
  }
  return std::unique_ptr<Dataset>(new TextDataset(c, std::move(bytes), train));
}

}  // namespace fp8moe
