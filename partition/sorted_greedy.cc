#include "partition/sorted_greedy.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::partition {

int64_t ParamPartition::max_numel() const {
  return numel_per_rank.empty() ? 0
                                : *std::max_element(numel_per_rank.begin(), numel_per_rank.end());
}

int64_t ParamPartition::total_numel() const {
  return std::accumulate(numel_per_rank.begin(), numel_per_rank.end(), int64_t{0});
}

namespace {

absl::Status check_sizes(const std::vector<std::vector<int64_t>>& group_numels, int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be at least 1, got ", world_size));
  }
  int64_t index = 0;
  for (size_t g = 0; g < group_numels.size(); ++g) {
    for (int64_t numel : group_numels[g]) {
      if (numel < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", index, " (group ", g, ") has negative size ", numel));
      }
      ++index;
    }
  }
  return absl::OkStatus();
}

ParamPartition empty_partition(const std::vector<std::vector<int64_t>>& group_numels,
                               int world_size) {
  ParamPartition p;
  p.world_size = world_size;
  p.params_per_rank.assign(world_size, std::vector<std::vector<int64_t>>(group_numels.size()));
  size_t total = 0;
  for (const auto& g : group_numels) total += g.size();
  p.owner.assign(total, -1);
  p.numel_per_rank.assign(world_size, 0);
  return p;
}

}  // namespace

absl::StatusOr<ParamPartition> sorted_greedy_partition(
    const std::vector<std::vector<int64_t>>& group_numels, int world_size) {
  if (absl::Status s = check_sizes(group_numels, world_size); !s.ok()) return s;
  ParamPartition p = empty_partition(group_numels, world_size);

  // Min-heap on (elements so far, rank): the top is exactly PyTorch's _get_min_index (the first
  // minimum of a linear scan), found in O(log W) instead of O(W).
  using Load = std::pair<int64_t, int>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
  for (int r = 0; r < world_size; ++r) loads.emplace(0, r);

  int64_t first = 0;
  std::vector<int64_t> order;
  for (size_t g = 0; g < group_numels.size(); ++g) {
    const std::vector<int64_t>& numels = group_numels[g];
    order.resize(numels.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    // Python's sorted(..., reverse=True) is stable: equal sizes keep registration order.
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return numels[a] > numels[b]; });
    for (int64_t local : order) {
      auto [load, rank] = loads.top();
      loads.pop();
      const int64_t global = first + local;
      p.params_per_rank[rank][g].push_back(global);
      p.owner[global] = rank;
      loads.emplace(load + numels[local], rank);
    }
    first += static_cast<int64_t>(numels.size());
  }
  while (!loads.empty()) {
    p.numel_per_rank[loads.top().second] = loads.top().first;
    loads.pop();
  }
  return p;
}

absl::StatusOr<ParamPartition> manual_partition(
    const std::vector<std::vector<int64_t>>& group_numels,
    const std::vector<std::vector<int64_t>>& params_per_rank, int world_size) {
  if (absl::Status s = check_sizes(group_numels, world_size); !s.ok()) return s;
  if (group_numels.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Specifying `params_per_rank` only supports a single parameter group, got ",
        group_numels.size(), " groups; pass all parameters in one group or let ZeRO partition"));
  }
  if (static_cast<int64_t>(params_per_rank.size()) != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("`params_per_rank` must have length equal to the world size (", world_size,
                     "), got ", params_per_rank.size()));
  }
  const std::vector<int64_t>& numels = group_numels[0];
  const int64_t num_params = static_cast<int64_t>(numels.size());
  ParamPartition p = empty_partition(group_numels, world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    for (int64_t index : params_per_rank[rank]) {
      if (index < 0 || index >= num_params) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Passing a new parameter in `params_per_rank` that was not passed into the "
            "ZeroRedundancyOptimizer constructor: rank ",
            rank, " lists parameter ", index, " but there are ", num_params, " parameters"));
      }
      if (p.owner[index] != -1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "`params_per_rank` gives parameter ", index, " to rank ", p.owner[index],
            " and again to rank ", rank, "; each parameter must have at most one owner"));
      }
      p.owner[index] = rank;
      p.params_per_rank[rank][0].push_back(index);
      p.numel_per_rank[rank] += numels[index];
    }
  }
  return p;
}

}  // namespace dtrain::partition
