// Assignment of DDP gradient buckets to ZeRO ranks (ZeroRedundancyOptimizer with
// overlap_with_ddp): whole buckets round-robin, or, with shard_buckets, PyTorch's threshold
// algorithm that slices buckets so every rank gets about total / world_size elements.
//
//   // Parameter numels per DDP bucket, in bucket order.
//   std::vector<std::vector<int64_t>> buckets = {{4, 4}, {100, 50, 50}, {8}};
//   absl::StatusOr<BucketPartition> bp = assign_ddp_buckets(buckets, /*world_size=*/2,
//                                                           /*shard_buckets=*/true);
//   for (const auto& [bucket, a] : bp->per_rank[rank]) {
//     // a.param_offset, a.num_params: the contiguous slice of bucket `bucket` this rank updates
//   }
#ifndef DTRAIN_PARTITION_BUCKET_ASSIGNMENT_H_
#define DTRAIN_PARTITION_BUCKET_ASSIGNMENT_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::partition {

// One rank's piece of one DDP bucket: parameters [param_offset, param_offset + num_params) of the
// bucket's parameter list (PyTorch's _DDPBucketAssignment).
struct BucketAssignment {
  int64_t bucket_index = 0;
  int64_t param_offset = 0;
  int64_t num_params = 0;
  int64_t numel = 0;
  int rank = 0;
};

struct BucketPartition {
  int world_size = 0;
  // Assignments in the order they were made.
  std::vector<BucketAssignment> assignments;
  // per_rank[rank]: bucket index -> that rank's piece of the bucket (at most one per bucket).
  std::vector<std::map<int64_t, BucketAssignment>> per_rank;
  // ranks_per_bucket[bucket]: ranks holding a piece of it, in assignment order.
  std::vector<std::vector<int>> ranks_per_bucket;
  std::vector<int64_t> numel_per_rank;
};

// Without shard_buckets: bucket i goes whole to rank i % world_size (PyTorch's _get_assigned_rank).
// With shard_buckets: buckets in increasing total size (stable); each is cut into maximal
// contiguous slices below threshold = total / world_size, each slice to the least-loaded rank that
// holds no piece of that bucket yet (lowest rank on ties) -- exactly PyTorch's
// _bucket_assignments_per_rank. Fails with InvalidArgument on world_size < 1, an empty bucket or a
// negative size, and with FailedPrecondition when a bucket would need more slices than there are
// ranks (PyTorch asserts there; use fewer, larger parameters per bucket or shard_buckets=false).
absl::StatusOr<BucketPartition> assign_ddp_buckets(
    const std::vector<std::vector<int64_t>>& bucket_param_numels, int world_size,
    bool shard_buckets);

}  // namespace dtrain::partition

#endif  // DTRAIN_PARTITION_BUCKET_ASSIGNMENT_H_
