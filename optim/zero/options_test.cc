#include "optim/zero/options.h"

#include <string>

#include <c10/util/Exception.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The message check_zero_options throws for `options`, or "" when it accepts them.
std::string error_of(const ZeroOptions& options, size_t groups = 1) {
  try {
    check_zero_options(options, groups);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(ZeroOptionsTest, DefaultsAreValidForAnyNumberOfGroups) {
  ZeroOptions options;
  EXPECT_EQ(options.strategy, PartitionStrategy::kSortedGreedy);
  EXPECT_EQ(options.flat_alignment, 16);
  EXPECT_FALSE(options.parameters_as_bucket_view);
  EXPECT_EQ(error_of(options, 1), "");
  EXPECT_EQ(error_of(options, 3), "");
  options.strategy = PartitionStrategy::kFlat;
  EXPECT_EQ(error_of(options, 3), "");
}

TEST(ZeroOptionsTest, ManualPartitionNeedsSortedGreedyAndOneGroup) {
  ZeroOptions options;
  options.params_per_rank = {{0}, {1}};
  EXPECT_EQ(error_of(options), "");
  EXPECT_THAT(error_of(options, 2),
              HasSubstr("Specifying `params_per_rank` only supports a single parameter group"));
  options.strategy = PartitionStrategy::kFlat;
  EXPECT_THAT(error_of(options), HasSubstr("use it with the sorted_greedy strategy, not kFlat"));
}

TEST(ZeroOptionsTest, OverlapNeedsSortedGreedyAndOneGroup) {
  ZeroOptions options;
  options.overlap_with_ddp = true;
  EXPECT_EQ(error_of(options), "");
  EXPECT_THAT(error_of(options, 2),
              HasSubstr("overlap_with_ddp supports a single parameter group, got 2"));
  options.strategy = PartitionStrategy::kFlat;
  EXPECT_THAT(error_of(options),
              HasSubstr("overlap_with_ddp partitions whole parameters by DDP bucket"));
}

TEST(ZeroOptionsTest, ShardGradientsExcludesOverlapAndManualPartition) {
  ZeroOptions options;
  options.shard_gradients = true;
  EXPECT_EQ(error_of(options), "");
  EXPECT_THAT(error_of(options, 2),
              HasSubstr("shard_gradients supports a single parameter group, got 2"));
  options.params_per_rank = {{0}};
  EXPECT_THAT(error_of(options), HasSubstr("leave params_per_rank empty"));
  options.params_per_rank.clear();
  options.overlap_with_ddp = true;
  EXPECT_THAT(error_of(options), HasSubstr("choose one"));
}

TEST(ZeroOptionsTest, AlignmentMustBePositive) {
  ZeroOptions options;
  options.flat_alignment = 0;
  EXPECT_THAT(error_of(options), HasSubstr("flat_alignment must be at least 1 element, got 0"));
  options.flat_alignment = 1;
  EXPECT_EQ(error_of(options), "");
}

TEST(ZeroOptionsTest, FingerprintDiffersInEveryOptionThatChangesTheCollectives) {
  const ZeroOptions base;
  const std::string same = zero_options_fingerprint(base);
  EXPECT_EQ(zero_options_fingerprint(ZeroOptions{}), same);
  auto differs = [&](void (*change)(ZeroOptions&)) {
    ZeroOptions o;
    change(o);
    return zero_options_fingerprint(o) != same;
  };
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.strategy = PartitionStrategy::kFlat; }));
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.flat_alignment = 32; }));
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.parameters_as_bucket_view = true; }));
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.overlap_with_ddp = true; }));
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.shard_gradients = true; }));
  EXPECT_TRUE(differs([](ZeroOptions& o) { o.overlap_chunk_bytes = 1 << 20; }));
  // The manual partition's contents, not only its size.
  ZeroOptions a;
  a.params_per_rank = {{0, 1}, {2}};
  ZeroOptions b;
  b.params_per_rank = {{0}, {1, 2}};
  EXPECT_NE(zero_options_fingerprint(a), zero_options_fingerprint(b));
  EXPECT_THAT(zero_options_fingerprint(a), Not(HasSubstr("group")));
}

}  // namespace
}  // namespace dtrain::optim
