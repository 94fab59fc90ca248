#include "comm/join.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

// PyTorch's test_join.py AllReducer: each step all-reduces ones; a joined rank shadows with zeros.
class AllReducer : public Joinable {
 public:
  explicit AllReducer(Group group) : group_(std::move(group)) {}

  double step() {
    Join::notify_join_context(*this);
    std::vector<at::Tensor> t = {at::ones({1})};
    group_->allreduce(t)->wait();
    total_ += t[0].item<double>();
    return t[0].item<double>();
  }

  std::unique_ptr<JoinHook> join_hook(const JoinOptions&) override {
    return std::make_unique<Hook>(this);
  }
  c10::Device join_device() const override { return c10::Device(c10::kCPU); }
  c10::intrusive_ptr<comm::C10dGroup> join_process_group() const override { return group_.pg(); }

  double total_ = 0;
  int shadowed_ = 0;
  int last_joiner_ = -1;

 private:
  struct Hook : JoinHook {
    explicit Hook(AllReducer* r) : r(r) {}
    void main_hook() override {
      std::vector<at::Tensor> t = {at::zeros({1})};
      r->group_->allreduce(t)->wait();
      r->total_ += t[0].item<double>();
      ++r->shadowed_;
    }
    void post_hook(bool is_last_joiner) override { r->last_joiner_ = is_last_joiner; }
    AllReducer* r;
  };
  Group group_;
};

TEST(JoinTest, UnevenInputsFinishTogether) {
  run_ranks_as_threads(3, [](Group& g) {
    AllReducer model(g);
    const int my_inputs = 5 + 2 * g.rank();  // 5, 7, 9
    Join join({&model});
    for (int i = 0; i < my_inputs; ++i) model.step();
    join.finish();
    // Steps 1-5: 3 ranks, 6-7: 2, 8-9: 1.
    EXPECT_EQ(model.total_, 5 * 3 + 2 * 2 + 2 * 1);
    EXPECT_EQ(model.shadowed_, 9 - my_inputs);
    EXPECT_EQ(model.last_joiner_, g.rank() == 2 ? 1 : 0);
  });
}

TEST(JoinTest, ThrowOnEarlyTermination) {
  run_ranks_as_threads(2, [](Group& g) {
    AllReducer model(g);
    JoinOptions o;
    o.throw_on_early_termination = true;
    Join join({&model}, o);
    try {
      for (int i = 0; i < (g.rank() == 0 ? 2 : 5); ++i) model.step();
      join.finish();
      ADD_FAILURE() << "expected an early-termination error";
    } catch (const c10::Error& e) {
      if (g.rank() == 0) {
        EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Rank 0 exhausted all inputs."));
      } else {
        EXPECT_THAT(e.what_without_backtrace(),
                    HasSubstr("Detected at least one rank that exhausted inputs"));
      }
    }
  });
}

TEST(JoinTest, DisabledJoinDoesNoCollectives) {
  run_ranks_as_threads(2, [](Group& g) {
    AllReducer model(g);
    JoinOptions o;
    o.enable = false;
    Join join({&model}, o);
    for (int i = 0; i < 3; ++i) model.step();  // even inputs: no shadowing needed
    join.finish();
    EXPECT_EQ(model.total_, 6);
    EXPECT_EQ(model.shadowed_, 0);
  });
}

TEST(JoinTest, RejectsJoinablesOnDifferentGroups) {
  run_ranks_as_threads(2, [](Group& g) {
    auto other = new_group(g, {0, 1});
    ASSERT_TRUE(other.ok());
    AllReducer a(g), b(*other);
    try {
      Join join({&a, &b});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("multiple process groups"));
    }
  });
}

}  // namespace
}  // namespace dtrain::comm
