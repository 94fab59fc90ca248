#include "checkpoint/dcp_state.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace dtrain::checkpoint {
namespace {

// Every range of every shape: the boxes, read in order from the tensor, are exactly the range.
TEST(DcpStateTest, FlatRangeBoxesTileTheRangeInOrder) {
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{7}, {3, 4}, {2, 3, 4}, {3, 1, 2}, {2, 0, 3}}) {
    const int64_t n = at::empty(shape).numel();
    const at::Tensor t = at::arange(n, at::kLong).view(shape);
    for (int64_t b = 0; b <= n; ++b) {
      for (int64_t e = b; e <= n; ++e) {
        std::vector<at::Tensor> parts;
        size_t boxes = 0;
        for (const auto& [offsets, sizes] : flat_range_boxes(shape, {b, e})) {
          at::Tensor box = t;
          for (size_t d = 0; d < shape.size(); ++d)
            box = box.narrow(static_cast<int64_t>(d), offsets[d], sizes[d]);
          parts.push_back(box.reshape({-1}));
          ++boxes;
        }
        const at::Tensor got = parts.empty() ? at::empty({0}, at::kLong) : at::cat(parts);
        EXPECT_TRUE(got.equal(at::arange(b, e, at::kLong))) << "range " << b << ".." << e;
        // At most a partial row per dimension on either side, plus the middle.
        EXPECT_LE(boxes, 2 * shape.size()) << "range " << b << ".." << e;
      }
    }
  }
  EXPECT_EQ(flat_range_boxes({}, {0, 1}).size(), 1u);
  EXPECT_TRUE(flat_range_boxes({}, {0, 1})[0].first.empty());
}

TEST(DcpStateTest, RefusesStateThatDoesNotMatchItsRange) {
  ShardedState s;
  ShardedState::Param p;
  p.shape = {4, 3};
  p.range = {2, 7};
  p.entries.insert("exp_avg", at::zeros({4}));  // 5 elements held, 4 given
  s.params[0] = p;
  absl::StatusOr<std::vector<DcpWriteItem>> items = dcp_optimizer_items(s, {"w"}, false);
  ASSERT_FALSE(items.ok());
  EXPECT_NE(items.status().message().find("parameter 0 (w) state 'exp_avg'"), std::string::npos)
      << items.status();
  EXPECT_FALSE(dcp_optimizer_items(s, {}, false).ok());  // no name for parameter 0
}

TEST(DcpStateTest, StepIsWrittenOnceAsPyTorchsTensor) {
  ShardedState s;
  for (int64_t r = 0; r < 2; ++r) {  // two ranks' pieces of one parameter
    ShardedState::Param p;
    p.shape = {4, 3};
    p.range = {r * 6, r * 6 + 6};
    p.entries.insert("step", int64_t{5});
    p.entries.insert("exp_avg", at::ones({6}));
    ShardedState mine;
    mine.params[0] = p;
    absl::StatusOr<std::vector<DcpWriteItem>> items = dcp_optimizer_items(mine, {"w"}, false);
    ASSERT_TRUE(items.ok()) << items.status();
    int steps = 0;
    for (const DcpWriteItem& item : *items) {
      if (item.key != "optim.state.w.step") continue;
      ++steps;
      EXPECT_EQ(item.tensor.scalar_type(), at::kFloat);
      EXPECT_EQ(item.tensor.item<float>(), 5.0f);
    }
    EXPECT_EQ(steps, r == 0 ? 1 : 0);
  }
}

}  // namespace
}  // namespace dtrain::checkpoint
