// FSDP state of one rank (internal to train/; docs/distributed.md): every
// parameter's f32 master and AdamW moments sharded flat over the FSDP group by
// GetShardRange (ZeRO-3's flat layout: AdamW is elementwise, so each rank
// updates only its range), the weights gathered whole once per step, the
// gradients reduce-scattered. On one rank every shard is the whole tensor and
// every collective a copy, so the single-rank trainer runs this same code and
// its bits are those of the plain loop.
#ifndef FP8MOE_TRAIN_FSDP_H_
#define FP8MOE_TRAIN_FSDP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/context.h"
#include "fp8moe/dist.h"
#include "fp8moe/model.h"
#include "fp8moe/moe.h"
#include "fp8moe/train.h"
#include "train/checkpoint.h"

namespace fp8moe::internal {

// Every parameter's name and shape, in Named() order (ParamShapes).
using ParamShapeList = std::vector<std::pair<std::string, Shape>>;

// Sums of per-rank values, the same bits on every rank: all-gathered, then
// added in rank order in double (the ring's reductions have no f64).
Result<std::vector<double>> SumOverRanks(Communicator& comm, const std::vector<double>& local);

// The layout: the dense tensors (embedding, attention, router, norms, LM
// head) are one flat vector, sharded as a whole, so a step gathers them and
// reduce-scatters their gradients in one collective each instead of one per
// tensor (every collective is a point where all ranks wait for the slowest;
// the small model's step went from ~55 collectives to ~18). Each expert
// weight is sharded on its own, the flat layout GatherFp8Weight expects.
class FsdpState : public ExpertWeightSource {
 public:
  // Shards of the tensors of `shapes` (ParamShapes: every expert) over
  // `comm` (every rank of the job), masters and moments zero.
  // With expert parallelism (P > 1 ranks in `ring`, the expert ring of this
  // rank) each expert tensor's unit is only this ring rank's rows
  // [r E/P, (r+1) E/P), sharded over `expert_group` (the F ranks that hold
  // the same experts); the dense unit stays sharded over all of `comm`.
  // Without a ring expert_group must be null or `comm`.
  static Result<std::unique_ptr<FsdpState>> Create(Communicator& comm,
                                                   const ParamShapeList& shapes,
                                                   Communicator* expert_group = nullptr,
                                                   Communicator* ring = nullptr);

  // Keeps this rank's range of a checkpoint's tensor t (`whole`: all of it,
  // whatever rank count wrote it: resharding is slicing), or of an initial
  // weight (InitParams' sink). Local.
  void LoadTensor(const CheckpointTensor& t, const float* whole);

  // The f32 masters gathered whole into *params; with skip_experts the
  // expert weights wi / wo are left out (their codes or bf16 copies come
  // through this ExpertWeightSource instead). An expert tensor may hold all
  // E experts or only this ring rank's E/P (AllocateParams); likewise the
  // gradients of ReduceGradients.
  Status GatherParams(ModelParams* params, bool skip_experts);
  // Checkpoint tensor t (a master or a moment) gathered whole into `out`,
  // the other ring ranks' expert rows included. Collective: every rank
  // asks for the same tensors in the same order (SaveCheckpoint's). The
  // dense tensors of a set come from one gather of the dense unit into the
  // staging buffer, made for the first of them.
  Status GatherTensor(const CheckpointTensor& t, float* out);

  // grads: this rank's whole gradient of its local mean loss (the expert rows
  // of its ring rank: of the ring's tokens). Reduce-scatters (f32 sum, the
  // ring's fixed order) over the unit's group and scales by 1 / (ranks of
  // the job): the gradient of the global mean loss, this rank's range.
  Status ReduceGradients(const ModelParams& grads);
  struct GradientCheck {
    std::string first_nonfinite;  // the first tensor (Named() order) with a
                                  // NaN or an infinity on any rank, or ""
    double norm = 0;              // sqrt of the sum of squares, every rank
  };
  // Collective (one all-gather).
  Result<GradientCheck> CheckGradients();
  Status AdamW(Context& ctx, const TrainConfig& config, int64_t t, double lr, double grad_scale);
  // routed_bias: moves every layer's router_bias (UpdateRoutedBias) by the
  // global batch's loads [L][E]. The state is replicated whole on every rank
  // and the loads are the same bits everywhere, so every rank moves it
  // identically. Local.
  Status UpdateRoutedBias(const std::vector<std::vector<int32_t>>& load, double rate);
  // Every layer's router_bias [E] ([L]; empty for a layer without one: a
  // dense layer, or a model without routed_bias). Local: it is replicated.
  std::vector<std::vector<float>> RouterBias(int64_t layers) const;
  // The first tensor (Named() order) whose master weights hold a NaN or an
  // infinity on any rank, or "". Collective (one all-gather).
  Result<std::string> FirstNonFiniteMaster();

  // Whether Quantize counts the codes' FP8 health (one all-reduce per
  // tensor): the trainer asks only on the steps that log it.
  void set_count_health(bool on) { count_health_ = on; }

  // ExpertWeightSource: gather8 (GatherFp8Weight) and the bf16 gather.
  Status Quantize(Context& ctx, int64_t layer, bool wo, const Shape& shape, QuantDType dtype,
                  const Calibration& calib, uint8_t* codes, float* scale,
                  Fp8Health* health) override;
  Status RoundToBf16(int64_t layer, bool wo, const Shape& shape, uint16_t* out) override;

  // Bytes this rank sent for the expert weights' gathers (codes and amax
  // all-reduce, or bf16) since it was created.
  int64_t expert_gather_bytes() const { return expert_gather_bytes_; }

 private:
  // A sharded unit: one expert tensor, or every dense tensor back to back;
  // or the state (IsModelState: every router_bias back to back), replicated
  // whole on every rank, never reduced, normed or updated by AdamW.
  struct Unit {
    std::vector<size_t> members;   // tensor indices (Named() order)
    std::vector<int64_t> offsets;  // each member's place in the unit
    int64_t total = 0;
    int64_t first = 0;  // the unit's first element in its tensor (expert rows)
    ShardRange range;
    bool expert = false;
    bool state = false;
    Tensor master, m, v, g;  // F32 [range.size()]
    Tensor staging;          // F32 [total] (units of several tensors)
  };
  // Tensor k's part of its unit's shard: elements [begin, begin + size) of
  // the tensor, at `at` in the unit's shard arrays.
  struct Part {
    size_t unit = 0;
    int64_t begin = 0, size = 0, at = 0;
    int64_t layer = -1;  // state: the layer of "layers.<l>.router_bias"
  };

  explicit FsdpState(Communicator& comm, Communicator& expert_group, Communicator* ring)
      : comm_(comm), ecomm_(expert_group), ring_(ring) {}
  Communicator& Group(const Unit& u) { return u.expert ? ecomm_ : comm_; }
  size_t ExpertUnit(int64_t layer, bool wo, const Shape& shape, Status* error) const;
  // Where unit u starts in its tensor t: an expert tensor holds all E
  // experts (the unit at u.first) or only this ring rank's (at 0).
  static int64_t UnitOffset(const Unit& u, const Tensor& t);
  // The unit's whole data from `tensors` (staged when it has several).
  const float* Whole(Unit& u, const std::vector<std::pair<std::string, const Tensor*>>& tensors);
  // Gathers `shard` of unit u whole into `tensors`.
  Status GatherUnit(Unit& u, const Tensor& shard,
                    const std::vector<std::pair<std::string, Tensor*>>& tensors);
  struct NonFiniteScan {
    std::string first_nonfinite;  // as in GradientCheck
    double sum_of_squares = 0;    // every rank's, added in rank order
  };
  // Scans this rank's range of `field` (&Unit::g or &Unit::master) in
  // Named() order for the first tensor holding a NaN or an infinity, adding
  // up the squares when `sum_squares` (else it stops at the first), then
  // takes the lowest tensor index and the sum over every rank, in rank order
  // so every rank gets the same bits. Collective (one all-gather).
  Result<NonFiniteScan> ScanOverRanks(Tensor Unit::*field, bool sum_squares);
  // The shard of a checkpoint set: master, m or v.
  static Tensor& ShardOf(Unit& u, CheckpointSet set);

  Communicator& comm_;
  Communicator& ecomm_;
  Communicator* ring_;
  std::vector<std::string> names_;
  std::vector<bool> decay_;  // matrices: weight decay applies
  std::vector<Part> parts_;  // per tensor
  std::vector<Unit> units_;
  DistScratch scratch_;
  // Which set's dense unit the staging buffer holds for GatherTensor; reset
  // by everything else that writes the staging or the shards.
  std::optional<CheckpointSet> staged_;
  int64_t expert_gather_bytes_ = 0;
  bool count_health_ = true;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_TRAIN_FSDP_H_
