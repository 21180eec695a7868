// Training data for the model: token batches of inputs [B, S] and targets
// [B, S] (the inputs shifted by one), a train/eval split, and a position that
// a checkpoint saves so a resumed run reads the same batches.
//
//  synthetic  a corpus generated from the seed: a mixture of M small Markov
//             sources over an alphabet of A symbols. Each sequence picks a
//             source uniformly and starts with that source's marker token
//             (tokens 0..M-1; symbols are M..M+A-1), then its first symbol is
//             drawn from the source's initial distribution and every further
//             symbol from the source's transition row of the previous one.
//             The source is therefore known from the first token, and the
//             Bayes-optimal next-token loss is the source's conditional
//             entropy, computed exactly (EntropyFloor).
//  text       the bytes of a file as tokens (vocab_size >= 256); the last
//             eval_split_fraction of the file is the eval split; training
//             windows start at random offsets of the train split.
//  tokens     the token file of `python -m fp8moe.data encode` (docs/train.md,
//             Data: header, document offsets, ids; every document ends with
//             EOS). The last ceil(eval_split_fraction x documents) documents
//             are the eval split. Each split's token stream is cut into
//             windows of S + 1 tokens that overlap by one (inputs the first
//             S, targets the last S); training draws the windows in a new
//             seeded order each epoch. Documents are packed back to back,
//             separated only by EOS: no segment ids or attention mask.
#ifndef FP8MOE_DATA_H_
#define FP8MOE_DATA_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/flag_table.h"
#include "fp8moe/status.h"

namespace fp8moe {

// The initializers of the fields a flag sets are the flags' defaults
// (DataConfigFlags reads them). seq_len, batch and vocab_size have no flag of
// their own: the trainer copies them from the model and the global batch.
struct DataConfig {
  std::string type = "synthetic";  // dataset_type: synthetic, text or tokens
  std::string path;                // dataset_path (text, tokens)
  int64_t seq_len = 64;            // S (max_target_length)
  int64_t batch = 16;              // B: sequences of one NextTrainBatch
  int64_t vocab_size = 256;
  uint64_t seed = 0;               // data_shuffle_seed
  int64_t num_sources = 4;         // synthetic_num_sources (M)
  int64_t alphabet_size = 32;      // synthetic_alphabet_size (A)
  int64_t branching = 4;           // synthetic_branching: successors per symbol
  double eval_fraction = 0.1;      // eval_split_fraction (text, tokens)
};

// The flags of the data (dataset_type, dataset_path, data_shuffle_seed, the
// synthetic_* shape, eval_split_fraction) bound to DataConfig's fields; the
// trainer nests it in its table.
const FlagTable<DataConfig>& DataConfigFlags();

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The next training batch; inputs and targets I32 [B, S].
  virtual void NextTrainBatch(int32_t* inputs, int32_t* targets) = 0;
  // Eval batch `index` (the same batch for the same index, always).
  virtual void EvalBatch(int64_t index, int32_t* inputs, int32_t* targets) = 0;
  // The exact expected loss of the Bayes-optimal predictor (synthetic only).
  virtual std::optional<double> EntropyFloor() const = 0;
  // Where the training stream stands, for checkpoints.
  virtual std::vector<uint64_t> Position() const = 0;
  virtual Status SetPosition(const std::vector<uint64_t>& position) = 0;
  // One line for logs: "synthetic: 4 Markov sources x 32 symbols" ...
  virtual std::string Describe() const = 0;
};

// Opens the dataset; every problem (unknown type, unreadable file, a file
// shorter than one sequence per split, a vocabulary too small for the
// tokens, a damaged token file) is an InvalidArgument / NotFound naming the
// flag, the file, the numbers and the fix. A token file is checked whole
// (header, size, offsets, every id) before it is used.
Result<std::unique_ptr<Dataset>> OpenDataset(const DataConfig& config);

}  // namespace fp8moe

#endif  // FP8MOE_DATA_H_
