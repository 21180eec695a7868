// The datasets of include/fp8moe/data.h.
#include "fp8moe/data.h"

#include <algorithm>
#include <bit>
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

// The size of dataset_path, which must be a regular file: a directory, a FIFO
// or a device (/dev/zero never ends) is refused before anything is read.
// `kind` ends the messages' fix ("a text file", "a token file").
Result<uint64_t> RegularFileSize(const std::string& path, const std::string& kind) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return NotFound("cannot read dataset_path '" + path + "': " +
                    (ec ? ec.message() : std::string("no such file")) + "; give a readable " +
                    kind);
  }
  if (!std::filesystem::is_regular_file(status)) {
    return InvalidArgument("dataset_path '" + path + "' is not a regular file (" +
                           (std::filesystem::is_directory(status) ? "a directory" : "a device, "
                            "FIFO or socket") + "); give " + kind);
  }
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) return NotFound("cannot read dataset_path '" + path + "': " + ec.message());
  return size;
}

// Up to `size` bytes from the start of `path` (fewer if it shrank meanwhile).
Result<std::string> ReadFile(const std::string& path, uint64_t size, const std::string& kind) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return NotFound("cannot read dataset_path '" + path + "': " + std::strerror(errno) +
                    "; give a readable " + kind);
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  const size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return NotFound("cannot read dataset_path '" + path + "': read error");
  bytes.resize(got);
  return bytes;
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

// dataset_type=tokens: the token file that `python -m fp8moe.data encode`
// writes (docs/train.md, Data, has the byte layout). All fields are
// little-endian; the header is 48 bytes, then the document offsets, then the
// ids.
constexpr char kTokenMagic[8] = {'F', 'P', '8', 'M', 'T', 'O', 'K', 'S'};
constexpr uint32_t kTokenVersion = 1;
constexpr uint64_t kTokenHeaderBytes = 48;
static_assert(std::endian::native == std::endian::little,
              "the token file is little-endian and read in place");

struct TokenHeader {
  uint32_t version = 0;
  uint32_t id_bytes = 0;     // 2 (vocab_size <= 65536) or 4
  uint64_t vocab_size = 0;
  uint64_t eos_id = 0;
  uint64_t num_documents = 0;
  uint64_t num_tokens = 0;
};

// The train split is the token stream of the first documents, the eval split
// that of the last ceil(eval_split_fraction x documents); every document ends
// with EOS, so a split's stream is its documents, each followed by EOS. A
// split of T tokens holds (T - 1) / S windows: window w is tokens
// [w S, w S + S] (inputs the first S, targets the last S), so consecutive
// windows share one token and every token but the first is a target once.
// Training takes the windows in a fresh random order each epoch (an epoch's
// order is drawn from data_shuffle_seed and the epoch's number alone), so the
// position is one counter: the sequences drawn so far.
class TokensDataset : public Dataset {
 public:
  // bytes: the whole file; ids_at: where the ids start; train_tokens: the
  // ids of the train split (a document boundary).
  TokensDataset(const DataConfig& c, std::string bytes, const TokenHeader& h, uint64_t ids_at,
                int64_t train_documents, int64_t train_tokens)
      : c_(c),
        bytes_(std::move(bytes)),
        h_(h),
        ids_at_(ids_at),
        train_documents_(train_documents),
        train_tokens_(train_tokens),
        train_windows_((train_tokens - 1) / c.seq_len),
        eval_windows_((static_cast<int64_t>(h.num_tokens) - train_tokens - 1) / c.seq_len) {}

  void NextTrainBatch(int32_t* inputs, int32_t* targets) override {
    for (int64_t b = 0; b < c_.batch; ++b) {
      const uint64_t epoch = next_ / static_cast<uint64_t>(train_windows_);
      if (epoch != order_epoch_ || order_.empty()) DrawOrder(epoch);
      const int64_t w = order_[next_ % static_cast<uint64_t>(train_windows_)];
      ++next_;
      Window(w * c_.seq_len, inputs + b * c_.seq_len, targets + b * c_.seq_len);
    }
  }
  void EvalBatch(int64_t index, int32_t* inputs, int32_t* targets) override {
    for (int64_t b = 0; b < c_.batch; ++b) {
      const int64_t w = (index * c_.batch + b) % eval_windows_;
      Window(train_tokens_ + w * c_.seq_len, inputs + b * c_.seq_len, targets + b * c_.seq_len);
    }
  }
  std::optional<double> EntropyFloor() const override { return std::nullopt; }
  std::vector<uint64_t> Position() const override { return {next_}; }
  Status SetPosition(const std::vector<uint64_t>& p) override {
    if (p.size() != 1) return InvalidArgument("a tokens data position is one number");
    next_ = p[0];
    return OkStatus();
  }
  std::string Describe() const override {
    return "tokens: " + c_.path + " (" + std::to_string(h_.num_documents) + " documents, " +
           std::to_string(h_.num_tokens) + " tokens, vocab " + std::to_string(h_.vocab_size) +
           ", EOS " + std::to_string(h_.eos_id) + "; " + std::to_string(train_documents_) +
           " documents for training: " + std::to_string(train_windows_) + " windows, eval " +
           std::to_string(eval_windows_) + ")";
  }

 private:
  uint32_t Id(int64_t i) const {
    const char* p = bytes_.data() + ids_at_ + static_cast<uint64_t>(i) * h_.id_bytes;
    if (h_.id_bytes == 2) {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  // tokens [start, start + S]: in [S], tgt [S].
  void Window(int64_t start, int32_t* in, int32_t* tgt) const {
    for (int64_t t = 0; t < c_.seq_len; ++t) {
      in[t] = static_cast<int32_t>(Id(start + t));
      tgt[t] = static_cast<int32_t>(Id(start + t + 1));
    }
  }
  // Fisher-Yates over the train windows with the epoch's own generator.
  void DrawOrder(uint64_t epoch) {
    order_.resize(static_cast<size_t>(train_windows_));
    for (int64_t i = 0; i < train_windows_; ++i) order_[static_cast<size_t>(i)] = i;
    Rng rng(SequenceSeed(c_.seed, 2, epoch));
    for (int64_t i = train_windows_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i + 1)));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
    }
    order_epoch_ = epoch;
  }

  DataConfig c_;
  std::string bytes_;
  TokenHeader h_;
  uint64_t ids_at_;
  int64_t train_documents_, train_tokens_, train_windows_, eval_windows_;
  uint64_t next_ = 0;
  uint64_t order_epoch_ = 0;
  std::vector<int64_t> order_;  // the current epoch's window order
};

template <typename T>
T ReadLe(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The header of a token file of `size` bytes: every field checked, and the
// file's size against the one the header implies, before the body is read.
Result<TokenHeader> ParseTokenHeader(const DataConfig& c, const char* p, uint64_t size) {
  const std::string file = "dataset_path '" + c.path + "'";
  if (size < kTokenHeaderBytes) {
    return InvalidArgument(file + " has " + std::to_string(size) + " bytes, fewer than the " +
                           std::to_string(kTokenHeaderBytes) + "-byte header of a token file; "
                           "write it with `python -m fp8moe.data encode`");
  }
  if (std::memcmp(p, kTokenMagic, sizeof kTokenMagic) != 0) {
    return InvalidArgument(file + " is not a token file (its first 8 bytes are not the magic "
                           "FP8MTOKS); write it with `python -m fp8moe.data encode`, or use "
                           "dataset_type=text for a text file");
  }
  TokenHeader h;
  h.version = ReadLe<uint32_t>(p + 8);
  h.id_bytes = ReadLe<uint32_t>(p + 12);
  h.vocab_size = ReadLe<uint64_t>(p + 16);
  h.eos_id = ReadLe<uint64_t>(p + 24);
  h.num_documents = ReadLe<uint64_t>(p + 32);
  h.num_tokens = ReadLe<uint64_t>(p + 40);
  if (h.version != kTokenVersion) {
    return InvalidArgument(file + " is token file version " + std::to_string(h.version) +
                           "; this fp8moe reads version " + std::to_string(kTokenVersion) +
                           "; encode it again with this version's fp8moe.data");
  }
  if (h.vocab_size < 1 || h.vocab_size > (uint64_t{1} << 32)) {
    return InvalidArgument(file + " has vocab_size " + std::to_string(h.vocab_size) +
                           " in its header; a token file's vocabulary is 1..2^32 ids");
  }
  const uint32_t want_bytes = h.vocab_size <= 65536 ? 2 : 4;
  if (h.id_bytes != want_bytes) {
    return InvalidArgument(file + " stores ids in " + std::to_string(h.id_bytes) +
                           " bytes, but its vocab_size " + std::to_string(h.vocab_size) +
                           " takes " + std::to_string(want_bytes) +
                           " (uint16 up to 65536 ids, else uint32); the file is damaged");
  }
  if (h.vocab_size > static_cast<uint64_t>(c.vocab_size)) {
    return InvalidArgument(file + " has a vocabulary of " + std::to_string(h.vocab_size) +
                           " ids but the model's vocab_size=" + std::to_string(c.vocab_size) +
                           "; set vocab_size=" + std::to_string(h.vocab_size) + " or more");
  }
  if (h.eos_id >= h.vocab_size) {
    return InvalidArgument(file + " has EOS id " + std::to_string(h.eos_id) +
                           " outside its vocabulary of " + std::to_string(h.vocab_size) +
                           " ids; the file is damaged");
  }
  // In 128 bits: D and N are any 64-bit numbers in a damaged header.
  using u128 = unsigned __int128;
  const u128 expected = u128{kTokenHeaderBytes} + u128{8} * (u128{h.num_documents} + 1) +
                        u128{h.id_bytes} * u128{h.num_tokens};
  if (expected != size) {
    const bool wide = expected > u128{UINT64_MAX};
    return InvalidArgument(
        file + " has " + std::to_string(size) + " bytes but its header (" +
        std::to_string(h.num_documents) + " documents, " + std::to_string(h.num_tokens) +
        " ids of " + std::to_string(h.id_bytes) + " bytes) makes it " +
        (wide ? std::string("more than 2^64") : std::to_string(static_cast<uint64_t>(expected))) +
        " bytes" + (expected > size ? "; the file is truncated" : "; the file is damaged") +
        ": encode it again");
  }
  return h;
}

// Checks the document offsets and the ids of a token file whose header is
// `h` (bytes: the whole file): offsets from 0 to num_tokens, every document
// non-empty and ending with EOS, every id below the vocabulary (one pass
// over the ids, as cheap as reading them).
Status CheckTokenBody(const DataConfig& c, const TokenHeader& h, const std::string& bytes) {
  const std::string file = "dataset_path '" + c.path + "'";
  const char* offsets = bytes.data() + kTokenHeaderBytes;
  const char* ids = offsets + 8 * (h.num_documents + 1);
  auto id = [&](uint64_t i) -> uint64_t {
    return h.id_bytes == 2 ? ReadLe<uint16_t>(ids + 2 * i) : ReadLe<uint32_t>(ids + 4 * i);
  };
  uint64_t prev = ReadLe<uint64_t>(offsets);
  if (prev != 0) {
    return InvalidArgument(file + ": document 0 starts at id " + std::to_string(prev) +
                           ", not 0; the file is damaged");
  }
  for (uint64_t d = 0; d < h.num_documents; ++d) {
    const uint64_t end = ReadLe<uint64_t>(offsets + 8 * (d + 1));
    if (end <= prev || end > h.num_tokens) {
      return InvalidArgument(file + ": document " + std::to_string(d) + " spans ids " +
                             std::to_string(prev) + ".." + std::to_string(end) + " of " +
                             std::to_string(h.num_tokens) + "; the file is damaged");
    }
    if (id(end - 1) != h.eos_id) {
      return InvalidArgument(file + ": document " + std::to_string(d) + " ends with id " +
                             std::to_string(id(end - 1)) + ", not EOS " +
                             std::to_string(h.eos_id) + "; the file is damaged");
    }
    prev = end;
  }
  if (prev != h.num_tokens) {
    return InvalidArgument(file + ": its documents end at id " + std::to_string(prev) +
                           " but it holds " + std::to_string(h.num_tokens) +
                           " ids; the file is damaged");
  }
  for (uint64_t i = 0; i < h.num_tokens; ++i) {
    if (id(i) >= h.vocab_size) {
      return InvalidArgument(file + ": id " + std::to_string(i) + " is " +
                             std::to_string(id(i)) + ", outside its vocabulary of " +
                             std::to_string(h.vocab_size) + " ids; the file is damaged");
    }
  }
  return OkStatus();
}

// f as printf's %g writes it (0.1, 1e-05).
std::string Shortest(double f) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", f);
  return text;
}

Status CheckEvalFraction(double f) {
  if (f > 0 && f < 1) return OkStatus();
  return InvalidArgument("eval_split_fraction=" + Shortest(f) +
                         " must be between 0 and 1 (exclusive): the share of the text held "
                         "out for eval");
}

Result<std::unique_ptr<Dataset>> OpenTokensDataset(const DataConfig& c) {
  if (c.path.empty()) {
    return InvalidArgument("dataset_type=tokens needs dataset_path=FILE (a token file from "
                           "`python -m fp8moe.data encode`)");
  }
  FP8MOE_RETURN_IF_ERROR(CheckEvalFraction(c.eval_fraction));
  FP8MOE_ASSIGN_OR_RETURN(const uint64_t size, RegularFileSize(c.path, "a token file"));
  // The header first (a few bytes): a wrong file is refused before the cap
  // check and the read of the whole.
  FP8MOE_ASSIGN_OR_RETURN(const std::string head,
                          ReadFile(c.path, std::min(size, kTokenHeaderBytes), "a token file"));
  // (A file that shrank below the header meanwhile is parsed at its new size.)
  const uint64_t parsed_size = head.size() < kTokenHeaderBytes ? head.size() : size;
  FP8MOE_ASSIGN_OR_RETURN(const TokenHeader h, ParseTokenHeader(c, head.data(), parsed_size));
  // The file and the order of its train windows (8 bytes each).
  FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest(
      "dataset_path '" + c.path + "' and its window order",
      size + 8 * (h.num_tokens / static_cast<uint64_t>(c.seq_len) + 1)));
  FP8MOE_ASSIGN_OR_RETURN(std::string bytes, ReadFile(c.path, size, "a token file"));
  if (bytes.size() != size) {
    return InvalidArgument("dataset_path '" + c.path + "' shrank while it was read (" +
                           std::to_string(bytes.size()) + " of " + std::to_string(size) +
                           " bytes)");
  }
  FP8MOE_RETURN_IF_ERROR(CheckTokenBody(c, h, bytes));
  // Split by documents: the last ceil(fraction x D) are eval, at least one
  // each side; each side needs S + 1 tokens for one window.
  const auto D = static_cast<int64_t>(h.num_documents);
  const int64_t eval_docs = static_cast<int64_t>(std::ceil(static_cast<double>(D) * c.eval_fraction));
  const int64_t train_docs = D - eval_docs;
  const char* offsets = bytes.data() + kTokenHeaderBytes;
  const auto train_tokens =
      train_docs > 0 ? static_cast<int64_t>(ReadLe<uint64_t>(offsets + 8 * train_docs)) : 0;
  const int64_t eval_tokens = static_cast<int64_t>(h.num_tokens) - train_tokens;
  if (train_docs < 1 || eval_docs < 1 || train_tokens < c.seq_len + 1 ||
      eval_tokens < c.seq_len + 1) {
    return InvalidArgument(
        "dataset_path '" + c.path + "' has " + std::to_string(D) + " documents (" +
        std::to_string(h.num_tokens) + " tokens); eval_split_fraction=" + Shortest(c.eval_fraction) + " keeps " +
        std::to_string(train_docs) + " for training (" + std::to_string(train_tokens) +
        " tokens) and " + std::to_string(eval_docs) + " for eval (" +
        std::to_string(eval_tokens) + " tokens), but each split needs one document and "
        "max_target_length + 1 = " + std::to_string(c.seq_len + 1) +
        " tokens; encode more text, change eval_split_fraction or lower max_target_length");
  }
  const uint64_t ids_at = kTokenHeaderBytes + 8 * (h.num_documents + 1);
  return std::unique_ptr<Dataset>(
      new TokensDataset(c, std::move(bytes), h, ids_at, train_docs, train_tokens));
}

}  // namespace

const FlagTable<DataConfig>& DataConfigFlags() {
  static const FlagTable<DataConfig>* const table = [] {
    auto* t = new FlagTable<DataConfig>;
    t->String("dataset_type", &DataConfig::type,
              "synthetic: a seeded mixture of Markov sources with an exact loss floor; text: "
              "the bytes of dataset_path; tokens: the token file of dataset_path (python -m "
              "fp8moe.data encode), its documents packed into max_target_length windows.",
              {"synthetic", "text", "tokens"});
    t->String("dataset_path", &DataConfig::path,
              "The text file of dataset_type=text or the token file of dataset_type=tokens.");
    t->Int("data_shuffle_seed", &DataConfig::seed,
           "Seed of the synthetic corpus and of the order of text windows and token windows.",
           {.min = 0});
    t->Int("synthetic_num_sources", &DataConfig::num_sources,
           "Synthetic: Markov sources in the mixture; each sequence starts with its source's "
           "marker token.");
    t->Int("synthetic_alphabet_size", &DataConfig::alphabet_size,
           "Synthetic: symbols shared by the sources (tokens after the markers).");
    t->Int("synthetic_branching", &DataConfig::branching,
           "Synthetic: random successors drawn for each symbol of each source.");
    t->Float("eval_split_fraction", &DataConfig::eval_fraction,
             "Text: the last fraction of the file kept for evaluation; tokens: the last "
             "fraction of the documents (rounded up).",
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
  if (c.type == "tokens") return OpenTokensDataset(c);
  if (c.type != "text") {
    return InvalidArgument("dataset_type='" + c.type + "' is not supported; set "
                           "dataset_type=synthetic, text or tokens");
  }
  if (c.path.empty()) {
    return InvalidArgument("dataset_type=text needs dataset_path=FILE (any UTF-8 text file)");
  }
  if (c.vocab_size < 256) {
    return InvalidArgument("dataset_type=text reads bytes (tokens 0..255) but vocab_size=" +
                           std::to_string(c.vocab_size) + "; set vocab_size=256");
  }
  FP8MOE_RETURN_IF_ERROR(CheckEvalFraction(c.eval_fraction));
  FP8MOE_ASSIGN_OR_RETURN(const uint64_t size, RegularFileSize(c.path, "a text file"));
  FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest("dataset_path '" + c.path + "'", size));
  FP8MOE_ASSIGN_OR_RETURN(std::string bytes, ReadFile(c.path, size, "a text file"));
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
    return InvalidArgument(
        "dataset_path '" + c.path + "' has " + std::to_string(n) +
        " bytes, shorter than one sequence per split: with max_target_length=" +
        std::to_string(c.seq_len) + " and eval_split_fraction=" + Shortest(c.eval_fraction) + " it needs at least " +
        std::to_string(least) + " bytes; use a longer file or a smaller max_target_length");
  }
  return std::unique_ptr<Dataset>(new TextDataset(c, std::move(bytes), train));
}

}  // namespace fp8moe
