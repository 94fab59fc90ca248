#include "partition/bucket_assignment.h"

#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::partition {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BucketAssignmentTest, WholeBucketsRoundRobin) {
  auto bp = assign_ddp_buckets({{4, 4}, {100, 50, 50}, {8}}, 2, /*shard_buckets=*/false);
  ASSERT_TRUE(bp.ok()) << bp.status();
  EXPECT_THAT(bp->ranks_per_bucket, ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(0)));
  EXPECT_THAT(bp->numel_per_rank, ElementsAre(16, 200));
  EXPECT_EQ(bp->per_rank[1].at(1).num_params, 3);
}

TEST(BucketAssignmentTest, ShardedFollowsPyTorchThreshold) {
  // total 216, threshold 108. Buckets by increasing size: 0 (8), 2 (8), 1 (200).
  auto bp = assign_ddp_buckets({{4, 4}, {100, 50, 50}, {8}}, 2, /*shard_buckets=*/true);
  ASSERT_TRUE(bp.ok()) << bp.status();
  ASSERT_EQ(bp->assignments.size(), 4u);
  const auto& r0 = bp->per_rank[0];
  const auto& r1 = bp->per_rank[1];
  ASSERT_EQ(r0.size(), 2u);
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r0.at(0).param_offset, 0);
  EXPECT_EQ(r0.at(0).num_params, 2);
  EXPECT_EQ(r1.at(2).num_params, 1);
  // Bucket 1 splits before the parameter that reaches the threshold: [100] | [50, 50].
  EXPECT_EQ(r0.at(1).param_offset, 0);
  EXPECT_EQ(r0.at(1).num_params, 1);
  EXPECT_EQ(r1.at(1).param_offset, 1);
  EXPECT_EQ(r1.at(1).num_params, 2);
  EXPECT_THAT(bp->numel_per_rank, ElementsAre(108, 108));
}

TEST(BucketAssignmentTest, PropertiesOnRandomBuckets) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 8);
    std::vector<std::vector<int64_t>> buckets(1 + rng() % 12);
    for (auto& b : buckets) {
      b.resize(1 + rng() % 10);
      for (auto& n : b) n = 1 + static_cast<int64_t>(rng() % 50);
    }
    for (bool shard : {false, true}) {
      auto bp = assign_ddp_buckets(buckets, world, shard);
      if (!bp.ok()) {
        // Only possible when sharding needs more slices than ranks; the error says so.
        ASSERT_TRUE(shard);
        EXPECT_EQ(bp.status().code(), absl::StatusCode::kFailedPrecondition);
        continue;
      }
      // Every parameter of every bucket covered exactly once, by contiguous slices, a rank at most
      // once per bucket.
      for (size_t b = 0; b < buckets.size(); ++b) {
        std::vector<int> covered(buckets[b].size(), 0);
        std::vector<int> ranks;
        for (const auto& a : bp->assignments) {
          if (a.bucket_index != static_cast<int64_t>(b)) continue;
          ranks.push_back(a.rank);
          int64_t numel = 0;
          for (int64_t i = a.param_offset; i < a.param_offset + a.num_params; ++i) {
            ++covered[i];
            numel += buckets[b][i];
          }
          EXPECT_EQ(numel, a.numel);
        }
        for (int c : covered) EXPECT_EQ(c, 1);
        std::sort(ranks.begin(), ranks.end());
        EXPECT_EQ(std::adjacent_find(ranks.begin(), ranks.end()), ranks.end());
      }
    }
  }
}

TEST(BucketAssignmentTest, TooManySlicesIsAClearError) {
  // total 36, threshold 12 at world 3: every 9 becomes its own slice, 4 slices for 3 ranks.
  auto bp = assign_ddp_buckets({{9, 9, 9, 9}}, 3, /*shard_buckets=*/true);
  EXPECT_EQ(bp.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(bp.status().message()),
              HasSubstr("DDP bucket 0 (36 elements) needs more than 3 slices"));
}

TEST(BucketAssignmentTest, RejectsEmptyBucket) {
  auto bp = assign_ddp_buckets({{1}, {}}, 2, false);
  EXPECT_THAT(std::string(bp.status().message()), HasSubstr("DDP bucket 1 is empty"));
}

}  // namespace
}  // namespace dtrain::partition
