#include "partition/sorted_greedy.h"

#include <random>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::partition {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// PyTorch's loop written out literally (sort, linear first-minimum scan) to check the heap version.
std::vector<std::vector<std::vector<int64_t>>> reference(
    const std::vector<std::vector<int64_t>>& groups, int world) {
  std::vector<std::vector<std::vector<int64_t>>> out(
      world, std::vector<std::vector<int64_t>>(groups.size()));
  std::vector<int64_t> sizes(world, 0);
  int64_t first = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> idx(groups[g].size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t a, int64_t b) { return groups[g][a] > groups[g][b]; });
    for (int64_t i : idx) {
      int best = 0;
      for (int r = 1; r < world; ++r)
        if (sizes[r] < sizes[best]) best = r;
      out[best][g].push_back(first + i);
      sizes[best] += groups[g][i];
    }
    first += static_cast<int64_t>(groups[g].size());
  }
  return out;
}

TEST(SortedGreedyTest, RepeatedSizesBalanceExactly) {
  for (int world : {1, 2, 3, 4, 8}) {
    std::vector<int64_t> sizes;
    for (int i = 0; i < world; ++i) sizes.insert(sizes.end(), {9, 7, 5, 3});
    auto p = sorted_greedy_partition({sizes}, world);
    ASSERT_TRUE(p.ok()) << p.status();
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(p->numel_per_rank[r], 24) << "world " << world << " rank " << r;
  }
}

TEST(SortedGreedyTest, LargestFirstLowestRankOnTies) {
  auto p = sorted_greedy_partition({{3, 10, 3, 2, 2}}, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_THAT(p->params_per_rank[0][0], ElementsAre(1));
  // Equal sizes keep registration order (stable sort), ties between ranks go to the lower rank.
  EXPECT_THAT(p->params_per_rank[1][0], ElementsAre(0, 2, 3, 4));
  EXPECT_THAT(p->owner, ElementsAre(1, 0, 1, 1, 1));
  EXPECT_THAT(p->numel_per_rank, ElementsAre(10, 10));
}

TEST(SortedGreedyTest, LoadsCarryAcrossGroups) {
  // Group 0 leaves rank 0 heavier, so group 1's largest parameter goes to rank 1.
  auto p = sorted_greedy_partition({{5}, {4, 1}}, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_THAT(p->params_per_rank[0], ElementsAre(ElementsAre(0), ElementsAre()));
  EXPECT_THAT(p->params_per_rank[1], ElementsAre(ElementsAre(), ElementsAre(1, 2)));
}

TEST(SortedGreedyTest, MatchesPyTorchLoopOnRandomSizes) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 17);
    std::vector<std::vector<int64_t>> groups(1 + rng() % 3);
    std::set<int64_t> seen;
    int64_t total = 0;
    for (auto& g : groups) {
      g.resize(rng() % 40);
      // Few distinct sizes so ties are common.
      for (auto& n : g) {
        n = static_cast<int64_t>(rng() % 6) * 100;
        total += n;
      }
    }
    auto p = sorted_greedy_partition(groups, world);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->params_per_rank, reference(groups, world)) << "trial " << trial;
    // Every parameter owned exactly once, sizes add up.
    std::vector<int> count(p->owner.size(), 0);
    for (int r = 0; r < world; ++r)
      for (const auto& g : p->params_per_rank[r])
        for (int64_t i : g) {
          ++count[i];
          EXPECT_EQ(p->owner[i], r);
        }
    for (int c : count) EXPECT_EQ(c, 1);
    EXPECT_EQ(p->total_numel(), total);
    // Greedy bound: the heaviest rank exceeds the lightest by at most the largest parameter.
    int64_t largest = 0;
    for (auto& g : groups)
      for (auto n : g) largest = std::max(largest, n);
    int64_t lightest = *std::min_element(p->numel_per_rank.begin(), p->numel_per_rank.end());
    EXPECT_LE(p->max_numel() - lightest, largest);
  }
}

TEST(SortedGreedyTest, RejectsBadInput) {
  auto bad_world = sorted_greedy_partition({{1}}, 0);
  EXPECT_EQ(bad_world.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_world.status().message()),
              HasSubstr("world_size must be at least 1"));
  auto negative = sorted_greedy_partition({{1, -2}}, 2);
  EXPECT_THAT(std::string(negative.status().message()),
              HasSubstr("parameter 1 (group 0) has negative size -2"));
}

TEST(ManualPartitionTest, KeepsGivenOrderAndLeavesFrozenOut) {
  auto p = manual_partition({{4, 5, 6, 7}}, {{3, 0}, {1}}, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->params_per_rank[0][0], ElementsAre(3, 0));
  EXPECT_THAT(p->params_per_rank[1][0], ElementsAre(1));
  EXPECT_THAT(p->owner, ElementsAre(0, 1, -1, 0));
  EXPECT_THAT(p->numel_per_rank, ElementsAre(11, 5));
}

TEST(ManualPartitionTest, RejectsWrongLength) {
  auto p = manual_partition({{1, 2}}, {{0, 1}}, 2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("`params_per_rank` must have length equal to the world size (2), got 1"));
}

TEST(ManualPartitionTest, RejectsUnknownParameter) {
  auto p = manual_partition({{1, 2}}, {{0}, {2}}, 2);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("Passing a new parameter in `params_per_rank` that was not passed into the "
                        "ZeroRedundancyOptimizer constructor: rank 1 lists parameter 2"));
}

TEST(ManualPartitionTest, RejectsTwoOwners) {
  auto p = manual_partition({{1, 2}}, {{0, 1}, {1}}, 2);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("gives parameter 1 to rank 0 and again to rank 1"));
}

TEST(ManualPartitionTest, RejectsMoreThanOneGroup) {
  auto p = manual_partition({{1}, {2}}, {{0}, {1}}, 2);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("Specifying `params_per_rank` only supports a single parameter group"));
}

}  // namespace
}  // namespace dtrain::partition
