#include "partition/bucket_assignment.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::partition {
namespace {

// PyTorch's _get_min_index: first minimum, skipping ranks that already hold a piece of the bucket.
int min_rank_excluding(const std::vector<int64_t>& sizes, const std::vector<int>& excluded) {
  int best = -1;
  int64_t best_size = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < static_cast<int>(sizes.size()); ++r) {
    if (std::find(excluded.begin(), excluded.end(), r) != excluded.end()) continue;
    if (best == -1 || sizes[r] < best_size) {
      best = r;
      best_size = sizes[r];
    }
  }
  return best;
}

// Each bucket's element count; InvalidArgument for an empty bucket or a negative size.
absl::StatusOr<std::vector<int64_t>> bucket_sizes(
    const std::vector<std::vector<int64_t>>& bucket_param_numels) {
  const int64_t num_buckets = static_cast<int64_t>(bucket_param_numels.size());
  std::vector<int64_t> bucket_numel(num_buckets, 0);
  for (int64_t b = 0; b < num_buckets; ++b) {
    if (bucket_param_numels[b].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("DDP bucket ", b, " is empty"));
    }
    for (int64_t n : bucket_param_numels[b]) {
      if (n < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("DDP bucket ", b, " has a parameter of negative size ", n));
      }
      bucket_numel[b] += n;
    }
  }
  return bucket_numel;
}

void assign(BucketPartition& bp, int64_t bucket, int64_t offset, int64_t count, int64_t numel,
            int rank) {
  BucketAssignment a{bucket, offset, count, numel, rank};
  bp.assignments.push_back(a);
  bp.per_rank[rank][bucket] = a;
  bp.ranks_per_bucket[bucket].push_back(rank);
  bp.numel_per_rank[rank] += numel;
}

// shard_buckets=true: the buckets, smallest first, cut into slices below total / world_size
// elements, each slice to the least loaded rank that holds no other slice of its bucket.
absl::Status assign_slices(const std::vector<std::vector<int64_t>>& bucket_param_numels,
                           const std::vector<int64_t>& bucket_numel, int world_size,
                           BucketPartition& bp) {
  const int64_t num_buckets = static_cast<int64_t>(bucket_param_numels.size());
  const int64_t total = std::accumulate(bucket_numel.begin(), bucket_numel.end(), int64_t{0});
  // PyTorch compares integer sizes against a true (float) division.
  const double threshold = static_cast<double>(total) / world_size;
  std::vector<int64_t> order(num_buckets);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return bucket_numel[a] < bucket_numel[b]; });
  std::vector<int64_t> size_per_rank(world_size, 0);
  auto place = [&](int64_t b, int64_t offset, int64_t end, int64_t numel) -> absl::Status {
    const int rank = min_rank_excluding(size_per_rank, bp.ranks_per_bucket[b]);
    if (rank < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("DDP bucket ", b, " (", bucket_numel[b], " elements) needs more than ",
                       world_size, " slices below the threshold ", threshold,
                       " elements; use shard_buckets=false or a larger bucket_cap_mb"));
    }
    assign(bp, b, offset, end - offset, numel, rank);
    size_per_rank[rank] += numel;
    return absl::OkStatus();
  };
  for (int64_t b : order) {
    const std::vector<int64_t>& params = bucket_param_numels[b];
    int64_t offset = 0;
    int64_t size = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i) {
      if (static_cast<double>(size + params[i]) >= threshold && i > offset) {
        if (absl::Status s = place(b, offset, i, size); !s.ok()) return s;
        offset = i;
        size = 0;
      }
      size += params[i];
    }
    // The remainder of the bucket, so that no assignment spans two buckets.
    if (absl::Status s = place(b, offset, static_cast<int64_t>(params.size()), size); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BucketPartition> assign_ddp_buckets(
    const std::vector<std::vector<int64_t>>& bucket_param_numels, int world_size,
    bool shard_buckets) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be at least 1, got ", world_size));
  }
  const int64_t num_buckets = static_cast<int64_t>(bucket_param_numels.size());
  absl::StatusOr<std::vector<int64_t>> bucket_numel = bucket_sizes(bucket_param_numels);
  if (!bucket_numel.ok()) return bucket_numel.status();

  BucketPartition bp;
  bp.world_size = world_size;
  bp.per_rank.resize(world_size);
  bp.ranks_per_bucket.resize(num_buckets);
  bp.numel_per_rank.assign(world_size, 0);

  if (!shard_buckets) {
    for (int64_t b = 0; b < num_buckets; ++b) {
      assign(bp, b, 0, static_cast<int64_t>(bucket_param_numels[b].size()), (*bucket_numel)[b],
             static_cast<int>(b % world_size));
    }
    return bp;
  }
  if (absl::Status s = assign_slices(bucket_param_numels, *bucket_numel, world_size, bp); !s.ok())
    return s;
  return bp;
}

}  // namespace dtrain::partition
