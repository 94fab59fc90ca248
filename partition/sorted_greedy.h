// Parameter partitions for ZeroRedundancyOptimizer: PyTorch's sorted-greedy algorithm and
// validated manual partitions. Pure algorithms over parameter sizes: no LibTorch here.
//
//   // Two groups: numels in registration order. Global index = position across the groups.
//   std::vector<std::vector<int64_t>> groups = {{9, 7, 5, 3}, {9, 7, 5, 3}};
//   absl::StatusOr<ParamPartition> p = sorted_greedy_partition(groups, /*world_size=*/2);
//   if (!p.ok()) return p.status();
//   for (int64_t index : p->params_per_rank[rank][/*group=*/0]) { ... }   // largest first
//   int owner = p->owner[5];
//   // p->numel_per_rank == {24, 24}
#ifndef DTRAIN_PARTITION_SORTED_GREEDY_H_
#define DTRAIN_PARTITION_SORTED_GREEDY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::partition {

// Which rank updates which parameter. Parameters are named by global index: their position when
// the groups' parameter lists are concatenated (the indexing of PyTorch's optimizer state_dict).
struct ParamPartition {
  int world_size = 0;
  // params_per_rank[rank][group]: global indices that `rank` owns in `group`, in the order the
  // rank's local optimizer sees them (sorted-greedy: largest first, registration order on ties).
  std::vector<std::vector<std::vector<int64_t>>> params_per_rank;
  // owner[global index] = owning rank, or -1 for a parameter no rank owns (a manual partition may
  // leave frozen parameters out).
  std::vector<int> owner;
  // Elements each rank owns, over all groups.
  std::vector<int64_t> numel_per_rank;

  int64_t max_numel() const;
  int64_t total_numel() const;
};

// PyTorch's ZeroRedundancyOptimizer._partition_parameters: within each group, parameters sorted by
// size (largest first, stable), each to the rank with the fewest elements so far (lowest rank on
// ties); the running per-rank sizes carry over from one group to the next. Identical output to
// PyTorch's, in O(P log P + P log W).
// Fails (InvalidArgument) when world_size < 1 or a size is negative.
absl::StatusOr<ParamPartition> sorted_greedy_partition(
    const std::vector<std::vector<int64_t>>& group_numels, int world_size);

// A user-given `params_per_rank` (global indices per rank, one parameter group only), validated as
// PyTorch does: its length must equal the world size, every index must name a parameter passed to
// the optimizer; beyond PyTorch, a parameter given to two ranks (or twice) is rejected, since two
// owners would silently overwrite each other's updates. Parameters left out (frozen ones) get
// owner -1. Errors are InvalidArgument with PyTorch's wording where PyTorch has one.
absl::StatusOr<ParamPartition> manual_partition(
    const std::vector<std::vector<int64_t>>& group_numels,
    const std::vector<std::vector<int64_t>>& params_per_rank, int world_size);

}  // namespace dtrain::partition

#endif  // DTRAIN_PARTITION_SORTED_GREEDY_H_
