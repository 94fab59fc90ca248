#include "optim/model_averagers.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;

// Parameters that differ by rank, with gradients (only those are averaged) -- and one without.
std::vector<at::Tensor> rank_params(int rank) {
  std::vector<at::Tensor> p = {at::full({3}, static_cast<double>(rank)),
                               at::full({2, 2}, rank * 10.0, at::kDouble),
                               at::full({2}, 100.0 + rank)};
  p[0].mutable_grad() = at::zeros({3});
  p[1].mutable_grad() = at::zeros({2, 2}, at::kDouble);
  return p;  // p[2] has no gradient
}

double mean_of_ranks(const std::vector<int>& ranks, double scale) {
  double s = 0;
  for (int r : ranks) s += r * scale;
  return s / ranks.size();
}

TEST(ModelAveragersTest, PeriodicAveragesAfterWarmupEveryPeriod) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    PeriodicModelAverager avg(/*period=*/3, /*warmup_steps=*/2, g);
    for (int64_t step = 0; step < 10; ++step) {
      auto p = rank_params(g.rank());
      avg.average_parameters(p);
      const bool averaged = step >= 2 && (step - 2) % 3 == 0;
      EXPECT_EQ(p[0][0].item<double>(), averaged ? 0.5 : g.rank()) << "step " << step;
      EXPECT_EQ(p[1][1][1].item<double>(), averaged ? 5.0 : g.rank() * 10.0);  // double kept double
      EXPECT_EQ(p[1].scalar_type(), at::kDouble);
      EXPECT_EQ(p[2][0].item<double>(), 100.0 + g.rank()) << "no gradient: not averaged";
    }
    EXPECT_EQ(avg.step(), 10);
  });
}

TEST(ModelAveragersTest, HierarchicalPicksTheHighestDividingLevel) {
  run_ranks_as_threads(4, [](comm::Group& g) {
    HierarchicalModelAverager avg({{2, 2}, {4, 4}}, /*warmup_steps=*/1, g);
    const int pair = g.rank() / 2;
    for (int64_t step = 0; step < 9; ++step) {
      auto p = rank_params(g.rank());
      avg.average_parameters(p);
      double want = g.rank();
      if (step >= 1 && step % 4 == 0) {
        want = mean_of_ranks({0, 1, 2, 3}, 1);
      } else if (step >= 1 && step % 2 == 0) {
        want = mean_of_ranks({2 * pair, 2 * pair + 1}, 1);
      }
      EXPECT_DOUBLE_EQ(p[0][0].item<double>(), want) << "step " << step << " rank " << g.rank();
    }
  });
}

using test_util::expect_error;

TEST(ModelAveragersTest, ArgumentErrors) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    expect_error([&] { PeriodicModelAverager(0, 0, g); },
                 "Arg ``period`` must be a positive value.");
    expect_error([&] { PeriodicModelAverager(2, -1, g); },
                 "Arg ``warmup_steps`` must be a non-negative number.");
    expect_error([&] { HierarchicalModelAverager({}, 0, g); },
                 "Arg ``period_group_size_dict`` must not be empty.");
    expect_error(
        [&] {
          HierarchicalModelAverager({{0, 2}}, 0, g);
        },
        "The minimum period in arg ``period_group_size_dict`` must be a positive value.");
    expect_error(
        [&] {
          HierarchicalModelAverager({{2, 1}}, 0, g);
        },
        "The last value in arg ``period_process_group_dict`` 1 must be equal to the size of arg "
        "``process_group`` 2.");
    expect_error([&] { HierarchicalModelAverager({{4, 1}, {2, 2}}, 0, g); }, "increasing periods");
  });
}

}  // namespace
}  // namespace dtrain::optim
