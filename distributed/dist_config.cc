// The configuration check every rank runs before any work.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "base/number_text.h"
#include "fp8moe/dist.h"

namespace fp8moe {
namespace {

// "rank 3" or "ranks 0, 2, 5".
std::string RankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// Which flag differs, after the fingerprints did (a collective: every rank
// calls it). A rank whose flags did not parse takes part with its error as
// its text; it is named, and it shows its own error. Otherwise the first
// "key: value" line whose hash is not the same on every rank is named, with
// this rank's value. "" when the texts cannot be compared line by line.
Result<std::string> WhatDiffers(Communicator& comm, std::string_view text) {
  const bool valid = !text.starts_with(kInvalidConfigText);
  std::vector<std::string_view> lines;
  for (size_t at = 0; valid && at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    if (!line.empty() && line[0] != '#') lines.push_back(line);
    at = end + 1;
  }
  const uint64_t head[2] = {valid ? 1u : 0u, lines.size()};
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<uint64_t> heads(2 * n);
  FP8MOE_RETURN_IF_ERROR(comm.AllGather(head, heads.data(), 2, DType::kU64));
  std::vector<int> invalid;
  for (size_t r = 0; r < n; ++r) {
    if (heads[2 * r] == 0) invalid.push_back(static_cast<int>(r));
  }
  if (!valid) {
    return "; this rank's flags are invalid: " +
           std::string(text.substr(kInvalidConfigText.size()));
  }
  if (!invalid.empty()) {
    return "; " + RankList(invalid) + (invalid.size() == 1 ? " has" : " have") +
           " flags that are invalid (see " + (invalid.size() == 1 ? "its" : "their") +
           " message)";
  }
  for (size_t r = 1; r < n; ++r) {
    if (heads[2 * r + 1] != heads[1]) return std::string();
  }
  std::vector<uint64_t> mine(lines.size()), all(lines.size() * n);
  for (size_t i = 0; i < lines.size(); ++i) mine[i] = ConfigFingerprint(lines[i]);
  FP8MOE_RETURN_IF_ERROR(comm.AllGather(mine.data(), all.data(),
                                        static_cast<int64_t>(lines.size()), DType::kU64));
  for (size_t i = 0; i < lines.size(); ++i) {
    for (size_t r = 1; r < n; ++r) {
      if (all[r * lines.size() + i] != all[i]) {
        const std::string_view line = lines[i];
        return "; the first flag that differs is '" + std::string(line.substr(0, line.find(':'))) +
               "' (this rank: " + std::string(line) + ")";
      }
    }
  }
  return std::string();
}

}  // namespace

uint64_t ConfigFingerprint(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

Result<ParallelLayout> CheckDistributedConfig(Communicator& comm,
                                              std::string_view canonical_text,
                                              int64_t ici_fsdp_parallelism,
                                              int64_t ici_expert_parallelism) {
  // 1. The same configuration everywhere. Every rank sees every fingerprint,
  //    so every rank reports the same error.
  const uint64_t mine = ConfigFingerprint(canonical_text);
  std::vector<uint64_t> all(static_cast<size_t>(comm.size()));
  FP8MOE_RETURN_IF_ERROR(comm.AllGather(&mine, all.data(), 1, DType::kU64));
  std::map<uint64_t, std::vector<int>> groups;
  for (int r = 0; r < comm.size(); ++r) groups[all[static_cast<size_t>(r)]].push_back(r);
  if (groups.size() > 1) {
    std::vector<std::pair<std::vector<int>, uint64_t>> ordered;  // by first rank
    for (const auto& [h, ranks] : groups) ordered.emplace_back(ranks, h);
    std::sort(ordered.begin(), ordered.end());
    std::string msg = "the configuration differs across ranks:";
    for (size_t i = 0; i < ordered.size(); ++i) {
      msg += (i == 0 ? " " : "; ") + RankList(ordered[i].first) + " " +
             (ordered[i].first.size() == 1 ? "has" : "have") + " config fingerprint " +
             internal::Hex64(ordered[i].second);
    }
    FP8MOE_ASSIGN_OR_RETURN(const std::string detail, WhatDiffers(comm, canonical_text));
    msg += detail + ". Start every rank with the same config file and key=value overrides.";
    return FailedPrecondition(msg);
  }

  // 2. The mesh covers the ranks exactly (MaxText's names; -1 = the rest).
  const int64_t n = comm.size();
  int64_t fsdp = ici_fsdp_parallelism, expert = ici_expert_parallelism;
  for (const auto& [name, v] : {std::pair{"ici_fsdp_parallelism", fsdp},
                                std::pair{"ici_expert_parallelism", expert}}) {
    if (v < 1 && v != -1) {
      return InvalidArgument(std::string(name) + "=" + std::to_string(v) +
                             " is invalid: use a positive number of ranks, or -1 for the "
                             "ranks the other axis leaves");
    }
  }
  if (fsdp == -1 && expert == -1) {
    return InvalidArgument(
        "ici_fsdp_parallelism=-1 and ici_expert_parallelism=-1: at most one axis may be -1");
  }
  auto fill = [&](int64_t other, const char* other_name, const char* name) -> Result<int64_t> {
    if (n % other != 0) {
      return InvalidArgument(std::string(name) + "=-1 needs " + other_name + "=" +
                             std::to_string(other) + " to divide the " + std::to_string(n) +
                             (n == 1 ? " rank" : " ranks") + " of the job (mpirun -np)");
    }
    return n / other;
  };
  if (fsdp == -1) {
    FP8MOE_ASSIGN_OR_RETURN(fsdp, fill(expert, "ici_expert_parallelism", "ici_fsdp_parallelism"));
  }
  if (expert == -1) {
    FP8MOE_ASSIGN_OR_RETURN(expert, fill(fsdp, "ici_fsdp_parallelism", "ici_expert_parallelism"));
  }
  // Both are >= 1 here; a factor above n cannot multiply to n (and the
  // product might overflow), so test that first.
  if (fsdp > n || expert > n || fsdp * expert != n) {
    // The product itself unless it would overflow (each factor is below
    // 2^63 and the job has at most 2^31 ranks).
    const bool fits = fsdp <= (int64_t{1} << 31) && expert <= (int64_t{1} << 31);
    const std::string product =
        fits ? std::to_string(fsdp * expert) : "more than " + std::to_string(n);
    return InvalidArgument("ici_fsdp_parallelism=" + std::to_string(fsdp) +
                           " * ici_expert_parallelism=" + std::to_string(expert) + " = " +
                           product + ", but the job has " +
                           std::to_string(n) + " rank" + (n == 1 ? "" : "s") +
                           ": set them so the product is " + std::to_string(n) +
                           " (mpirun -np sets the number of ranks)");
  }
  ParallelLayout layout;
  layout.fsdp = static_cast<int>(fsdp);
  layout.expert = static_cast<int>(expert);
  layout.expert_index = comm.rank() % layout.expert;
  layout.fsdp_index = comm.rank() / layout.expert;
  return layout;
}

}  // namespace fp8moe
