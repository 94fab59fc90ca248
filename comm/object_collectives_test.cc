#include "comm/object_collectives.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

c10::IValue object_of(int rank) {
  // Ranks send objects of different sizes and kinds: a dict with a string, a list and a tensor.
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("rank", static_cast<int64_t>(rank));
  d.insert("name", std::string(static_cast<size_t>(rank) * 100 + 1, 'x'));
  d.insert("values", c10::List<double>(std::vector<double>(rank + 1, 0.5)));
  d.insert("tensor", at::arange(rank + 3, at::kFloat));
  return d;
}

void expect_object_of(const c10::IValue& v, int rank) {
  ASSERT_TRUE(v.isGenericDict());
  auto d = v.toGenericDict();
  EXPECT_EQ(d.at("rank").toInt(), rank);
  EXPECT_EQ(d.at("name").toStringRef().size(), static_cast<size_t>(rank) * 100 + 1);
  EXPECT_EQ(d.at("values").toDoubleList().size(), static_cast<size_t>(rank) + 1);
  EXPECT_TRUE(d.at("tensor").toTensor().equal(at::arange(rank + 3, at::kFloat)));
}

// Swept over world sizes 1-8; the root is the last rank.
class ObjectCollectivesWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(ObjectCollectivesWorldTest, Broadcast) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    const int root = world - 1;
    c10::IValue obj = g.rank() == root ? object_of(root) : c10::IValue(std::string("stale"));
    ASSERT_TRUE(broadcast_object(g, obj, root).ok());
    expect_object_of(obj, root);
  });
}

TEST_P(ObjectCollectivesWorldTest, AllGatherKeepsRankOrder) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    auto all = all_gather_object(g, object_of(g.rank()));
    ASSERT_TRUE(all.ok()) << all.status();
    ASSERT_EQ(all->size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) expect_object_of((*all)[r], r);
  });
}

TEST_P(ObjectCollectivesWorldTest, GatherOnlyOnDestination) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    const int dst = world - 1;
    auto got = gather_object(g, object_of(g.rank()), dst);
    ASSERT_TRUE(got.ok()) << got.status();
    if (g.rank() != dst) {
      EXPECT_TRUE(got->empty());
      return;
    }
    ASSERT_EQ(got->size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) expect_object_of((*got)[r], r);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ObjectCollectivesWorldTest, ::testing::Range(1, 9));

TEST(ObjectCollectivesTest, BadRootIsAnError) {
  run_ranks_as_threads(2, [](Group& g) {
    c10::IValue v(1);
    absl::Status s = broadcast_object(g, v, 2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("src=2 is not a rank of this group of 2"));
    EXPECT_THAT(std::string(gather_object(g, v, -1).status().message()), HasSubstr("dst=-1"));
  });
}

TEST(ObjectCollectivesTest, MissingPeerTimesOut) {
  testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(2);
  run_ranks_as_threads(
      2,
      [](Group& g) {
        if (g.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(3));
          return;
        }
        auto all = all_gather_object(g, c10::IValue(1));
        EXPECT_FALSE(all.ok());
        EXPECT_THAT(std::string(all.status().message()), HasSubstr("all_gather_object"));
      },
      o);
}

}  // namespace
}  // namespace dtrain::comm
