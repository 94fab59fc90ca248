#include "optim/post_local_sgd_optimizer.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "comm/testing/test_harness.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;

std::vector<at::Tensor> params() {
  return {at::cos(at::arange(6, at::kFloat)).requires_grad_(),
          at::sin(at::arange(4, at::kFloat)).requires_grad_()};
}

void local_grads(std::vector<at::Tensor>& p, int rank, int step) {
  for (size_t i = 0; i < p.size(); ++i) {
    p[i].mutable_grad() = at::sin(at::arange(p[i].numel(), at::kFloat) + step * 0.1 + rank * 1.7 +
                                  static_cast<double>(i));
  }
}

bool equal_across_ranks(comm::Group& g, const std::vector<at::Tensor>& p) {
  std::vector<at::Tensor> flat = {at::cat({p[0].detach().reshape(-1), p[1].detach().reshape(-1)})};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < g.size(); ++r) all[0].push_back(at::empty_like(flat[0]));
  g->allgather(all, flat)->wait();
  for (int r = 1; r < g.size(); ++r) {
    if (!all[0][r].equal(all[0][0])) return false;
  }
  return true;
}

// The seed's example: period 4, warmup 100. Gradients differ by rank (no DDP here), so the
// parameters agree exactly at the averaging steps after warm-up and nowhere else.
TEST(PostLocalSGDOptimizerTest, SeedExamplePeriod4Warmup100) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = params();
    PostLocalSGDOptimizer opt(
        std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01)),
        std::make_shared<PeriodicModelAverager>(4, 100, g));
    for (int step = 0; step < 120; ++step) {
      opt.zero_grad();
      local_grads(p, g.rank(), step);
      opt.step();
      const bool averaged = step >= 100 && (step - 100) % 4 == 0;
      EXPECT_EQ(equal_across_ranks(g, p), averaged) << "step " << step;
    }
  });
}

TEST(PostLocalSGDOptimizerTest, StateDictCarriesTheAveragerStep) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = params();
    PostLocalSGDOptimizer opt(
        std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01).momentum(0.9)),
        std::make_shared<PeriodicModelAverager>(2, 3, g));
    for (int step = 0; step < 7; ++step) {
      local_grads(p, g.rank(), step);
      opt.step();
    }
    c10::IValue sd = opt.state_dict();
    EXPECT_EQ(sd.toGenericDict().at("step").toInt(), 7);
    EXPECT_TRUE(sd.toGenericDict().at("state").toGenericDict().contains(static_cast<int64_t>(0)));

    std::vector<at::Tensor> q = params();
    PostLocalSGDOptimizer other(
        std::make_unique<torch::optim::SGD>(q, torch::optim::SGDOptions(0.5).momentum(0.9)),
        std::make_shared<PeriodicModelAverager>(2, 3, g));
    other.load_state_dict(sd);
    EXPECT_EQ(other.averager().step(), 7);
    EXPECT_DOUBLE_EQ(other.param_groups()[0].options().get_lr(), 0.01);
    // Without "step": warning and 0.
    (void)sd.toGenericDict().erase("step");
    other.load_state_dict(sd);
    EXPECT_EQ(other.averager().step(), 0);
  });
}

TEST(PostLocalSGDOptimizerTest, LrChangesReachTheLocalOptimizer) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = params();
    PostLocalSGDOptimizer opt(std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1.0)),
                              std::make_shared<PeriodicModelAverager>(1000, 0, g));
    opt.param_groups()[0].options().set_lr(0.0);
    at::Tensor before = p[0].detach().clone();
    for (int step = 1; step < 3; ++step) {  // step 0 would average
      local_grads(p, g.rank(), step);
    }
    opt.averager().set_step(1);
    opt.step();
    EXPECT_TRUE(p[0].detach().equal(before)) << "lr 0 set on the wrapper must reach the local SGD";
  });
}

// PyTorch's wrapper shares one param_groups list with the local optimizer: a group added to either
// is stepped by the local optimizer, with its own options.
TEST(PostLocalSGDOptimizerTest, GroupsAddedToEitherSideAreStepped) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = params();
    at::Tensor extra = at::ones({3}).requires_grad_();
    at::Tensor direct = at::ones({2}).requires_grad_();
    auto* local = new torch::optim::SGD({p[0]}, torch::optim::SGDOptions(0.1));
    PostLocalSGDOptimizer opt(
        std::unique_ptr<torch::optim::Optimizer>(local),
        std::make_shared<PeriodicModelAverager>(1000, 500, g));  // never averages here
    torch::optim::Optimizer& base = opt;  // add_param_group is not virtual: the base's runs
    base.add_param_group(torch::optim::OptimizerParamGroup(
        {extra}, std::make_unique<torch::optim::SGDOptions>(0.5)));
    local->add_param_group(torch::optim::OptimizerParamGroup(
        {direct}, std::make_unique<torch::optim::SGDOptions>(0.25)));
    for (const at::Tensor& t : {p[0], extra, direct}) t.mutable_grad() = at::ones_like(t);
    const at::Tensor p0 = p[0].detach().clone();
    opt.step();
    EXPECT_TRUE(p[0].detach().allclose(p0 - 0.1));
    EXPECT_TRUE(extra.detach().allclose(at::full({3}, 0.5))) << extra;
    EXPECT_TRUE(direct.detach().allclose(at::full({2}, 0.75))) << direct;
    EXPECT_EQ(opt.param_groups().size(), 3u);
    EXPECT_EQ(local->param_groups().size(), 3u);
    for (size_t i = 0; i < 3; ++i) {  // one order on both sides, so options sync group by group
      EXPECT_TRUE(opt.param_groups()[i].params()[0].is_same(local->param_groups()[i].params()[0]))
          << i;
    }
    auto lr = [&](size_t i) {
      return static_cast<torch::optim::SGDOptions&>(opt.param_groups()[i].options()).lr();
    };
    EXPECT_DOUBLE_EQ(lr(1), 0.25);  // the local optimizer's new group first, then the wrapper's
    EXPECT_DOUBLE_EQ(lr(2), 0.5);
  });
}

// The wrapper's state() is the local optimizer's, as in PyTorch.
TEST(PostLocalSGDOptimizerTest, StateIsTheLocalOptimizers) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = params();
    PostLocalSGDOptimizer opt(
        std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)),
        std::make_shared<PeriodicModelAverager>(1000, 500, g));
    EXPECT_TRUE(opt.state().empty());
    local_grads(p, g.rank(), 0);
    opt.step();
    EXPECT_EQ(opt.state().size(), 2u);
    EXPECT_EQ(&opt.state(), &opt.optimizer().state());
  });
}

}  // namespace
}  // namespace dtrain::optim
