// FSDP state of one rank (train/fsdp.h).
#include "train/fsdp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "train/optimizer.h"

namespace fp8moe::internal {

Result<std::vector<double>> SumOverRanks(Communicator& comm, const std::vector<double>& local) {
  const size_t n = local.size();
  std::vector<double> all(n * static_cast<size_t>(comm.size()));
  FP8MOE_RETURN_IF_ERROR(
      comm.AllGather(local.data(), all.data(), static_cast<int64_t>(n), DType::kF64));
  std::vector<double> sum(n, 0.0);
  for (int r = 0; r < comm.size(); ++r) {
    for (size_t i = 0; i < n; ++i) sum[i] += all[static_cast<size_t>(r) * n + i];
  }
  return sum;
}

Result<std::unique_ptr<FsdpState>> FsdpState::Create(Communicator& comm,
                                                     const ParamShapeList& shapes,
                                                     Communicator* expert_group,
                                                     Communicator* ring) {
  if (ring != nullptr && ring->size() <= 1) ring = nullptr;
  if (ring != nullptr) {
    // The expert units hold this ring rank's experts: they may only be
    // gathered and reduced over the ranks holding the same experts, which
    // the job alone is not (its ranks hold other experts).
    if (expert_group == nullptr ||
        int64_t{expert_group->size()} * ring->size() != comm.size()) {
      return Internal("FsdpState: an expert ring of " + std::to_string(ring->size()) +
                      " ranks needs the expert FSDP group of the ranks holding the same "
                      "experts (size x ring size = the job's " +
                      std::to_string(comm.size()) + " ranks)");
    }
  }
  if (expert_group == nullptr) expert_group = &comm;
  if (ring == nullptr && expert_group != &comm) {
    return Internal("FsdpState: an expert group other than the job needs an expert ring");
  }
  const int64_t P = ring != nullptr ? ring->size() : 1, ring_rank = ring != nullptr ? ring->rank() : 0;
  std::unique_ptr<FsdpState> s(new FsdpState(comm, *expert_group, ring));
  s->units_.emplace_back();  // unit 0: the dense tensors
  s->parts_.resize(shapes.size());
  size_t state_unit = 0;  // 0: none yet
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto& [name, shape] = shapes[k];
    const auto elements = static_cast<int64_t>(NumElements(shape));
    s->names_.push_back(name);
    s->decay_.push_back(shape.size() >= 2);
    const bool expert =
        name.starts_with("layers.") && (name.ends_with(".wi") || name.ends_with(".wo"));
    const bool state = IsModelState(name);
    if (expert || (state && state_unit == 0)) s->units_.emplace_back();
    if (state && state_unit == 0) state_unit = s->units_.size() - 1;
    const size_t unit = expert ? s->units_.size() - 1 : (state ? state_unit : 0);
    Unit& u = s->units_[unit];
    u.expert = expert;
    u.state = state;
    u.members.push_back(k);
    u.offsets.push_back(u.total);
    s->parts_[k].unit = unit;
    // "layers.<l>.router_bias": the layer whose loads move it.
    if (state) s->parts_[k].layer = std::stoll(name.substr(7, name.find('.', 7) - 7));
    if (expert && P > 1) {
      if (shape[0] % P != 0) {
        return InvalidArgument(name + " has " + std::to_string(shape[0]) +
                               " experts, which do not divide over " + std::to_string(P) +
                               " expert-parallel ranks");
      }
      u.total = elements / P;
      u.first = ring_rank * u.total;
    } else {
      u.total += elements;
    }
  }
  for (Unit& u : s->units_) {
    Communicator& g = s->Group(u);
    u.range = u.state ? ShardRange{0, u.total} : GetShardRange(u.total, g.size(), g.rank());
    for (Tensor* t : {&u.master, &u.m, &u.v, &u.g}) {
      FP8MOE_ASSIGN_OR_RETURN(*t, Tensor::Create(DType::kF32, {u.range.size()}));
      std::memset(t->data(), 0, t->num_bytes());
    }
    if (u.members.size() > 1) {
      FP8MOE_ASSIGN_OR_RETURN(u.staging, Tensor::Create(DType::kF32, {u.total}));
    }
    for (size_t i = 0; i < u.members.size(); ++i) {
      const int64_t lo = u.offsets[i];
      const int64_t hi = lo + static_cast<int64_t>(NumElements(shapes[u.members[i]].second));
      const int64_t b = std::max(lo, u.range.begin), e = std::min(hi, u.range.end);
      Part& p = s->parts_[u.members[i]];
      p.begin = b - lo;
      p.size = std::max<int64_t>(0, e - b);
      p.at = b - u.range.begin;
    }
  }
  return s;
}

int64_t FsdpState::UnitOffset(const Unit& u, const Tensor& t) {
  return static_cast<int64_t>(t.num_elements()) == u.total ? 0 : u.first;
}

const float* FsdpState::Whole(
    Unit& u, const std::vector<std::pair<std::string, const Tensor*>>& tensors) {
  if (u.members.size() == 1) {
    const Tensor& t = *tensors[u.members[0]].second;
    return t.data_as<float>() + UnitOffset(u, t);
  }
  staged_.reset();
  float* flat = u.staging.data_as<float>();
  for (size_t i = 0; i < u.members.size(); ++i) {
    const Tensor& t = *tensors[u.members[i]].second;
    std::memcpy(flat + u.offsets[i], t.data(), t.num_bytes());
  }
  return flat;
}

Status FsdpState::GatherUnit(Unit& u, const Tensor& shard,
                             const std::vector<std::pair<std::string, Tensor*>>& tensors) {
  if (u.state) {  // replicated: every rank holds it whole
    for (size_t i = 0; i < u.members.size(); ++i) {
      Tensor& t = *tensors[u.members[i]].second;
      std::memcpy(t.data(), shard.data_as<float>() + u.offsets[i], t.num_bytes());
    }
    return OkStatus();
  }
  if (u.members.size() == 1) {
    Tensor& t = *tensors[u.members[0]].second;
    return Group(u).AllGatherShards(shard.data(), t.data_as<float>() + UnitOffset(u, t), u.total,
                                    DType::kF32);
  }
  staged_.reset();
  FP8MOE_RETURN_IF_ERROR(
      comm_.AllGatherShards(shard.data(), u.staging.data(), u.total, DType::kF32));
  const float* flat = u.staging.data_as<float>();
  for (size_t i = 0; i < u.members.size(); ++i) {
    Tensor& t = *tensors[u.members[i]].second;
    std::memcpy(t.data(), flat + u.offsets[i], t.num_bytes());
  }
  return OkStatus();
}

Tensor& FsdpState::ShardOf(Unit& u, CheckpointSet set) {
  switch (set) {
    case CheckpointSet::kAdamM:
      return u.m;
    case CheckpointSet::kAdamV:
      return u.v;
    case CheckpointSet::kParams:
      break;
  }
  return u.master;
}

void FsdpState::LoadTensor(const CheckpointTensor& t, const float* whole) {
  staged_.reset();
  const Part& p = parts_[t.index];
  Unit& u = units_[p.unit];
  std::memcpy(ShardOf(u, t.set).data_as<float>() + p.at, whole + u.first + p.begin,
              static_cast<size_t>(p.size) * sizeof(float));
}

Status FsdpState::GatherParams(ModelParams* params, bool skip_experts) {
  const auto p = params->Named();
  for (Unit& u : units_) {
    if (skip_experts && u.expert) continue;
    FP8MOE_RETURN_IF_ERROR(GatherUnit(u, u.master, p));
  }
  return OkStatus();
}

Status FsdpState::GatherTensor(const CheckpointTensor& t, float* out) {
  Unit& u = units_[parts_[t.index].unit];
  const Tensor& shard = ShardOf(u, t.set);
  if (u.state) {  // replicated: this rank's copy is the whole
    std::memcpy(out, shard.data_as<float>() + parts_[t.index].at, t.num_elements() * sizeof(float));
    return OkStatus();
  }
  if (u.members.size() == 1) {
    // An expert tensor: this ring rank's rows over the expert group, then
    // the other ring ranks' rows around the ring (in place).
    FP8MOE_RETURN_IF_ERROR(
        Group(u).AllGatherShards(shard.data(), out + u.first, u.total, DType::kF32));
    if (u.expert && ring_ != nullptr) {
      FP8MOE_RETURN_IF_ERROR(ring_->AllGather(out + u.first, out, u.total, DType::kF32));
    }
    return OkStatus();
  }
  if (staged_ != t.set) {
    FP8MOE_RETURN_IF_ERROR(
        comm_.AllGatherShards(shard.data(), u.staging.data(), u.total, DType::kF32));
    staged_ = t.set;
  }
  const size_t i = static_cast<size_t>(
      std::find(u.members.begin(), u.members.end(), t.index) - u.members.begin());
  std::memcpy(out, u.staging.data_as<float>() + u.offsets[i], t.num_elements() * sizeof(float));
  return OkStatus();
}

Status FsdpState::ReduceGradients(const ModelParams& grads) {
  const auto g = grads.Named();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  for (Unit& u : units_) {
    if (u.state) continue;  // no gradient: the model never writes one
    FP8MOE_RETURN_IF_ERROR(Group(u).ReduceScatterShards(Whole(u, g), u.g.data(), u.total,
                                                        DType::kF32, ReduceOp::kSum));
    if (comm_.size() > 1) {
      float* d = u.g.data_as<float>();
      for (int64_t i = 0; i < u.range.size(); ++i) d[i] *= inv;
    }
  }
  return OkStatus();
}

Result<FsdpState::NonFiniteScan> FsdpState::ScanOverRanks(Tensor Unit::*field,
                                                           bool sum_squares) {
  // In Named() order, element by element: on one rank the bits of the
  // single-process loop.
  const double none = static_cast<double>(names_.size());
  double first = none, sum = 0;
  for (size_t k = 0; k < names_.size() && (sum_squares || first == none); ++k) {
    const Part& p = parts_[k];
    if (field == &Unit::g && units_[p.unit].state) continue;  // state has no gradient
    const float* d = (units_[p.unit].*field).data_as<float>() + p.at;
    for (int64_t i = 0; i < p.size; ++i) {
      if (!std::isfinite(d[i]) && first == none) {
        first = static_cast<double>(k);
        if (!sum_squares) break;
      }
      if (sum_squares) sum += static_cast<double>(d[i]) * d[i];
    }
  }
  const double mine[2] = {first, sum};
  std::vector<double> all(2 * static_cast<size_t>(comm_.size()));
  FP8MOE_RETURN_IF_ERROR(comm_.AllGather(mine, all.data(), 2, DType::kF64));
  double lowest = none;
  NonFiniteScan scan;
  for (int r = 0; r < comm_.size(); ++r) {  // rank order: the same bits everywhere
    lowest = std::min(lowest, all[2 * static_cast<size_t>(r)]);
    scan.sum_of_squares += all[2 * static_cast<size_t>(r) + 1];
  }
  const size_t k = static_cast<size_t>(lowest);
  if (k < names_.size()) scan.first_nonfinite = names_[k];
  return scan;
}

Result<FsdpState::GradientCheck> FsdpState::CheckGradients() {
  FP8MOE_ASSIGN_OR_RETURN(const NonFiniteScan scan,
                          ScanOverRanks(&Unit::g, /*sum_squares=*/true));
  GradientCheck c;
  c.first_nonfinite = scan.first_nonfinite;
  c.norm = std::sqrt(scan.sum_of_squares);
  return c;
}

Result<std::string> FsdpState::FirstNonFiniteMaster() {
  FP8MOE_ASSIGN_OR_RETURN(const NonFiniteScan scan,
                          ScanOverRanks(&Unit::master, /*sum_squares=*/false));
  return scan.first_nonfinite;
}

Status FsdpState::AdamW(Context& ctx, const TrainConfig& config, int64_t t, double lr,
                        double grad_scale) {
  staged_.reset();
  for (size_t k = 0; k < names_.size(); ++k) {
    const Part& p = parts_[k];
    Unit& u = units_[p.unit];
    if (u.state) continue;  // moved by UpdateRoutedBias alone
    FP8MOE_RETURN_IF_ERROR(AdamWSpan(ctx, config, t, lr, grad_scale, decay_[k],
                                     u.g.data_as<float>() + p.at,
                                     u.master.data_as<float>() + p.at,
                                     u.m.data_as<float>() + p.at, u.v.data_as<float>() + p.at,
                                     p.size));
  }
  return OkStatus();
}

Status FsdpState::UpdateRoutedBias(const std::vector<std::vector<int32_t>>& load, double rate) {
  for (size_t k = 0; k < names_.size(); ++k) {
    const Part& p = parts_[k];
    Unit& u = units_[p.unit];
    if (!u.state) continue;
    const auto l = static_cast<size_t>(p.layer);
    if (l >= load.size() || static_cast<int64_t>(load[l].size()) != p.size) {
      return Internal("UpdateRoutedBias: no load of " + std::to_string(p.size) +
                      " experts for " + names_[k]);
    }
    fp8moe::UpdateRoutedBias(load[l].data(), p.size, rate, u.master.data_as<float>() + p.at);
  }
  return OkStatus();
}

std::vector<std::vector<float>> FsdpState::RouterBias(int64_t layers) const {
  std::vector<std::vector<float>> out(static_cast<size_t>(std::max<int64_t>(layers, 0)));
  for (const Part& p : parts_) {
    if (!units_[p.unit].state || p.layer < 0 || p.layer >= layers) continue;
    const float* d = units_[p.unit].master.data_as<float>() + p.at;
    out[static_cast<size_t>(p.layer)].assign(d, d + p.size);
  }
  return out;
}

size_t FsdpState::ExpertUnit(int64_t layer, bool wo, const Shape& shape, Status* error) const {
  const std::string want = "layers." + std::to_string(layer) + (wo ? ".wo" : ".wi");
  for (size_t k = 0; k < names_.size(); ++k) {
    if (names_[k] != want) continue;
    const Unit& u = units_[parts_[k].unit];
    if (u.expert && shape.size() == 3 && shape[0] * shape[1] * shape[2] == u.total) {
      return parts_[k].unit;
    }
  }
  *error = Internal("FSDP has no expert weight " + want + " shaped " + ShapeToString(shape));
  return units_.size();
}

Status FsdpState::Quantize(Context& ctx, int64_t layer, bool wo, const Shape& shape,
                           QuantDType dtype, const Calibration& calib, uint8_t* codes,
                           float* scale, Fp8Health* health) {
  Status error;
  const size_t k = ExpertUnit(layer, wo, shape, &error);
  if (k == units_.size()) return error;
  Unit& u = units_[k];
  const int64_t sent = ecomm_.bytes_sent();
  FP8MOE_RETURN_IF_ERROR(GatherFp8Weight(ecomm_, u.master.data_as<float>(), shape[0], shape[1],
                                         shape[2], dtype, calib, codes, scale, scratch_));
  expert_gather_bytes_ += ecomm_.bytes_sent() - sent;
  *health = {};
  if (count_health_) {
    // Integer counts of this rank's range, summed over every rank of the
    // job: the expert group's ranges tile this ring rank's experts and the
    // ring ranks hold the others, so the counts cover the whole tensor.
    FP8MOE_ASSIGN_OR_RETURN(const Fp8HealthCounts mine,
                            CountFp8Health(ctx, codes + u.range.begin, u.master.data_as<float>(),
                                           u.range.size(), dtype));
    int64_t counts[2] = {mine.saturated, mine.flushed};
    FP8MOE_RETURN_IF_ERROR(comm_.AllReduce(counts, counts, 2, DType::kI64, ReduceOp::kSum));
    const int64_t ring_size = ring_ != nullptr ? ring_->size() : 1;
    *health = Fp8HealthCounts{counts[0], counts[1], u.total * ring_size}.Fractions();
  }
  return OkStatus();
}

Status FsdpState::RoundToBf16(int64_t layer, bool wo, const Shape& shape, uint16_t* out) {
  Status error;
  const size_t k = ExpertUnit(layer, wo, shape, &error);
  if (k == units_.size()) return error;
  Unit& u = units_[k];
  const int64_t sent = ecomm_.bytes_sent();
  FP8MOE_RETURN_IF_ERROR(GatherBf16Weight(ecomm_, u.master.data_as<float>(), u.total, out));
  expert_gather_bytes_ += ecomm_.bytes_sent() - sent;
  return OkStatus();
}

}  // namespace fp8moe::internal
