#include "comm/agreement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

TEST(AgreementTest, IdenticalListsAgree) {
  run_ranks_as_threads(3, [](Group& g) {
    EXPECT_TRUE(check_identical(g, {"a", "b"}, "item").ok());
    EXPECT_TRUE(check_identical(g, {}, "item").ok());
  });
}

TEST(AgreementTest, TheFirstDifferenceIsNamedOnEveryRank) {
  run_ranks_as_threads(3, [](Group& g) {
    std::vector<std::string> mine = {"w Float [3]", g.rank() == 2 ? "b Float [5]" : "b Float [3]"};
    absl::Status s = check_identical(g, mine, "parameter");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << g.rank();
    EXPECT_EQ(s.message(), "parameter 1 is b Float [5] on rank 2 but b Float [3] on rank 0");
    std::vector<std::string> shorter = {"x"};
    if (g.rank() != 1) shorter.push_back("y");
    EXPECT_THAT(check_identical(g, shorter, "item").message(),
                HasSubstr("item 1 is (none) on rank 1 but y on rank 0"));
  });
}

TEST(AgreementTest, TheRootsVerdictReachesEveryRank) {
  run_ranks_as_threads(3, [](Group& g) {
    absl::Status mine =
        g.rank() == 1 ? absl::DataLossError("shard 3 is damaged") : absl::UnknownError("ignored");
    absl::Status s = share_verdict(g, mine, /*root=*/1);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(s.message(), "shard 3 is damaged");
    EXPECT_TRUE(
        share_verdict(g, g.rank() == 0 ? absl::OkStatus() : absl::InternalError("x"), 0).ok());
  });
}

// Swept over world sizes 1-8: which ranks fail is every subset's lowest member at work.
class FirstFailureTest : public ::testing::TestWithParam<int> {};

TEST_P(FirstFailureTest, EveryRankLearnsTheLowestFailedRank) {
  const int world = GetParam();
  run_ranks_as_threads(world, [&](Group& g) {
    EXPECT_TRUE(first_failure(g, absl::OkStatus()).ok()) << "rank " << g.rank();
    // Ranks 1 and the last fail (rank 0 alone at world 1).
    const int a = world > 1 ? 1 : 0, b = world - 1;
    const bool fails = g.rank() == a || g.rank() == b;
    absl::Status s =
        first_failure(g, fails ? absl::NotFoundError("no such dir") : absl::OkStatus());
    if (fails) {
      EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(s.message(), "no such dir");
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
      EXPECT_EQ(s.message(), "rank " + std::to_string(a) + " failed");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FirstFailureTest, ::testing::Range(1, 9));

}  // namespace
}  // namespace dtrain::comm
