#include "partition/flat_partition.h"

#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::partition {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(FlatPartitionTest, TilesTheBufferInRankOrder) {
  auto fp = flat_partition(int64_t{10}, 3);
  ASSERT_TRUE(fp.ok());
  EXPECT_THAT(fp->ranges, ElementsAre(Range{0, 4}, Range{4, 8}, Range{8, 10}));
}

TEST(FlatPartitionTest, AlignmentRoundsChunksUp) {
  auto fp = flat_partition(int64_t{100}, 3, 16);
  ASSERT_TRUE(fp.ok());
  // ceil(100/3) = 34 -> 48.
  EXPECT_THAT(fp->ranges, ElementsAre(Range{0, 48}, Range{48, 96}, Range{96, 100}));
}

TEST(FlatPartitionTest, SmallBufferLeavesTrailingRanksEmpty) {
  auto fp = flat_partition(int64_t{3}, 5);
  ASSERT_TRUE(fp.ok());
  EXPECT_THAT(fp->ranges,
              ElementsAre(Range{0, 1}, Range{1, 2}, Range{2, 3}, Range{3, 3}, Range{3, 3}));
}

TEST(FlatPartitionTest, ParameterSlicesCoverEachElementOnce) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 20);
    const int64_t alignment = int64_t{1} << (rng() % 6);
    std::vector<int64_t> numels(rng() % 30);
    int64_t total = 0;
    for (auto& n : numels) {
      n = static_cast<int64_t>(rng() % 200);
      total += n;
    }
    auto fp = flat_partition(numels, world, alignment);
    ASSERT_TRUE(fp.ok());
    // Balance bound: max / ideal <= 1 + alignment / ideal.
    const double ideal = static_cast<double>(total) / world;
    int64_t max_size = 0;
    int64_t next = 0;
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(fp->ranges[r].begin, next);
      next = fp->ranges[r].end;
      max_size = std::max(max_size, fp->ranges[r].size());
      EXPECT_EQ(fp->ranges[r].begin % alignment == 0 || fp->ranges[r].begin == total, true);
    }
    EXPECT_EQ(next, total);
    if (total > 0) {
      EXPECT_LE(max_size / ideal, 1.0 + alignment / ideal + 1e-12);
    }
    std::vector<std::vector<int>> seen(numels.size());
    for (size_t p = 0; p < numels.size(); ++p) seen[p].assign(numels[p], 0);
    for (int r = 0; r < world; ++r) {
      int64_t flat = fp->ranges[r].begin;
      for (const ParamSlice& s : fp->slices[r]) {
        EXPECT_EQ(s.flat_offset, flat);  // contiguous inside the rank's range
        flat += s.size();
        for (int64_t e = s.begin; e < s.end; ++e) ++seen[s.param_index][e];
      }
      EXPECT_EQ(flat, fp->ranges[r].end);
      // slices_in_range (from parameter 0) agrees with the construction (which resumes per rank).
      auto again = slices_in_range(numels, fp->ranges[r]);
      ASSERT_EQ(again.size(), fp->slices[r].size());
      for (size_t i = 0; i < again.size(); ++i) {
        EXPECT_EQ(again[i].param_index, fp->slices[r][i].param_index);
        EXPECT_EQ(again[i].begin, fp->slices[r][i].begin);
        EXPECT_EQ(again[i].end, fp->slices[r][i].end);
      }
    }
    for (const auto& v : seen)
      for (int c : v) EXPECT_EQ(c, 1);
  }
}

TEST(FlatPartitionTest, RejectsBadInput) {
  EXPECT_THAT(std::string(flat_partition(int64_t{10}, 0).status().message()),
              HasSubstr("world_size must be at least 1"));
  EXPECT_THAT(std::string(flat_partition(int64_t{10}, 2, 0).status().message()),
              HasSubstr("alignment must be at least 1"));
  EXPECT_THAT(std::string(flat_partition(std::vector<int64_t>{3, -1}, 2).status().message()),
              HasSubstr("parameter 1 has negative size"));
}

}  // namespace
}  // namespace dtrain::partition
