// FSDP state of one rank (train/fsdp.h).
#include "train/fsdp.h"

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
                                                     const ModelParams& like) {
  std::unique_ptr<FsdpState> s(new FsdpState(comm));
  for (const auto& [name, t] : like.Named()) {
    const int64_t total = static_cast<int64_t>(t->num_elements());
    const ShardRange r = GetShardRange(total, comm.size(), comm.rank());
    s->names_.push_back(name);
    s->totals_.push_back(total);
    s->ranges_.push_back(r);
    s->decay_.push_back(t->rank() >= 2);
    const bool expert = name.size() > 3 && (name.ends_with(".wi") || name.ends_with(".wo")) &&
                        name.starts_with("layers.");
    s->expert_.push_back(expert);
    for (auto* set : {&s->master_, &s->m_, &s->v_, &s->g_}) {
      FP8MOE_ASSIGN_OR_RETURN(Tensor shard, Tensor::Create(DType::kF32, {r.size()}));
      set->push_back(std::move(shard));
    }
  }
  return s;
}

void FsdpState::Slice(const ModelParams& params, const ModelParams& m, const ModelParams& v) {
  const auto p = params.Named(), ms = m.Named(), vs = v.Named();
  for (size_t k = 0; k < names_.size(); ++k) {
    const size_t off = static_cast<size_t>(ranges_[k].begin) * sizeof(float);
    const size_t bytes = static_cast<size_t>(ranges_[k].size()) * sizeof(float);
    std::memcpy(master_[k].data(), static_cast<const uint8_t*>(p[k].second->data()) + off, bytes);
    std::memcpy(m_[k].data(), static_cast<const uint8_t*>(ms[k].second->data()) + off, bytes);
    std::memcpy(v_[k].data(), static_cast<const uint8_t*>(vs[k].second->data()) + off, bytes);
  }
}

Status FsdpState::GatherParams(ModelParams* params, bool skip_experts) {
  const auto p = params->Named();
  for (size_t k = 0; k < names_.size(); ++k) {
    if (skip_experts && expert_[k]) continue;
    FP8MOE_RETURN_IF_ERROR(
        comm_.AllGatherShards(master_[k].data(), p[k].second->data(), totals_[k], DType::kF32));
  }
  return OkStatus();
}

Status FsdpState::GatherAll(ModelParams* params, ModelParams* m, ModelParams* v) {
  FP8MOE_RETURN_IF_ERROR(GatherParams(params, /*skip_experts=*/false));
  const auto ms = m->Named(), vs = v->Named();
  for (size_t k = 0; k < names_.size(); ++k) {
    FP8MOE_RETURN_IF_ERROR(
        comm_.AllGatherShards(m_[k].data(), ms[k].second->data(), totals_[k], DType::kF32));
    FP8MOE_RETURN_IF_ERROR(
        comm_.AllGatherShards(v_[k].data(), vs[k].second->data(), totals_[k], DType::kF32));
  }
  return OkStatus();
}

Status FsdpState::ReduceGradients(const ModelParams& grads) {
  const auto g = grads.Named();
  const float inv = 1.0f / static_cast<float>(comm_.size());
  for (size_t k = 0; k < names_.size(); ++k) {
    FP8MOE_RETURN_IF_ERROR(comm_.ReduceScatterShards(g[k].second->data(), g_[k].data(),
                                                     totals_[k], DType::kF32, ReduceOp::kSum));
    if (comm_.size() > 1) {
      float* d = g_[k].data_as<float>();
      for (int64_t i = 0; i < ranges_[k].size(); ++i) d[i] *= inv;
    }
  }
  return OkStatus();
}

Result<std::string> FsdpState::FirstNonFinite() {
  double first = static_cast<double>(names_.size());
  for (size_t k = 0; k < names_.size() && first == static_cast<double>(names_.size()); ++k) {
    const float* d = g_[k].data_as<float>();
    for (int64_t i = 0; i < ranges_[k].size(); ++i) {
      if (!std::isfinite(d[i])) {
        first = static_cast<double>(k);
        break;
      }
    }
  }
  // The smallest index over the ranks (exact in double).
  std::vector<double> all(static_cast<size_t>(comm_.size()));
  FP8MOE_RETURN_IF_ERROR(comm_.AllGather(&first, all.data(), 1, DType::kF64));
  double lowest = static_cast<double>(names_.size());
  for (double a : all) lowest = std::min(lowest, a);
  const size_t k = static_cast<size_t>(lowest);
  return k < names_.size() ? names_[k] : std::string();
}

Result<double> FsdpState::GlobalNorm() {
  double s = 0;
  for (size_t k = 0; k < names_.size(); ++k) {
    const float* d = g_[k].data_as<float>();
    for (int64_t i = 0; i < ranges_[k].size(); ++i) s += static_cast<double>(d[i]) * d[i];
  }
  FP8MOE_ASSIGN_OR_RETURN(std::vector<double> sum, SumOverRanks(comm_, {s}));
  return std::sqrt(sum[0]);
}

void FsdpState::AdamW(Context& ctx, const TrainConfig& config, int64_t t, double lr,
                      double grad_scale) {
  for (size_t k = 0; k < names_.size(); ++k) {
    AdamWSpan(ctx, config, t, lr, grad_scale, decay_[k], g_[k].data_as<float>(),
              master_[k].data_as<float>(), m_[k].data_as<float>(), v_[k].data_as<float>(),
              ranges_[k].size());
  }
}

size_t FsdpState::ExpertIndex(int64_t layer, bool wo) const {
  const std::string want = "layers." + std::to_string(layer) + (wo ? ".wo" : ".wi");
  for (size_t k = 0; k < names_.size(); ++k) {
    if (names_[k] == want) return k;
  }
  return names_.size();
}

Status FsdpState::Quantize(int64_t layer, bool wo, const Shape& shape, QuantDType dtype,
                           const Calibration& calib, uint8_t* codes, float* scale,
                           Fp8Health* health) {
  const size_t k = ExpertIndex(layer, wo);
  if (k == names_.size() || shape.size() != 3 || shape[0] * shape[1] * shape[2] != totals_[k]) {
    return Internal("FSDP has no expert weight of layer " + std::to_string(layer) +
                    " shaped " + ShapeToString(shape));
  }
  const int64_t sent = comm_.bytes_sent();
  FP8MOE_RETURN_IF_ERROR(GatherFp8Weight(comm_, master_[k].data_as<float>(), shape[0], shape[1],
                                         shape[2], dtype, calib, codes, scale, scratch_));
  expert_gather_bytes_ += comm_.bytes_sent() - sent;
  // Health: integer counts of this rank's range, summed over the ranks.
  const Fp8HealthCounts mine = CountFp8Health(codes + ranges_[k].begin,
                                              master_[k].data_as<float>(), ranges_[k].size(),
                                              dtype);
  int64_t counts[2] = {mine.saturated, mine.flushed};
  FP8MOE_RETURN_IF_ERROR(comm_.AllReduce(counts, counts, 2, DType::kI64, ReduceOp::kSum));
  *health = Fp8HealthCounts{counts[0], counts[1], totals_[k]}.Fractions();
  return OkStatus();
}

Status FsdpState::RoundToBf16(int64_t layer, bool wo, const Shape& shape, uint16_t* out) {
  const size_t k = ExpertIndex(layer, wo);
  if (k == names_.size() || shape.size() != 3 || shape[0] * shape[1] * shape[2] != totals_[k]) {
    return Internal("FSDP has no expert weight of layer " + std::to_string(layer) +
                    " shaped " + ShapeToString(shape));
  }
  const int64_t sent = comm_.bytes_sent();
  FP8MOE_RETURN_IF_ERROR(GatherBf16Weight(comm_, master_[k].data_as<float>(), totals_[k], out));
  expert_gather_bytes_ += comm_.bytes_sent() - sent;
  return OkStatus();
}

}  // namespace fp8moe::internal
